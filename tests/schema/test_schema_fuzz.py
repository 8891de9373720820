"""Fail-closed decoding: at least 20,000 random and mutated frames per decoder (LinkCodec,
ClientCodec, FrameReader), and nothing but a FrameError ever comes out (DESIGN.md
"Link W": decoding is fail-closed). Seeded, so a failure reproduces."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
from schema_strategies import normalize, random_struct

from basertd.schema import link
from basertd.schema.codec import CLIENT_MESSAGES, ClientCodec, FrameError, FrameReader, LinkCodec

N_FRAMES = 20_000
SEED = 20_261_129
_CODES = [int(t) for t in link.MsgType]


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    op = rng.randrange(6)
    if op == 0 and buf:  # flip bits
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif op == 1 and buf:  # overwrite bytes, often with msgpack type markers
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(len(buf))] = rng.choice(
                [0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC7, 0xD4, 0xDC, 0xDD, 0xFF]
            )
    elif op == 2:  # truncate
        del buf[rng.randrange(len(buf) + 1) :]
    elif op == 3:  # append garbage
        buf += rng.randbytes(rng.randint(1, 16))
    elif op == 4:  # insert garbage
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = rng.randbytes(rng.randint(1, 8))
    else:  # cut a slice out
        i = rng.randrange(len(buf) + 1)
        del buf[i : i + rng.randint(1, 8)]
    return bytes(buf)


def _link_corpus(rng: random.Random, codec: LinkCodec) -> list[list[bytes]]:
    corpus = []
    for cls in link.MSG_TYPE_OF:
        for k in range(4):
            msg = random_struct(cls, rng)
            corpus.append([bytes(f) for f in codec.encode(msg, seq=k + 1, corr=k)])
    return corpus


def _random_link_frames(rng: random.Random, corpus: list[list[bytes]]) -> list:
    frames = [bytes(f) for f in rng.choice(corpus)]
    op = rng.randrange(10)
    if op == 0:  # pure noise, sometimes behind a valid-looking envelope
        frames = [rng.randbytes(rng.randrange(40)) for _ in range(rng.randrange(5))]
        if frames and rng.random() < 0.5:
            frames[0] = link.Envelope(1, rng.choice(_CODES), rng.randrange(2**64)).pack()
    elif op == 9:  # frames that are not flat byte buffers at all
        junk = [None, 7, "text", memoryview(bytes(8)).cast("B", (2, 4)), np.zeros((2, 2)), [b"x"]]
        frames[rng.randrange(len(frames))] = rng.choice(junk)
    elif op == 1:  # the envelope names another type (the body is read as the wrong message)
        frames[0] = link.Envelope(1, rng.choice(_CODES), 1).pack()
    elif op == 2:  # envelope bytes mutated (version, type, magic, length)
        frames[0] = _mutate_bytes(frames[0], rng)
    elif op == 3:  # side frames dropped, duplicated, added or resized
        if len(frames) > 2 and rng.random() < 0.5:
            frames[rng.randrange(2, len(frames))] = _mutate_bytes(frames[-1], rng)
        else:
            frames.append(rng.choice([b"", rng.randbytes(8), frames[-1]]))
    elif op == 4:  # one frame too few
        frames.pop(rng.randrange(len(frames)))
    elif op == 5:  # a body spliced from another message
        frames[1] = rng.choice(corpus)[1]
    else:  # the body mutated (most of the traffic)
        frames[1] = _mutate_bytes(frames[1], rng)
    return frames


def test_link_codec_only_frame_error():
    rng = random.Random(SEED)
    codec = LinkCodec(version=1)
    fresh = LinkCodec()  # before the handshake: only HELLO / WELCOME / ERROR decode
    corpus = _link_corpus(rng, codec)
    outcomes: Counter = Counter()
    for i in range(N_FRAMES):
        frames = _random_link_frames(rng, corpus)
        try:
            env, msg = (fresh if i % 4 == 0 else codec).decode(frames)
        except FrameError as exc:
            outcomes[exc.code.name] += 1
        else:  # whatever decodes is a well-formed message of the envelope's type
            assert link.MSG_TYPE_OF[type(msg)] == env.msg_type
            for name, kind in getattr(type(msg), "_arrays", {}).items():
                arr = getattr(msg, name)
                assert arr is None or (arr.ndim == 1 and arr.dtype == link.as_array([], kind).dtype)
            outcomes["decoded"] += 1
    assert sum(outcomes.values()) == N_FRAMES
    # The fuzz reached every refusal path and still produced valid messages.
    assert {"decoded", "TRUNCATED", "MALFORMED", "UNKNOWN_TYPE", "BAD_VERSION", "BAD_BUFFER"} <= set(outcomes)


def test_client_codec_only_frame_error():
    rng = random.Random(SEED + 1)
    enc = ClientCodec()
    corpus = [enc.encode_body(random_struct(cls, rng)) for cls in CLIENT_MESSAGES for _ in range(4)]
    decoders = [ClientCodec("server"), ClientCodec("client"), ClientCodec("any")]
    outcomes: Counter = Counter()
    for i in range(N_FRAMES):
        noise = i % 10 == 0
        body = rng.randbytes(rng.randrange(64)) if noise else _mutate_bytes(rng.choice(corpus), rng)
        try:
            msg = decoders[i % 3].decode(body)
        except FrameError as exc:
            outcomes[exc.code.name] += 1
        else:
            assert type(msg) in CLIENT_MESSAGES
            outcomes["decoded"] += 1
    assert sum(outcomes.values()) == N_FRAMES
    assert {"decoded", "TRUNCATED", "MALFORMED", "UNKNOWN_TYPE"} <= set(outcomes)


def test_frame_reader_only_frame_error():
    """Streams of good frames with one bad frame (mutated body or length prefix, or noise), fed
    in random chunks: the good frames before it come out intact, then only FrameError."""
    rng = random.Random(SEED + 2)
    codec = ClientCodec("any")
    msgs = [random_struct(cls, rng) for cls in CLIENT_MESSAGES for _ in range(3)]
    frames = [codec.encode(m) for m in msgs]
    outcomes: Counter = Counter()
    for _ in range(N_FRAMES):
        picks = [rng.randrange(len(msgs)) for _ in range(rng.randint(0, 3))]
        bad = rng.choice(frames)
        if rng.random() < 0.2:
            bad = rng.randbytes(4) + bad[4:]  # a random length prefix
        elif rng.random() < 0.1:
            bad = rng.randbytes(rng.randrange(32))
        else:
            bad = bad[:4] + _mutate_bytes(bad[4:], rng)
        stream = b"".join(frames[i] for i in picks) + bad
        reader = FrameReader(codec)
        got = []
        pos = 0
        try:
            while pos < len(stream):
                n = rng.randint(1, 64)
                reader.feed_data(stream[pos : pos + n])
                pos += n
                while (m := reader.next_message()) is not None:
                    got.append(m)
        except FrameError as exc:
            outcomes[exc.code.name] += 1
        else:
            outcomes["no error"] += 1
        assert [normalize(m) for m in got[: len(picks)]] == [normalize(msgs[i]) for i in picks]
    assert sum(outcomes.values()) == N_FRAMES
    assert {"no error", "OVERSIZE", "TRUNCATED", "MALFORMED", "UNKNOWN_TYPE"} <= set(outcomes)


def test_array_decodes_never_alias_unrelated_memory():
    """Mutated inline arrays decode to copies; side arrays view exactly their own frame."""
    rng = random.Random(SEED + 3)
    codec = LinkCodec(version=1)
    for _ in range(200):
        tokens = np.array([rng.randrange(2**32) for _ in range(rng.randrange(130))], dtype=np.uint32)
        frames = [bytes(f) for f in codec.encode(link.Detokenize(tokens=tokens), seq=1)]
        _, msg = codec.decode(frames)
        assert msg.tokens.tolist() == tokens.tolist()
        if len(frames) == 3:
            assert np.shares_memory(msg.tokens, np.frombuffer(frames[2], dtype=np.uint8))
        else:
            assert msg.tokens.flags.owndata and msg.tokens.flags.writeable
