"""An urgent yield cuts a llama.cpp step mid-way (tiny model): the abort callback over the control
segment's yield word ends the ``llama_decode`` in flight, llama.cpp drops that step's KV cells,
the tick reports the cut prefill as a budget-shed chunk (ABI rules 56, 57) and the lane resumes
token-exact; the inter-token bound never cuts a step; two ticks in a row cannot both lose their
first step. And with lanes decoding beside a long prefill, the prefill is spread over the decode
rounds, so each decoding lane gets a token every round."""

from __future__ import annotations

import llama_cpp as L
import pytest
from lc_harness import admit, ignore_eos, make_prompt

from basertd.schema.abi import ShedKind, TickStatus
from basertd.schema.tick import LaneDecode, LanePrefill
from basertd.shm import YieldReason

STEP = 16


def _arrive_at_step(eng, control, step, reason=YieldReason.URGENT_ADMIT):
    """Set the yield word right after the engine armed (or not) the abort for batch part
    ``step`` (0-based): the arrival lands while that ``llama_decode`` runs."""
    orig = eng.rounds.arm_abort

    def arm(start, tick):
        orig(start, tick)
        if start == step * STEP:
            control.request_yield(reason)

    eng.rounds.arm_abort = arm


def _kv_end(eng, tag):
    return int(L.llama_memory_seq_pos_max(eng.cells.mem, eng.lanes[tag].seq)) + 1


def test_an_urgent_arrival_aborts_the_step_in_flight_and_the_lane_resumes_token_exact(make_engine, control):
    prompt = make_prompt(5, 100)
    _, rcoord = make_engine(yield_step_tokens=STEP)
    ev = rcoord.tick(
        admits=[admit(1, rcoord.prompt(prompt), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=100)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=8)],
    )
    want = rcoord.emitted(ev, 1)
    eng, coord = make_engine(yield_step_tokens=STEP)
    eng.attach_control(control)
    _arrive_at_step(eng, control, 2)
    ev = coord.tick(
        admits=[admit(1, coord.prompt(prompt), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=100)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=8)],
    )
    st = eng.stats()
    assert (st["yield_aborts_total"], st["yield_abort_rows_total"]) == (1, STEP)
    assert ev.tick_status == TickStatus.SHED
    (s,) = ev.shed.entries
    assert (s.kind, s.tokens) == (ShedKind.PREFILL_CHUNK, 100 - 2 * STEP)
    lane = eng.lanes[1]
    assert lane.prefilled == lane.kv_len == 2 * STEP
    assert _kv_end(eng, 1) == 2 * STEP  # llama.cpp dropped the aborted step's cells
    assert eng.ledger.length(lane.seq) == 2 * STEP  # and the cell ledger agrees
    control.clear_yield()
    del eng.rounds.arm_abort  # the class's method again
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=1, token_offset=2 * STEP, token_count=100 - 2 * STEP)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=8)],
    )
    assert ev.tick_status == TickStatus.OK
    assert coord.emitted(ev, 1) == want
    assert eng.stats()["prefill_tokens_total"] == 100


def test_the_inter_token_bound_waits_for_the_step_boundary(make_engine, control):
    eng, coord = make_engine(yield_step_tokens=STEP)
    eng.attach_control(control)
    _arrive_at_step(eng, control, 2, YieldReason.ITL_BOUND)
    ev = coord.tick(
        admits=[admit(1, coord.prompt(make_prompt(6, 100)))],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=100)],
    )
    assert eng.stats()["yield_aborts_total"] == 0
    (s,) = ev.shed.entries
    assert s.tokens == 100 - 3 * STEP  # the step in flight finished, then the tick ended
    assert eng.lanes[1].kv_len == _kv_end(eng, 1) == 3 * STEP


def test_two_ticks_in_a_row_cannot_both_lose_their_first_step(make_engine, control):
    eng, coord = make_engine(yield_step_tokens=STEP)
    eng.attach_control(control)
    _arrive_at_step(eng, control, 0)  # an arrival during the very first step: it is cut
    ev = coord.tick(
        admits=[admit(1, coord.prompt(make_prompt(7, 100)))],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=100)],
    )
    assert eng.stats()["yield_aborts_total"] == 1
    assert eng.lanes[1].kv_len == _kv_end(eng, 1) == 0
    (s,) = ev.shed.entries
    assert s.tokens == 100
    control.clear_yield()
    ev = coord.tick(prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=100)])
    # the same arrival pattern again: this time the first step is protected and runs
    assert eng.stats()["yield_aborts_total"] == 1
    assert eng.lanes[1].kv_len == _kv_end(eng, 1) == STEP
    control.clear_yield()
    del eng.rounds.arm_abort  # the class's method again
    ev = coord.tick(prefills=[LanePrefill(lane_tag=1, token_offset=STEP, token_count=100 - STEP)])
    assert ev.tick_status == TickStatus.OK and eng.lanes[1].kv_len == 100


@pytest.mark.parametrize(("n", "want"), [(400, [100, 200, 300, 400]), (40, [40, 40, 40, 40])])
def test_a_long_prefill_is_spread_over_the_decode_rounds_a_short_one_goes_whole(make_engine, n, want):
    eng, coord = make_engine(yield_step_tokens=STEP, context_length=1024, lanes=2)
    coord.tick(
        admits=[admit(2, coord.prompt(make_prompt(8, 10)), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=2, token_offset=0, token_count=10)],
        decodes=[LaneDecode(lane_tag=2, max_new_tokens=1)],
    )
    seen = []  # lane 1's KV length each time lane 2 streams a token

    def on_partial(tag, tokens):
        if tag == 2:
            seen.append(eng.lanes[1].kv_len)

    ev = coord.tick(
        admits=[admit(1, coord.prompt(make_prompt(9, n)))],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=n)],
        decodes=[LaneDecode(lane_tag=2, max_new_tokens=4)],
        on_partial_emit=on_partial,
    )
    assert ev.tick_status == TickStatus.OK
    assert len(coord.emitted(ev, 2)) == 4
    # one token per round; a long prompt spread evenly over the 4 rounds, a short one whole in the
    # first (at least MIN_ROUND_FEED rows a round)
    assert seen == want
