"""Grammar handles a scheduler holds on its worker (DESIGN.md "Link W", ABI rules 74 and 113).

A constrained request (``GenerationRequest.grammar``) owns one handle on its worker's current
incarnation from the plan that admits its lane to the plan that retires it: ``create`` sends
GRAMMAR_CREATE just before the admission, ``drop`` marks the handle of a request that no longer
owns a lane (done, cancel, fault, preemption, checkpoint, a refused admit or a rejected plan) and
``free_pending`` sends the GRAMMAR_FREEs between two ticks. A dead incarnation's handles died
with it: ``forget`` drops the books without a message. ``held`` is what the worker holds now (the
``basertd_grammar_handles`` gauge).
"""

from __future__ import annotations

from typing import Protocol

import structlog

from basertd.server.observe.metrics import Metrics
from basertd.server.request.record import GenerationRequest
from basertd.server.workers.link_errors import LinkError, WorkerError

log = structlog.get_logger("basertd.scheduler")

GRAMMAR_TIMEOUT_S = 60.0
"""Seconds a worker may take to compile one grammar (its first builds the vocabulary's tokenizer)."""


class GrammarLink(Protocol):
    """The two Link W requests a grammar handle needs (``basertd.server.workers.link.WorkerLink``)."""

    @property
    def alive(self) -> bool: ...

    async def grammar_create(self, spec: object, *, timeout: float) -> int: ...

    async def grammar_free(self, handle: int) -> None: ...


class GrammarHandles:
    """The grammar handles of one worker's scheduler (module docstring)."""

    def __init__(self, worker_id: int, metrics: Metrics) -> None:
        self.worker_id = worker_id
        self.metrics = metrics
        self.held: set[int] = set()
        self.pending_free: list[int] = []

    def _gauge(self) -> None:
        self.metrics.grammar_handles_held(self.worker_id, len(self.held))

    async def create(self, wlink: GrammarLink, req: GenerationRequest) -> str | None:
        """GRAMMAR_CREATE ``req.grammar`` over ``wlink`` into ``req.grammar_handle``. Returns None,
        or why the worker gave no handle (handle 0: it cannot compile the spec, or it refused the
        message); raises ``LinkError`` when the link died."""
        assert req.grammar is not None
        try:
            handle = await wlink.grammar_create(req.grammar.to_message(), timeout=GRAMMAR_TIMEOUT_S)
        except LinkError as exc:
            if not wlink.alive:
                raise
            return str(exc)
        if not handle:
            return "handle 0"
        req.grammar_handle = handle
        self.held.add(handle)
        self._gauge()
        return None

    def drop(self, req: GenerationRequest) -> None:
        """``req`` no longer owns a lane: its handle (if any) is freed between ticks."""
        if req.grammar_handle:
            self.pending_free.append(req.grammar_handle)
            req.grammar_handle = 0

    async def free_pending(self, wlink: GrammarLink) -> None:
        """GRAMMAR_FREE every dropped handle. A refusal (an unknown handle, rule 113) is logged; a
        dead link raises ``LinkError`` (``forget`` then clears the rest)."""
        while self.pending_free:
            handle = self.pending_free.pop()
            self.held.discard(handle)
            self._gauge()
            try:
                await wlink.grammar_free(handle)
            except WorkerError as exc:
                log.warning("grammar_free_refused", worker_id=self.worker_id, handle=handle, error=str(exc))

    def forget(self) -> None:
        """The incarnation is gone, and its handles with it."""
        self.held.clear()
        self.pending_free.clear()
        self._gauge()
