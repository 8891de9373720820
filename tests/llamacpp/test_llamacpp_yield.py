"""Yield inside a tick on the llama.cpp engine (tiny model): the control segment's yield word ends
a tick at a llama_decode boundary, the cut prefill is reported as a budget-shed chunk (ABI rules
56, 57) and resumes token-exact against a run that never yielded."""

from __future__ import annotations

import threading

from lc_harness import admit, ignore_eos, make_prompt

from basertd.schema.abi import Finish, ShedKind, TickStatus
from basertd.schema.tick import LaneDecode, LanePrefill
from basertd.shm import ControlBlock, YieldReason

STEP = 16


def _unyielded(make_engine, prompt, n_new):
    eng, coord = make_engine(yield_step_tokens=STEP)
    ev = coord.tick(
        admits=[admit(1, coord.prompt(prompt), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=len(prompt))],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=n_new)],
    )
    assert eng.stats()["yields_total"] == 0
    return coord.emitted(ev, 1)


def test_a_yielded_prefill_is_a_shed_chunk_and_resumes_token_exact(make_engine, control):
    # ABI rules 56, 57: the cut is reported like a budget cut and resumes at the offset reached
    prompt = make_prompt(5, 100)
    want = _unyielded(make_engine, prompt, 8)
    eng, coord = make_engine(yield_step_tokens=STEP)
    assert eng.attach_control(control) is True
    assert eng.info().extra["yield"] == "step"
    control.request_yield(YieldReason.URGENT_ADMIT)  # set before the tick: it runs one step
    ev = coord.tick(
        admits=[admit(1, coord.prompt(prompt), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=100)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=8)],
    )
    assert ev.tick_status == TickStatus.SHED
    assert ev.shed.prefill_chunks_dropped == 1
    (s,) = ev.shed.entries
    assert (s.lane_tag, s.kind, s.tokens) == (1, ShedKind.PREFILL_CHUNK, 100 - STEP)
    lane = eng.lanes[1]
    assert lane.prefilled == lane.kv_len == STEP
    assert coord.emitted(ev, 1) == []  # its decode waits for the prefill (ABI rule 47)
    assert eng.stats()["yields_total"] == 1 and control.yields_taken == 1
    control.clear_yield()
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=1, token_offset=STEP, token_count=100 - STEP)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=8)],
    )
    assert ev.tick_status == TickStatus.OK
    assert coord.emitted(ev, 1) == want
    assert eng.stats()["prefill_tokens_total"] == 100


def test_a_yield_keeps_decode_tokens_and_counts_cut_budget_once(make_engine, control):
    eng, coord = make_engine(yield_step_tokens=STEP)
    eng.attach_control(control)
    coord.tick(
        admits=[admit(2, coord.prompt(make_prompt(6, 10)), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=2, token_offset=0, token_count=10)],
        decodes=[LaneDecode(lane_tag=2, max_new_tokens=1)],
    )
    control.request_yield(YieldReason.URGENT_ADMIT)
    ev = coord.tick(
        admits=[admit(1, coord.prompt(make_prompt(7, 80)))],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=80)],
        decodes=[LaneDecode(lane_tag=2, max_new_tokens=4)],
        prefill_token_budget=60,  # 20 shed by the budget, the rest of the 60 by the yield
    )
    # Round 0 carried lane 2's token (a llama_decode of its own, split off its prefill rows) and
    # one step of STEP prefill rows; the yield ended the tick after it.
    (e2,) = [e for e in ev.emits if e.lane_tag == 2]
    assert (e2.n_tokens, e2.finish) == (1, Finish.NONE)
    (s,) = ev.shed.entries
    assert (s.lane_tag, s.tokens) == (1, 80 - STEP)
    assert ev.shed.prefill_chunks_dropped == 1
    assert eng.lanes[1].prefilled == eng.lanes[1].kv_len == STEP
    control.clear_yield()
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=1, token_offset=STEP, token_count=80 - STEP)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=1), LaneDecode(lane_tag=2, max_new_tokens=1)],
    )
    assert ev.tick_status == TickStatus.OK
    assert {e.lane_tag: e.n_tokens for e in ev.emits} == {1: 1, 2: 1}


class _SetAfterReads:
    """The control block, with the yield word set by another thread once the engine has read it
    ``reads`` times (so the word changes between two llama_decode calls of one tick)."""

    def __init__(self, block: ControlBlock, reads: int) -> None:
        self.block = block
        self.reads = reads
        self.calls = 0

    def yield_reason(self) -> int:
        self.calls += 1
        if self.calls == self.reads:
            t = threading.Thread(target=self.block.request_yield)
            t.start()
            t.join()
        return self.block.yield_reason()

    def note_yield_taken(self) -> None:
        self.block.note_yield_taken()


def test_a_yield_set_mid_tick_ends_it_at_a_step_boundary(make_engine, control):
    # The word is read before every llama_decode call but the first; set during the 3rd read
    # (before step 4), the tick ends there: 3 steps of prefill done.
    eng, coord = make_engine(yield_step_tokens=STEP, context_length=1024, lanes=2)
    probe = _SetAfterReads(control, 3)
    eng.attach_control(probe)
    n = 1000
    ev = coord.tick(
        admits=[admit(1, coord.prompt(make_prompt(8, n)))],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=n)],
    )
    lane = eng.lanes[1]
    assert probe.calls == 3
    assert lane.prefilled == lane.kv_len == 3 * STEP
    (s,) = ev.shed.entries
    assert (s.kind, s.tokens) == (ShedKind.PREFILL_CHUNK, n - 3 * STEP)
    assert control.yields_taken == 1
