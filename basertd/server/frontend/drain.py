"""Drain: stop taking requests, let the accepted ones finish, cancel what is left (DESIGN.md "Operators").

``Drainer`` holds the daemon's drain state and the set of accepted requests that have not ended
(queued or running; the request observer adds and discards them), and counts the embedding
requests being served (``serving()``: they hold no lane and are never queued, but a drain waits
for them too). ``drain(timeout_s, code)``:

1. from the first call on, ``draining`` is True (health says so at once); after ``grace_s``
   seconds (``[operators] drain_grace_s``, 0 by default: at once) the daemon refuses every new
   Generate with a typed error (``refusal()``: DRAINING, or SHUTTING_DOWN for a drain before a
   stop). During the grace requests are still accepted, so a router whose health checks see the
   drain stops sending before anything is refused;
2. requests already accepted keep being served, queued ones included (they were acknowledged),
   and so are the embedding requests being served;
3. at ``timeout_s`` whatever generation is still in flight is cancelled with ``code`` through its
   scheduler (its lane retires in the next plan, the client gets ``Error(code)`` after the tokens
   it had); an embedding still running is not cancelled (the drain is then not clean);
4. it returns a ``DrainOutcome`` (drained cleanly or not, requests cancelled, seconds waited).

``resume()`` ends a drain: new requests are accepted again and pending ``drain`` calls return at
once without cancelling anything. Rules: DESIGN.md "Operators" and "Reliability rules" (nothing
acknowledged is lost: a request is only ever cancelled by the timeout, with a typed error).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from basertd.schema.client import ErrorCode

if TYPE_CHECKING:
    from basertd.server.request.record import GenerationRequest

log = structlog.get_logger("basertd.drain")


@dataclass(frozen=True)
class DrainOutcome:
    """How a drain ended: ``drained`` True when every accepted request finished within the
    timeout; ``cancelled`` requests cancelled at the timeout; ``waited_s`` seconds waited;
    ``resumed`` True when ``resume()`` ended the wait first."""

    drained: bool
    cancelled: int
    waited_s: float
    resumed: bool = False


class Drainer:
    """Drain state and in-flight accounting (module docstring). ``cancel(req, code, message)``
    ends one request through its scheduler (``Scheduler.cancel``)."""

    def __init__(self, cancel: Callable[[GenerationRequest, ErrorCode, str], None]) -> None:
        self._cancel = cancel
        self._live: dict[int, GenerationRequest] = {}
        self._serving = 0  # embedding requests being served
        self._idle = asyncio.Event()
        self._idle.set()
        self._resumed = asyncio.Event()
        self.draining = False
        self.code = ErrorCode.DRAINING
        self._refuse_at = 0.0

    # --- in-flight accounting --------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Accepted requests that have not ended, and embedding requests being served."""
        return len(self._live) + self._serving

    def requests(self) -> list[GenerationRequest]:
        """The accepted requests that have not ended (acceptance order)."""
        return list(self._live.values())

    def accepted(self, req: GenerationRequest) -> None:
        """``req`` was accepted (Accepted sent)."""
        self._live[req.key] = req
        self._idle.clear()

    def ended(self, req: GenerationRequest) -> None:
        """``req`` sent Done or Error."""
        self._live.pop(req.key, None)
        if not self.in_flight:
            self._idle.set()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Count an embedding request in flight while the block runs (a drain waits for it)."""
        self._serving += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._serving -= 1
            if not self.in_flight:
                self._idle.set()

    # --- drain -----------------------------------------------------------------------------------

    def refusal(self) -> tuple[ErrorCode, str] | None:
        """The typed error a new Generate gets now, or None when requests are accepted."""
        if not self.draining or time.monotonic() < self._refuse_at:
            return None
        if self.code is ErrorCode.SHUTTING_DOWN:
            return self.code, "basertd is shutting down; retry on another instance"
        return self.code, "basertd is draining (an operator ran basertctl drain); retry later or elsewhere"

    def begin(self, code: ErrorCode = ErrorCode.DRAINING, grace_s: float = 0.0) -> None:
        """Drain from now on: refuse new requests with ``code`` (SHUTTING_DOWN wins over
        DRAINING) once ``grace_s`` seconds have passed (a later call never extends the grace)."""
        if not self.draining:
            self._resumed = asyncio.Event()
            self._refuse_at = time.monotonic() + max(0.0, grace_s)
            log.info("drain_started", in_flight=self.in_flight, code=str(code), grace_s=grace_s)
        if not self.draining or code is ErrorCode.SHUTTING_DOWN:
            self.code = code
        self.draining = True

    async def drain(
        self, timeout_s: float, code: ErrorCode = ErrorCode.DRAINING, grace_s: float = 0.0
    ) -> DrainOutcome:
        """Drain (module docstring): accept requests for ``grace_s`` more seconds, then wait up to
        ``timeout_s`` seconds (>= 0) for the in-flight requests, then cancel the rest with
        ``code``. Several drains may wait at once."""
        self.begin(code, grace_s)
        resumed = self._resumed
        t0 = time.monotonic()
        grace_left = self._refuse_at - t0
        if grace_left > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(resumed.wait()), grace_left)
        idle = asyncio.ensure_future(self._idle.wait())
        woke = asyncio.ensure_future(resumed.wait())
        try:
            await asyncio.wait({idle, woke}, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            woke.cancel()
        waited = time.monotonic() - t0
        if resumed.is_set():
            return DrainOutcome(drained=not self.in_flight, cancelled=0, waited_s=waited, resumed=True)
        left = self.requests()
        for req in left:
            self._cancel(req, code, f"drain timeout: cancelled after {timeout_s:g} s")
        if left or self._serving:
            log.warning(
                "drain_timeout",
                cancelled=len(left),
                embeddings_running=self._serving,
                timeout_s=timeout_s,
                code=str(code),
            )
        else:
            log.info("drained", waited_s=round(waited, 3))
        return DrainOutcome(drained=not (left or self._serving), cancelled=len(left), waited_s=waited)

    def resume(self) -> bool:
        """Accept new requests again; True when a drain was in progress. A drain before a stop
        (SHUTTING_DOWN) cannot be resumed: returns False and changes nothing."""
        if not self.draining or self.code is ErrorCode.SHUTTING_DOWN:
            return False
        self.draining = False
        self.code = ErrorCode.DRAINING
        self._resumed.set()
        log.info("drain_resumed", in_flight=self.in_flight)
        return True
