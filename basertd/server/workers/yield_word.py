"""The yield word of one worker incarnation and the inter-token-latency timer (``basertd.shm.
control``, DESIGN.md "Scheduling").

With nothing urgent waiting, ticks are long (``TickRates`` throughput budgets). Setting the yield
word ends the tick in flight at its next step boundary: when a request that outranks it arrives,
a running request is cancelled, the scheduler stops, or a streaming lane would otherwise wait past
``max_itl_s`` (the timer, which follows the lanes' tokens). The word is cleared just before the
next plan is sent: that plan serves what asked for the yield.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from basertd.shm import YieldReason

log = structlog.get_logger("basertd.scheduler")


class YieldWord:
    """The yield word of the incarnation ``proc`` (a ``WorkerProcess``, None between
    incarnations) and the ITL timer of the tick in flight. ``requested`` counts yields asked."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.proc: Any = None
        self.in_flight = False
        self.requested = 0
        self._timer: asyncio.TimerHandle | None = None

    def request(self, reason: YieldReason | None) -> None:
        """Ask the tick in flight to end at its next step boundary (no-op for no ``reason``, when
        no tick is in flight, or when the engine cannot yield or was already asked)."""
        proc = self.proc
        if reason is None or not self.in_flight or proc is None or not proc.can_yield or proc.yield_requested:
            return
        proc.request_yield(reason)
        self.requested += 1
        log.debug("yield_requested", worker_id=self.worker_id, reason=reason.name)

    def send(self, missed_urgent: bool, deadline: Callable[[], float | None] | None) -> None:
        """A plan is about to be sent (its tick is in flight from now on): clear the word; set it
        again at once when an urgent request missed the plan (``missed_urgent``); else, with
        ``deadline`` (monotonic seconds by which a streaming lane needs its next token, or None),
        arm the ITL timer."""
        self.in_flight = True
        proc = self.proc
        if proc is None or not proc.can_yield:
            return
        if proc.yield_requested:
            proc.clear_yield()
        if missed_urgent:
            self.request(YieldReason.URGENT_ADMIT)
        elif deadline is not None:
            self._arm(deadline)

    def _arm(self, deadline: Callable[[], float | None]) -> None:
        """Yield (ITL_BOUND) at ``deadline()``; re-read when the timer fires, since partial emits
        move the deadline on as they deliver tokens."""
        self._cancel()
        if not self.in_flight:
            return
        at = deadline()
        if at is None:
            return
        now = time.monotonic()
        if at <= now:
            self.request(YieldReason.ITL_BOUND)
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + at - now, self._arm, deadline)

    def landed(self) -> None:
        """The tick in flight answered (or was lost): stop the timer."""
        self.in_flight = False
        self._cancel()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
