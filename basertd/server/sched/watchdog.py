"""The scheduler's progress watchdog (DESIGN.md "Scheduling": a worker with work waiting ticks).

A scheduler makes progress when a tick completes, or when it has nothing to do. One that has
work waiting (queued requests or live lanes) on a live worker and completes no tick for
``[scheduler] stall_timeout_s`` seconds is *stalled*: a tick that never answers, a between-ticks
call that hangs, or a planner that admits nothing while requests wait. ``ProgressWatchdog`` keeps
the clock and the reason; the scheduler's watch task (``Scheduler.watch``) polls it and acts:

- the worker is restarted (its lanes fail with ``WORKER_FAILED`` after the tokens already
  delivered, as on any worker loss);
- when no tick was in flight, the queued requests that waited the whole bound are the stuck work:
  they fail with ``INTERNAL``.

``reason`` (``WorkerSnapshot.stall_reason``) stays set until the next completed tick, so health checks
report the stall.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class Phase(enum.Enum):
    """Where a scheduler's loop is: what a stall there means."""

    NO_WORKER = "no_worker"
    """Waiting for a live worker (its supervisor bounds that): never a stall."""
    IDLE = "idle"
    """Waiting for work or a wake-up."""
    BETWEEN = "between"
    """Running between-ticks calls (cache verbs, lease releases, pin renewals)."""
    PLANNING = "planning"
    """Building a plan (prefix matches and seed leases included)."""
    TICK = "tick"
    """A plan is in flight."""


class ProgressWatchdog:
    """Progress clock of one scheduler. ``bound_s``: seconds without progress, while work waits,
    that make a stall; ``clock``: monotonic seconds."""

    def __init__(self, bound_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound_s = bound_s
        self.clock = clock
        self.last_progress = clock()
        self.reason: str | None = None
        self.stalls = 0

    @property
    def poll_s(self) -> float:
        """How often to call ``check`` (seconds): a quarter of the bound, within [0.05, 1]."""
        return min(1.0, max(0.05, self.bound_s / 4))

    def progress(self) -> None:
        """A tick completed, or there is nothing to do: the clock restarts, the stall clears."""
        self.last_progress = self.clock()
        self.reason = None

    def check(self, phase: Phase, waiting: int) -> str | None:
        """A new stall's reason when ``waiting`` requests (queued or in lanes) have seen no progress
        for the bound in ``phase``, else None. A stall is reported once: the clock restarts, so a
        stall that persists is reported again one bound later."""
        now = self.clock()
        if phase is Phase.NO_WORKER or waiting == 0:
            self.last_progress = now
            return None
        idle = now - self.last_progress
        if idle < self.bound_s:
            return None
        self.last_progress = now
        self.stalls += 1
        self.reason = (
            f"no tick completed for {idle:.1f} s while {waiting} requests wait (stuck in {phase.value})"
        )
        return self.reason
