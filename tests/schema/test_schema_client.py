"""Client and control APIs on the client socket: round trips of every message, framing, the
incremental reader and the asyncio reader over a real Unix socket (DESIGN.md "Client API",
"Operators")."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import normalize, struct_strategy

from basertd.schema import client, control
from basertd.schema.codec import (
    CLIENT_MESSAGES,
    MAX_FRAME_BYTES,
    ClientCodec,
    FrameError,
    FrameReader,
    MalformedFrame,
    OversizeFrame,
    TruncatedFrame,
    UnknownMessageType,
    read_message,
)

REQUESTS = (*client.REQUESTS, *control.REQUESTS)
REPLIES = (*client.REPLIES, *control.REPLIES)
HYPO = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_tags_are_unique_and_snake_case():
    tags = [cls.__struct_config__.tag for cls in CLIENT_MESSAGES]
    assert len(tags) == len(set(tags)) == len(CLIENT_MESSAGES)
    assert all(isinstance(t, str) and t == t.lower() and " " not in t for t in tags)
    assert set(CLIENT_MESSAGES) == set(REQUESTS) | set(REPLIES)


def test_error_codes_cover_the_issue():
    wanted = {
        "invalid_request",
        "empty_prompt",
        "context_length_exceeded",
        "queue_full",
        "cancelled",
        "worker_failed",
        "shutting_down",
        "draining",
        "permission_denied",
        "not_found",
        "internal",
        "timeout",
    }
    assert wanted <= {c.value for c in client.ErrorCode}


@pytest.mark.parametrize("cls", CLIENT_MESSAGES, ids=lambda c: c.__name__)
@HYPO
@given(data=st.data())
def test_roundtrip_every_message(cls, data):
    msg = data.draw(struct_strategy(cls))
    frame = ClientCodec().encode(msg)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    side = "server" if cls in REQUESTS else "client"
    out = ClientCodec(side).decode(frame[4:])
    assert type(out) is cls and normalize(out) == normalize(msg)
    # The other side refuses it by its tag.
    other = ClientCodec("client" if side == "server" else "server")
    with pytest.raises(UnknownMessageType):
        other.decode(frame[4:])


def test_wire_form_is_a_tagged_map():
    body = ClientCodec().encode_body(client.Cancel(request_id="r1"))
    assert msgspec.msgpack.decode(body) == {"type": "cancel", "request_id": "r1"}
    # Defaults fill in; unknown fields from a newer peer are ignored; types are enforced.
    codec = ClientCodec("server")
    gen = codec.decode(
        msgspec.msgpack.encode({"type": "generate", "request_id": "a", "prompt": "hi", "new": 1})
    )
    assert (gen.max_tokens, gen.qos, gen.stream, gen.prompt_tokens) == (256, "interactive", True, None)
    for bad in (
        {"type": "generate", "request_id": 5},
        {"type": "generate", "request_id": "a", "qos": "urgent"},
        {"type": "generate", "request_id": "a", "prompt_tokens": ["x"]},
        {"type": "generate"},
        {"request_id": "a"},
        [1, 2],
    ):
        with pytest.raises(MalformedFrame):
            codec.decode(msgspec.msgpack.encode(bad))
    with pytest.raises(UnknownMessageType):
        codec.decode(msgspec.msgpack.encode({"type": "teleport"}))
    with pytest.raises(MalformedFrame):  # a code outside ErrorCode
        ClientCodec("client").decode(msgspec.msgpack.encode({"type": "error", "code": "oops"}))


def test_codec_errors():
    codec = ClientCodec()
    with pytest.raises(UnknownMessageType):
        codec.encode(client.Usage())  # a nested record, not a message
    with pytest.raises(MalformedFrame):
        codec.encode(client.Generate(request_id="a", seed=2**64))
    with pytest.raises(OversizeFrame):
        ClientCodec(max_frame_bytes=50).encode(client.Tokenize(text="x" * 100))
    with pytest.raises(TruncatedFrame):
        codec.decode(b"")
    with pytest.raises(TruncatedFrame):
        codec.decode(codec.encode_body(client.Health())[:-3])
    with pytest.raises(MalformedFrame):
        codec.decode(b"\x81\xa4type\xa6health\xff")  # trailing garbage
    with pytest.raises(MalformedFrame):
        codec.decode(b"\x81\xa4type\xa3\xff\xfe\xfd")  # invalid UTF-8
    with pytest.raises(OversizeFrame):
        codec.decode(bytes(MAX_FRAME_BYTES + 1))
    with pytest.raises(ValueError):
        ClientCodec("both")  # type: ignore[arg-type]


def _stream(msgs) -> bytes:
    codec = ClientCodec()
    return b"".join(codec.encode(m) for m in msgs)


MSGS = [
    client.Generate(request_id="g1", prompt_tokens=[1, 2, 3], max_tokens=4, stop=["\n"]),
    control.CachePin(tokens=[5, 6], request_id="p"),
    client.Cancel(request_id="g1"),
    control.Drain(timeout_s=2.5),
    client.Health(),
]


def test_frame_reader_any_chunking():
    stream = _stream(MSGS)
    rng = random.Random(7)
    for _ in range(50):
        reader = FrameReader(ClientCodec("server"))
        got = []
        pos = 0
        while pos < len(stream):
            n = rng.randint(1, 40)
            got += reader.feed(stream[pos : pos + n])
            pos += n
        assert got == MSGS and reader.buffered == 0
    # byte by byte with the primitive API
    reader = FrameReader(ClientCodec("server"))
    got = []
    for i in range(len(stream)):
        reader.feed_data(stream[i : i + 1])
        while (m := reader.next_message()) is not None:
            got.append(m)
    assert got == MSGS


def test_frame_reader_oversize_prefix_fails_at_once_and_stays_dead():
    reader = FrameReader(ClientCodec("server"))
    assert reader.feed(_stream(MSGS[:1])) == MSGS[:1]
    reader.feed_data(b"\x01\x00")
    with pytest.raises(OversizeFrame):
        reader.feed_data(b"\x00\x01")  # 16 MiB + 1: refused on the prefix, nothing buffered for it
    assert reader.buffered == 0
    with pytest.raises(OversizeFrame):
        reader.feed(_stream(MSGS))
    with pytest.raises(OversizeFrame):
        reader.next_message()


def test_frame_reader_bad_frame_after_good_ones():
    good = _stream(MSGS[:2])
    reader = FrameReader(ClientCodec("server"))
    reader.feed_data(good + b"\x00\x00\x00\x02\xc1\xc1" + _stream(MSGS))
    assert [reader.next_message(), reader.next_message()] == MSGS[:2]
    with pytest.raises(MalformedFrame):
        reader.next_message()
    with pytest.raises(MalformedFrame):
        reader.feed_data(b"")
    zero = FrameReader(ClientCodec())
    with pytest.raises(TruncatedFrame):
        zero.feed(b"\x00\x00\x00\x00")
    with pytest.raises(MalformedFrame):
        FrameReader(ClientCodec()).feed_data("text")  # type: ignore[arg-type]


def test_read_message_over_a_real_unix_socket(tmp_path):
    """The asyncio helper reads whole messages, stops cleanly at EOF, and fails typed mid-frame."""
    path = str(tmp_path / "c.sock")
    codec = ClientCodec("server")

    async def main():
        received: list = []
        errors: list[FrameError] = []
        done = asyncio.Event()

        async def serve(reader, writer):
            try:
                while (msg := await read_message(reader, codec)) is not None:
                    received.append(msg)
            except FrameError as exc:
                errors.append(exc)
            writer.close()
            done.set()

        server = await asyncio.start_unix_server(serve, path=path)
        async with server:
            for payload, n_errors in ((_stream(MSGS), 0), (_stream(MSGS[:1]) + b"\x00\x00\x00\x09abc", 1)):
                done.clear()
                _, w = await asyncio.open_unix_connection(path)
                w.write(payload)
                await w.drain()
                w.close()
                await asyncio.wait_for(done.wait(), 5)
                assert len(errors) == n_errors
            _, w = await asyncio.open_unix_connection(path)
            done.clear()
            w.write(b"\xff\xff\xff\xff")  # oversize prefix; the peer keeps the socket open
            await w.drain()
            await asyncio.wait_for(done.wait(), 5)
            w.close()
        return received, errors

    received, errors = asyncio.run(main())
    assert received == MSGS + MSGS[:1]
    assert isinstance(errors[0], TruncatedFrame) and isinstance(errors[1], OversizeFrame)
