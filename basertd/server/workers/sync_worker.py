"""A started worker as blocking calls, for tests and benches (DESIGN.md "Processes", "Link W").

``SyncWorker(spec)`` starts a ``basertd.server.workers.process.WorkerProcess`` on a private event
loop and runs each ``WorkerLink`` coroutine to completion; the coordinator never uses it (it runs
``WorkerProcess`` and ``WorkerLink`` on its own loop).
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from basertd.schema import link
from basertd.schema.tick import TickEvents, TickPlan
from basertd.server.workers.link import WorkerLink
from basertd.server.workers.link_replies import EmitCallback
from basertd.server.workers.process import WorkerProcess, WorkerSpec

__all__ = ["SyncWorker"]


class SyncWorker:
    """Blocking wrapper over ``WorkerProcess`` with a private event loop (tests, benches).

    ``SyncWorker(spec)`` starts the worker; ``tick``, ``request``, ``ping`` and ``call`` run the
    matching coroutine to completion; ``close`` stops it. Also a context manager. The ring and
    link attributes of the ``WorkerProcess`` are available as ``proc``."""

    def __init__(self, spec: WorkerSpec, *, context: zmq.Context | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self.proc = self._loop.run_until_complete(WorkerProcess.start(spec, context=context))
        except BaseException:
            self._loop.close()
            raise

    @property
    def link(self) -> WorkerLink:
        """The ``WorkerLink``."""
        return self.proc.link

    @property
    def capabilities(self) -> link.Capabilities:
        """The worker's capability record."""
        return self.proc.capabilities

    def call(self, coro: Any) -> Any:
        """Run any coroutine (e.g. ``worker.link.seed_acquire(...)``) on the private loop."""
        return self._loop.run_until_complete(coro)

    def tick(
        self, plan: TickPlan, on_emit: EmitCallback | None = None, timeout: float | None = None
    ) -> TickEvents:
        """``WorkerLink.tick``, blocking."""
        return self._loop.run_until_complete(self.proc.link.tick(plan, on_emit=on_emit, timeout=timeout))

    def request(self, msg: Any, timeout: float | None = None) -> Any:
        """``WorkerLink.request``, blocking."""
        return self._loop.run_until_complete(self.proc.link.request(msg, timeout=timeout))

    def ping(self, timeout: float | None = None) -> link.Pong:
        """``WorkerLink.ping``, blocking."""
        return self._loop.run_until_complete(self.proc.link.ping(timeout=timeout))

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the worker to exit; raises TimeoutError after ``timeout`` seconds."""
        return self._loop.run_until_complete(asyncio.wait_for(self.proc.wait(), timeout))

    def close(self, grace: float = 5.0) -> int | None:
        """``WorkerProcess.close`` then close the loop. Idempotent."""
        if self._loop.is_closed():
            return self.proc.returncode
        try:
            return self._loop.run_until_complete(self.proc.close(grace))
        finally:
            self._loop.close()

    def __enter__(self) -> SyncWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
