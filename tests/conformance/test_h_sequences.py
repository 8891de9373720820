"""RULES.md section H, trim, boundaries, sequence handles, grammar and logit-bias handles:
rules 109-113."""

from __future__ import annotations

import pytest
from gkit import PAGED, blob
from hkit import bare, envelope, lane, need_cffi, sealed, sized, status_of, valid_len
from lanekit import D

from basertd.native.ref import RefSpace
from basertd.schema.abi import SpaceKind, Status

BOUNDS = Status.REJECT_BOUNDS
OFF = Status.ERR_OUT_OF_BOUNDARY
UNKNOWN = Status.ERR_UNKNOWN_HANDLE
TOKENS_48 = list(range(40, 88))  # blob boundaries (interval 16) at 16, 32, 48


# ABI rule 109
def test_rule_109_trim_paged_to_any_length(rig):
    seq, _ = bare(rig)  # 32 tokens
    for n in (31, 21, 16, 5, 0):
        rig.bundle.trim(seq, 0, n)
        assert valid_len(rig, seq) == n
    assert status_of(rig.bundle.trim, seq, 0, 1) == BOUNDS


# ABI rule 109
def test_rule_109_trim_beyond_the_valid_length(rig):
    seq, _ = bare(rig)
    for n in (33, 1000):
        assert status_of(rig.bundle.trim, seq, 0, n) == BOUNDS
    assert valid_len(rig, seq) == 32
    rig.bundle.trim(seq, 0, 32)  # the valid length itself is fine


@pytest.mark.parametrize("kind", [SpaceKind.RECURRENT_BLOB, SpaceKind.RING_KV])
# ABI rule 109
def test_rule_109_trim_blob_only_to_a_boundary(make_rig, kind):
    space = RefSpace(1, kind, blob_bytes=512, snapshot_cadence=2, snapshot_interval_tokens=16, name="state")
    rig = make_rig(spaces=[PAGED, space])
    seq, _ = bare(rig, tokens=TOKENS_48)
    for off in (40, 20, 1, 47):
        assert status_of(rig.bundle.trim, seq, 1, off) == OFF
        assert valid_len(rig, seq, 1) == 48
    assert status_of(rig.bundle.trim, seq, 1, 49) == BOUNDS
    rig.bundle.trim(seq, 1, 32)
    assert valid_len(rig, seq, 1) == 32
    assert status_of(rig.bundle.trim, seq, 1, 48) == BOUNDS  # beyond the new length
    rig.bundle.trim(seq, 1, 16)
    assert rig.bundle.snapshot_boundary(seq, 1, 1000) == 16
    rig.bundle.trim(seq, 0, 21)  # the paged space of the same sequence takes any length
    assert valid_len(rig, seq, 0) == 21


# ABI rule 110
def test_rule_110_blob_snapshot_ends_at_a_recorded_boundary(make_rig):
    rig = make_rig(spaces=[PAGED, blob()])
    seq, _ = lane(rig, tokens=list(range(40, 80)))  # 40 tokens: boundaries 16 and 32
    for pos in (40, 20, 33, 1):
        size, gen = sized(rig, seq, 1, pos)
        assert status_of(rig.bundle.snapshot, seq, 1, pos, gen, size) == OFF
    for pos in (16, 32):
        env = envelope(sealed(rig, seq, 1, pos))
        assert (env.range.start, env.range.end) == (pos, pos)


# ABI rule 110
def test_rule_110_tool_boundary_cadence_snapshots_the_current_length(make_rig):
    tool = RefSpace(1, SpaceKind.RECURRENT_BLOB, blob_bytes=512, snapshot_cadence=1, name="ssm")
    rig = make_rig(spaces=[PAGED, tool])
    seq, _ = lane(rig, tokens=list(range(40, 80)))
    for pos in (16, 32, 39):
        size, gen = sized(rig, seq, 1, pos)
        assert status_of(rig.bundle.snapshot, seq, 1, pos, gen, size) == OFF
    assert envelope(sealed(rig, seq, 1, 40)).range.end == 40
    rig.tick(decodes=[D(1, 3)])
    assert envelope(sealed(rig, seq, 1, 43)).range.end == 43  # the current length moves with it


# ABI rule 111
def test_rule_111_snapshot_boundary_of_a_blob_space(make_rig):
    rig = make_rig(spaces=[PAGED, blob()])
    seq, _ = lane(rig, tokens=list(range(40, 80)))  # 40 tokens: boundaries 16 and 32
    for cap, want in ((1000, 32), (40, 32), (32, 32), (31, 16), (16, 16), (15, 0), (0, 0)):
        assert rig.bundle.snapshot_boundary(seq, 1, cap) == want, cap
    assert rig.bundle.snapshot_boundary(rig.bundle.sequence_create(), 1, 1000) == 0  # nothing durable
    rig.tick(decodes=[D(1, 8)])  # to 48 tokens: a new boundary
    assert rig.bundle.snapshot_boundary(seq, 1, 1000) == 48


# ABI rule 111
def test_rule_111_snapshot_boundary_of_a_paged_space_is_the_last_whole_page(rig):
    seq, _ = lane(rig, tokens=list(range(40, 80)))  # 40 tokens, 16-token pages
    for cap, want in ((1000, 32), (40, 32), (31, 16), (15, 0)):
        assert rig.bundle.snapshot_boundary(seq, 0, cap) == want, cap


def _free_raw(bundle, raw) -> int:
    return bundle.lib.baseRT_tick_sequence_free(bundle.handle, raw)


def _fake_handle(bundle, value: int):
    ffi = getattr(bundle, "ffi", None)
    return ffi.cast("baseRT_sequence_t", value) if ffi is not None else value


# ABI rule 112
def test_rule_112_free_unknown_or_already_freed(rig):
    for value in (0, 0x7FFF00001234, 1):
        assert _free_raw(rig.bundle, _fake_handle(rig.bundle, value)) == UNKNOWN
    seq = rig.bundle.sequence_create()
    raw = rig.bundle.sequence_pointer(seq)
    assert _free_raw(rig.bundle, raw) == Status.OK
    assert _free_raw(rig.bundle, raw) == UNKNOWN  # already freed


# ABI rule 112
def test_rule_112_free_another_bundles_sequence(make_rig):
    one, two = make_rig(), make_rig()
    seq = two.bundle.sequence_create()
    raw = two.bundle.sequence_pointer(seq)
    assert _free_raw(one.bundle, raw) == UNKNOWN
    two.bundle.sequence_free(seq)  # still the other bundle's, and still alive


# ABI rule 112
def test_rule_112_free_lane_owned(rig):
    seq, _ = lane(rig)
    assert _free_raw(rig.bundle, rig.bundle.sequence_pointer(seq)) == UNKNOWN
    rig.tick(decodes=[D(1, 2)])  # the lane never noticed
    assert valid_len(rig, seq) >= 32


# ABI rule 113
def test_rule_113_free_absent_grammar_and_bias_handles(rig):
    for h in (0, 1, 7, 0xFFFFFFFF):
        assert status_of(rig.bundle.grammar_free, h) == UNKNOWN
        assert status_of(rig.bundle.logit_bias_free, h) == UNKNOWN
    bias = rig.bundle.logit_bias_create([5, 6], [1.0, -2.0])
    assert bias
    rig.bundle.logit_bias_free(bias)
    assert status_of(rig.bundle.logit_bias_free, bias) == UNKNOWN
    grammar = rig.bundle.grammar_create('{"type": "object"}')
    if not grammar:
        pytest.skip("this engine serves no grammars (grammar_create returns 0)")
    rig.bundle.grammar_free(grammar)
    assert status_of(rig.bundle.grammar_free, grammar) == UNKNOWN


# ABI rule 113
def test_rule_113_logit_bias_create_empty_returns_zero(rig):
    assert rig.bundle.logit_bias_create([], []) == 0
    assert rig.bundle.logit_bias_create([3], [0.5]) != 0


# ABI rule 113
def test_rule_113_logit_bias_create_null_or_nonpositive_returns_zero(rig):
    ffi = need_cffi(rig.bundle)
    lib, h = rig.bundle.lib, rig.bundle.handle
    tokens = ffi.new("int32_t[]", [3, 4])
    values = ffi.new("float[]", [0.5, 1.5])
    assert lib.baseRT_tick_logit_bias_create(h, ffi.NULL, values, 2) == 0
    assert lib.baseRT_tick_logit_bias_create(h, tokens, ffi.NULL, 2) == 0
    for n in (0, -1, -(2**31)):
        assert lib.baseRT_tick_logit_bias_create(h, tokens, values, n) == 0
    assert lib.baseRT_tick_logit_bias_create(h, tokens, values, 2) != 0
