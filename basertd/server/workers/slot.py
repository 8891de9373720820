"""Worker supervision: spawn, watch, respawn with backoff, give up, never leak (DESIGN.md "Processes").

One ``WorkerSlot`` per configured worker runs one supervisor task on the daemon's loop:

- it starts the worker (``basertd.server.workers.process.WorkerProcess.start``: memfd rings, spawn,
  handshake), or handshakes the first one the daemon spawned before its own imports
  (``start(spawned)``), and publishes it as ``proc`` once ready;
- it waits for the link to die (process exit noticed through its pidfd, a protocol error, or the
  scheduler asking for a restart), then closes the process (SHUTDOWN, SIGKILL after a grace
  period, reap, release the rings and the ipc endpoint) and starts a new one after a backoff of
  ``backoff_initial_s`` doubling up to ``backoff_max_s`` seconds;
- after ``max_failures`` failures in a row (a start that failed, or an incarnation that died
  before finishing a single tick with no tick in flight) it stops retrying, logs one
  ``worker_given_up`` line and calls ``on_give_up``; the next request (``poke``) starts it again.
  A start failure is *any* exception of ``WorkerProcess.start`` (``zmq.ZMQError`` under fd
  exhaustion included), never a dead supervisor task;
- a death while a tick was in flight (``WorkerLink.died_in_tick``) is charged to the requests of
  that tick (the scheduler's ``[scheduler] max_crash_resumes`` bound, counted across workers), not
  to the slot: a poison request fails typed and never gets its worker given up. The backoff still
  doubles until an incarnation finishes a tick, so a worker that dies on every tick respawns at
  most every ``backoff_max_s`` seconds;
- a start that fails with exit status 2 (bad command line) or 3 (engine or model cannot load;
  ``worker_proc.PERMANENT_EXIT_CODES``) gives up at once: respawning the same spec cannot fix a
  configuration or model error. ``last_error`` is then the worker's own one-line reason.

``replace(spec)`` is a planned replacement (a reload's new ``[[workers]]`` table, ``basertctl
worker restart``): the current incarnation is dropped at once (``proc`` None, so nothing serves it
again), closed in order (SIGTERM: it finishes its tick and exits 0) and the next one starts from
``spec`` without a backoff and without counting a failure.

``stop()`` ends the task and closes the worker; no child survives it (the child also has
``PR_SET_PDEATHSIG`` should the coordinator itself be killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from basertd.server.states import SlotState
from basertd.server.tasks import RECANCEL_S, cancel_and_wait
from basertd.server.workers.link_errors import LinkError
from basertd.server.workers.process import SpawnedWorker, WorkerProcess, WorkerSpec, WorkerStartError

log = structlog.get_logger("basertd.supervisor")


class WorkerSlot:
    """One configured worker and its current incarnation.

    ``state``: a ``SlotState``. ``proc``: the ready
    ``WorkerProcess`` or None. ``respawns``: incarnations started after the first.
    ``consecutive_failures``: failures since the last incarnation that finished a tick.
    ``start_failures``: starts that failed, in all. ``last_error``: why the last start failed or
    the last incarnation ended, one line (for a worker that exited 2 or 3, its own reason and exit
    status)."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        max_failures: int = 5,
        close_grace_s: float = 5.0,
        on_give_up: Callable[[str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.worker_id = spec.worker_id
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.max_failures = max_failures
        self.close_grace_s = close_grace_s
        self.on_give_up = on_give_up
        self.state = SlotState.STARTING
        self.proc: WorkerProcess | None = None
        self.respawns = 0
        self.incarnations = 0
        self.consecutive_failures = 0
        self.start_failures = 0
        self.last_error = ""
        self.permanent_at: float | None = None
        self._progress = False
        self._changed = asyncio.Event()
        self._poked = asyncio.Event()
        self._stopping = False
        self._next_spec: WorkerSpec | None = None
        self._task: asyncio.Task | None = None
        self._spawned: SpawnedWorker | None = None

    # --- state the scheduler waits on -----------------------------------------------------------

    def _set_state(self, state: SlotState, proc: WorkerProcess | None = None) -> None:
        self.state = state
        self.proc = proc
        self._changed.set()
        self._changed = asyncio.Event()

    async def ready(self) -> WorkerProcess:
        """The live worker, waiting for one as long as it takes (respawns, a poke after giving
        up). Raises ``asyncio.CancelledError`` only."""
        while True:
            proc = self.proc
            if proc is not None and proc.link.alive:
                return proc
            await self._changed.wait()

    async def live(self, timeout_s: float) -> WorkerProcess | None:
        """The live worker, waiting up to ``timeout_s`` seconds for one (a respawn after a death);
        None when the time passes, or the slot has given up or is stopping."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            proc = self.proc
            if proc is not None and proc.link.alive:
                return proc
            left = deadline - asyncio.get_running_loop().time()
            if self._stopping or self.state in (SlotState.GIVEN_UP, SlotState.STOPPED) or left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changed.wait()

    async def settled(self) -> SlotState:
        """Wait until the slot serves (READY) or has given up (GIVEN_UP); returns which."""
        while self.state not in (SlotState.READY, SlotState.GIVEN_UP):
            await self._changed.wait()
        return self.state

    @property
    def given_up(self) -> bool:
        """True while the slot has stopped retrying (until ``poke``)."""
        return self.state is SlotState.GIVEN_UP

    def poke(self) -> None:
        """A request arrived: if the slot gave up, try again (failure count reset). After a
        permanent start failure (exit 2 or 3) it tries again only once ``backoff_max_s`` seconds
        have passed since; before that the queued requests fail at once through ``on_give_up``
        (the operator may have fixed the model or library meanwhile, but a stream of requests must
        not become a stream of doomed spawns)."""
        if self.state is not SlotState.GIVEN_UP:
            return
        held = self.permanent_at is not None and time.monotonic() - self.permanent_at < self.backoff_max_s
        if held:
            if self.on_give_up is not None:
                asyncio.get_running_loop().call_soon(self.on_give_up, self.last_error)
            return
        self._poked.set()

    def progress(self) -> None:
        """The current incarnation finished a tick: it counts as healthy."""
        if not self._progress:
            self._progress = True
            self.consecutive_failures = 0

    def restart(self, reason: str) -> None:
        """Ask for the current incarnation to be replaced (a hung or misbehaving worker): its
        process is killed; the supervisor then respawns it as after a death."""
        proc = self.proc
        if proc is not None:
            log.warning("worker_restart_requested", worker_id=self.worker_id, pid=proc.pid, reason=reason)
            proc.link.close()

    def replace(self, spec: WorkerSpec, reason: str) -> None:
        """Replace the current incarnation with one started from ``spec`` (module docstring);
        the caller has handed its lanes over first (``HandOver.hand_over``). A slot that gave up
        starts again from ``spec``; one still starting takes ``spec`` for its next start."""
        self._next_spec = spec
        proc = self.proc
        log.info("worker_replacing", worker_id=self.worker_id, pid=proc.pid if proc else 0, reason=reason)
        if self.state is SlotState.GIVEN_UP:
            self.spec, self._next_spec = spec, None
            self.consecutive_failures = 0
            self.permanent_at = None
            self._poked.set()
            return
        if proc is not None:
            self._set_state(SlotState.RESTARTING)
            proc.link.close()

    # --- the supervisor task --------------------------------------------------------------------

    def start(self, spawned: SpawnedWorker | None = None) -> None:
        """Start the supervisor task on the running loop. It spawns the first incarnation, or
        handshakes ``spawned`` (a worker of this slot's spec already spawned,
        ``basertd.server.launch``), which the slot owns from now on."""
        if spawned is not None:
            if self._task is not None or self._spawned is not None:
                spawned.kill()
                raise RuntimeError(f"worker {self.worker_id}: its supervisor has already started")
            self._spawned = spawned
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._supervise(), name=f"supervisor-{self.worker_id}"
            )

    async def _supervise(self) -> None:
        """``_run`` until stopped; an exception that escapes it (a bug of ours) is logged with its
        traceback and the supervision starts over after ``backoff_max_s``: the slot is never left
        ``restarting`` with no task behind it."""
        while not self._stopping:
            try:
                await self._run()
            except Exception as exc:
                self.last_error = f"supervisor error: {_describe(exc)}"
                with contextlib.suppress(Exception):  # logging itself may fail (fd exhaustion)
                    log.exception("supervisor_error", worker_id=self.worker_id, error=_describe(exc))
                self.consecutive_failures += 1
                self._set_state(SlotState.RESTARTING)
                await asyncio.sleep(self.backoff_max_s)

    async def _run(self) -> None:
        backoff = self.backoff_initial_s
        while not self._stopping:
            if self.consecutive_failures >= self.max_failures:
                log.error(
                    "worker_given_up",
                    worker_id=self.worker_id,
                    failures=self.consecutive_failures,
                    last_error=self.last_error,
                    note="not retrying until the next request arrives"
                    if self.permanent_at is None
                    else f"configuration or model error: a request retries after {self.backoff_max_s:g} s",
                )
                self._set_state(SlotState.GIVEN_UP)
                if self.on_give_up is not None:
                    self.on_give_up(self.last_error)
                self._poked.clear()
                await self._poked.wait()
                self.consecutive_failures = 0
                backoff = self.backoff_initial_s
                log.info("worker_retry_on_request", worker_id=self.worker_id)
            self._set_state(SlotState.STARTING if self.incarnations == 0 else SlotState.RESTARTING)
            started = time.monotonic()
            if self._next_spec is not None:
                self.spec, self._next_spec = self._next_spec, None
            spawned, self._spawned = self._spawned, None
            if spawned is not None and spawned.spec != self.spec:
                spawned.kill()  # a replacement spec arrived first
                spawned = None
            try:
                proc = await (spawned.handshake() if spawned is not None else WorkerProcess.start(self.spec))
            except Exception as exc:  # any start failure is retried, never a dead supervisor task
                self.start_failures += 1
                if isinstance(exc, WorkerStartError) and exc.permanent:
                    # A usage or load error: the same spec fails the same way; give up now.
                    self.consecutive_failures = max(self.consecutive_failures + 1, self.max_failures)
                    self.last_error = f"{exc.reason or exc} (exit status {exc.returncode})"
                    self.permanent_at = time.monotonic()
                    continue
                self.consecutive_failures += 1
                self.last_error = f"start failed: {_describe(exc)}"
                expected = isinstance(exc, (LinkError, OSError, ValueError))
                (log.warning if expected else log.error)(
                    "worker_start_failed",
                    worker_id=self.worker_id,
                    error=_describe(exc),
                    exc_info=not expected,
                    failures=self.consecutive_failures,
                    retry_in_s=backoff,
                )
                if self.consecutive_failures < self.max_failures:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.backoff_max_s)
                continue
            self.permanent_at = None
            self.incarnations += 1
            if self.incarnations > 1:
                self.respawns += 1
            self._progress = False
            log.info(
                "worker_ready",
                worker_id=self.worker_id,
                pid=proc.pid,
                engine=proc.capabilities.engine,
                lanes=proc.capabilities.max_lanes,
                start_s=round(time.monotonic() - started, 3),
            )
            self._set_state(SlotState.READY, proc)
            try:
                why = await proc.link.wait_dead()
            finally:
                if self._stopping:
                    await proc.close(self.close_grace_s, reason="daemon stopping")
            if self._stopping:
                break
            self._set_state(SlotState.RESTARTING)
            if self._next_spec is not None:  # a planned replacement: no failure, no backoff
                code = await proc.close(self.close_grace_s, reason="replaced")
                self.spec, self._next_spec = self._next_spec, None
                self.consecutive_failures = 0
                backoff = self.backoff_initial_s
                log.info("worker_replaced", worker_id=self.worker_id, pid=proc.pid, exit_status=code)
                continue
            in_tick = proc.link.died_in_tick
            code = await proc.close(min(self.close_grace_s, 1.0), reason="link lost")
            if self._progress:
                backoff = self.backoff_initial_s
                self.consecutive_failures = 0 if in_tick else 1
            elif not in_tick:  # charged to the tick's requests (module docstring), not the slot
                self.consecutive_failures += 1
            self.last_error = f"{why} (exit status {code})"
            log.warning(
                "worker_lost",
                worker_id=self.worker_id,
                pid=proc.pid,
                exit_status=code,
                reason=str(why),
                in_tick=in_tick,
                failures=self.consecutive_failures,
                respawn_in_s=backoff,
            )
            if self.consecutive_failures < self.max_failures:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    async def stop(self) -> None:
        """Stop supervising and close the worker (SHUTDOWN, then SIGKILL after the grace period);
        idempotent. Returns once the child is reaped and its resources released."""
        self._stopping = True
        task, self._task = self._task, None
        proc = self.proc
        if self._spawned is not None:  # never handshaken (stopped before the task ran)
            self._spawned.kill()
            self._spawned = None
        if task is not None:  # cancelled, it closes the worker itself (up to the grace period)
            await cancel_and_wait([task], recancel_s=self.close_grace_s + RECANCEL_S)
        if proc is not None:
            await proc.close(self.close_grace_s, reason="daemon stopping")
        self._set_state(SlotState.STOPPED)


def _describe(exc: BaseException) -> str:
    """``exc`` as one line naming its type (``ZMQError: Too many open files``)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
