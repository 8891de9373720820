"""RingWriter / RingReader semantics in one process: cursor, multi-slot spans, wrap-around,
staleness, the empty span, payload checks and lifecycle (ABI rules 126-128, 130)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.schema.abi import RingKind, Status
from basertd.schema.tick import RingRef, TokenRef
from basertd.shm import (
    BadPayload,
    RingClosed,
    RingReader,
    RingWriter,
    Segment,
    SpanTooLarge,
    StaleRef,
    ring_bytes,
    slot_bytes_for,
)

RID = 11
SLOTS = 4
CAP = 8
SB = slot_bytes_for(CAP)  # 48
TOK = RingKind.TOKENS


@pytest.fixture
def ring(no_leaks):
    with Segment.create(ring_bytes(SLOTS, SB)) as seg:
        yield RingWriter.create(seg, RID, TOK, SLOTS, SB), RingReader.attach(seg, RID, TOK, SLOTS, SB), seg


def ref(index, count, gen, ring_id=RID):
    return TokenRef(ring_id=ring_id, index=index, count=count, generation=gen)


def test_first_write_is_index_0_generation_1_and_cursor_advances(ring):  # ABI rule 126
    w, r, _ = ring
    assert (w.next_index, w.next_generation) == (0, 1)
    assert w.capacity_elems == CAP and w.max_span_elems == CAP * SLOTS
    refs = [w.write([i]) for i in range(6)]
    assert [(x.index, x.generation, x.count, x.ring_id) for x in refs] == [
        (i % SLOTS, i + 1, 1, RID) for i in range(6)
    ]
    assert (w.next_index, w.next_generation) == (2, 7)
    assert [r.slot_generation(i) for i in range(SLOTS)] == [5, 6, 3, 4]


def test_multi_slot_span_takes_consecutive_slots_and_generations(ring):
    w, r, _ = ring
    a = w.write(np.arange(20, dtype=np.uint32))  # 3 slots: 8 + 8 + 4
    assert (a.index, a.count, a.generation) == (0, 20, 1)
    assert (w.next_index, w.next_generation) == (3, 4)
    assert [r.slot_generation(i) for i in range(SLOTS)] == [1, 2, 3, 0]
    assert r.read(a).tolist() == list(range(20))
    b = w.write(np.arange(100, 110))  # 2 slots wrapping: index 3 then 0
    assert (b.index, b.count, b.generation) == (3, 10, 4)
    assert r.read(b).tolist() == list(range(100, 110))
    with pytest.raises(StaleRef):
        r.read(a)  # slot 0 was recycled by b


def test_span_as_large_as_the_ring_and_one_larger(ring):
    w, r, seg = ring
    full = w.write(np.arange(CAP * SLOTS))
    assert r.read(full).tolist() == list(range(CAP * SLOTS))
    before, cursor = bytes(seg.buffer), (w.next_index, w.next_generation)
    with pytest.raises(SpanTooLarge) as info:
        w.write(np.arange(CAP * SLOTS + 1))
    assert info.value.status == Status.REJECT_BOUNDS
    assert bytes(seg.buffer) == before and (w.next_index, w.next_generation) == cursor


def test_wrap_around_makes_the_old_reference_stale(ring):  # ABI rule 128
    w, r, _ = ring
    first = w.write([1, 2, 3])
    for i in range(SLOTS - 1):
        w.write([i])
        assert r.read(first).tolist() == [1, 2, 3]  # still there after slots-1 further writes
    w.write([99])  # the slots-th further write recycles slot 0
    with pytest.raises(StaleRef) as info:
        r.read(first)
    assert info.value.status == Status.REJECT_BAD_REF_GENERATION


def test_generation_zero_never_resolves(ring):  # ABI rule 127
    w, r, _ = ring
    with pytest.raises(StaleRef):
        r.read(ref(0, 1, 0))  # nothing written: every slot holds generation 0
    w.write([5])
    with pytest.raises(StaleRef):
        r.read(ref(0, 1, 0))
    with pytest.raises(StaleRef):
        r.read_row(RingRef(ring_id=RID, index=0, generation=0))


@pytest.mark.parametrize(
    "bad",
    [
        ref(SLOTS, 3, 1),  # index out of range
        ref(0, 3, 2),  # wrong generation
        ref(0, 2, 1),  # count shorter than the payload
        ref(0, 4, 1),  # count longer than the payload
        ref(0, 9, 1),  # count implying a second slot that is not there
        ref(0, CAP * SLOTS + 1, 1),  # count beyond the ring
        ref(0, 3, 1, ring_id=RID + 1),  # another ring's reference
        ref(0, 3, 2**64 - 1),
    ],
)
def test_bad_references_are_stale(ring, bad):
    w, r, _ = ring
    assert w.write([7, 8, 9]) == ref(0, 3, 1)
    with pytest.raises(StaleRef):
        r.read(bad)
    assert r.read(ref(0, 3, 1)).tolist() == [7, 8, 9]


def test_count_ending_on_a_slot_boundary_reads_that_prefix(ring):
    """Documented limit of the layout (no end-of-span mark): a count of whole slots inside a longer
    span reads exactly those slots; a count ending mid-slot does not match a payload_len."""
    w, r, _ = ring
    a = w.write(np.arange(20))  # slots of 8, 8, 4
    assert r.read(ref(a.index, CAP, a.generation)).tolist() == list(range(CAP))
    assert r.read(ref(a.index, 2 * CAP, a.generation)).tolist() == list(range(2 * CAP))
    for count in (CAP - 1, CAP + 1, 19, 21, 24):
        with pytest.raises(StaleRef):
            r.read(ref(a.index, count, a.generation))


def test_a_slot_being_rewritten_reads_stale(ring):
    """Generation 0 is the writer's "being rewritten" mark (native/brt_ring.h): a slot caught in that
    state never yields data, even with its old payload still in place."""
    w, r, seg = ring
    good = w.write([1, 2, 3])
    gen_at = 64  # slot 0's generation
    saved = bytes(seg.buffer[gen_at : gen_at + 8])
    seg.buffer[gen_at : gen_at + 8] = bytes(8)
    with pytest.raises(StaleRef):
        r.read(good)
    seg.buffer[gen_at : gen_at + 8] = saved
    assert r.read(good).tolist() == [1, 2, 3]


def test_empty_span_convention(ring):
    w, r, _ = ring
    empty = w.write(np.array([], dtype=np.uint32))
    assert empty == ref(0, 0, 0)
    assert (w.next_index, w.next_generation) == (0, 1)  # no slot used
    assert w.write([]) == ref(0, 0, 0)
    got = r.read(empty)
    assert got.shape == (0,) and got.dtype == np.uint32
    assert r.read(TokenRef()).shape == (0,)  # the all-zero ref of an emit without tokens
    w.write([4])
    for bad in (ref(0, 0, 1), ref(1, 0, 0)):
        with pytest.raises(StaleRef):
            r.read(bad)


def test_read_returns_a_private_copy(ring):
    w, r, _ = ring
    a = w.write([1, 2, 3])
    got = r.read(a)
    got[0] = 1000
    assert r.read(a).tolist() == [1, 2, 3]
    for _ in range(SLOTS):
        w.write([9, 9, 9])
    assert got.tolist() == [1000, 2, 3]


def test_read_into_out(ring):
    w, r, _ = ring
    a = w.write(np.arange(12))
    out = np.zeros(12, np.uint32)
    assert r.read(a, out=out) is out and out.tolist() == list(range(12))
    for bad in (np.zeros(11, np.uint32), np.zeros(12, np.int64), np.zeros((12, 1), np.uint32)):
        with pytest.raises(BadPayload):
            r.read(a, out=bad)
    ro = np.zeros(12, np.uint32)
    ro.flags.writeable = False
    with pytest.raises(BadPayload):
        r.read(a, out=ro)


@pytest.mark.parametrize(
    "values",
    [
        np.zeros((2, 2), np.uint32),
        np.array([1.0, 2.0]),
        np.array([-1, 2]),
        np.array([2**32]),
        ["a"],
        np.array([True]),
    ],
)
def test_bad_token_payloads_change_nothing(ring, values):
    w, _, seg = ring
    before = bytes(seg.buffer)
    with pytest.raises(BadPayload) as info:
        w.write(values)
    assert info.value.status == Status.REJECT_BOUNDS
    assert bytes(seg.buffer) == before and w.next_generation == 1


def test_token_payloads_are_converted_when_exact(ring):
    w, r, _ = ring
    for values in ([0, 2**32 - 1], np.array([3, 4], dtype=np.int64), np.array([5, 6], dtype=">u4")):
        got = r.read(w.write(values))
        assert got.tolist() == [int(v) for v in values]
    strided = np.arange(10, dtype=np.uint32)[::2]
    assert r.read(w.write(strided)).tolist() == [0, 2, 4, 6, 8]


def test_logits_rows_round_trip_bit_exact(no_leaks):
    vocab = 50
    sb = slot_bytes_for(vocab)
    with Segment.create(ring_bytes(3, sb)) as seg:
        w = RingWriter.create(seg, 3, RingKind.LOGITS, 3, sb)
        r = RingReader.attach(seg, 3, RingKind.LOGITS, 3, sb)
        rng = np.random.default_rng(1)
        row = rng.standard_normal(vocab).astype(np.float32)
        row[3] = np.float32(np.nan)
        row[4] = -np.inf
        nonce = w.write_row(row)
        assert nonce == RingRef(ring_id=3, index=0, generation=1)
        got = r.read_row(nonce)
        assert got.dtype == np.float32 and got.view(np.uint32).tolist() == row.view(np.uint32).tolist()
        short = w.write_row(row[:7].astype(np.float64))  # float64 stored as f32
        np.testing.assert_array_equal(r.read_row(short), row[:7])
        out = np.empty(7, np.float32)
        assert r.read_row(short, out=out) is out
        with pytest.raises(BadPayload):
            r.read_row(short, out=np.empty(6, np.float32))  # row longer than out
        with pytest.raises(BadPayload):
            r.read_row(short, out=np.empty(8, np.float32))  # row shorter than out
        before = bytes(seg.buffer)
        with pytest.raises(SpanTooLarge):
            w.write_row(np.zeros(vocab + 1, np.float32))
        with pytest.raises(BadPayload):
            w.write_row(np.zeros(0, np.float32))
        with pytest.raises(BadPayload):
            w.write_row(np.arange(4))  # integers are not logits
        assert bytes(seg.buffer) == before
        w.write_row(row)
        w.write_row(row)
        with pytest.raises(StaleRef):
            r.read_row(nonce)  # recycled after `slots` rows
        with pytest.raises(StaleRef):
            r.read_row(RingRef(ring_id=4, index=1, generation=2))
        with pytest.raises(StaleRef):
            r.read_row(RingRef(ring_id=3, index=3, generation=2))
        span = w.write(rng.standard_normal(2 * vocab + 1))  # logits may also span slots
        assert r.read(span).shape == (2 * vocab + 1,)


def test_writer_attach_restarts_at_generation_1_and_invalidates_old_refs(ring):  # ABI rule 130
    w, r, seg = ring
    old = [w.write([i, i]) for i in range(3)]
    w.close()
    w2 = RingWriter.attach(seg, RID, TOK, SLOTS, SB)
    assert (w2.next_index, w2.next_generation) == (0, 1)
    for stale in old:
        with pytest.raises(StaleRef):
            r.read(stale)
    assert w2.write([42]) == ref(0, 1, 1)
    assert r.read(ref(0, 1, 1)).tolist() == [42]


def test_invalidate_makes_everything_stale_and_keeps_the_cursor(ring):
    w, r, _ = ring
    a = w.write([1])
    w.invalidate()
    with pytest.raises(StaleRef):
        r.read(a)
    assert w.write([2]) == ref(1, 1, 2)


def test_closing_the_segment_closes_its_rings(no_leaks):
    seg = Segment.create(ring_bytes(SLOTS, SB))
    w = RingWriter.create(seg, RID, TOK, SLOTS, SB)
    r = RingReader.attach(seg, RID, TOK, SLOTS, SB)
    a = w.write([1])
    seg.close()
    assert w.closed and r.closed
    with pytest.raises(RingClosed):
        w.write([1])
    with pytest.raises(RingClosed):
        r.read(a)
    r.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        RingReader.attach(seg, RID, TOK, SLOTS, SB)


def test_rings_over_a_plain_buffer_release_it_on_close():
    buf = bytearray(ring_bytes(SLOTS, SB) + 64)
    view = memoryview(buf)
    with RingWriter.create(view, RID, TOK, SLOTS, SB) as w, RingReader.attach(view, RID, TOK, SLOTS, SB) as r:
        assert r.read(w.write([3, 1, 4])).tolist() == [3, 1, 4]
    view.release()  # would raise BufferError if a ring still held the buffer
    buf.extend(b"x")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=CAP * SLOTS), min_size=1, max_size=30))
def test_reads_match_a_model_of_slot_generations(lengths):
    """Against a model that tracks each slot's generation: a reference reads back its exact payload
    while all its slots still hold its generations, and is StaleRef otherwise (ABI rules 126-128)."""
    buf = bytearray(ring_bytes(SLOTS, SB))
    w = RingWriter.create(buf, RID, TOK, SLOTS, SB)
    r = RingReader.attach(buf, RID, TOK, SLOTS, SB)
    model = [0] * SLOTS
    published = []
    next_gen, next_index = 1, 0
    for n in lengths:
        values = np.arange(n, dtype=np.uint32) + np.uint32(1000 * next_gen)
        got = w.write(values)
        if n == 0:
            assert got == ref(0, 0, 0)
            continue
        k = -(-n // CAP)
        assert got == ref(next_index, n, next_gen)
        for j in range(k):
            model[(next_index + j) % SLOTS] = next_gen + j
        published.append((got, values))
        next_gen, next_index = next_gen + k, (next_index + k) % SLOTS
        for old, old_values in published:
            k_old = -(-old.count // CAP)
            alive = all(model[(old.index + j) % SLOTS] == old.generation + j for j in range(k_old))
            if alive:
                assert r.read(old).tolist() == old_values.tolist()
            else:
                with pytest.raises(StaleRef):
                    r.read(old)
    w.close()
    r.close()
