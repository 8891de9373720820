"""Bounded work off the event loop: a pool of child processes, each running one job at a time
under a time limit and a memory limit, whose native crash costs only that job.

What a request carries can make a library loop, allocate without end or crash the process that
runs it (a Jinja chat template with a long loop; a grammar whose compilation overflows
llguidance's native stack and dies of SIGSEGV). A thread cannot be stopped and shares the
coordinator's fate, so such work runs in ``SandboxPool``'s children: ``size`` processes
(``python -m <module>``, the module calling ``serve(handler)``, which lives with the frame format in
``sandbox_child``, a module a child imports without asyncio or structlog), each with
``RLIMIT_AS`` of ``memory_bytes``, a nice value of ``CHILD_NICE`` (a spinning job yields the CPU to
the coordinator and the engines), ``PR_SET_PDEATHSIG`` (it dies with the coordinator) and its
stdin/stdout as the job pipe: a frame is a 4-byte little-endian length and a msgpack body
(``msgspec``), one job in, one reply out. A child says it is ready (one frame) once its modules
are imported; its start (``STARTUP_TIMEOUT_S`` at most) does not count against a job's time limit.

Children start as they are needed, one ahead: ``start(n)`` warms ``n`` in the background (the
daemon warms one per pool while it starts), and a job that takes the last child ready starts the
next one in the background, so the next job finds one ready while an idle daemon keeps one process
per pool (each is a Python process of about 20 MiB). A job that finds none ready and a slot free
starts one itself.

``run(job)`` awaits an idle child (at most ``max_pending`` callers wait or run at once: more are
``SandboxBusy``), sends the job and waits ``timeout_s`` for the reply. A child that does not
answer in time is killed (``SandboxTimeout``); one that dies meanwhile (a signal, an exit) is
``SandboxCrashed`` naming the signal. Either way a replacement starts at once in the background
and takes the slot when ready; other jobs and the coordinator go on. ``close()`` kills and reaps every child.

A handler returns any msgpack value; an exception it raises is answered as
``SandboxJobError`` with its message (the child lives on).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

import msgspec
import structlog

from basertd.server.request.sandbox_child import CHILD_NICE, MAX_FRAME_BYTES, serve
from basertd.server.request.sandbox_child import LEN as _LEN
from basertd.server.tasks import cancel_and_wait

__all__ = [
    "CHILD_NICE",
    "MAX_FRAME_BYTES",
    "STARTUP_TIMEOUT_S",
    "SandboxBusy",
    "SandboxCrashed",
    "SandboxError",
    "SandboxJobError",
    "SandboxPool",
    "SandboxTimeout",
    "serve",
]

log = structlog.get_logger("basertd.sandbox")

STARTUP_TIMEOUT_S = 60.0
"""Seconds a child may take to start and say it is ready."""


class SandboxError(Exception):
    """A sandboxed job produced no result; ``reason`` is a short label for metrics (``busy``,
    ``timeout``, ``crash``, ``error``)."""

    reason = "error"


class SandboxBusy(SandboxError):
    """``max_pending`` jobs already wait or run."""

    reason = "busy"


class SandboxTimeout(SandboxError):
    """The job ran past the time limit; its child was killed."""

    reason = "timeout"


class SandboxCrashed(SandboxError):
    """The child died running the job (``signal_name``, e.g. ``SIGSEGV``, or ``exit N``)."""

    reason = "crash"

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"the sandbox process died ({signal_name})")
        self.signal_name = signal_name


class SandboxJobError(SandboxError):
    """The handler raised; ``str()`` is its message."""


class _Child:
    """One child process and its pipe."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def call(self, payload: bytes) -> bytes:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(_LEN.pack(len(payload)) + payload)
        await stdin.drain()
        return await self.reply()

    async def reply(self) -> bytes:
        stdout = self.proc.stdout
        assert stdout is not None
        (n,) = _LEN.unpack(await stdout.readexactly(_LEN.size))
        if n > MAX_FRAME_BYTES:
            raise asyncio.IncompleteReadError(b"", n)
        return await stdout.readexactly(n)

    async def kill(self) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(Exception):
            await self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def _died(rc: int | None) -> str:
    if rc is None:
        return "closed its pipe"
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


class SandboxPool:
    """``size`` child processes running ``module``'s handler (module docstring). ``timeout_s``:
    seconds one job may take; ``max_pending``: jobs waiting or running at once; ``memory_bytes``:
    each child's address-space limit (0: none)."""

    def __init__(
        self,
        name: str,
        module: str,
        *,
        size: int,
        timeout_s: float,
        max_pending: int,
        memory_bytes: int = 0,
    ) -> None:
        self.name = name
        self.module = module
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.memory_bytes = memory_bytes
        self.size = size
        # idle slots, a started child (rank 0) before an empty slot (rank 1, None)
        self._idle: asyncio.PriorityQueue[tuple[int, int, _Child | None]] = asyncio.PriorityQueue()
        self._order = 0  # ties within a rank: first in, first out
        self._ready = 0  # started children in ``_idle``
        self._empty = 0  # empty slots in ``_idle``
        self._warming: set[asyncio.Task[None]] = set()
        self._reaping: set[asyncio.Task[int]] = set()
        for _ in range(size):
            self._put(None)  # a slot; its child starts when needed
        self._children: set[_Child] = set()
        self._pending = 0
        self._closed = False
        self._encode = msgspec.msgpack.Encoder()
        self._decode = msgspec.msgpack.Decoder()

    @property
    def pending(self) -> int:
        """Jobs waiting or running now."""
        return self._pending

    def start(self, count: int | None = None) -> None:
        """Start ``count`` children (default: one per empty slot) in the background, so a job
        finds one ready instead of waiting for a Python process to start; call with the event loop
        running. Later children start one ahead of the jobs (module docstring)."""
        n = self._empty if count is None else min(count, self._empty)
        for _ in range(n):
            if self._claim_empty():  # taken out now, so a second ``start`` does not warm it again
                self._background(self._warm())

    def _claim_empty(self) -> bool:
        """Take an empty slot out of the idle queue now; False when it holds none."""
        ready = []
        found = False
        while not self._idle.empty():
            item = self._idle.get_nowait()
            if item[2] is None:
                found = True
                self._empty -= 1
                break
            ready.append(item)  # started children sort first: put back
        for item in ready:
            self._idle.put_nowait(item)
        return found

    def _put(self, child: _Child | None) -> None:
        self._order += 1
        if child is None:
            self._empty += 1
        else:
            self._ready += 1
        self._idle.put_nowait((0 if child is not None else 1, self._order, child))

    async def _get(self) -> _Child | None:
        """The next idle slot: a started child if one is idle, else an empty slot (None)."""
        _, _, child = await self._idle.get()
        if child is None:
            self._empty -= 1
        else:
            self._ready -= 1
        return child

    def _ahead(self) -> None:
        """No started child is idle or starting and a slot is empty: start one in the background."""
        if self._ready == 0 and self._empty > 0 and not self._warming and not self._closed:
            self.start(1)

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm(self) -> None:
        """Start a child for a slot out of the idle queue (claimed by ``start``, or the slot of a
        child just dropped) and put it there, ready, or empty again when it does not start."""
        child: _Child | None = None
        try:
            child = await self._spawn()
        except SandboxError:
            child = None
        finally:
            if not self._closed:
                self._put(child)
            elif child is not None:
                await self._drop(child)

    async def _spawn(self) -> _Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            self.module,
            str(os.getpid()),
            str(self.memory_bytes),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            close_fds=True,
        )
        child = _Child(proc)
        self._children.add(child)
        try:
            await asyncio.wait_for(child.reply(), STARTUP_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            await self._drop(child)
            raise SandboxCrashed(f"did not start: {type(exc).__name__}") from None
        return child

    async def run(self, job: Any) -> Any:
        """The handler's reply to ``job`` (msgpack values). Raises ``SandboxBusy``,
        ``SandboxTimeout``, ``SandboxCrashed`` or ``SandboxJobError``. A caller cancelled while
        its job runs kills that child (its late reply must not reach the next job)."""
        if self._closed:
            raise SandboxBusy(f"the {self.name} sandbox is closed")
        if self._pending >= self.max_pending:
            raise SandboxBusy(f"{self.max_pending} {self.name} jobs are already waiting")
        payload = self._encode.encode(job)
        self._pending += 1
        try:
            child = await self._get()
        except BaseException:
            self._pending -= 1
            raise
        self._ahead()  # the next job finds one ready
        clean = False  # the slot goes back with ``child`` only when no job is left half-done on it
        try:
            if child is None or not child.alive:
                if child is not None:
                    self._drop_now(child)
                child = None
                child = await self._spawn()
            try:
                reply = await asyncio.wait_for(child.call(payload), self.timeout_s)
            except TimeoutError:
                raise SandboxTimeout(
                    f"the {self.name} ran past its time limit ({self.timeout_s:g} s)"
                ) from None
            except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(child.proc.wait(), 5.0)
                raise SandboxCrashed(_died(child.proc.returncode)) from None
            clean = True
            ok, value = self._decode.decode(reply)
            if not ok:
                raise SandboxJobError(str(value))
            return value
        finally:
            self._pending -= 1
            if not clean and child is not None:
                self._drop_now(child)
                child = None
            if self._closed:
                if child is not None:
                    self._drop_now(child)
            elif child is None:  # dropped: its replacement starts now, not on the next job
                self._background(self._warm())
            else:
                self._put(child)

    def _drop_now(self, child: _Child) -> None:
        """Kill ``child`` without waiting; it is reaped in the background."""
        self._children.discard(child)
        if child.alive:
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
        if child.proc.stdin is not None:
            child.proc.stdin.close()
        task = asyncio.ensure_future(child.proc.wait())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _drop(self, child: _Child) -> None:
        self._children.discard(child)
        await child.kill()

    async def close(self) -> None:
        """Kill and reap every child; later ``run`` calls are ``SandboxBusy``."""
        self._closed = True
        await cancel_and_wait(list(self._warming))
        for child in list(self._children):
            await self._drop(child)
        if self._reaping:
            await asyncio.wait(list(self._reaping), timeout=10.0)
