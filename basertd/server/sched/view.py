"""A worker's scheduler read as one frozen value (``basertd.server.observe.snapshot``): what the
fleet, the control verbs, both metrics collectors and the status line see of it."""

from __future__ import annotations

from basertd.server.observe.snapshot import LaneSnapshot, QueueSnapshot, WorkerSnapshot
from basertd.server.sched.core import SchedulerCore
from basertd.server.states import SlotState
from basertd.server.workers.slot import WorkerSlot


def worker_snapshot(
    worker_id: int,
    core: SchedulerCore,
    slot: WorkerSlot,
    stall_reason: str,
    yields_requested: int,
    now: float,
) -> WorkerSnapshot:
    """The snapshot of worker ``worker_id`` at ``now`` (monotonic seconds): its slot's state and
    process, the core's lanes, queues (waits measured to ``now``) and counters, the watchdog's
    ``stall_reason`` and the yields the loop requested. Call on the event loop (it reads live
    state); the value returned shares nothing mutable with it."""
    lanes = tuple(
        LaneSnapshot(
            tag=lane.tag,
            request_id=lane.request.request_id,
            qos=lane.request.qos,
            phase=lane.phase,
            prompt_tokens=lane.prompt_len,
            generated_tokens=len(lane.request.generated),
            cached_tokens=lane.request.cached_tokens,
            reserved_tokens=lane.reserved,
            admitted_at=lane.admitted_at,
        )
        for lane in core.lanes.values()
    )
    return WorkerSnapshot(
        worker_id=worker_id,
        taken_at=now,
        state=slot.state,
        pid=slot.proc.pid if slot.proc is not None else 0,
        respawns=slot.respawns,
        last_error="" if slot.state is SlotState.READY else slot.last_error,
        limits=core.limits,
        lanes=lanes,
        queues=tuple(QueueSnapshot(q, depth, wait) for q, depth, wait in core.queue_rows(now)),
        mem=core.last_mem,
        stall_reason=stall_reason,
        prefix_caching=core.cache.enabled,
        ticks_run=core.ticks_run,
        plans_rejected=core.plans_rejected,
        requests_done=core.requests_done,
        prefill_tokens=core.prefill_tokens_total,
        decode_tokens=core.decode_tokens_total,
        preemptions=core.preemptions,
        checkpoints=core.checkpoints,
        crash_resumes=core.crash_resumes,
        yields_requested=yields_requested,
        host_tier=core.cache_policy.host,
        speculation=tuple((name, d, a) for name, (d, a) in sorted(core.spec_tokens.items())),
        spec_verify=core.spec_verify,
    )
