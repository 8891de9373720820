"""Worker-held handles: engine objects one worker incarnation holds for the coordinator
(DESIGN.md "Link W"; ABI rules 74 and 113).

A *worker-held handle* names something the engine made on the coordinator's request and keeps
until it is told to free it: a grammar matcher (GRAMMAR_CREATE, named by
``LaneAdmit.grammar_handle``) or a logit-bias table (LOGIT_BIAS_CREATE, named by
``LaneAdmit.logit_bias_handle``). ``WorkerHandles`` books the handles of one kind for one worker,
by owner (the request), with one lifecycle:

- ``hold(owner, handle)`` once the create the kind needs returned a handle (the loop awaits it
  before the admit that names it); ``get(owner)`` is the handle an admit names (0: none);
- ``drop(owner)`` when the owner no longer needs it: synchronous (the core calls it when a lane
  ends), the handle waits in ``pending_free``; ``drop_where(pred)`` drops every owner ``pred``
  selects (a finished request that holds no lane);
- ``free_pending(wlink)`` sends the frees between two ticks, never while the tick naming a handle
  runs; a refusal (an unknown handle, rule 113) is logged, a dead link raises ``LinkError``;
- ``forget()`` when the incarnation died: its handles died with it, no message;
- ``len()``: handles the worker holds now (held and not yet freed), reported to ``on_count`` (the
  ``basertd_grammar_handles`` gauge) at every change.

The two kinds differ only in who drops and when: a grammar handle lives for one lane (its matcher
advances with the lane's tokens; a re-admission gets a fresh one and ``grammar_replay``,
``basertd.server.sched.grammar_handles``), a logit-bias table for the request's life on the
incarnation, reused by re-admissions (``basertd.server.sched.logit_bias``).

Seed leases are not booked here, because the engine ends them itself: a lease is consumed by the
one admit that names it and expires ``seed_lease_ticks`` ticks after its grant (ABI rules 81-83),
so the coordinator only releases the ones no admit used (``SchedulerState.to_release``, released
between ticks by the loop) and renews the pins' (``basertd.server.cache.policy``). A lost lease
costs nothing lasting; a lost grammar handle or bias table stays on the worker until freed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import structlog

from basertd.server.workers.link_errors import WorkerError

log = structlog.get_logger("basertd.scheduler")

K = TypeVar("K", bound=Hashable)

FreeHandle = Callable[[Any, int], Awaitable[object]]
"""``free(wlink, handle)``: the Link W request that frees one handle of a kind (GRAMMAR_FREE,
LOGIT_BIAS_FREE); raises ``WorkerError`` when the worker refuses it, ``LinkError`` when the link
fails."""


class WorkerHandles(Generic[K]):
    """The handles of one ``kind`` (a name for the logs) one worker holds, by owner (module
    docstring). ``free`` sends one free (``FreeHandle``); ``on_count(n)`` is told the count after
    every change."""

    def __init__(
        self,
        kind: str,
        worker_id: int,
        free: FreeHandle,
        on_count: Callable[[int], None] | None = None,
    ) -> None:
        self.kind = kind
        self.worker_id = worker_id
        self._free = free
        self._on_count = on_count
        self._held: dict[K, int] = {}
        self.pending_free: list[int] = []
        """Handles dropped and not yet freed, in drop order."""

    def __len__(self) -> int:
        return len(self._held) + len(self.pending_free)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._held))

    def _count(self) -> None:
        if self._on_count is not None:
            self._on_count(len(self))

    def get(self, owner: K) -> int:
        """The handle ``owner`` holds, 0 when none."""
        return self._held.get(owner, 0)

    def hold(self, owner: K, handle: int) -> None:
        """Book ``handle`` (nonzero, just created on the worker) for ``owner``. A handle the owner
        already held is dropped (freed between ticks). Raises ValueError for handle 0."""
        if not handle:
            raise ValueError(f"{self.kind}: handle 0 names nothing")
        old = self._held.get(owner)
        if old is not None:
            self.pending_free.append(old)
        self._held[owner] = handle
        self._count()

    def drop(self, owner: K) -> None:
        """``owner`` no longer needs its handle (if any): it is freed by the next
        ``free_pending``."""
        handle = self._held.pop(owner, None)
        if handle is not None:
            self.pending_free.append(handle)

    def drop_where(self, pred: Callable[[K], bool]) -> int:
        """``drop`` every owner for which ``pred(owner)`` is true; returns how many."""
        owners = [o for o in self._held if pred(o)]
        for owner in owners:
            self.drop(owner)
        return len(owners)

    async def free_pending(self, wlink: Any) -> int:
        """Free every dropped handle over ``wlink`` (between two ticks); returns how many were
        sent. A refusal (an unknown handle: the engine already lost it, ABI rule 113) is logged and
        the handle forgotten; ``LinkError`` when the link fails (``forget`` then clears the rest)."""
        sent = 0
        while self.pending_free:
            handle = self.pending_free.pop(0)
            self._count()
            sent += 1
            try:
                await self._free(wlink, handle)
            except WorkerError as exc:
                log.warning(
                    "handle_free_refused",
                    kind=self.kind,
                    worker_id=self.worker_id,
                    handle=handle,
                    error=str(exc),
                )
        return sent

    def forget(self) -> None:
        """The incarnation is gone, and every handle with it: nothing is sent."""
        self._held.clear()
        self.pending_free.clear()
        self._count()
