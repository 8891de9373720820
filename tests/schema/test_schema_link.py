"""Link W schema and LinkCodec: round trips of every message type, side buffers, versions,
caps and typed errors (DESIGN.md "Link W")."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import normalize, struct_strategy

from basertd.schema import link
from basertd.schema.abi import Status
from basertd.schema.codec import (
    MAX_FRAME_BYTES,
    SIDE_THRESHOLD,
    BadSideBuffer,
    FrameError,
    FrameErrorCode,
    LinkCodec,
    MalformedFrame,
    OversizeFrame,
    TruncatedFrame,
    UnknownMessageType,
    VersionMismatch,
)
from basertd.schema.tick import LaneDecode, TickEvents, TickPlan

BODY_CLASSES = sorted(link.MSG_TYPE_OF, key=lambda c: (link.MSG_TYPE_OF[c], c.__name__))
HYPO = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def roundtrip(codec: LinkCodec, msg, seq=1, corr=0):
    frames = codec.encode(msg, seq=seq, corr=corr)
    return frames, *codec.decode(frames)


def test_catalog_is_complete_and_stable():
    """Every MsgType has a body class, every class one type, and the codes are the published ones."""
    assert set(link.MESSAGE_TYPES) == set(link.MsgType)
    assert len(set(link.MSG_TYPE_OF)) == len(link.MSG_TYPE_OF)
    # A few pinned codes: renumbering would break mixed-version fleets silently.
    assert (link.MsgType.HELLO, link.MsgType.TICK_SUBMIT, link.MsgType.STATE_OP, link.MsgType.SHUTDOWN) == (
        1,
        16,
        48,
        116,
    )
    assert link.MSG_TYPE_OF[TickPlan] is link.MsgType.TICK_SUBMIT
    assert link.MSG_TYPE_OF[TickEvents] is link.MsgType.TICK_RESULT
    assert {link.MSG_TYPE_OF[c] for c in link.STATE_OPS} == {link.MsgType.STATE_OP}
    for request, replies in link.REPLIES.items():
        assert link.MsgType.ERROR not in replies  # implied for every request
        assert request in link.MESSAGE_TYPES and replies <= set(link.MESSAGE_TYPES)


@pytest.mark.parametrize("cls", BODY_CLASSES, ids=lambda c: c.__name__)
@HYPO
@given(data=st.data())
def test_roundtrip_every_message(cls, data):
    codec = LinkCodec(version=link.PROTOCOL_VERSION)
    msg = data.draw(struct_strategy(cls))
    seq = data.draw(st.integers(1, 2**64 - 1))
    corr = data.draw(st.integers(0, 2**64 - 1))
    frames, env, out = roundtrip(codec, msg, seq, corr)
    assert type(out) is cls
    assert normalize(out) == normalize(msg)
    assert env == link.Envelope(link.PROTOCOL_VERSION, link.MSG_TYPE_OF[cls], seq, corr)
    assert isinstance(env.msg_type, link.MsgType)
    # Every array above the threshold left the body, every smaller one stayed in it.
    arrays = [getattr(msg, name) for name in getattr(cls, "_arrays", {})]
    big = [a for a in arrays if a is not None and a.size > SIDE_THRESHOLD]
    assert len(frames) == 2 + len(big)


def test_envelope_layout():
    """24 bytes LE: "BRTW", version u16, msg_type u16, seq u64, corr u64."""
    env = link.Envelope(1, link.MsgType.PONG, 0x0102030405060708, 7)
    raw = env.pack()
    assert raw == b"BRTW" + bytes([1, 0, 113, 0]) + bytes(range(8, 0, -1)) + (7).to_bytes(8, "little")
    assert link.Envelope.unpack(raw) == env
    assert link.Envelope.unpack(memoryview(bytearray(raw))) == env
    with pytest.raises(MalformedFrame):
        link.Envelope(1, 2, -1).pack()
    with pytest.raises(MalformedFrame):
        link.Envelope(1, 70000, 1).pack()


def test_side_buffers_are_zero_copy_both_ways():
    codec = LinkCodec(version=1)
    tokens = np.arange(SIDE_THRESHOLD + 1, dtype=np.uint32)
    frames = codec.encode(link.TickEmit(plan_seq=9, lane_tag=3, tokens=tokens), seq=5, corr=4)
    assert len(frames) == 3
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.uint32), tokens)  # send side
    received = [bytes(frames[0]), bytes(frames[1]), bytearray(frames[2])]
    _, msg = codec.decode(received)
    assert np.shares_memory(msg.tokens, np.frombuffer(received[2], dtype=np.uint8))  # receive side
    assert msg.tokens.tolist() == tokens.tolist()
    # At the threshold the array stays inline, in the body.
    frames = codec.encode(link.TickEmit(plan_seq=9, lane_tag=3, tokens=tokens[:SIDE_THRESHOLD]), seq=6)
    assert len(frames) == 2
    assert codec.decode(frames)[1].tokens.tolist() == tokens[:SIDE_THRESHOLD].tolist()


def test_over_real_zmq_pair_with_zmq_frames(tmp_path):
    """Frames sent with copy=False over an ipc PAIR decode from zmq.Frame objects, zero-copy."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 5000)
        endpoint = f"ipc://{tmp_path}/link.sock"
        a.bind(endpoint)
        b.connect(endpoint)
        sender, receiver = LinkCodec(), LinkCodec()
        a.send_multipart(sender.encode(link.Hello(min_version=1, max_version=3, worker_id=2, pid=77), seq=1))
        env, hello = receiver.decode(b.recv_multipart(copy=False))
        assert (env.msg_type, hello.worker_id, hello.pid) == (link.MsgType.HELLO, 2, 77)
        version = link.negotiate(hello.min_version, hello.max_version)
        b.send_multipart(receiver.encode(link.Welcome(version=version), seq=1, corr=env.seq))
        env, welcome = sender.decode(a.recv_multipart(copy=False))
        assert (welcome.version, env.corr) == (1, 1)
        sender.version = receiver.version = welcome.version
        data = np.frombuffer(np.random.default_rng(1).bytes(100_000), dtype=np.uint8)
        a.send_multipart(
            sender.encode(link.StateOpDone(op=5, state=2, bytes_moved=data.size, data=data), seq=2, corr=9),
            copy=False,
        )
        frames = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        env, done = receiver.decode(frames)
        assert (env.seq, env.corr, done.op, done.bytes_moved) == (2, 9, 5, 100_000)
        assert np.array_equal(done.data, data)
        assert np.shares_memory(done.data, np.frombuffer(frames[2].buffer, dtype=np.uint8))
    finally:
        a.close()
        b.close()
        ctx.term()


def test_version_rules():
    before = LinkCodec()
    hello = link.Hello(min_version=1, max_version=1, worker_id=0, pid=1)
    # Handshake types travel before negotiation, nothing else does (either way).
    assert before.decode(before.encode(hello, seq=1))[1] == hello
    assert (
        before.decode(before.encode(link.Error(status=Status.ERR_FATAL, message="x"), seq=2))[1].status == -1
    )
    with pytest.raises(VersionMismatch):
        before.encode(link.Ping(), seq=3)
    after = LinkCodec(version=1)
    ping = after.encode(link.Ping(), seq=3)
    with pytest.raises(VersionMismatch) as info:
        before.decode(ping)
    assert info.value.code is FrameErrorCode.BAD_VERSION
    assert info.value.envelope.msg_type is link.MsgType.PING
    # Wrong version after negotiation.
    wrong = [link.Envelope(2, link.MsgType.PING, 3).pack(), ping[1]]
    with pytest.raises(VersionMismatch):
        after.decode(wrong)
    # A handshake frame at version 0 is refused; at a future version it still decodes.
    body = after.encode(hello, seq=1)[1]
    with pytest.raises(VersionMismatch):
        after.decode([link.Envelope(0, link.MsgType.HELLO, 1).pack(), body])
    assert after.decode([link.Envelope(9, link.MsgType.HELLO, 1).pack(), body])[1] == hello
    with pytest.raises(VersionMismatch):
        LinkCodec(version=0)
    with pytest.raises(VersionMismatch):
        after.version = 70000


def test_typed_decode_errors():
    codec = LinkCodec(version=1)
    tokens = np.arange(200, dtype=np.uint32)
    env, body, side = codec.encode(link.TokenizeResult(tokens=tokens), seq=1)
    cases = {
        TruncatedFrame: [[env], [env[:10], body], [env, body[:-1], side]],
        MalformedFrame: [
            [b"XXXX" + bytes(env)[4:], body],
            [bytes(env) + b"\0", body],
            [env, b"\xc1"],  # never-used msgpack byte
            [env, body, 12345],  # not a buffer
            [link.Envelope(1, link.MsgType.TOKENIZE_RESULT, 1).pack(), msgspec.msgpack.encode(["x"])],
        ],
        UnknownMessageType: [[link.Envelope(1, 999, 1).pack(), body]],
        BadSideBuffer: [[env, body], [env, body, side, side], [env, body, bytes(side)[:-4]]],
        OversizeFrame: [[env, body, *([b""] * 65)]],
    }
    for exc_type, inputs in cases.items():
        for frames in inputs:
            with pytest.raises(exc_type) as info:
                codec.decode(frames)
            assert isinstance(info.value, FrameError) and info.value.code is exc_type.code


def test_ill_typed_arrays_fail_decode_and_construction():
    codec = LinkCodec(version=1)
    env = link.Envelope(1, link.MsgType.TICK_EMIT, 1).pack()
    with pytest.raises(MalformedFrame):  # a plain list where an array extension belongs
        codec.decode([env, msgspec.msgpack.encode([1, 2, [1, 2, 3]])])
    bad_dtype = msgspec.msgpack.encode([1, 2, msgspec.msgpack.Ext(1, b"\x09abcd")])
    with pytest.raises(BadSideBuffer):
        codec.decode([env, bad_dtype])
    ragged = msgspec.msgpack.encode([1, 2, msgspec.msgpack.Ext(1, b"\x02abc")])
    with pytest.raises(BadSideBuffer):
        codec.decode([env, ragged])
    with pytest.raises(ValueError):
        link.TickEmit(plan_seq=1, lane_tag=1, tokens=[-1])
    with pytest.raises(ValueError):
        link.TickEmit(plan_seq=1, lane_tag=1, tokens=[2**32])
    with pytest.raises(TypeError):
        link.TickEmit(plan_seq=1, lane_tag=1, tokens=np.array([1.5]))
    with pytest.raises(ValueError):
        link.TickEmit(plan_seq=1, lane_tag=1, tokens=np.zeros((2, 2), dtype=np.uint32))
    assert (
        link.TickEmit(plan_seq=1, lane_tag=1, tokens=np.array([7], dtype=np.int64)).tokens.dtype == np.uint32
    )


def test_encode_errors_are_typed():
    codec = LinkCodec(version=1)
    with pytest.raises(UnknownMessageType):
        codec.encode(LaneDecode(lane_tag=1), seq=1)  # a record, not a message
    with pytest.raises(MalformedFrame):
        codec.encode(link.Ping(), seq=-1)
    with pytest.raises(MalformedFrame):
        codec.encode(link.SeedRelease(seed_handle=2**64), seq=1)
    small = LinkCodec(version=1, max_frame_bytes=100)
    with pytest.raises(OversizeFrame):
        small.encode(link.GrammarCreate(json_schema="x" * 200), seq=1)
    msg = link.Detokenize(tokens=np.arange(1000))
    with pytest.raises(OversizeFrame):
        LinkCodec(version=1, max_side_bytes=1000).encode(msg, seq=1)
    # numpy scalars are accepted where ints belong
    out = codec.decode(codec.encode(link.SeedRelease(seed_handle=np.uint64(5)), seq=1))[1]
    assert out.seed_handle == 5 and type(out.seed_handle) is int


def test_body_cap_is_checked_before_decoding():
    codec = LinkCodec(version=1)
    env = link.Envelope(1, link.MsgType.GRAMMAR_CREATE, 1).pack()
    with pytest.raises(OversizeFrame):
        codec.decode([env, bytes(MAX_FRAME_BYTES + 1)])
    with pytest.raises(OversizeFrame):
        LinkCodec(version=1, max_side_bytes=10).decode(
            [link.Envelope(1, link.MsgType.TICK_EMIT, 1).pack(), b"\x93\x01\x02\xc0", bytes(11)]
        )


def test_state_op_union_tags():
    """STATE_OP carries one op, told apart by its integer tag (the first array element)."""
    codec = LinkCodec(version=1)
    tags = [c.__struct_config__.tag for c in link.STATE_OPS]
    assert tags == list(range(1, len(link.STATE_OPS) + 1))
    frames = codec.encode(link.OpTrim(seq=4, space_id=0, new_len=32), seq=1)
    assert msgspec.msgpack.decode(frames[1]) == [6, 4, 0, 32]
    env = frames[0]
    with pytest.raises(MalformedFrame):
        codec.decode([env, msgspec.msgpack.encode([99, 1, 2])])


def test_codec_shared_between_threads():
    """Side-buffer bookkeeping is per thread: concurrent encode/decode never mixes frames."""
    codec = LinkCodec(version=1)
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for i in range(300):
                tokens = np.arange(base, base + 65 + i % 7, dtype=np.uint32)
                _, msg = codec.decode(
                    codec.encode(link.TickEmit(plan_seq=i, lane_tag=base, tokens=tokens), seq=i + 1)
                )
                assert msg.tokens.tolist() == tokens.tolist() and msg.lane_tag == base
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_error_family():
    """One subclass per code, all FrameError, the code readable from class and instance."""
    for code in FrameErrorCode:
        exc = FrameError.for_code(code, "why")
        assert type(exc) is not FrameError and isinstance(exc, FrameError)
        assert exc.code is code and type(exc).code is code and "why" in str(exc)
    with pytest.raises(ValueError):
        FrameError.for_code(99)
