"""QoS classes, aging, lane caps and the preemption choice, and how the plan builder uses them
(pure functions; DESIGN.md "Scheduling"; ABI rules 45-47, 53, 71-73)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.server.sched.plan_builder import Candidate, LaneView, PlanLimits, build_plan
from basertd.server.sched.qos import LaneCaps, admission_order, choose_victim, effective_rank


@dataclass
class Q:
    name: str
    qos: str
    t_received: float


def order(classes, now, aging, skip=None):
    return [r.name for r in admission_order(classes, now, aging, skip=skip)]


def test_effective_rank_climbs_one_class_per_aging_period_and_stops_at_interactive():
    assert effective_rank(2, 0.0, 10.0) == 2
    assert effective_rank(2, 9.99, 10.0) == 2
    assert effective_rank(2, 10.0, 10.0) == 1
    assert effective_rank(2, 25.0, 10.0) == 0
    assert effective_rank(1, 1e9, 10.0) == 0
    assert effective_rank(2, 1e9, 0.0) == 2  # aging off


def test_strict_class_order_without_aging_and_fifo_within_a_class():
    classes = {
        "interactive": [Q("i1", "interactive", 5.0), Q("i2", "interactive", 6.0)],
        "batch": [Q("b1", "batch", 1.0)],
        "background": [Q("g1", "background", 0.0)],
    }
    assert order(classes, 100.0, 0.0) == ["i1", "i2", "b1", "g1"]


def test_an_aged_background_request_goes_ahead_of_younger_interactive_ones():
    classes = {
        "interactive": [Q("i1", "interactive", 20.0), Q("i2", "interactive", 21.0)],
        "batch": [],
        "background": [Q("g1", "background", 0.0)],
    }
    assert order(classes, 21.0, 10.0) == ["g1", "i1", "i2"]  # waited 21 s: rank 0, and oldest
    assert order(classes, 21.0, 0.0) == ["i1", "i2", "g1"]  # the same queues, aging off: it starves
    # half aged (rank 1) it still yields to interactive requests
    assert order(classes, 15.0, 10.0) == ["i1", "i2", "g1"]


def test_skipped_requests_do_not_block_their_class():
    classes = {
        "interactive": [Q("i1", "interactive", 1.0), Q("i2", "interactive", 2.0)],
        "batch": [Q("b1", "batch", 0.0)],
        "background": [],
    }
    assert order(classes, 3.0, 0.0, skip=lambda r: r.name == "i1") == ["i2", "b1"]


@given(
    st.lists(
        st.tuples(st.sampled_from(["interactive", "batch", "background"]), st.floats(0, 100)),
        max_size=20,
    ),
    st.floats(0, 50),
)
@settings(max_examples=200, deadline=None)
def test_admission_order_is_a_permutation_that_keeps_each_class_fifo(items, aging):
    classes: dict[str, list[Q]] = {"interactive": [], "batch": [], "background": []}
    for i, (qos, t) in enumerate(sorted(items, key=lambda x: x[1])):
        classes[qos].append(Q(f"{qos}{i}", qos, t))
    got = list(admission_order(classes, 100.0, aging))
    assert sorted(r.name for r in got) == sorted(r.name for q in classes.values() for r in q)
    for q in classes.values():
        assert [r for r in got if r in q] == q


def test_lane_caps_from_names_and_allows():
    caps = LaneCaps.from_names({"background": 1, "batch": 0})
    assert caps.allows(2, [0, 0, 0]) and not caps.allows(2, [0, 0, 1])
    assert caps.allows(1, [0, 99, 0])  # 0 = no cap
    with pytest.raises(KeyError):
        LaneCaps.from_names({"urgent": 1})
    with pytest.raises(ValueError):
        LaneCaps.from_names({"batch": -1})


def view(tag, rank, *, preemptible=True, prompt_len=10, prefilled=10, remaining=50, reserved=60, **kw):
    return LaneView(
        tag=tag,
        prompt_len=prompt_len,
        prefilled=prefilled,
        remaining=remaining,
        reserved=reserved,
        qos_rank=rank,
        preemptible=preemptible,
        **kw,
    )


def test_the_victim_is_the_lowest_class_then_the_youngest_lane_never_a_protected_one():
    lanes = [view(1, 1), view(2, 2), view(3, 2), view(4, 1), view(5, 2, preemptible=False), view(6, 0)]
    assert choose_victim(lanes, 0).tag == 3
    assert choose_victim([view(1, 1), view(4, 1)], 0).tag == 4
    assert choose_victim([view(1, 1)], 1) is None  # a batch request never preempts a batch lane
    assert choose_victim([view(6, 0), view(5, 2, preemptible=False)], 0) is None


def limits(**kw) -> PlanLimits:
    base = dict(
        max_lanes=2,
        max_decode_lanes=2,
        kv_tokens=10_000,
        prefill_budget=8,
        decode_grant=4,
        max_admit_tokens=4096,
        preempt=True,
        urgent_prefill_budget=512,
    )
    base.update(kw)
    return PlanLimits(**base)


def cand(key, rank=0, prompt_len=20, max_tokens=10, **kw) -> Candidate:
    return Candidate(
        key=key,
        prompt_len=prompt_len,
        reserve=prompt_len + max_tokens,
        remaining=max_tokens,
        qos_rank=rank,
        urgent=rank == 0,
        **kw,
    )


def test_an_interactive_candidate_preempts_and_gets_its_first_token_in_the_same_plan():
    lanes = [view(1, 1), view(2, 1)]  # both lanes decode batch requests
    d = build_plan(lanes, [cand(7)], limits(), next_tag=3)
    assert d.preempted == [2] and (2, True) in d.retires  # the youngest, publishing its KV
    assert [(t, c.key) for t, c in d.admitted] == [(3, 7)]
    assert d.prefills == [(3, 0, 20)]  # whole, past the small shared budget of 8
    assert (3, 4) in d.decodes and (1, 4) in d.decodes and all(t != 2 for t, _ in d.decodes)


def test_no_preemption_for_batch_candidates_when_disabled_or_when_it_would_not_help():
    lanes = [view(1, 1), view(2, 1)]
    assert not build_plan(lanes, [cand(7, rank=1)], limits(), next_tag=3).preempted
    assert not build_plan(lanes, [cand(7)], limits(preempt=False), next_tag=3).admitted
    # the KV reservation would not fit even with both victims gone: nobody is preempted
    d = build_plan(lanes, [cand(7, prompt_len=20_000)], limits(), next_tag=3)
    assert not d.preempted and not d.admitted and not d.retires


def test_preemption_frees_kv_too():
    lanes = [view(1, 2, reserved=900)]
    d = build_plan(lanes, [cand(7, prompt_len=500, max_tokens=100)], limits(max_lanes=4, kv_tokens=1000), 2)
    assert d.preempted == [1] and len(d.admitted) == 1


def test_a_capped_class_is_skipped_without_blocking_the_others():
    d = build_plan(
        [view(1, 2, preemptible=False)],
        [cand(7, rank=2), cand(8, rank=1)],
        limits(max_lanes=3, lane_caps=LaneCaps((0, 0, 1))),
        next_tag=2,
    )
    assert [c.key for _, c in d.admitted] == [8]


def test_a_resumed_request_replays_its_tokens_through_decode_units():
    # prompt 20 + 6 generated; seeded with 16 cached tokens: prefill 16..20, then 6 replay units
    c = Candidate(key=1, prompt_len=20, reserve=40, remaining=14, qos_rank=1, prefilled=16, replay=6)
    d = build_plan([], [c], limits(prefill_budget=100), next_tag=1)
    assert d.prefills == [(1, 16, 4)]  # ABI rules 45, 46: from the seed to the prefill end
    assert d.decodes == [(1, 4)]
    d = build_plan([view(1, 1, replay=6, remaining=14, prompt_len=20, prefilled=20)], [], limits(), 2)
    assert d.decodes == [(1, 4)]  # replay units count in the grant, which max_tokens alone would cap
    d = build_plan([view(1, 1, replay=3, remaining=1, prompt_len=20, prefilled=20)], [], limits(), 2)
    assert d.decodes == [(1, 4)]
    # a seed reaching into the replayed tokens: no prefill at all, only replay units
    c = Candidate(key=1, prompt_len=20, reserve=40, remaining=14, qos_rank=1, prefilled=24, replay=6)
    d = build_plan([], [c], limits(prefill_budget=100), next_tag=1)
    assert not d.prefills and d.decodes == [(1, 4)]


def test_a_checkpoint_stops_the_prefill_there_and_never_decodes():
    c = cand(1, rank=1, prompt_len=100, checkpoint=64)
    d = build_plan([], [c], limits(prefill_budget=512), next_tag=1)
    assert d.prefills == [(1, 0, 64)] and not d.decodes
    d = build_plan([view(1, 1, prompt_len=100, prefilled=64, checkpoint=64)], [], limits(), 2)
    assert d.empty


def test_long_interactive_prompts_share_the_budget_like_everyone_else():
    d = build_plan([], [cand(1, prompt_len=600)], limits(prefill_budget=8), next_tag=1)
    assert d.prefills == [(1, 0, 8)]
