"""RULES.md section G, seed leases: rules 75-86."""

from __future__ import annotations

import pytest
from gkit import FLAGGED, PAGED, blob, candidates, publish, publish_tainted
from lanekit import ALL_EVICTABLE, D, P, R, xfail_unless_reference

from basertd.native.abi import AbiError
from basertd.schema.abi import AdmitStatus, DeterminismClass, Encoding, Status, Taint
from basertd.schema.tick import ShedPolicy, TokenRange

STALE = Status.REJECT_STALE_SEED
UNSERVABLE = Status.ERR_SEED_UNSERVABLE
BEST, DET = DeterminismClass.BEST_EFFORT, DeterminismClass.DETERMINISTIC
PREFIX = list(range(100, 132))  # two 16-token blocks


def _status(call, *args) -> Status:
    with pytest.raises(AbiError) as info:
        call(*args)
    return info.value.status


@pytest.mark.parametrize("prefix_len", [0, 33, 1000])
# ABI rule 75
def test_rule_075_prefix_len_zero_or_beyond_span(rig, prefix_len):
    publish(rig, 1, PREFIX)
    span = rig.put(PREFIX)
    assert _status(rig.bundle.seed_acquire, span, prefix_len, BEST) == Status.REJECT_BOUNDS
    assert rig.bundle.seed_acquire(span, 32, BEST)


def _flagged_space_refuses_seeds(make_rig, flag: str) -> None:
    rig = make_rig(spaces=[PAGED, blob(flags=FLAGGED[flag])])
    publish(rig, 1, PREFIX)
    assert candidates(rig, rig.put(PREFIX)) == [32]  # the KV space itself holds the prefix
    assert _status(rig.bundle.seed_acquire, rig.put(PREFIX), 32, BEST) == UNSERVABLE
    plain = make_rig(spaces=[PAGED, blob()])
    publish(plain, 1, PREFIX)
    assert plain.bundle.seed_acquire(plain.put(PREFIX), 32, BEST)


# ABI rule 76
def test_rule_076_ops_unavailable_space_makes_seeds_unservable(make_rig):
    _flagged_space_refuses_seeds(make_rig, "ops unavailable")


# ABI rule 77
def test_rule_077_no_prefix_cache_space_makes_seeds_unservable(make_rig):
    _flagged_space_refuses_seeds(make_rig, "no prefix cache")


@pytest.mark.parametrize("case", ["paged off a block", "paged not cached", "blob off a boundary"])
# ABI rule 78
def test_rule_078_prefix_some_space_cannot_serve(make_rig, case):
    rig = make_rig(spaces=[PAGED, blob(interval=24)])  # blob boundaries at 24 and 48
    tokens = list(range(100, 150))  # 50 tokens: KV entry of 48, blob boundaries 24, 48
    publish(rig, 1, tokens)
    span = rig.put(tokens)
    prefix = {"paged off a block": 24, "paged not cached": 48, "blob off a boundary": 32}[case]
    if case == "paged not cached":
        span = rig.put(list(range(200, 250)))
    assert _status(rig.bundle.seed_acquire, span, prefix, BEST) == UNSERVABLE
    # Nothing was pinned: every entry can still be evicted.
    stats = rig.ref.stats()
    assert stats["live_seed_leases"] == 0
    assert rig.bundle.cache_evict(ALL_EVICTABLE, 2**40) == stats["cache_bytes"]
    # A prefix every space serves is granted.
    publish(rig, 2, tokens)
    assert rig.bundle.seed_acquire(rig.put(tokens), 48, BEST)


# ABI rule 79
def test_rule_079_deterministic_seed_skips_tainted_variants(rig):
    publish_tainted(rig, 1, PREFIX)
    span = rig.put(PREFIX)
    assert _status(rig.bundle.seed_acquire, span, 32, DET) == UNSERVABLE
    assert rig.bundle.seed_acquire(span, 32, BEST)


@pytest.mark.parametrize("case", ["determinism class", "different prefix"])
# ABI rule 80
def test_rule_080_admit_must_match_the_lease(rig, case):
    publish(rig, 1, PREFIX)
    prompt = [*PREFIX, 7, 8, 9]
    seed = rig.bundle.seed_acquire(rig.put(prompt), 32, BEST)
    if case == "determinism class":
        bad = rig.admit(2, rig.put(prompt), seed_handle=seed, determinism_class=DET)
    else:
        other = [*PREFIX[:31], 5, 7, 8, 9]  # last seeded token differs
        bad = rig.admit(2, rig.put(other), seed_handle=seed)
    rig.rejects(STALE, [bad])
    events = rig.tick([rig.admit(2, rig.put(prompt), seed_handle=seed)], prefills=[P(2, 32, 3)])
    assert events.admit_results[0].status == AdmitStatus.ADMITTED


# ABI rule 81
def test_rule_081_seed_is_consumed_by_one_admit(rig):
    publish(rig, 1, PREFIX)
    span = rig.put([*PREFIX, 1, 2])
    seed = rig.bundle.seed_acquire(span, 32, BEST)
    rig.tick([rig.admit(2, span, seed_handle=seed)], prefills=[P(2, 32, 2)])
    rig.rejects(STALE, [rig.admit(3, rig.put([*PREFIX, 1, 2]), seed_handle=seed)])
    assert _status(rig.bundle.seed_release, seed) == Status.ERR_UNKNOWN_HANDLE


# ABI rule 82
def test_rule_082_one_seed_twice_in_a_plan(rig):
    publish(rig, 1, PREFIX)
    span = rig.put([*PREFIX, 1, 2])
    seed = rig.bundle.seed_acquire(span, 32, BEST)
    twice = [rig.admit(2, span, seed_handle=seed), rig.admit(3, span, seed_handle=seed)]
    rig.rejects(STALE, twice, prefills=[P(2, 32, 2), P(3, 32, 2)])
    events = rig.tick(twice[:1], prefills=[P(2, 32, 2)])
    assert events.admit_results[0].status == AdmitStatus.ADMITTED


# ABI rule 83
def test_rule_083_lease_ttl_in_ticks(make_rig):
    rig = make_rig(seed_lease_ticks=3)
    ttl = rig.bundle.seed_lease_ticks()
    publish(rig, 1, PREFIX)
    prompt = [*PREFIX, 1, 2]
    # Acquired before tick T: ticks T .. T+ttl may still use it.
    seed = rig.bundle.seed_acquire(rig.put(prompt), 32, BEST)
    for _ in range(ttl):
        rig.tick()
    events = rig.tick([rig.admit(2, rig.put(prompt), seed_handle=seed)], prefills=[P(2, 32, 2)])
    assert events.admit_results[0].status == AdmitStatus.ADMITTED
    rig.tick(retires=[R(2)])
    # One tick later it is stale, and its pin no longer protects the entry.
    seed = rig.bundle.seed_acquire(rig.put(prompt), 32, BEST)
    everything = ShedPolicy(evictable_cache_classes=2**64 - 1, max_evict_bytes=2**64 - 1)
    assert rig.bundle.cache_evict(everything, 2**40) == 0  # pinned
    for _ in range(ttl + 1):
        rig.tick()
    rig.rejects(STALE, [rig.admit(3, rig.put(prompt), seed_handle=seed)])
    assert rig.bundle.cache_evict(everything, 2**40) == 2 * 16 * 64


# ABI rule 84
def test_rule_084_declared_lease_ttl(make_rig):
    assert make_rig().bundle.seed_lease_ticks() == 8
    assert make_rig(seed_lease_ticks=3).bundle.seed_lease_ticks() == 3


# ABI rule 84
def test_rule_084_lease_ttl_is_positive(rig):
    assert rig.bundle.seed_lease_ticks() >= 1


# ABI rule 85
def test_rule_085_seeded_lane_inherits_taint(rig):
    publish_tainted(rig, 1, PREFIX)
    prompt = [*PREFIX, *range(200, 216)]
    span = rig.put(prompt)
    seed = rig.bundle.seed_acquire(span, 32, BEST)
    rig.tick([rig.admit(2, span, seed_handle=seed)], prefills=[P(2, 32, 16)])
    rig.tick(retires=[R(2, publish=True)])
    match = rig.bundle.space_match(0, rig.put(prompt)).spaces[0].candidates
    longest = max(match, key=lambda c: c.prefix_len)
    assert longest.prefix_len == 48
    assert longest.taint_bits & Taint.QUANTIZED_DEMOTION


@pytest.mark.parametrize("case", ["lane-owned", "busy", "span shorter", "span longer"])
# ABI rule 86
def test_rule_086_seed_adopt_refusals(rig, case):
    prompt = list(range(40, 60))
    events = rig.start(1, prompt, decode=4)
    history = prompt + rig.emitted(events, 1)
    lane_seq = rig.bundle.lane_sequence(1)
    if case == "lane-owned":
        assert _status(rig.bundle.seed_adopt, lane_seq, rig.put(history)) == Status.ERR_UNKNOWN_HANDLE
        return
    child = rig.bundle.seq_fork(lane_seq)
    if case == "busy":
        try:
            size, gen = rig.bundle.export_size(child, 0, TokenRange(start=0, end=16), Encoding.LOSSLESS)
            rig.bundle.snapshot(child, 0, 16, gen, size)
        except AbiError as e:
            if e.status == Status.ERR_OP_UNSUPPORTED:
                xfail_unless_reference(rig.bundle, "state ops (RULES.md section H)")
            raise
        assert _status(rig.bundle.seed_adopt, child, rig.put(history)) == Status.EBUSY
        return
    span = rig.put(history[:-1] if case == "span shorter" else [*history, 5])
    assert _status(rig.bundle.seed_adopt, child, span) == UNSERVABLE
    # The matching span is adopted; the admit takes the sequence over and continues exactly.
    seed = rig.bundle.seed_adopt(child, rig.put(history))
    tail = rig.emitted(rig.tick(decodes=[D(1, 5)]), 1)
    events = rig.tick([rig.admit(2, rig.put(history), seed_handle=seed)], decodes=[D(2, 5)])
    assert rig.emitted(events, 2) == tail
