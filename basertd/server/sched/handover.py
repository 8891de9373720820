"""Where a worker's requests go when it stops serving them: to a peer, or back to the head of
their class (DESIGN.md "Crash = preemption; acceptance is durable" and "Operators").

A worker that dies (or breaks the link) preempts its lanes (``lost``: ``Lost`` applied by the core,
crashes charged to the requests); a planned replacement (a reload changing the worker's
``[[workers]]`` table, ``basertctl worker restart``) goes the same way without the crash:
``hand_over`` asks the tick in flight to yield (DRAIN), the loop then preempts every lane between
two ticks (``park``: ``Lost(planned=True)``, nothing charged) and parks until ``release`` (the next
incarnation then serves what waits here). Either way each request to resume moves to the least
loaded live peer that can run it now (``peer_for``: a worker serving the same model with the same
vocabulary, ``peers``, whose admission check passes) and resumes there exactly with
``decode_replay`` (ABI rules 71-73), else waits at the head of its class here (the oldest at the
head). Queued requests stay queued through a hand-over; when the worker leaves or changes its
model, ``hand_off_queued`` moves them to peers or fails them WORKER_FAILED.

``HandOver`` is a part of one ``basertd.server.sched.loop.Scheduler`` and works on that loop's
state (its core, yield word and wake event) on the loop's event loop; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from basertd.schema.client import ErrorCode
from basertd.server.observe.notify import Heartbeat
from basertd.server.request.record import AdmissionError, GenerationRequest
from basertd.server.sched.core import SchedulerCore
from basertd.server.sched.outcome import Lost
from basertd.server.sched.watchdog import Phase
from basertd.server.states import SlotState
from basertd.server.workers.link_errors import LinkError
from basertd.server.workers.process import WorkerProcess
from basertd.server.workers.prompt_feed import WorkerPort
from basertd.server.workers.slot import WorkerSlot
from basertd.server.workers.yield_word import YieldWord
from basertd.shm import YieldReason


class Loop(Protocol):
    """What ``HandOver`` uses of its scheduler loop (``basertd.server.sched.loop.Scheduler``) and
    of a peer's: the core, the worker's slot, the yield word, the wake event, the live worker's
    port (None between incarnations), the watchdog's stall reason and phase, the heartbeat, and
    ``adopt`` / ``signal_tick``."""

    worker_id: int
    core: SchedulerCore
    slot: WorkerSlot
    yield_word: YieldWord
    wake: asyncio.Event
    port: WorkerPort | None
    stalled: str | None
    phase: Phase
    heartbeat: Heartbeat

    def adopt(self, req: GenerationRequest) -> None: ...

    def signal_tick(self) -> None: ...


log = structlog.get_logger("basertd.scheduler")


class HandOver:
    """The hand-over part of the scheduler loop ``sched`` (module docstring). ``peers``: the
    schedulers of the other workers serving the same model with the same vocabulary (set by the
    fleet); ``reason``: why the loop is to park (None: it serves)."""

    def __init__(self, sched: Loop) -> None:
        self.sched = sched
        self.peers: Callable[[], list[Loop]] = list
        self.reason: str | None = None
        self._parked = asyncio.Event()
        self._released = asyncio.Event()

    async def hand_over(self, reason: str) -> None:
        """Stop ticking this worker for a planned replacement: the tick in flight is asked to
        yield (DRAIN) and lands; every live lane is then preempted between two ticks (``park``)
        and its request moves to the least loaded live peer (``peers``) that can run it, else
        waits at the head of its class here. Returns once the loop is parked (it ticks nothing
        until ``release``), at once when no incarnation is being served. Queued requests stay
        queued (``hand_off_queued`` moves them to peers)."""
        s = self.sched
        self.reason = reason
        self._parked = asyncio.Event()
        self._released = asyncio.Event()
        s.yield_word.request(YieldReason.DRAIN)
        s.wake.set()
        if s.port is not None:
            await self._parked.wait()

    def release(self) -> None:
        """End the park of ``hand_over``: the loop waits for the slot's next incarnation (the
        caller has made the slot drop the old one first, ``WorkerSlot.replace``)."""
        self.reason = None
        self._released.set()
        self.sched.wake.set()

    def left(self) -> None:
        """The loop stopped serving its incarnation without parking (the worker died during a
        hand-over): ``hand_over`` returns, as nothing runs here any more."""
        if self.reason is not None:
            self._parked.set()

    async def park(self, proc: WorkerProcess) -> None:
        """``hand_over`` between two ticks: preempt every lane of ``proc`` (planned), then wait
        for ``release``."""
        s = self.sched
        self.lost(proc, LinkError(f"handed over: {self.reason}"), planned=True)
        s.phase = Phase.NO_WORKER
        self._parked.set()
        await s.heartbeat.wait(self._released.wait())

    def lost(self, proc: WorkerProcess, exc: LinkError, planned: bool = False) -> None:
        """The worker ``proc`` died or broke the link (``Lost``, ``SchedulerCore.apply``), or is
        handed over (``planned``: no crash charged): each request to resume goes to the least
        loaded live peer that can run it, else back to the head of its class here (the oldest at
        the head)."""
        s = self.sched
        s.yield_word.landed()
        stalled, s.stalled = s.stalled, None
        core = s.core
        out = core.apply(core.flight, Lost(str(exc), stalled, planned), time.monotonic())
        for d in out.deliveries:
            d.send()
        moved: list[int] = []
        for req in out.resume:
            peer = self.peer_for(req)
            if peer is None:
                core.requeue(req)
            else:
                peer.adopt(req)
                moved.append(req.key)
        s.signal_tick()
        s.wake.set()
        log.warning(
            "worker_lanes_resumed",
            worker_id=s.worker_id,
            pid=proc.pid,
            resumed=len(out.resume),
            failed=len(out.failed),
            resumed_keys=[r.key for r in out.resume][::-1],
            failed_keys=out.failed,
            moved_to_peers=moved[::-1],
            planned=planned,
            error=str(exc),
        )

    def hand_off_queued(self, why: str, peers: list[Loop] | None = None) -> tuple[int, int]:
        """Move every queued request to the least loaded live peer that can run it (``peers``,
        default ``self.peers()``; its delivered tokens kept: it resumes there exactly), failing
        with WORKER_FAILED and ``why`` each one no peer can take: this worker leaves, or now
        serves another model, so they cannot wait for it. Returns (moved, failed)."""
        core = self.sched.core
        now = time.monotonic()
        moved = failed = 0
        for req in reversed(core.queues.drain()):  # adopt puts each at the head: keep order
            if req.finished:
                continue
            peer = self.peer_for(req, peers)
            if peer is not None:
                peer.adopt(req)
                moved += 1
            else:
                for d in core.drop(req, ErrorCode.WORKER_FAILED, why, now):
                    d.send()
                failed += 1
        return moved, failed

    def peer_for(self, req: GenerationRequest, peers: list[Loop] | None = None) -> Loop | None:
        """The least loaded live peer (among ``peers``, default ``self.peers()``) that can run
        ``req`` now, or None."""
        fits = []
        for peer in self.peers() if peers is None else peers:
            proc = peer.slot.proc
            if proc is None or not proc.link.alive or peer.slot.state != SlotState.READY:
                continue
            try:
                peer.core.check_admission(len(req.prompt), req.max_tokens, req.qos)
            except AdmissionError:
                continue
            fits.append(peer)
        return min(fits, key=lambda p: p.core.load(), default=None)
