"""Yield inside a tick through a real worker (reference engine, basertd.shm.control): the
coordinator sets the control segment's yield word while a long prefill runs; the tick ends at the
next prefill step, the cut is a budget-shed chunk (ABI rules 56, 57) and resumes token-exact."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from basertd.schema.abi import ShedKind, TickStatus
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, TickPlan
from basertd.server.workers.process import WorkerProcess
from basertd.server.workers.sync_worker import SyncWorker
from basertd.shm import YieldReason

STEP = 16
STEP_US = 20_000  # 20 ms per 16-token prefill step
PROMPT = 400  # 25 steps: 0.5 s unyielded
REF = {"prefill_step_tokens": STEP, "prefill_step_us": STEP_US, "context_length": 1024, "pool_bytes": 1 << 22}


def _plan(seq: int, **kw) -> TickPlan:
    kw.setdefault("prefill_token_budget", 1 << 20)
    kw.setdefault("max_decode_lanes", 16)
    return TickPlan(plan_seq=seq, **kw)


def _first_tick(proc: WorkerProcess, tag: int, prompt: np.ndarray, seq: int) -> TickPlan:
    ref = proc.prompt_ring.write(prompt)
    return _plan(
        seq,
        admits=[LaneAdmit(lane_tag=tag, prompt=ref)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=PROMPT)],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=6)],
    )


def _tokens(proc: WorkerProcess, ev, tag: int) -> list[int]:
    return [t for e in ev.emits if e.lane_tag == tag and e.n_tokens for t in proc.emit_ring.read(e.token_ref)]


def test_a_yield_ends_a_long_prefill_tick_and_it_resumes_exactly(make_spec):
    prompt = (np.arange(PROMPT, dtype=np.uint32) * 7) % 250 + 3
    with SyncWorker(make_spec(ref_config=REF)) as w:
        proc = w.proc
        assert proc.can_yield and not proc.yield_requested

        # Unyielded reference run on lane 1.
        t0 = time.monotonic()
        ev = w.tick(_first_tick(proc, 1, prompt, 1))
        full_s = time.monotonic() - t0
        want = _tokens(proc, ev, 1)
        assert len(want) == 6 and ev.tick_status == TickStatus.OK
        assert full_s >= 25 * STEP_US / 1e6

        # The same request on lane 2; the coordinator asks for a yield 0.1 s into the tick.
        async def yielded_tick():
            task = asyncio.ensure_future(proc.link.tick(_first_tick(proc, 2, prompt, 2)))
            await asyncio.sleep(0.1)
            t = time.monotonic()
            proc.request_yield(YieldReason.URGENT_ADMIT)
            ev = await task
            return ev, time.monotonic() - t

        ev, after_s = w.call(yielded_tick())
        assert after_s < 2 * STEP_US / 1e6 + 0.05  # the tick ended within about one step
        assert ev.tick_status == TickStatus.SHED and ev.shed.prefill_chunks_dropped == 1
        (s,) = ev.shed.entries
        done = PROMPT - s.tokens
        assert s.lane_tag == 2 and s.kind == ShedKind.PREFILL_CHUNK
        assert 0 < done < PROMPT and done % STEP == 0
        assert _tokens(proc, ev, 2) == []  # no decode before the prefill ends (ABI rule 47)
        assert proc.yields_taken == 1

        # Still set: the next tick runs its first step only, then yields again.
        rest = [LanePrefill(lane_tag=2, token_offset=done, token_count=PROMPT - done)]
        ev = w.tick(_plan(3, prefills=rest))
        (s,) = ev.shed.entries
        assert s.tokens == PROMPT - done - STEP
        done += STEP
        proc.clear_yield()
        assert not proc.yield_requested
        ev = w.tick(
            _plan(
                4,
                prefills=[LanePrefill(lane_tag=2, token_offset=done, token_count=PROMPT - done)],
                decodes=[LaneDecode(lane_tag=2, max_new_tokens=6)],
            )
        )
        assert ev.tick_status == TickStatus.OK
        assert _tokens(proc, ev, 2) == want
        assert proc.yields_taken == 2
        assert w.close() == 0
    assert not proc.yield_requested and proc.yields_taken == 0  # closed: the segment is gone


def test_a_llamacpp_worker_yields_a_long_prefill_at_once(make_spec, tiny_gguf):
    # The yield word set before the tick: the worker's llama.cpp engine runs one step (its
    # n_ubatch, 512 rows) of a 1,000-token prefill and reports the rest as a shed chunk.
    spec = make_spec(engine="llamacpp", model=str(tiny_gguf), lanes=2, context_length=1024, threads=1)
    prompt = (np.arange(1000, dtype=np.uint32) * 11) % 290 + 3
    with SyncWorker(spec) as w:
        proc = w.proc
        assert proc.can_yield and w.capabilities.extra["step_tokens"] == "512"
        proc.request_yield(YieldReason.URGENT_ADMIT)
        ref = proc.prompt_ring.write(prompt)
        ev = w.tick(
            _plan(
                1,
                admits=[LaneAdmit(lane_tag=1, prompt=ref)],
                prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=1000)],
                max_decode_lanes=2,
            )
        )
        (s,) = ev.shed.entries
        assert (s.lane_tag, s.kind, s.tokens) == (1, ShedKind.PREFILL_CHUNK, 1000 - 512)
        assert proc.yields_taken == 1
        proc.clear_yield()
        ev = w.tick(
            _plan(
                2,
                prefills=[LanePrefill(lane_tag=1, token_offset=512, token_count=488)],
                decodes=[LaneDecode(lane_tag=1, max_new_tokens=2)],
                max_decode_lanes=2,
            )
        )
        assert ev.tick_status == TickStatus.OK and ev.emits[0].n_tokens == 2
        assert w.close() == 0
