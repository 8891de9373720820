"""Grammar handles a scheduler holds on its worker (DESIGN.md "Link W", ABI rules 74 and 113).

A constrained request (``GenerationRequest.grammar``) owns one grammar handle on its worker's
current incarnation from the plan that admits its lane to the plan that retires it, booked in a
``WorkerHandles`` (``basertd.server.sched.handles``: ``grammar_handles``) by request: ``create``
sends GRAMMAR_CREATE just before the admission; the core ``drop``s the handle of a request that no
longer owns a lane (done, cancel, fault, preemption, checkpoint, a refused admit or a rejected
plan: a re-admission gets a fresh handle and ``grammar_replay``); between two ticks the loop drops
the handle of any finished request that owns no lane (one made for a plan that was not sent) and
frees the dropped ones, and it forgets them all when the incarnation dies. Its count is the
``basertd_grammar_handles`` gauge.
"""

from __future__ import annotations

from typing import Protocol

from basertd.server.observe.metrics import Metrics
from basertd.server.request.record import GenerationRequest
from basertd.server.sched.handles import WorkerHandles
from basertd.server.workers.link_errors import LinkError

GRAMMAR_TIMEOUT_S = 60.0
"""Seconds a worker may take to compile one grammar (its first builds the vocabulary's tokenizer)."""


class GrammarLink(Protocol):
    """The two Link W requests a grammar handle needs (``basertd.server.workers.link.WorkerLink``)."""

    @property
    def alive(self) -> bool: ...

    async def grammar_create(self, spec: object, *, timeout: float) -> int: ...

    async def grammar_free(self, handle: int) -> None: ...


async def _free(wlink: GrammarLink, handle: int) -> None:
    await wlink.grammar_free(handle)


def grammar_handles(worker_id: int, metrics: Metrics) -> WorkerHandles[GenerationRequest]:
    """The grammar handles of one worker's scheduler, by request, counted on the
    ``basertd_grammar_handles`` gauge."""
    return WorkerHandles("grammar", worker_id, _free, lambda n: metrics.grammar_handles_held(worker_id, n))


async def create(
    handles: WorkerHandles[GenerationRequest], wlink: GrammarLink, req: GenerationRequest
) -> str | None:
    """GRAMMAR_CREATE ``req.grammar`` over ``wlink`` and book the handle for ``req``. Returns None,
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
    handles.hold(req, handle)
    return None
