"""RULES.md section D: plan validation, rules 27-52.

Each refusal is checked twice: the code ``baseRT_tick`` returns, and (reference engine) that the
engine's observable state - counters, pool, cache, leases, every lane - is exactly what it was
(``Rig.rejects``). Where a rule names a legal neighbour (DRAIN with only decodes, the same plan at
a fitting budget) the neighbour is run too, so a check that refused everything would fail.
"""

from __future__ import annotations

import pytest
from lanekit import ALL_EVICTABLE, C, D, P, R, xfail_unless_reference

from basertd.native.abi import AbiError, CapabilityReq, StrategyRegistration
from basertd.schema.abi import (
    Encoding,
    Finish,
    Sampling,
    Status,
    StrategyCap,
    TickFlag,
)
from basertd.schema.tick import ShedPolicy, TokenRange

ILLEGAL = Status.REJECT_ILLEGAL_COMBINATION
HOST = Sampling.HOST
U64_MAX = 2**64 - 1


def host_lane(rig, tag: int = 4, prompt=(7, 8, 9, 10)) -> int:
    """Admit a HOST lane and decode once; returns the pending row's nonce."""
    events = rig.start(tag, list(prompt), decode=1, sampling=HOST)
    nonce = rig.emit_of(events, tag).logits_row.generation
    assert nonce
    return nonce


def gpu_lane(rig, tag: int = 1, prompt=(11, 12, 13, 14, 15, 16), decode: int = 2):
    return rig.start(tag, list(prompt), decode=decode)


@pytest.mark.parametrize("array", ["admits", "commits", "prefills", "decodes", "retires"])
# ABI rule 27
def test_rule_027_same_tag_twice_in_one_array(rig, array):
    gpu_lane(rig, 1)
    nonce = host_lane(rig, 4)
    span = rig.put([5, 6, 7])
    cases = {
        "admits": dict(admits=[rig.admit(2, span), rig.admit(2, span)]),
        "commits": dict(commits=[C(4, 9, nonce), C(4, 9, nonce)]),
        "prefills": dict(admits=[rig.admit(2, span)], prefills=[P(2, 0, 1), P(2, 1, 2)]),
        "decodes": dict(decodes=[D(1, 1), D(1, 1)]),
        "retires": dict(retires=[R(1), R(1)]),
    }
    rig.rejects(Status.REJECT_DUPLICATE_LANE, **cases[array])
    # One record per array is fine.
    single = {k: v[:1] for k, v in cases[array].items()}
    rig.tick(**single)


# ABI rule 28
def test_rule_028_admit_and_retire_of_one_tag(rig):
    gpu_lane(rig, 1)
    span = rig.put([5, 6, 7])
    rig.rejects(ILLEGAL, [rig.admit(2, span)], retires=[R(2)])
    rig.rejects(ILLEGAL, [rig.admit(1, span)], retires=[R(1)])


@pytest.mark.parametrize("combo", ["admit+commit", "commit+retire", "decode+retire", "prefill+retire"])
# ABI rule 29
def test_rule_029_contradicting_records_of_one_tag(rig, combo):
    nonce = host_lane(rig, 4, prompt=(1, 2, 3, 4, 5, 6, 7, 8))
    span = rig.put([5, 6, 7])
    rig.start(6, [30, 31, 32, 33], decode=0)
    cases = {
        "admit+commit": dict(admits=[rig.admit(9, span, sampling=HOST)], commits=[C(9, 3, nonce)]),
        "commit+retire": dict(commits=[C(4, 3, nonce)], retires=[R(4)]),
        "decode+retire": dict(decodes=[D(6, 1)], retires=[R(6)]),
        "prefill+retire": dict(prefills=[P(6, 4, 0)], retires=[R(6)]),
    }
    rig.rejects(ILLEGAL, **cases[combo])


# ABI rule 30
def test_rule_030_more_decodes_than_max_decode_lanes(rig):
    gpu_lane(rig, 1)
    gpu_lane(rig, 2)
    rig.rejects(Status.REJECT_BUDGET, decodes=[D(1), D(2)], max_decode_lanes=1)
    rig.tick(decodes=[D(1), D(2)], max_decode_lanes=2)


# ABI rule 31
def test_rule_031_max_decode_lanes_above_batch_size(make_rig):
    rig = make_rig(max_batch_size=4)
    gpu_lane(rig, 1)
    rig.rejects(Status.REJECT_BUDGET, decodes=[D(1)], max_decode_lanes=5)
    rig.tick(decodes=[D(1)], max_decode_lanes=4)


# ABI rule 32
def test_rule_032_plan_seq_must_increase(rig):
    gpu_lane(rig, 1)  # plan_seq 1
    rig.tick(decodes=[D(1)], plan_seq=10)
    rig.rejects(ILLEGAL, decodes=[D(1)], plan_seq=10)
    rig.rejects(ILLEGAL, decodes=[D(1)], plan_seq=3)
    events = rig.tick(decodes=[D(1)], plan_seq=11)
    assert events.plan_seq == 11


# ABI rule 33
def test_rule_033_drain_refuses_admits_only(rig):
    gpu_lane(rig, 1)
    span = rig.put([5, 6, 7])
    rig.rejects(ILLEGAL, [rig.admit(2, span)], prefills=[P(2, 0, 3)], flags=TickFlag.DRAIN)
    events = rig.tick(decodes=[D(1, 2)], flags=TickFlag.DRAIN)
    assert rig.emit_of(events, 1).n_tokens == 2


# ABI rule 34
def test_rule_034_admit_of_a_live_lane(rig):
    gpu_lane(rig, 1)
    rig.rejects(ILLEGAL, [rig.admit(1, rig.put([5, 6, 7]))])


@pytest.mark.parametrize("how", ["future generation", "recycled slot", "generation 0"])
# ABI rule 35
def test_rule_035_prompt_ref_generation_must_be_current(rig, how):
    gpu_lane(rig, 1)
    span = rig.put([5, 6, 7])
    if how == "future generation":
        bad = span.__class__(
            ring_id=span.ring_id, index=span.index, count=span.count, generation=span.generation + 1
        )
    elif how == "generation 0":
        bad = span.__class__(ring_id=span.ring_id, index=span.index, count=span.count, generation=0)
    else:
        for _ in range(rig.prompt.slots):  # every slot rewritten once: the span's slot recycled
            rig.put([1])
        bad = span
    rig.rejects(Status.REJECT_BAD_REF_GENERATION, [rig.admit(2, bad)], prefills=[P(2, 0, 3)])
    rig.tick([rig.admit(2, rig.put([5, 6, 7]))], prefills=[P(2, 0, 3)])


@pytest.mark.parametrize("field", ["sampling", "strategy_slot"])
# ABI rule 36
def test_rule_036_unknown_sampling_or_strategy(rig, field):
    span = rig.put([5, 6, 7])
    bad = rig.admit(2, span, sampling=3) if field == "sampling" else rig.admit(2, span, strategy_slot=7)
    rig.rejects(ILLEGAL, [bad], prefills=[P(2, 0, 3)])
    rig.tick([rig.admit(2, span)], prefills=[P(2, 0, 3)])


# ABI rule 37
def test_rule_037_host_lane_needs_host_compatible_strategy(rig):
    reg = StrategyRegistration(
        strategy_id="linear-draft", capabilities=[CapabilityReq(kind_id=StrategyCap.PROPOSAL_LINEAR)]
    )
    try:
        grant = rig.bundle.strategy_register(reg)
    except AbiError as e:
        if e.status == Status.ERR_REGISTRATION_REFUSED:
            xfail_unless_reference(rig.bundle, "strategy registration (RULES.md section I)")
        raise
    span = rig.put([5, 6, 7])
    bad = rig.admit(2, span, sampling=HOST, strategy_slot=grant.strategy_slot, allow_approximate=1)
    rig.rejects(Status.REJECT_HOST_RULES, [bad], prefills=[P(2, 0, 3)])


@pytest.mark.parametrize("array", ["commits", "prefills", "decodes", "retires"])
# ABI rule 38
def test_rule_038_records_naming_unknown_lanes(rig, array):
    gpu_lane(rig, 1)
    cases = {
        "commits": dict(commits=[C(77, 3, 1)]),
        "prefills": dict(prefills=[P(77, 0, 1)]),
        "decodes": dict(decodes=[D(77, 1)]),
        "retires": dict(retires=[R(77)]),
    }
    rig.rejects(Status.REJECT_UNKNOWN_LANE, **cases[array])


# ABI rule 39
def test_rule_039_commit_on_gpu_lane(rig):
    gpu_lane(rig, 1)
    rig.rejects(ILLEGAL, commits=[C(1, 3, 1)])


# ABI rule 40
def test_rule_040_commit_without_pending_row(rig):
    rig.start(4, [7, 8, 9], sampling=HOST)  # prefilled, never decoded: no row
    rig.rejects(Status.REJECT_HOST_RULES, commits=[C(4, 3, 1)])
    nonce = rig.emit_of(rig.tick(decodes=[D(4, 1)]), 4).logits_row.generation
    rig.tick(commits=[C(4, 3, nonce)])
    rig.rejects(Status.REJECT_HOST_RULES, commits=[C(4, 3, nonce)])  # answered already


# ABI rule 41
def test_rule_041_commit_with_stale_nonce(rig):
    nonce = host_lane(rig, 4)
    rig.rejects(Status.REJECT_STALE_NONCE, commits=[C(4, 3, nonce + 1)])
    rig.rejects(Status.REJECT_STALE_NONCE, commits=[C(4, 3, 0)])
    rig.tick(commits=[C(4, 3, nonce)])


@pytest.mark.parametrize("case", ["token >= vocab", "finished lane"])
# ABI rule 42
def test_rule_042_commit_token_bounds_and_finished_lane(make_rig, case):
    rig = make_rig(vocab_size=64, eos_token=2)
    nonce = host_lane(rig, 4)
    if case == "token >= vocab":
        rig.rejects(Status.REJECT_BOUNDS, commits=[C(4, 64, nonce)])
        rig.tick(commits=[C(4, 63, nonce)])
    else:
        events = rig.tick(commits=[C(4, 2, nonce)])  # the host picked EOS: the lane ends
        assert rig.emit_of(events, 4).finish == Finish.EOS
        rig.rejects(ILLEGAL, commits=[C(4, 3, nonce)])


# ABI rule 43
def test_rule_043_host_decode_grant_must_be_one(rig):
    rig.start(4, [7, 8, 9], sampling=HOST)
    rig.rejects(Status.REJECT_HOST_RULES, decodes=[D(4, 2)])
    rig.tick(decodes=[D(4, 1)])


# ABI rule 44
def test_rule_044_host_decode_while_row_pending(rig):
    nonce = host_lane(rig, 4)
    rig.rejects(Status.REJECT_HOST_RULES, decodes=[D(4, 1)])
    events = rig.tick(commits=[C(4, 3, nonce)], decodes=[D(4, 1)])
    assert rig.emit_of(events, 4).logits_row.generation not in (0, nonce)


@pytest.mark.parametrize("offset", [0, 3, 5, 9])
# ABI rule 45
def test_rule_045_noncontiguous_prefill(rig, offset):
    span = rig.put(list(range(20, 32)))
    rig.tick([rig.admit(2, span)], prefills=[P(2, 0, 4)])  # 4 prefilled
    rig.rejects(ILLEGAL, prefills=[P(2, offset, 2)])
    rig.tick(prefills=[P(2, 4, 2)])
    if rig.state() is not None:
        assert rig.ref.lane_info(2).prefilled == 6


@pytest.mark.parametrize("replay", [0, 3])
# ABI rule 46
def test_rule_046_prefill_beyond_replay_start(rig, replay):
    tokens = list(range(20, 30))
    span = rig.put(tokens)
    end = len(tokens) - replay
    rig.rejects(Status.REJECT_BOUNDS, [rig.admit(2, span, decode_replay=replay)], prefills=[P(2, 0, end + 1)])
    rig.tick([rig.admit(2, span, decode_replay=replay)], prefills=[P(2, 0, end)])


# ABI rule 47
def test_rule_047_decode_before_prefill_completes(rig):
    span = rig.put(list(range(20, 30)))
    admit = rig.admit(2, span)
    rig.rejects(ILLEGAL, [admit], prefills=[P(2, 0, 10)], decodes=[D(2, 1)], budget=5)
    rig.rejects(ILLEGAL, [admit], prefills=[P(2, 0, 6)], decodes=[D(2, 1)])
    events = rig.tick([admit], prefills=[P(2, 0, 10)], decodes=[D(2, 1)], budget=10)
    assert rig.emit_of(events, 2).n_tokens == 1


@pytest.mark.parametrize("how", ["eos", "length", "forced"])
# ABI rule 48
def test_rule_048_decode_on_finished_lane(make_rig, how):
    if how == "eos":
        rig = make_rig(scripted_tokens=[40, 2], eos_token=2)
        events = rig.start(1, [5, 6, 7], decode=4)
        assert rig.emitted(events, 1) == [40, 2]
        finish = Finish.EOS
    elif how == "length":
        rig = make_rig(context_length=8)
        events = rig.start(1, [5, 6, 7], decode=10)
        assert rig.emit_of(events, 1).n_tokens == 5
        finish = Finish.LENGTH
    else:
        rig = make_rig()
        rig.start(1, [5, 6, 7], decode=1)
        rig.ref.force_finish(1, Finish.CANCELLED)
        events = rig.tick()
        finish = Finish.CANCELLED
    assert rig.emit_of(events, 1).finish == finish
    rig.rejects(ILLEGAL, decodes=[D(1, 1)])
    rig.tick(retires=[R(1)])


# ABI rule 49
def test_rule_049_record_on_lane_with_op_in_flight(rig):
    gpu_lane(rig, 1, prompt=tuple(range(40, 72)))  # 32 tokens + 2 generated
    seq = rig.bundle.lane_sequence(1)
    try:
        size, gen = rig.bundle.export_size(seq, 0, TokenRange(start=0, end=32), Encoding.LOSSLESS)
        op = rig.bundle.snapshot(seq, 0, 32, gen, size)
    except AbiError as e:
        if e.status == Status.ERR_OP_UNSUPPORTED:
            xfail_unless_reference(rig.bundle, "state ops (RULES.md section H)")
        raise
    assert op
    for records in (dict(decodes=[D(1, 1)]), dict(retires=[R(1)])):
        rig.rejects(Status.REJECT_TRANSFER_LOCKED, **records)


def _small_pool(make_rig, blocks: int, **config):
    """A rig whose pool holds ``blocks`` blocks of 16 tokens (1 KiB each)."""
    return make_rig(page_size_tokens=16, bytes_per_token=64, pool_bytes=blocks * 1024, **config)


def _publish(rig, tag: int, tokens) -> None:
    rig.start(tag, list(tokens))
    rig.tick(retires=[R(tag, publish=True)])


# ABI rule 50
def test_rule_050_plan_that_cannot_fit_needs_replan(make_rig):
    rig = _small_pool(make_rig, 6)
    _publish(rig, 1, range(100, 132))  # a 2-block cache entry
    rig.start(2, list(range(200, 232)))  # a lane holding 2 blocks; 2 blocks free
    used = rig.ref.stats()["pool_bytes_used"]
    big = rig.admit(3, rig.put(range(300, 380)))  # 80 tokens: 5 blocks
    # Free 2 + evictable 2 < 5: no envelope is enough.
    rig.rejects(Status.NEEDS_REPLAN, [big], prefills=[P(3, 0, 80)], shed=ALL_EVICTABLE)
    # An envelope smaller than the entry evicts nothing: 3 blocks do not fit in 2 either.
    mid = rig.admit(3, rig.put(range(300, 348)))
    rig.rejects(
        Status.NEEDS_REPLAN,
        [mid],
        prefills=[P(3, 0, 48)],
        shed=ShedPolicy(evictable_cache_classes=1, max_evict_bytes=1024),
    )
    assert rig.ref.stats()["pool_bytes_used"] == used
    # Inside the allowed envelope the same plan fits by evicting the entry.
    events = rig.tick([mid], prefills=[P(3, 0, 48)], shed=ALL_EVICTABLE)
    assert events.shed.evictions_performed == 1


# ABI rule 51
def test_rule_051_full_protected_quota_evicts_nothing(make_rig):
    rig = _small_pool(make_rig, 4)
    _publish(rig, 1, range(100, 132))  # 2 blocks cached, 2 free
    admit = rig.admit(2, rig.put(range(200, 248)))  # 3 blocks
    protected = ShedPolicy(
        evictable_cache_classes=U64_MAX, protected_quota_bytes=U64_MAX, max_evict_bytes=U64_MAX
    )
    rig.rejects(Status.NEEDS_REPLAN, [admit], prefills=[P(2, 0, 48)], shed=protected)
    events = rig.tick([admit], prefills=[P(2, 0, 48)], shed=ALL_EVICTABLE)
    assert events.shed.evictions_performed == 1


@pytest.mark.parametrize("source", ["commit", "seed prefix", "host replay"])
# ABI rule 52
def test_rule_052_commits_seeds_and_replay_count_toward_the_pool(make_rig, source):
    if source == "commit":
        rig = _small_pool(make_rig, 2)
        nonce = host_lane(rig, 4, prompt=range(100, 132))  # exactly 2 full blocks
        rig.rejects(Status.NEEDS_REPLAN, commits=[C(4, 3, nonce)], shed=ALL_EVICTABLE)
        rig.tick(retires=[R(4)])
    elif source == "host replay":
        rig = _small_pool(make_rig, 2)
        span = rig.put(range(100, 133))  # 33 tokens, the last one generated before a preemption
        rig.tick([rig.admit(4, span, sampling=HOST, decode_replay=1)], prefills=[P(4, 0, 32)])
        rig.rejects(Status.NEEDS_REPLAN, decodes=[D(4, 1)], shed=ALL_EVICTABLE)
    else:
        rig = _small_pool(make_rig, 5)
        _publish(rig, 1, range(100, 132))  # entry: 2 blocks; 3 free
        prompt = list(range(100, 132)) + list(range(300, 364))  # seed 32 + 64 new: 4 new blocks
        span = rig.put(prompt)
        seed = rig.bundle.seed_acquire(span, 32, 0)
        # Evicting the seeded entry would make room, but its blocks back the new lane.
        admit = rig.admit(2, span, seed_handle=seed)
        rig.rejects(Status.NEEDS_REPLAN, [admit], prefills=[P(2, 32, 64)], shed=ALL_EVICTABLE)
        events = rig.tick([admit], prefills=[P(2, 32, 48)], shed=ALL_EVICTABLE)  # 3 new blocks fit
        assert events.admit_results[0].status == 1
        assert events.shed.evictions_performed == 0
