"""Throughput-first tick budgets from the measured rate curve, bounded by an interactive request or
the inter-token latency bound (DESIGN.md "Scheduling"; ``basertd.server.sched.plan_builder.TickRates``)."""

from __future__ import annotations

import pytest

from basertd.server.sched.plan_builder import GRANT_CEILING, TickRates, best_chunk, rate_curve

STATS = {
    "rate_tok_s_b16": 60,
    "rate_calls_b16": 9,
    "rate_tok_s_b64": 150,
    "rate_tok_s_b128": 210,
    "rate_tok_s_b256": 232,
    "rate_tok_s_b512": 240,
    "ticks": 40,
}


def test_the_rate_curve_is_read_from_pong_stats_and_the_chunk_is_the_smallest_near_the_best():
    curve = rate_curve(STATS)
    assert curve == [(16, 60.0), (64, 150.0), (128, 210.0), (256, 232.0), (512, 240.0)]
    assert best_chunk(curve, floor=64, ceiling=2048) == 256  # 232 >= 0.9 x 240; 210 is not
    assert best_chunk(curve, floor=64, ceiling=200) == 200
    assert best_chunk([], floor=64, ceiling=2048) == 2048  # nothing measured: the long budget
    assert best_chunk([(16, 100.0)], floor=64, ceiling=2048) == 64
    assert rate_curve({"rate_tok_s_bx": 3, "other": 1}) == []


def rates() -> TickRates:
    r = TickRates(tick_target_s=0.05, max_prefill=512, max_grant=8, long_prefill=2048, max_itl_s=0.5)
    r.set_curve(rate_curve(STATS))
    r.observe(prefill_tokens=1000, prefill_s=4.0, decode_steps=8, decode_s=0.8)  # 4 ms/token, 100 ms/step
    return r


def test_nothing_urgent_gets_long_ticks_of_whole_chunks_and_a_full_grant():
    r = rates()
    assert r.chunk() == 256
    assert r.budgets(False, True) == (2048, 8)
    r.long_prefill = 1000
    assert r.budgets(False, True) == (768, 8)  # whole chunks: 3 x 256
    r.long_prefill = 100
    assert r.budgets(False, True) == (512, 8)  # never below max_prefill
    # A yielding engine keeps long ticks beside streaming lanes (it is asked to end them in time).
    r.long_prefill = 2048
    assert r.budgets(False, True, streaming=True, can_yield=True) == (2048, 8)


def test_a_fast_decode_step_gets_enough_rounds_to_fill_decode_tick_s_unless_something_urgent_waits():
    """``decode_tick_s``: at 2 ms a step, 0.05 s is 25 rounds, not the configured 8; at 100 ms a
    step the configured grant stands; the urgent regime keeps its own (half the tick target); a
    step of microseconds stops at the ceiling; 0 turns it off."""
    r = TickRates(tick_target_s=0.05, max_prefill=512, max_grant=8, decode_tick_s=0.05)
    assert r.budgets(False)[1] == 8  # nothing measured yet
    r.observe(prefill_tokens=0, prefill_s=0.0, decode_steps=10, decode_s=0.02)  # 2 ms a step
    assert r.long_grant() == 25 and r.budgets(False)[1] == 25
    assert r.budgets(False, streaming=True)[1] == 25  # streaming with no prefill measured yet
    assert r.budgets(True)[1] == 8  # an interactive request waits: 0.025 s of steps, at most 8
    r.decode_s_per_step = 0.1
    assert r.long_grant() == 8
    r.decode_s_per_step = 1e-6
    assert r.long_grant() == GRANT_CEILING
    r.decode_tick_s = 0.0
    assert r.long_grant() == 8


def test_a_round_grant_spreads_a_long_prefill_into_rounds_within_the_inter_token_bound():
    r = rates()
    grant = r.round_grant(2048)
    rows = int((0.8 * 0.5 - 0.1) / 0.004)  # 75 prefill tokens per round: 0.3 s, plus a 0.1 s step
    assert grant == -(-2048 // rows)
    assert (2048 / grant) * r.prefill_s_per_token + r.decode_s_per_step <= r.max_itl_s


def test_a_round_grant_never_falls_below_the_configured_grant_nor_exceeds_a_u16():
    r = rates()
    assert r.round_grant(100) == 8  # 100 tokens fit in two rounds: the configured 8 stand
    assert r.round_grant(10_000_000) == 0xFFFF
    r.prefill_s_per_token = None
    assert r.round_grant(2048) == 8  # nothing measured yet


def test_streaming_lanes_bound_the_prefill_of_an_engine_that_cannot_yield():
    r = rates()
    prefill, grant = r.budgets(False, True, streaming=True, can_yield=False)
    assert grant == 8
    assert prefill == int((0.8 * 0.5 - 0.1) / 0.004)  # 75 tokens: 0.3 s, plus one 0.1 s decode step
    assert prefill * r.prefill_s_per_token + r.decode_s_per_step <= r.max_itl_s


def test_a_waiting_interactive_request_binds_the_tick_target():
    r = rates()
    prefill, grant = r.budgets(True, True, streaming=True, can_yield=True)
    assert grant == 1 and prefill == 16  # half the 50 ms target is below one 100 ms step: floors
    r.observe(prefill_tokens=1000, prefill_s=0.1, decode_steps=10, decode_s=0.01)
    prefill, grant = r.budgets(True, False)
    assert prefill <= 512 and prefill * r.prefill_s_per_token <= r.tick_target_s + 1e-9


@pytest.mark.parametrize("step", [1, 64, 512])
def test_the_itl_yield_comes_early_enough_for_the_step_in_flight(step):
    r = rates()
    after = r.itl_yield_after(step)
    assert 0.05 <= after <= 0.45
    if after > 0.05:  # not at the floor: the step in flight, a decode step and slack fit in
        assert after + step * r.prefill_s_per_token + r.decode_s_per_step <= 0.9 * r.max_itl_s + 1e-9


def test_an_urgent_tick_before_any_measurement_prefills_the_floor():
    r = TickRates(tick_target_s=0.05, max_prefill=512, max_grant=8, long_prefill=2048, max_itl_s=0.5)
    assert r.budgets(True, False) == (16, 8)  # a fresh worker: short, not max_prefill
