"""RULES.md section C: array and struct decoding of tick plans (schema §1.1), rules 17-26.

Malformed plans are hand-made: ``Bundle.encode_plan`` writes a valid plan into the binding's arena
and returns the ``BaseRTTickPlan *``, the test edits its fields (strides, pointers, counts,
struct_size) or points an array at a buffer it built, and ``Bundle.tick_raw`` sends it. Every
refusal must leave the engine unchanged (``Rig.state``) and not read the bad array: the
memory-safety run (``make memcheck``) would catch a read past a buffer.
"""

from __future__ import annotations

import pytest
from lanekit import D, P, R

from basertd.schema.abi import Status
from basertd.schema.tick import ShedPolicy

ARRAYS = ("admits", "commits", "prefills", "decodes", "retires")
RECORD = {
    "admits": "BaseRTLaneAdmit",
    "commits": "BaseRTLaneCommit",
    "prefills": "BaseRTLanePrefill",
    "decodes": "BaseRTLaneDecode",
    "retires": "BaseRTLaneRetire",
}


def _array(ptr, name):
    return ptr.shed_policy.victim_lanes if name == "victim_lanes" else getattr(ptr, name)


def raw(rig, plan, mutate=None) -> tuple[int, int]:
    """Encode ``plan``, let ``mutate(ptr, ffi)`` edit it, send it; returns (status, events)."""
    b = rig.bundle
    ptr = b.encode_plan(plan)
    keep = mutate(ptr, b.ffi) if mutate else None
    status, events = b.tick_raw(ptr)
    del keep
    return status, events


def refused(rig, plan, mutate, status: Status) -> None:
    """Assert the raw plan is refused with ``status`` and changed nothing."""
    before = rig.state()
    got, events = raw(rig, plan, mutate)
    assert got == status, f"expected {status!r}, got {Status(got)!r}"
    assert events == 0, "a refused tick must not hand out events"
    assert rig.state() == before, "a refused plan changed engine state"


def live_lane(rig, tag: int = 1) -> None:
    """A live lane with some tokens, so that a wrong state change would be visible."""
    rig.start(tag, [11, 12, 13, 14, 15, 16], decode=2)


# ABI rule 17
def test_rule_017_admit_stride_below_v1_is_bad_stride(rig):
    live_lane(rig)
    span = rig.put([3, 4, 5])
    plan = rig.plan([rig.admit(2, span)], prefills=[P(2, 0, 3)])

    def shrink(ptr, ffi):
        ptr.admits.elem_size = 128

    refused(rig, plan, shrink, Status.REJECT_BAD_STRIDE)
    # The same plan at its proper stride is accepted afterwards.
    rig.tick([rig.admit(2, span)], prefills=[P(2, 0, 3)])


# ABI rule 18
def test_rule_018_admits_at_v1_stride_read_as_no_replay(rig):
    ffi = rig.bundle.ffi
    tokens_a, tokens_b = [21, 22, 23, 24, 25], [31, 32, 33, 34]
    # The second tag's upper half is 5: a reader taking 144 bytes from the first record would see
    # grammar_replay = 2 (no grammar: refused) and decode_replay = 5 in it.
    tag_a, tag_b = 2, (5 << 32) | 2
    plan = rig.plan(
        [rig.admit(tag_a, rig.put(tokens_a)), rig.admit(tag_b, rig.put(tokens_b))],
        prefills=[P(tag_a, 0, 5), P(tag_b, 0, 4)],
        decodes=[D(tag_a, 2), D(tag_b, 2)],
    )

    def v1(ptr, f):
        buf = ffi.new("uint64_t[]", 2 * 136 // 8)
        full = ffi.buffer(ptr.admits.data, 2 * 144)
        dst = ffi.buffer(buf)
        dst[0:136] = full[0:136]
        dst[136:272] = full[144:280]
        ptr.admits.data = buf
        ptr.admits.elem_size = 136
        return buf

    status, addr = raw(rig, plan, v1)
    assert status == Status.OK
    events = rig.bundle.read_events(addr)
    assert [e.n_tokens for e in events.emits] == [2, 2]
    if rig.state() is not None:
        for tag, n in ((tag_a, 5), (tag_b, 4)):
            info = rig.ref.lane_info(tag)
            assert (info.prompt_len, info.prefill_end) == (n, n)


@pytest.mark.parametrize("name", ["admits", "prefills", "decodes"])
# ABI rule 19
def test_rule_019_longer_records_read_known_prefix(rig, name):
    ffi = rig.bundle.ffi
    span = rig.put([41, 42, 43])
    plan = rig.plan([rig.admit(3, span)], prefills=[P(3, 0, 3)], decodes=[D(3, 4)])
    size = ffi.sizeof(RECORD[name])
    wide = size + 16

    def widen(ptr, f):
        arr = getattr(ptr, name)
        buf = ffi.new("uint64_t[]", wide // 8)
        dst = ffi.buffer(buf)
        dst[0:wide] = b"\xab" * wide  # an unknown tail of a newer writer
        dst[0:size] = ffi.buffer(arr.data, size)[:]
        arr.data = buf
        arr.elem_size = wide
        return buf

    status, addr = raw(rig, plan, widen)
    assert status == Status.OK
    events = rig.bundle.read_events(addr)
    assert events.admit_results[0].status == 1
    assert rig.emit_of(events, 3).n_tokens == 4


@pytest.mark.parametrize("count", [0, 1])
@pytest.mark.parametrize("name", [*ARRAYS, "victim_lanes"])
# ABI rule 20
def test_rule_020_misaligned_data_is_bad_alignment(rig, name, count):
    live_lane(rig)
    plan = rig.plan()

    def misalign(ptr, ffi):
        buf = ffi.new("uint64_t[]", 64)
        arr = _array(ptr, name)
        arr.data = ffi.cast("char *", buf) + 4
        arr.count = count
        arr.elem_size = 8 if name == "victim_lanes" else ffi.sizeof(RECORD[name])
        return buf

    refused(rig, plan, misalign, Status.REJECT_BAD_ALIGNMENT)


# ABI rule 21
def test_rule_021_empty_arrays_are_legal(rig):
    live_lane(rig)
    plan = rig.plan(decodes=[D(1, 1)])

    def empty(ptr, ffi):
        for name in ("admits", "commits", "prefills", "retires", "victim_lanes"):
            arr = _array(ptr, name)
            arr.data, arr.count, arr.elem_size = ffi.NULL, 0, 0

    status, addr = raw(rig, plan, empty)
    assert status == Status.OK
    assert rig.bundle.read_events(addr).emits[0].n_tokens == 1
    # A plan with nothing in it at all is a legal (idle) tick.
    status, _ = raw(rig, rig.plan(), lambda ptr, ffi: [setattr(ptr.decodes, "elem_size", 0)])
    assert status == Status.OK


@pytest.mark.parametrize("name", [*ARRAYS, "victim_lanes"])
# ABI rule 22
def test_rule_022_count_with_null_data_is_refused(rig, name):
    live_lane(rig)

    def null(ptr, ffi):
        arr = _array(ptr, name)
        arr.data = ffi.NULL
        arr.count = 1
        arr.elem_size = 8 if name == "victim_lanes" else ffi.sizeof(RECORD[name])

    refused(rig, rig.plan(), null, Status.REJECT_BAD_ALIGNMENT)


@pytest.mark.parametrize(
    ("count", "elem_size"),
    [(0xFFFFFFFF, 0xFFFFFFFF), (1 << 31, 144), (1 << 20, 1 << 12)],
    ids=["u32xu32", "2^31 admits", "4GiB"],
)
# ABI rule 23
def test_rule_023_oversized_arrays_are_bounds_before_reading(rig, count, elem_size):
    live_lane(rig)

    def huge(ptr, ffi):
        buf = ffi.new("uint64_t[]", 32)  # 256 bytes: any element read beyond it is a bug
        ptr.admits.data = buf
        ptr.admits.count = count
        ptr.admits.elem_size = elem_size
        return buf

    refused(rig, rig.plan(), huge, Status.REJECT_BOUNDS)


@pytest.mark.parametrize(
    ("name", "elem_size"), [("admits", 8), ("admits", 135), ("decodes", 4), ("victim_lanes", 4)]
)
# ABI rule 24
def test_rule_024_empty_array_with_short_stride_is_bad_stride(rig, name, elem_size):
    live_lane(rig)

    def short(ptr, ffi):
        arr = _array(ptr, name)
        arr.data, arr.count, arr.elem_size = ffi.NULL, 0, elem_size

    refused(rig, rig.plan(), short, Status.REJECT_BAD_STRIDE)


@pytest.mark.parametrize("size", [0, 8, 144, 151])
# ABI rule 25
def test_rule_025_struct_size_below_v1_is_bad_struct(rig, size):
    live_lane(rig)

    def small(ptr, ffi):
        ptr.struct_size = size

    refused(rig, rig.plan(decodes=[D(1, 1)]), small, Status.REJECT_BAD_STRUCT)


@pytest.mark.parametrize("count", [0, 1, 2])
# ABI rule 26
def test_rule_026_victim_lanes_are_validated_as_u64_records(rig, count):
    live_lane(rig)

    def short(ptr, ffi):
        buf = ffi.new("uint64_t[]", 2)
        arr = ptr.shed_policy.victim_lanes
        arr.data, arr.count, arr.elem_size = buf, count, 4
        return buf

    refused(rig, rig.plan(retires=[R(1)]), short, Status.REJECT_BAD_STRIDE)
    # Proper u64 records are accepted (the victim list itself sheds nothing here).
    events = rig.tick(decodes=[D(1, 1)], shed=ShedPolicy(victim_lanes=[1, 99]))
    assert events.emits[0].n_tokens == 1
