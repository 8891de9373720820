"""Plan validation of the llama.cpp engine (RULES.md section D and rules 71, 74): every bad plan
gets its reject code and changes nothing - lanes, KV, cache, leases, counters, plan_seq."""

from __future__ import annotations

import pytest
from lc_harness import admit, ignore_eos, make_prompt

from basertd.schema.abi import AdmitStatus, Exactness, Sampling, Status, TickFlag
from basertd.schema.tick import (
    LaneCommit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    ShedPolicy,
    TokenRef,
)
from basertd.worker.engines.base import PlanRejected

U64 = (1 << 64) - 1


def fingerprint(eng):
    """Everything a rejected plan must leave alone."""
    lanes = sorted(
        (t, ln.n_tokens, ln.kv_len, ln.prefilled, ln.produced, ln.pending_nonce, ln.finish, ln.generated)
        for t, ln in eng.lanes.items()
    )
    stats = {k: v for k, v in eng.stats().items() if k != "rejected_plans"}
    cache = sorted((e.entry_id, e.pins, e.lru) for e in eng.cache.entries.values())
    return (
        eng.last_plan_seq,
        eng.tick_index,
        eng.ledger.used,
        eng.ledger.free,
        lanes,
        sorted(eng.faulted),
        cache,
        sorted(eng.cache.leases),
        stats,
    )


def rejects(coord, status, **plan):
    """Run a plan that must be rejected with ``status`` and change nothing."""
    eng = coord.engine
    before = fingerprint(eng)
    n_rejected = eng.stats()["rejected_plans"]
    with pytest.raises(PlanRejected) as ex:
        coord.tick(**plan)
    assert ex.value.status == status, str(ex.value)
    assert fingerprint(eng) == before
    assert eng.stats()["rejected_plans"] == n_rejected + 1


def live(coord, tag, n=8, decode=True, **kw):
    ref = coord.prompt(make_prompt(tag, n))
    coord.tick(
        admits=[admit(tag, ref, **kw)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=n)],
        decodes=[LaneDecode(lane_tag=tag)] if decode else [],
    )


D = LaneDecode
P = LanePrefill
R = LaneRetire
C = LaneCommit


def test_duplicates_in_one_array(lc):
    # ABI rule 27
    _eng, coord = lc
    live(coord, 1)
    ref = coord.prompt(make_prompt(2, 4))
    rejects(coord, Status.REJECT_DUPLICATE_LANE, admits=[admit(2, ref), admit(2, ref)])
    rejects(coord, Status.REJECT_DUPLICATE_LANE, decodes=[D(lane_tag=1), D(lane_tag=1)])
    rejects(coord, Status.REJECT_DUPLICATE_LANE, retires=[R(lane_tag=1), R(lane_tag=1)])
    rejects(
        coord,
        Status.REJECT_DUPLICATE_LANE,
        prefills=[P(lane_tag=1, token_offset=8, token_count=0), P(lane_tag=1, token_offset=8, token_count=0)],
    )


def test_illegal_combinations(lc):
    # ABI rules 28, 29, 33, 34
    _eng, coord = lc
    live(coord, 1)
    live(coord, 5, sampling=Sampling.HOST)
    ref = coord.prompt(make_prompt(2, 4))
    bad = Status.REJECT_ILLEGAL_COMBINATION
    rejects(coord, bad, admits=[admit(2, ref)], retires=[R(lane_tag=2)])
    rejects(coord, bad, admits=[admit(2, ref)], commits=[C(lane_tag=2)])
    rejects(coord, bad, commits=[C(lane_tag=5, logits_nonce=1)], retires=[R(lane_tag=5)])
    rejects(coord, bad, decodes=[D(lane_tag=1)], retires=[R(lane_tag=1)])
    rejects(coord, bad, prefills=[P(lane_tag=1, token_offset=8)], retires=[R(lane_tag=1)])
    rejects(coord, bad, admits=[admit(1, ref)])  # already live
    rejects(coord, bad, admits=[admit(2, ref)], flags=TickFlag.DRAIN)
    coord.tick(decodes=[D(lane_tag=1)], flags=TickFlag.DRAIN)  # DRAIN with decodes only is fine
    rejects(coord, bad, decodes=[D(lane_tag=1, max_new_tokens=0)])


def test_budgets(lc):
    # ABI rules 30, 31
    eng, coord = lc
    live(coord, 1)
    live(coord, 2)
    rejects(coord, Status.REJECT_BUDGET, decodes=[D(lane_tag=1), D(lane_tag=2)], max_decode_lanes=1)
    rejects(coord, Status.REJECT_BUDGET, decodes=[D(lane_tag=1)], max_decode_lanes=eng.max_lanes + 1)
    for t in range(3, 9):
        live(coord, t, decode=False)
    ref = coord.prompt(make_prompt(9, 4))
    rejects(coord, Status.REJECT_BUDGET, admits=[admit(9, ref)])  # a ninth lane


def test_plan_seq_must_rise(lc):
    # ABI rule 32
    _eng, coord = lc
    coord.tick()
    coord.plan_seq -= 1
    rejects(coord, Status.REJECT_ILLEGAL_COMBINATION)
    coord.plan_seq -= 3
    rejects(coord, Status.REJECT_ILLEGAL_COMBINATION)
    coord.plan_seq += 4
    coord.tick()


def test_admit_records(lc):
    # ABI rules 35, 36, 71, 74 and the engine's BOUNDS choices
    eng, coord = lc
    good = coord.prompt(make_prompt(1, 6))
    bad = Status.REJECT_ILLEGAL_COMBINATION
    rejects(coord, bad, admits=[admit(1, good, sampling=3)])
    rejects(coord, bad, admits=[admit(1, good, strategy_slot=1)])
    rejects(coord, bad, admits=[admit(1, good, grammar_handle=4)])
    rejects(coord, bad, admits=[admit(1, good, grammar_replay=2)])
    rejects(coord, bad, admits=[admit(1, good, logit_bias_handle=99)])
    rejects(coord, Status.REJECT_BOUNDS, admits=[admit(1, good, want_logprobs=22)])
    rejects(coord, Status.REJECT_BOUNDS, admits=[admit(1, good, decode_replay=6)])
    rejects(coord, Status.REJECT_BOUNDS, admits=[admit(1, coord.prompt([1, 5, eng.n_vocab]))])
    rejects(coord, Status.REJECT_BOUNDS, admits=[admit(1, coord.prompt(make_prompt(2, 257)))])
    rejects(coord, Status.REJECT_BAD_REF_GENERATION, admits=[admit(1, TokenRef(ring_id=1, count=3))])
    stale = coord.prompt(make_prompt(3, 5))
    for i in range(coord.prompts.slots):
        coord.prompt(make_prompt(4 + i, 5))
    rejects(coord, Status.REJECT_BAD_REF_GENERATION, admits=[admit(1, stale)])  # ABI rules 35, 128
    coord.tick(admits=[admit(1, coord.prompt(make_prompt(1, 6)), want_logprobs=21)])


def test_unknown_lanes(lc):
    # ABI rule 38
    _eng, coord = lc
    live(coord, 1)
    unk = Status.REJECT_UNKNOWN_LANE
    rejects(coord, unk, decodes=[D(lane_tag=2)])
    rejects(coord, unk, retires=[R(lane_tag=2)])
    rejects(coord, unk, prefills=[P(lane_tag=2)])
    rejects(coord, unk, commits=[C(lane_tag=2)])


def test_prefill_records(lc):
    # ABI rules 45-47
    _eng, coord = lc
    ref = coord.prompt(make_prompt(1, 20))
    coord.tick(admits=[admit(1, ref)], prefills=[P(lane_tag=1, token_offset=0, token_count=10)])
    bad = Status.REJECT_ILLEGAL_COMBINATION
    rejects(coord, bad, prefills=[P(lane_tag=1, token_offset=9, token_count=3)])
    rejects(coord, bad, prefills=[P(lane_tag=1, token_offset=11, token_count=3)])
    rejects(coord, Status.REJECT_BOUNDS, prefills=[P(lane_tag=1, token_offset=10, token_count=11)])
    rejects(coord, bad, decodes=[D(lane_tag=1)])  # prefill not complete [47]
    rejects(  # ... nor after the budget cuts this tick's chunk [47]
        coord,
        bad,
        prefills=[P(lane_tag=1, token_offset=10, token_count=10)],
        decodes=[D(lane_tag=1)],
        prefill_token_budget=9,
    )
    coord.tick(prefills=[P(lane_tag=1, token_offset=10, token_count=10)], decodes=[D(lane_tag=1)])


def test_emit_ring_capacity_bounds_a_grant(make_engine):
    _eng, coord = make_engine(coord_kw={"emit_slots": 4, "emit_slot_tokens": 8})
    live(coord, 1, params=ignore_eos())
    rejects(coord, Status.REJECT_BOUNDS, decodes=[D(lane_tag=1, max_new_tokens=33)])
    ev = coord.tick(decodes=[D(lane_tag=1, max_new_tokens=32)])
    assert ev.emits[0].n_tokens == 32


def test_a_lane_under_a_state_op_is_transfer_locked(lc):
    # ABI rule 49
    eng, coord = lc
    live(coord, 1)
    live(coord, 2)
    seq = eng.lane_sequence(1)
    size, gen = eng.export_size(seq, 0, _range(eng.lanes[1].kv_len), 0)
    op = eng.snapshot(seq, 0, eng.lanes[1].kv_len, gen, size)
    rejects(coord, Status.REJECT_TRANSFER_LOCKED, decodes=[D(lane_tag=1)])
    rejects(coord, Status.REJECT_TRANSFER_LOCKED, retires=[R(lane_tag=1)])
    ev = coord.tick(decodes=[D(lane_tag=2)])  # other lanes go on; the op completes in this tick
    assert [(c.op, c.state) for c in ev.op_completions] == [(op, 2)]
    coord.tick(decodes=[D(lane_tag=1)])


def _range(end):
    from basertd.schema.tick import TokenRange

    return TokenRange(start=0, end=end)


def test_certificates(lc):
    # ABI rules 14, 15, 119, 122: this engine has no certificates; a plain lane is DISTRIBUTION_EXACT
    eng, coord = lc
    ref = coord.prompt(make_prompt(1, 4))
    ev = coord.tick(
        admits=[
            admit(1, ref),
            admit(2, ref, required_cert_id=3),
            admit(3, ref, required_cert_id=3, allow_approximate=1),
            admit(4, ref, minimum_exactness=Exactness.SEED_PATH_INVARIANT),
        ],
        prefills=[P(lane_tag=t, token_offset=0, token_count=4) for t in (1, 2, 3, 4)],
        decodes=[D(lane_tag=t) for t in (1, 2, 3, 4)],
    )
    res = {r.lane_tag: r for r in ev.admit_results}
    assert (res[1].status, res[1].granted_class) == (AdmitStatus.ADMITTED, Exactness.DISTRIBUTION_EXACT)
    assert res[2].status == AdmitStatus.REJECTED and res[2].reject_code == 0xFFFFFF74
    assert res[2].reject_status == Status.REJECT_CERT_UNMATCHED
    assert (res[3].status, res[3].granted_class, res[3].cert_id) == (
        AdmitStatus.ADMITTED,
        Exactness.APPROXIMATE,
        0,
    )
    assert res[4].status == AdmitStatus.REJECTED
    assert sorted(eng.lanes) == [1, 3]
    assert sorted(e.lane_tag for e in ev.emits) == [1, 3]


@pytest.mark.kv_layouts("unified")
def test_kv_exhaustion_is_needs_replan_never_a_crash(make_engine):
    # ABI rules 50-52: 4 lanes of 128 tokens in a 256-cell pool; every committed token is charged,
    # including each lane's last sampled one, whose KV the next decode computes
    eng, coord = make_engine(lanes=4, context_length=128, pool_tokens=256)
    assert eng.n_cells == 256
    for t in (1, 2, 3):
        live(coord, t, n=80, params=ignore_eos())  # 80 prompt + 1 sampled: 81 charged each
    ref = coord.prompt(make_prompt(4, 60))
    prefill = [P(lane_tag=4, token_offset=0, token_count=60)]
    rejects(coord, Status.NEEDS_REPLAN, admits=[admit(4, ref)], prefills=prefill)
    rejects(coord, Status.NEEDS_REPLAN, decodes=[D(lane_tag=t, max_new_tokens=5) for t in (1, 2, 3)])
    ev = coord.tick(decodes=[D(lane_tag=t, max_new_tokens=4) for t in (1, 2, 3)])  # 243 + 12 of 256
    assert sum(e.n_tokens for e in ev.emits) == 12 and eng.ledger.free == 256 - 3 * 84
    rejects(coord, Status.NEEDS_REPLAN, decodes=[D(lane_tag=t, max_new_tokens=1) for t in (1, 2, 3)])
    ev = coord.tick(retires=[R(lane_tag=1)], decodes=[D(lane_tag=t, max_new_tokens=1) for t in (2, 3)])
    assert sum(e.n_tokens for e in ev.emits) == 2


@pytest.mark.kv_layouts("unified")
def test_commits_and_replay_tokens_are_charged_when_committed(make_engine):
    # ABI rule 52
    _eng, coord = make_engine(lanes=2, context_length=64, pool_tokens=32)
    ref = coord.prompt(make_prompt(1, 32))
    ev = coord.tick(
        admits=[admit(1, ref, sampling=Sampling.HOST)],
        prefills=[P(lane_tag=1, token_offset=0, token_count=32)],
        decodes=[D(lane_tag=1)],
    )
    nonce = ev.emits[0].logits_row.generation  # the row came from the prefill: no new cell
    rejects(coord, Status.NEEDS_REPLAN, commits=[C(lane_tag=1, token_id=5, logits_nonce=nonce)])
    coord.tick(retires=[R(lane_tag=1)])
    ref = coord.prompt(make_prompt(2, 33))
    coord.tick(
        admits=[admit(2, ref, decode_replay=1)], prefills=[P(lane_tag=2, token_offset=0, token_count=32)]
    )
    rejects(coord, Status.NEEDS_REPLAN, decodes=[D(lane_tag=2)])  # the replayed token needs a cell


@pytest.mark.kv_layouts("unified")
def test_cache_entries_are_evicted_inside_the_shed_envelope(make_engine):
    # ABI rules 50-52, 58
    eng, coord = make_engine(lanes=4, context_length=128, pool_tokens=256)
    for t in (1, 2):
        live(coord, t, n=96)
    coord.tick(retires=[R(lane_tag=1, publish_to_cache=1), R(lane_tag=2, publish_to_cache=1)])
    assert len(eng.cache.entries) == 2 and eng.ledger.used == 192
    ref = coord.prompt(make_prompt(7, 100))
    plan = dict(admits=[admit(7, ref)], prefills=[P(lane_tag=7, token_offset=0, token_count=100)])
    rejects(coord, Status.NEEDS_REPLAN, **plan)  # the default envelope evicts nothing
    rejects(
        coord,
        Status.NEEDS_REPLAN,
        shed_policy=ShedPolicy(evictable_cache_classes=1, protected_quota_bytes=U64, max_evict_bytes=U64),
        **plan,
    )  # ABI rule 51
    rejects(
        coord,
        Status.NEEDS_REPLAN,
        shed_policy=ShedPolicy(evictable_cache_classes=2, max_evict_bytes=U64),
        **plan,
    )
    ev = coord.tick(shed_policy=ShedPolicy(evictable_cache_classes=1, max_evict_bytes=U64), **plan)
    (s,) = ev.shed.entries
    assert (s.kind, s.lane_tag, s.tokens, s.bytes) == (2, 0, 96, 96 * eng.bytes_per_token)
    assert ev.shed.evictions_performed == 1 and ev.tick_status == 1  # SHED
    assert len(eng.cache.entries) == 1 and eng.lanes[7].kv_len == 100
