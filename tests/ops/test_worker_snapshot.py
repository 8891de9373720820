"""basertd.server.observe.snapshot: the frozen worker view, its fleet totals, and both metrics
collectors reading it (no daemon: the snapshots are built by hand)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from basertd.schema.tick import MemCounters
from basertd.server.observe.metrics import LiveState, Metrics
from basertd.server.observe.metrics_vllm import bind_vllm
from basertd.server.observe.snapshot import (
    FleetTotals,
    LaneSnapshot,
    QueueSnapshot,
    SpecVerifyCost,
    WorkerSnapshot,
)
from basertd.server.request.record import QOS_CLASSES
from basertd.server.states import SlotState
from basertd.server.workers.limits import WorkerLimits


def _lane(tag: int, reserved: int) -> LaneSnapshot:
    return LaneSnapshot(
        tag=tag,
        request_id=f"r{tag}",
        qos="interactive",
        phase="decode",
        prompt_tokens=10,
        generated_tokens=3,
        cached_tokens=0,
        reserved_tokens=reserved,
        admitted_at=1.0,
    )


def _snap(worker_id: int, state: SlotState, lanes: tuple[LaneSnapshot, ...], depths: dict[str, int], **kw):
    fields = dict(
        worker_id=worker_id,
        taken_at=2.0,
        state=state,
        pid=100 + worker_id,
        respawns=1,
        last_error="",
        limits=WorkerLimits(
            context_length=512,
            max_lanes=4,
            max_batch_size=4,
            page_tokens=16,
            kv_tokens=2048,
            max_admit_tokens=512,
        ),
        lanes=lanes,
        queues=tuple(QueueSnapshot(q, depths.get(q, 0), 0.5 if depths.get(q) else 0.0) for q in QOS_CLASSES),
        mem=None,
        stall_reason=None,
        prefix_caching=True,
        ticks_run=7,
        plans_rejected=1,
        requests_done=2,
        prefill_tokens=30,
        decode_tokens=40,
        preemptions=0,
        checkpoints=0,
        crash_resumes=0,
        yields_requested=0,
    )
    fields.update(kw)
    return WorkerSnapshot(**fields)


def test_snapshot_is_frozen_and_sums_its_lanes_and_queues():
    s = _snap(0, SlotState.READY, (_lane(1, 100), _lane(2, 60)), {"interactive": 2, "batch": 1})
    assert s.ready and s.lanes_busy == 2 and s.kv_reserved_tokens == 160
    assert s.queued == 3 and s.depth("batch") == 1 and s.depth("no-such-class") == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.ticks_run = 8  # type: ignore[misc]


def test_fleet_totals_over_snapshots():
    a = _snap(0, SlotState.READY, (_lane(1, 100),), {"interactive": 2})
    b = _snap(1, SlotState.RESTARTING, (), {"batch": 1})
    t = FleetTotals.of([a, b])
    assert (t.ready, t.total, t.lanes_busy, t.lanes_max, t.queued) == (1, 2, 1, 8, 3)
    assert list(t.queued_by_class) == list(QOS_CLASSES)
    assert t.queued_by_class["interactive"] == 2 and t.queued_by_class["batch"] == 1


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_both_collectors_read_one_live_state():
    mem = MemCounters(pool_blocks_used=5, pool_blocks_total=128, pool_bytes_evictable=4096)
    verify = SpecVerifyCost.of(
        {"spec_verify_base_permille": 1040, "spec_verify_per_draft_permille": 12, "spec_verify_measured": 1}
    )
    assert SpecVerifyCost.of({"pool_bytes_used": 1}) is None  # an engine that does not measure it
    a = _snap(
        0, SlotState.READY, (_lane(1, 100), _lane(2, 28)), {"interactive": 2}, mem=mem, spec_verify=verify
    )
    b = _snap(1, SlotState.READY, (), {"batch": 1})
    state = LiveState(workers=[a, b], model_names={0: "m", 1: "m"}, in_flight=5, draining=False)

    async def scrape() -> str:
        metrics = Metrics()
        metrics.bind(lambda: state)
        bind_vllm(metrics, lambda: state)
        try:
            return metrics.exposition()
        finally:
            metrics.unbind()

    got = _samples(asyncio.run(scrape()))
    w0, w1 = (("worker", "0"),), (("worker", "1"),)
    assert got[("basertd_lanes_active", w0)] == 2 and got[("basertd_lanes_active", w1)] == 0
    assert got[("basertd_lanes_max", w0)] == 4
    assert got[("basertd_kv_reserved_tokens", w0)] == 128
    assert got[("basertd_kv_pool_usage_ratio", w0)] == pytest.approx(128 / 2048)
    assert (
        got[("basertd_engine_pool_blocks_used", w0)] == 5
        and got[("basertd_engine_pool_blocks_used", w1)] == 0
    )
    assert got[("basertd_engine_pool_evictable_bytes", w0)] == 4096
    assert got[("basertd_spec_verify_base", w0)] == 1.04 and got[("basertd_spec_verify_measured", w0)] == 1
    assert got[("basertd_spec_verify_per_draft", w0)] == 0.012
    assert ("basertd_spec_verify_base", w1) not in got  # no cost reported: no series
    assert got[("basertd_ticks_total", w0)] == 7 and got[("basertd_worker_respawns_total", w1)] == 1
    assert got[("basertd_queue_depth", (("qos", "interactive"),))] == 2
    assert got[("basertd_queue_depth", (("qos", "batch"),))] == 1
    assert got[("basertd_requests_in_flight", ())] == 5
    m = (("model_name", "m"),)
    assert got[("vllm:num_requests_waiting", m)] == 3 and got[("vllm:num_requests_running", m)] == 2
    assert got[("vllm:kv_cache_usage_perc", m)] == pytest.approx(128 / 4096)
    info = [k for k in got if k[0] == "vllm:cache_config_info"]
    assert dict(info[0][1])["block_size"] == "16" and dict(info[0][1])["num_gpu_blocks"] == "256"
