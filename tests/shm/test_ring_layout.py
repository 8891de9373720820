"""BRTRING1 bytes against hand-computed offsets, and header validation on attach (ABI rules 123-125).

The expected bytes here are built with ``struct`` from the layout in the tick ABI header's ring
comment, independently of native/brt_ring.c."""

from __future__ import annotations

import mmap
import struct

import numpy as np
import pytest

from basertd.schema.abi import RING_MAGIC, RingKind, Status
from basertd.schema.tick import TokenRef
from basertd.shm import (
    MIN_SLOT_BYTES,
    RING_HEADER_BYTES,
    SLOT_HEADER_BYTES,
    RingLayoutError,
    RingReader,
    RingWriter,
    Segment,
    ring_bytes,
    slot_bytes_for,
)

RING_ID = 0xA1B2C3D4
SLOTS = 3
SLOT_BYTES = 16 + 10 * 4  # 56: 10 tokens per slot
TOKENS = RingKind.TOKENS


@pytest.fixture
def seg(no_leaks):
    with Segment.create(ring_bytes(SLOTS, SLOT_BYTES)) as s:
        yield s


def test_constants_and_sizes():
    assert (RING_HEADER_BYTES, SLOT_HEADER_BYTES, MIN_SLOT_BYTES) == (64, 16, 24)
    assert ring_bytes(SLOTS, SLOT_BYTES) == 64 + 3 * 56
    assert ring_bytes(4, 4096 + 16) == 64 + 4 * 4112
    assert slot_bytes_for(1) == 24 and slot_bytes_for(2) == 24 and slot_bytes_for(3) == 32
    assert slot_bytes_for(1024) == 16 + 4096 and slot_bytes_for(262_144) == 16 + 1_048_576


def test_fresh_header_bytes(seg):  # ABI rule 123
    RingWriter.create(seg, RING_ID, TOKENS, SLOTS, SLOT_BYTES)
    raw = bytes(seg.buffer)
    assert raw[0:8] == bytes([0x31, 0x47, 0x4E, 0x49, 0x52, 0x54, 0x52, 0x42]) == b"1GNIRTRB"
    assert raw[0:8][::-1] == b"BRTRING1"
    assert struct.unpack_from("<Q", raw, 0)[0] == RING_MAGIC == 0x42525452494E4731
    assert struct.unpack_from("<III", raw, 8) == (RING_ID, SLOT_BYTES, SLOTS)
    assert raw[20:64] == bytes(44)
    assert raw[64:] == bytes(SLOTS * SLOT_BYTES)  # every slot generation 0


def test_slot_bytes_after_writes(seg):  # ABI rule 124
    w = RingWriter.create(seg, RING_ID, TOKENS, SLOTS, SLOT_BYTES)
    w.write(np.arange(100, 104))  # 4 tokens -> slot 0, generation 1
    w.write(np.arange(200, 213))  # 13 tokens -> slots 1 (10) and 2 (3), generations 2 and 3
    raw = bytes(seg.buffer)

    def slot(i):
        off = 64 + i * SLOT_BYTES
        gen, plen, pad = struct.unpack_from("<QII", raw, off)
        payload = struct.unpack_from(f"<{plen // 4}I", raw, off + 16)
        return gen, plen, pad, list(payload)

    assert slot(0) == (1, 16, 0, [100, 101, 102, 103])
    assert slot(1) == (2, 40, 0, list(range(200, 210)))
    assert slot(2) == (3, 12, 0, [210, 211, 212])


def test_logits_payload_is_f32_le(no_leaks):
    slot_bytes = slot_bytes_for(4)
    with Segment.create(ring_bytes(2, slot_bytes)) as seg:
        w = RingWriter.create(seg, 5, RingKind.LOGITS, 2, slot_bytes)
        ref = w.write_row(np.array([1.5, -2.0, 0.0, 3.25]))
        assert (ref.index, ref.generation) == (0, 1)
        raw = bytes(seg.buffer)
        assert struct.unpack_from("<QII4f", raw, 64) == (1, 16, 0, 1.5, -2.0, 0.0, 3.25)


def _hand_written_ring(buf, ring_id, slots, slot_bytes, slot_contents):
    """Writes a ring with struct only: slot_contents is {index: (generation, [u32 ...])}."""
    struct.pack_into("<QIII", buf, 0, RING_MAGIC, ring_id, slot_bytes, slots)
    for index, (gen, values) in slot_contents.items():
        off = 64 + index * slot_bytes
        struct.pack_into(f"<QII{len(values)}I", buf, off, gen, 4 * len(values), 0, *values)


def test_reader_reads_a_ring_written_by_hand(seg):
    """Interop with an independent encoder: the reader decodes a ring built with struct alone."""
    _hand_written_ring(seg.buffer, 77, SLOTS, SLOT_BYTES, {2: (41, list(range(10))), 0: (42, [7, 8])})
    r = RingReader.attach(seg, 77, TOKENS, SLOTS, SLOT_BYTES)
    # a 12-token span starting in the last slot wraps to slot 0
    got = r.read(TokenRef(ring_id=77, index=2, count=12, generation=41))
    assert got.dtype == np.uint32 and got.tolist() == [*range(10), 7, 8]
    assert r.read(TokenRef(ring_id=77, index=0, count=2, generation=42)).tolist() == [7, 8]


def _expect_layout_error(target, ring_id=RING_ID, slots=SLOTS, slot_bytes=SLOT_BYTES, kind=TOKENS):
    before = bytes(memoryview(target.buffer if isinstance(target, Segment) else target))
    for cls in (RingReader.attach, RingWriter.attach):
        with pytest.raises(RingLayoutError) as info:
            cls(target, ring_id, kind, slots, slot_bytes)
        assert info.value.status == Status.ERR_RING_LAYOUT == -131
    after = bytes(memoryview(target.buffer if isinstance(target, Segment) else target))
    assert after == before, "a refused attach changed ring memory"


@pytest.mark.parametrize(
    "field,value",
    [("ring_id", RING_ID + 1), ("slots", SLOTS - 1), ("slot_bytes", SLOT_BYTES + 8)],
)
def test_attach_mismatched_descriptor(seg, field, value):  # ABI rule 125
    RingWriter.create(seg, RING_ID, TOKENS, SLOTS, SLOT_BYTES).write([1, 2, 3])
    _expect_layout_error(seg, **{field: value})


@pytest.mark.parametrize("offset", [0, 7, 8, 12, 16, 20, 40, 63])
def test_attach_corrupted_header_byte(seg, offset):  # ABI rule 125: magic, ids, reserved bytes
    RingWriter.create(seg, RING_ID, TOKENS, SLOTS, SLOT_BYTES)
    seg.buffer[offset] ^= 0x10
    _expect_layout_error(seg)


def test_attach_unformatted_memory(seg):
    _expect_layout_error(seg)


def test_attach_mapping_shorter_than_ring(no_leaks):  # ABI rule 125: len < 64 + slots*slot_bytes
    big = bytearray(ring_bytes(SLOTS, SLOT_BYTES) + 8)
    RingWriter.create(big, RING_ID, TOKENS, SLOTS, SLOT_BYTES).close()
    with Segment.create(ring_bytes(SLOTS, SLOT_BYTES) - 1) as short:
        short.buffer[:] = big[: short.length]
        _expect_layout_error(short)


@pytest.mark.parametrize(
    "slots,slot_bytes",
    [(0, 56), (3, 16), (3, 20), (3, 60), (3, 2**32), (-1, 56)],
)
def test_create_refuses_bad_geometry_without_writing(seg, slots, slot_bytes):
    with pytest.raises(RingLayoutError):
        RingWriter.create(seg, RING_ID, TOKENS, slots, slot_bytes)
    assert bytes(seg.buffer) == bytes(seg.length)


@pytest.mark.parametrize("kind", [RingKind.UNSPECIFIED, 7, "tokens"])
def test_create_refuses_bad_kind(seg, kind):
    with pytest.raises(RingLayoutError):
        RingWriter.create(seg, RING_ID, kind, SLOTS, SLOT_BYTES)
    assert bytes(seg.buffer) == bytes(seg.length)


def test_create_refuses_short_mapping(no_leaks):
    with Segment.create(ring_bytes(SLOTS, SLOT_BYTES) - 8) as seg:
        with pytest.raises(RingLayoutError):
            RingWriter.create(seg, RING_ID, TOKENS, SLOTS, SLOT_BYTES)
        assert bytes(seg.buffer) == bytes(seg.length)


def test_buffers_must_be_writable_and_aligned():
    data = bytes(ring_bytes(SLOTS, SLOT_BYTES))
    with pytest.raises(RingLayoutError):
        RingWriter.create(data, RING_ID, TOKENS, SLOTS, SLOT_BYTES)  # read-only
    anon = mmap.mmap(-1, ring_bytes(SLOTS, SLOT_BYTES) + 8)
    try:
        view = memoryview(anon)[4:]  # 4 bytes off a page boundary
        with pytest.raises(RingLayoutError):
            RingWriter.create(view, RING_ID, TOKENS, SLOTS, SLOT_BYTES)
        view.release()
        with pytest.raises(RingLayoutError):
            RingWriter.create(object(), RING_ID, TOKENS, SLOTS, SLOT_BYTES)
    finally:
        anon.close()


def test_ring_over_a_plain_buffer_matches_the_segment_bytes(seg):
    """A ring built over a memoryview (what a RingMapping hands an engine) writes the same bytes."""
    plain = mmap.mmap(-1, seg.length)
    try:
        with RingWriter.create(memoryview(plain), RING_ID, TOKENS, SLOTS, SLOT_BYTES) as a:
            a.write([5, 6, 7])
        b = RingWriter.create(seg, RING_ID, TOKENS, SLOTS, SLOT_BYTES)
        b.write([5, 6, 7])
        assert bytes(plain) == bytes(seg.buffer)
    finally:
        plain.close()
