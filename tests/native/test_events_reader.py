"""The fail-closed reader of engine output (basertd.native._events.ArrayReader), fed TickEvents
and other structs built by hand in cffi memory: RULES.md section C from the reader's side."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.native._events import ArrayReader
from basertd.native._layout import tick_ffi
from basertd.native.abi import EventsMalformed
from basertd.schema.abi import Status
from basertd.schema.tick import MatchCandidate

FFI = tick_ffi()
READER = ArrayReader(FFI, max_array_bytes=1 << 20)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)


def addr(cdata) -> int:
    return int(FFI.cast("uintptr_t", cdata))


def events_with(keep: list, **fields):
    ev = FFI.new("BaseRTTickEvents *", {"struct_size": 216, "plan_seq": 1, **fields})
    keep.append(ev)
    return ev


def test_full_decode():
    keep = []
    admits = FFI.new(
        "BaseRTAdmitResult[]",
        [{"lane_tag": 1, "status": 2, "reject_code": -140 & 0xFFFFFFFF, "cert_id": 0, "granted_class": 0}],
    )
    emits = FFI.new(
        "BaseRTLaneEmit[]",
        [
            {
                "lane_tag": 2,
                "token_ref": {"ring_id": 2, "index": 5, "count": 3, "generation": 9},
                "n_tokens": 3,
                "finish": 2,
                "logits_row": {"ring_id": 3, "index": 1, "generation": 77},
                "spec": {"proposed": 4, "accepted": 2, "cert_id_in_effect": 1},
            }
        ],
    )
    faults = FFI.new("BaseRTLaneFault[]", [{"lane_tag": 3, "code": 5, "detail": 11}])
    shed = FFI.new("BaseRTShedEntry[]", [{"lane_tag": 0, "kind": 2, "reason": 1, "bytes": 4096, "tokens": 0}])
    ops = FFI.new("BaseRTOpComplete[]", [{"op": 8, "state": 2, "error": 0, "bytes_moved": 200}])
    lp = FFI.new(
        "BaseRTLaneLogprob[]",
        [{"lane_tag": 2, "logprob": -0.5, "n_top": 2, "top_ids": [7, 8], "top_logprobs": [-0.5, -1.5]}],
    )
    ev = events_with(
        keep,
        tick_status=2,
        admit_results={"data": admits, "count": 1, "elem_size": 24},
        emits={"data": emits, "count": 1, "elem_size": 72},
        faults={"data": faults, "count": 1, "elem_size": 24},
        shed={
            "prefill_chunks_dropped": 0,
            "evictions_performed": 1,
            "bytes_evicted": 4096,
            "entries": {"data": shed, "count": 1, "elem_size": 32},
        },
        op_completions={"data": ops, "count": 1, "elem_size": 24},
        timings={"wall_ns": 10, "prefill_ns": 4, "decode_ns": 5, "graph_hits": 1, "graph_misses": 2},
        mem={"allocated_bytes": 1, "pool_blocks_total": 64, "pool_blocks_used": 3},
        logprobs={"data": lp, "count": 1, "elem_size": 176},
    )
    e = READER.events(addr(ev))
    assert e.tick_status == 2
    assert e.admit_results[0].reject_code == 0xFFFFFF74
    assert e.admit_results[0].reject_status is Status.REJECT_CERT_UNMATCHED
    emit = e.emits[0]
    assert (emit.lane_tag, emit.n_tokens, emit.finish) == (2, 3, 2)
    assert (emit.token_ref.index, emit.token_ref.count, emit.token_ref.generation) == (5, 3, 9)
    assert emit.logits_row.generation == 77 and emit.spec.accepted == 2
    assert (e.faults[0].code, e.faults[0].detail) == (5, 11)
    assert e.shed.evictions_performed == 1 and e.shed.entries[0].bytes == 4096
    assert e.op_completions[0].op == 8 and e.op_completions[0].bytes_moved == 200
    assert e.timings.graph_misses == 2 and e.mem.pool_blocks_used == 3
    assert e.logprobs[0].top_ids == [7, 8] and e.logprobs[0].top_logprobs == [-0.5, -1.5]


def test_empty_arrays_are_legal():
    # ABI rule 21: count 0, NULL data, elem_size 0 is an empty array.
    ev = events_with([])
    e = READER.events(addr(ev))
    assert e.emits == [] and e.admit_results == [] and e.shed.entries == []


@pytest.mark.parametrize("count", [0, 1])
def test_misaligned_data_is_refused_even_when_empty(count):
    # ABI rule 20: a non-NULL pointer that is not 8-byte aligned is refused, even with count 0.
    keep = []
    buf = FFI.new("uint64_t[]", 32)
    ev = events_with(keep, faults={"data": FFI.cast("char *", buf) + 4, "count": count, "elem_size": 24})
    with pytest.raises(EventsMalformed) as info:
        READER.events(addr(ev))
    assert info.value.where == "events.faults" and "aligned" in info.value.reason


def test_count_with_null_data_is_refused():
    # ABI rule 22.
    ev = events_with([], op_completions={"data": FFI.NULL, "count": 2, "elem_size": 24})
    with pytest.raises(EventsMalformed, match="NULL"):
        READER.events(addr(ev))


@pytest.mark.parametrize(("count", "elem_size"), [(1, 16), (0, 8), (3, 71)])
def test_elem_size_below_min_prefix_is_refused(count, elem_size):
    # ABI rules 17 and 24: a stride below the record's minimum, even with count 0.
    buf = FFI.new("uint64_t[]", 64)
    ev = events_with([], emits={"data": buf, "count": count, "elem_size": elem_size})
    with pytest.raises(EventsMalformed, match="below"):
        READER.events(addr(ev))


def test_size_over_cap_is_refused_before_reading():
    # ABI rule 23: count x elem_size beyond what may be read is refused before any element is
    # read: the data pointer here points at 8 bytes, so reading would fault.
    buf = FFI.new("uint64_t[]", 1)
    ev = events_with([], emits={"data": buf, "count": 0xFFFFFFFF, "elem_size": 0xFFFFFFFF})
    with pytest.raises(EventsMalformed, match="cap"):
        READER.events(addr(ev))


def test_longer_stride_reads_the_known_prefix():
    # ABI rule 19: records longer than ours are accepted; only our prefix is read.
    stride = 40
    buf = FFI.new("uint64_t[]", 3 * stride // 8)
    raw = FFI.buffer(buf)
    raw[:] = b"\xee" * len(raw)
    for i in range(3):
        rec = FFI.cast("BaseRTLaneFault *", FFI.cast("char *", buf) + i * stride)
        rec.lane_tag, rec.code, rec._pad0, rec.detail = 10 + i, i, 0, 100 + i
    ev = events_with([], faults={"data": buf, "count": 3, "elem_size": stride})
    faults = READER.events(addr(ev)).faults
    assert [(f.lane_tag, f.code, f.detail) for f in faults] == [(10, 0, 100), (11, 1, 101), (12, 2, 102)]


def test_shorter_stride_zero_fills_missing_fields():
    # ABI rule 18 (reader's half): an admit written at the v1 stride of 136 reads with the
    # appended grammar_replay / decode_replay as 0, and the next record starts at 136.
    buf = FFI.new("uint64_t[]", 2 * 136 // 8)
    raw = FFI.buffer(buf)
    for i in range(2):
        full = FFI.new("BaseRTLaneAdmit *", {"lane_tag": 5 + i, "grammar_replay": 9, "decode_replay": 9})
        raw[i * 136 : (i + 1) * 136] = FFI.buffer(full)[:136]
    rows = READER.array((addr(buf), 2, 136), "BaseRTLaneAdmit", "admits")
    assert rows["lane_tag"].tolist() == [5, 6]
    assert rows["grammar_replay"].tolist() == [0, 0] and rows["decode_replay"].tolist() == [0, 0]
    with pytest.raises(EventsMalformed):
        READER.array((addr(buf), 2, 128), "BaseRTLaneAdmit", "admits")


def test_undersized_or_missing_events_struct():
    # Like ABI rule 25, for the top-level events struct; and a NULL / misaligned pointer.
    ev = FFI.new("BaseRTTickEvents *", {"struct_size": 208})
    with pytest.raises(EventsMalformed, match="struct_size"):
        READER.events(addr(ev))
    with pytest.raises(EventsMalformed, match="NULL"):
        READER.events(0)
    with pytest.raises(EventsMalformed, match="aligned"):
        READER.events(addr(ev) + 4)


def test_logprob_n_top_over_20_is_refused():
    lp = FFI.new("BaseRTLaneLogprob[]", [{"lane_tag": 1, "n_top": 21}])
    ev = events_with([], logprobs={"data": lp, "count": 1, "elem_size": 176})
    with pytest.raises(EventsMalformed, match="n_top"):
        READER.events(addr(ev))


def test_nested_match_result_is_checked_at_every_level():
    cands = FFI.new(
        "BaseRTMatchCandidate[]",
        [{"prefix_len": 16, "provenance_digest": list(range(32)), "taint_bits": 1, "resident_tier": 1}],
    )
    spaces = FFI.new(
        "BaseRTSpaceMatch[]", [{"space_id": 3, "candidates": {"data": cands, "count": 1, "elem_size": 48}}]
    )
    res = FFI.new(
        "BaseRTMatchResult *", {"struct_size": 24, "spaces": {"data": spaces, "count": 1, "elem_size": 24}}
    )
    m = READER.match_result(addr(res))
    assert m.spaces[0].space_id == 3
    assert m.spaces[0].candidates == [
        MatchCandidate(prefix_len=16, provenance_digest=bytes(range(32)), taint_bits=1, resident_tier=1)
    ]
    spaces[0].candidates.elem_size = 40
    with pytest.raises(EventsMalformed) as info:
        READER.match_result(addr(res))
    assert info.value.where == "match.spaces[0].candidates"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(U64, U32, U32, U32, U64, U32, U32, U32, U32, U64, U32, U32, U32),
        max_size=40,
    ),
    st.integers(0, 24),
)
def test_emit_round_trip(records, extra):
    # Any emits written at any stride >= 72 (multiple of 8) read back field for field.
    stride = 72 + 8 * (extra // 8)
    n = len(records)
    buf = FFI.new("uint64_t[]", max(1, n * stride // 8))
    for i, r in enumerate(records):
        e = FFI.cast("BaseRTLaneEmit *", FFI.cast("char *", buf) + i * stride)
        e.lane_tag = r[0]
        e.token_ref.ring_id, e.token_ref.index, e.token_ref.count, e.token_ref.generation = r[1:5]
        e.n_tokens, e.finish = r[5], r[6]
        e.logits_row.ring_id, e.logits_row.index, e.logits_row.generation = r[7], r[8], r[9]
        e.spec.proposed, e.spec.accepted, e.spec.cert_id_in_effect = r[10:13]
    ev = events_with([], emits={"data": buf if n else FFI.NULL, "count": n, "elem_size": stride})
    got = READER.events(addr(ev)).emits
    assert [
        (
            e.lane_tag,
            e.token_ref.ring_id,
            e.token_ref.index,
            e.token_ref.count,
            e.token_ref.generation,
            e.n_tokens,
            e.finish,
            e.logits_row.ring_id,
            e.logits_row.index,
            e.logits_row.generation,
            e.spec.proposed,
            e.spec.accepted,
            e.spec.cert_id_in_effect,
        )
        for e in got
    ] == records
