"""The pure plan builder and the adaptive tick budgets (DESIGN.md "Scheduling"; ABI rules 30, 45,
47, 53, 54)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.server.sched.plan_builder import Candidate, LaneView, PlanLimits, TickRates, build_plan


def limits(**kw) -> PlanLimits:
    base = dict(
        max_lanes=4,
        max_decode_lanes=4,
        kv_tokens=10_000,
        prefill_budget=100,
        decode_grant=8,
        max_admit_tokens=4096,
    )
    base.update(kw)
    return PlanLimits(**base)


def lane(tag, prompt_len=10, prefilled=10, remaining=50, reserved=60, **kw) -> LaneView:
    return LaneView(
        tag=tag, prompt_len=prompt_len, prefilled=prefilled, remaining=remaining, reserved=reserved, **kw
    )


def cand(key, prompt_len=10, max_tokens=20, qos_rank=0) -> Candidate:
    return Candidate(
        key=key,
        prompt_len=prompt_len,
        reserve=prompt_len + max_tokens,
        remaining=max_tokens,
        qos_rank=qos_rank,
    )


def test_empty_state_gives_an_empty_plan():
    d = build_plan([], [], limits(), next_tag=1)
    assert d.empty and d.prefill_tokens == 0


def test_every_decoding_lane_gets_a_grant_capped_by_what_it_may_still_generate():
    d = build_plan([lane(1, remaining=50), lane(2, remaining=3)], [], limits(decode_grant=8), next_tag=3)
    assert d.decodes == [(1, 8), (2, 3)]
    assert not d.admitted and not d.prefills and not d.retires


def test_a_speculating_lanes_grant_is_decode_grant_rounds_of_its_tokens_per_round():
    lanes = [
        lane(1, remaining=500, tokens_per_round=3.5),
        lane(2, remaining=20, tokens_per_round=3.5),
        lane(3, remaining=500),
        lane(4, remaining=500, tokens_per_round=1.06),
    ]
    d = build_plan(lanes, [], limits(decode_grant=8), next_tag=5)
    assert d.decodes == [(1, 28), (2, 20), (3, 8), (4, 8)]


def test_admit_prefill_and_decode_in_the_same_tick():  # ABI rule 54
    d = build_plan([], [cand(7, prompt_len=30, max_tokens=5)], limits(prefill_budget=100), next_tag=11)
    assert [(t, c.key) for t, c in d.admitted] == [(11, 7)]
    assert d.prefills == [(11, 0, 30)]
    assert d.decodes == [(11, 5)]


def test_a_lane_whose_prefill_does_not_complete_gets_no_decode():  # ABI rule 47
    d = build_plan([], [cand(1, prompt_len=300)], limits(prefill_budget=100), next_tag=1)
    assert d.prefills == [(1, 0, 100)] and d.decodes == []
    # next tick: the chunk continues where the last one ended (ABI rule 45)
    d2 = build_plan([lane(1, prompt_len=300, prefilled=100, reserved=320)], [], limits(prefill_budget=100), 2)
    assert d2.prefills == [(1, 100, 100)] and d2.decodes == []
    d3 = build_plan([lane(1, prompt_len=300, prefilled=250, reserved=320)], [], limits(prefill_budget=100), 2)
    assert d3.prefills == [(1, 250, 50)] and d3.decodes == [(1, 8)]


def test_prefill_budget_goes_shortest_remaining_first_within_class_order():
    lanes = [
        lane(1, prompt_len=500, prefilled=0, reserved=600),
        lane(2, prompt_len=40, prefilled=10, reserved=100),
        lane(3, prompt_len=60, prefilled=0, reserved=100, qos_rank=1),
        lane(4, prompt_len=20, prefilled=0, reserved=100, qos_rank=2),
    ]
    d = build_plan(lanes, [], limits(prefill_budget=100), next_tag=5)
    assert d.prefills == [(2, 10, 30), (1, 0, 70)]  # interactive first, shortest remaining first
    assert d.decodes == [(2, 8)]
    d2 = build_plan(lanes, [], limits(prefill_budget=1000), next_tag=5)
    assert [p[0] for p in d2.prefills] == [2, 1, 3, 4]


def test_retires_come_first_and_free_their_lane_for_an_admit_in_the_same_plan():  # ABI rule 53
    lanes = [lane(1), lane(2, retire=True, publish=True), lane(3), lane(4, retire=True)]
    d = build_plan(lanes, [cand(10), cand(11), cand(12)], limits(max_lanes=4), next_tag=5)
    assert d.retires == [(2, True), (4, False)]
    assert [(t, c.key) for t, c in d.admitted] == [(5, 10), (6, 11)]
    assert {t for t, _ in d.decodes} == {1, 3, 5, 6}  # retired lanes never decode (ABI rule 29)


def test_admission_stops_at_the_first_candidate_that_does_not_fit():
    q = [cand(1, prompt_len=10, max_tokens=10), cand(2, prompt_len=500, max_tokens=500), cand(3)]
    d = build_plan([lane(9, reserved=100)], q, limits(kv_tokens=400), next_tag=10)
    assert [c.key for _, c in d.admitted] == [1]  # 2 needs 1000 KV tokens; 3 must not overtake it
    d = build_plan([], [cand(1, prompt_len=300), cand(2, prompt_len=300)], limits(max_admit_tokens=500), 1)
    assert [c.key for _, c in d.admitted] == [1]  # the prompt ring holds one plan's admits
    d = build_plan([], [cand(1), cand(2), cand(3)], limits(max_admits=2), 1)
    assert [c.key for _, c in d.admitted] == [1, 2]


def test_queue_is_consumed_lazily():
    consumed = []

    def gen():
        for k in range(100):
            consumed.append(k)
            yield cand(k)

    build_plan([], gen(), limits(max_lanes=2), next_tag=1)
    assert consumed == [0, 1, 2]


def test_decode_lanes_capped_by_max_decode_lanes():  # ABI rule 30
    lanes = [lane(t) for t in range(1, 7)]
    d = build_plan(lanes, [], limits(max_lanes=8, max_decode_lanes=4), next_tag=7)
    assert [t for t, _ in d.decodes] == [1, 2, 3, 4]


def test_lane_with_nothing_left_to_generate_gets_no_decode():
    d = build_plan([lane(1, remaining=0)], [], limits(), next_tag=2)
    assert d.decodes == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 400), st.integers(0, 400), st.integers(0, 40), st.booleans(), st.integers(0, 2)
        ),
        max_size=8,
    ),
    st.lists(st.tuples(st.integers(1, 400), st.integers(1, 64), st.integers(0, 2)), max_size=12),
    st.integers(1, 8),
    st.integers(1, 600),
    st.integers(1, 16),
    st.integers(100, 5000),
)
def test_plan_invariants(lane_specs, queue_specs, max_lanes, budget, grant, kv):
    lanes = []
    for i, (plen, pre, rem, retire, rank) in enumerate(lane_specs[:max_lanes]):
        lanes.append(
            lane(
                i + 1,
                prompt_len=plen,
                prefilled=min(pre, plen),
                remaining=rem,
                reserved=plen + rem,
                retire=retire,
                qos_rank=rank,
            )
        )
    queue = [cand(100 + k, prompt_len=p, max_tokens=m, qos_rank=r) for k, (p, m, r) in enumerate(queue_specs)]
    lim = limits(
        max_lanes=max_lanes, prefill_budget=budget, decode_grant=grant, kv_tokens=kv, max_decode_lanes=8
    )
    d = build_plan(lanes, queue, lim, next_tag=1000)

    retired = {t for t, _ in d.retires}
    new = {t: c for t, c in d.admitted}
    assert set(new) == set(range(1000, 1000 + len(new)))  # fresh, never reused tags
    assert [c.key for c in new.values()] == [c.key for c in queue[: len(new)]]  # FIFO prefix
    live = [lane for lane in lanes if not lane.retire]
    assert len(live) + len(new) <= max_lanes
    assert d.prefill_tokens <= budget
    by_tag = {lane.tag: lane for lane in live}
    for tag, off, n in d.prefills:
        assert tag not in retired and n > 0
        plen, pre = (
            (by_tag[tag].prompt_len, by_tag[tag].prefilled) if tag in by_tag else (new[tag].prompt_len, 0)
        )
        assert off == pre and off + n <= plen  # contiguous, never past the prompt (ABI rules 45-46)
    chunk = {tag: off + n for tag, off, n in d.prefills}
    for tag, g in d.decodes:
        assert tag not in retired and 1 <= g <= grant
        if tag in by_tag:
            assert chunk.get(tag, by_tag[tag].prefilled) >= by_tag[tag].prompt_len  # ABI rule 47
            assert g <= by_tag[tag].remaining
        else:
            assert chunk.get(tag, 0) >= new[tag].prompt_len and g <= new[tag].remaining
    assert len({t for t, _ in d.decodes}) == len(d.decodes)  # no duplicate lanes (ABI rule 27)
    if new:
        assert sum(lane.reserved for lane in live) + sum(c.reserve for c in new.values()) <= kv


def test_tick_rates_keep_ticks_near_the_target_while_anything_waits():
    r = TickRates(tick_target_s=0.05, max_prefill=512, max_grant=16)
    assert r.budgets(waiting=True) == (16, 16)  # nothing measured yet: the floor keeps the tick short
    r.observe(prefill_tokens=100, prefill_s=0.1, decode_steps=10, decode_s=0.05)  # 1 ms/token, 5 ms/step
    prefill, grant = r.budgets(waiting=True)
    assert grant == 5  # half the 50 ms target at 5 ms a step
    assert prefill == 25  # the other 25 ms at 1 ms a token
    assert r.budgets(waiting=False) == (512, 16)
    r.observe(prefill_tokens=10, prefill_s=1.0, decode_steps=1, decode_s=1.0)  # a very slow tick
    prefill, grant = r.budgets(waiting=True)
    assert grant == 1 and prefill == 16  # never below the floor: prompts always progress
