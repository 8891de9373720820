"""1,000 mixed ticks through a real worker equal the same plans run in-process.

The plan stream (worker_plans.MixedPlanStream) admits greedy, Gumbel and HOST lanes with prompts
written to the prompt ring, prefills in chunks under a budget (sometimes over it: shed entries),
decodes, commits HOST rows, retires (some publishing to the prefix cache, evicted again in-tick
under a small pool), and lanes finish by EOS. It is recorded on a fresh in-process reference
bundle, then replayed through ``basertd-worker``: every prompt ref, every event record (timings
aside), every emitted token (read from the worker's emit ring), every logits row and every
TICK_EMIT partial emit must be the same (ABI rule 63: same plan log, same tokens).
"""

from __future__ import annotations

import numpy as np
import pytest
from worker_plans import (
    EMIT_RING,
    LOGITS_RING,
    PROMPT_RING,
    StreamConfig,
    comparable,
    record,
    ring_geometry,
)

from basertd.native.ref import RefConfig
from basertd.schema.abi import ShedKind
from basertd.server.workers.process import RingGeometry
from basertd.server.workers.sync_worker import SyncWorker

TICKS = 1000
REF = {"eos_period": 12, "pool_bytes": 64 * 1024}


@pytest.mark.slow
def test_thousand_ticks_equal_in_process(make_spec):
    cfg = StreamConfig(lanes=8, seed=77)
    ref = RefConfig(**REF)
    steps = record(cfg, ref, TICKS)
    # The stream really is mixed: every kind of record and outcome occurs.
    assert sum(len(s.plan.admits) for s in steps) > 300
    assert sum(len(s.plan.commits) for s in steps) > 100
    assert sum(sum(r.publish_to_cache for r in s.plan.retires) for s in steps) > 50
    assert sum(1 for s in steps for e in s.events.emits if e.finish) > 100
    assert any(e.kind == ShedKind.CACHE_EVICTION for s in steps for e in s.events.shed.entries)
    assert any(e.kind == ShedKind.PREFILL_CHUNK for s in steps for e in s.events.shed.entries)
    assert sum(1 for s in steps if s.partial) > 100

    geo = ring_geometry(cfg, ref)
    spec = make_spec(
        ref_config=REF,
        emit_window_ms=0,  # every engine callback is streamed: partial emits compare exactly
        prompt_ring=RingGeometry(*geo[PROMPT_RING]),
        emit_ring=RingGeometry(*geo[EMIT_RING]),
        logits_ring=RingGeometry(*geo[LOGITS_RING]),
    )
    with SyncWorker(spec) as w:
        proc = w.proc
        for i, step in enumerate(steps):
            for prompt, want in zip(step.prompts, step.refs, strict=True):
                assert proc.prompt_ring.write(prompt) == want, f"tick {i}: prompt ring diverged"
            partial: dict[int, list[int]] = {}

            def on_emit(emit, partial=partial):
                partial.setdefault(emit.lane_tag, []).extend(emit.tokens.tolist())

            events = w.tick(step.plan, on_emit=on_emit)
            assert events.plan_seq == step.plan.plan_seq
            assert comparable(events) == step.events, f"tick {i}: events differ"
            for j, emit in enumerate(events.emits):
                got = proc.emit_ring.read(emit.token_ref)
                np.testing.assert_array_equal(got, step.tokens[j], err_msg=f"tick {i} emit {j}")
                if j in step.rows:
                    np.testing.assert_array_equal(proc.logits_ring.read_row(emit.logits_row), step.rows[j])
            assert partial == step.partial, f"tick {i}: partial emits differ"
        pong = w.ping()
        assert pong.ticks_run == TICKS
        assert pong.last_plan_seq == steps[-1].plan.plan_seq
        assert pong.stats["ticks"] == TICKS
        assert pong.stats["decode_tokens_total"] >= sum(len(t) for s in steps for t in s.tokens)
        assert w.close() == 0
