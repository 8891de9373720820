"""``basertd serve``: wiring and lifecycle of the coordinator (DESIGN.md "Processes").

``Daemon(config)`` wires, on one asyncio loop: the runtime directory (the client socket, and a
private 0700 ``workers-<pid>/`` directory holding each worker's ``ipc://`` endpoint), the
``Fleet`` (every worker's supervisor, scheduler and tokenizer, and routing), the ``Frontend``
(admission of every API's requests), the native API on the client socket (``NativeService`` over
``ApiServer``), the OpenAI-compatible HTTP API (``basertd.server.transport.http``, ``[http] listen`` and
systemd sockets named ``http``), the control verbs (``ControlService``, which sees the daemon
through its narrow
``ControlHost`` protocol), metrics, drain, reload and systemd notification. It keeps only
lifecycle: start, stop, drain, reload, notify.

The start's first part (the runtime directory, the journal, every worker spawned) is
``basertd.server.launch``: ``basertd serve`` runs it before importing this module, so the workers
load their models while the coordinator imports the rest; a ``Daemon`` given no ``Launch`` runs
it itself at ``start()``.

``run(config)`` starts it and serves until told to stop and returns the exit status: 0, or
``EXIT_JOURNAL_FAILED`` (74) when the write-ahead log failed while serving (the daemon stops at
once, acknowledging nothing more, so that systemd's ``Restart=on-failure`` restarts it). On
every exit path it fails what is still queued or running with SHUTTING_DOWN, closes every worker
(SHUTDOWN, then SIGKILL after a grace period; reaped), and removes the socket and the runtime
files it created.

Durability (``basertd.server.durability.durable``): the write-ahead log in ``state_dir`` is opened (locked,
recovered) before any worker starts; every unfinished request it holds is queued again and runs
on from its durable tokens; it is closed last (its last commit and fdatasync), after the
schedulers stopped. With the log on (``[durability] mode = "write"``, the default, or ``"tick"``) a
stop hands over: what it ends with SHUTTING_DOWN stays unfinished in the log and the next start
runs it on (clients ``Resume``).

Operators (DESIGN.md "Operators"): SIGTERM drains first (``basertd.server.frontend.drain``: new requests
refused, in-flight ones finish within ``[operators] drain_timeout_s``, the rest are cancelled
typed, or with durability on handed over to the next start) and then stops, exit status 0; a
second SIGTERM, or SIGINT, stops at once. SIGHUP reloads
the configuration file (``basertd.server.ops.reload``; workers added, removed or replaced one at a
time, their requests handed over, ``basertd.server.ops.worker_changes``). systemd gets READY=1
once every worker has handshaken, STATUS= lines and watchdog pings, and the client socket may
come from ``LISTEN_FDS`` (``basertd.server.observe.notify``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from basertd import __version__
from basertd.models import ModelUnavailable
from basertd.schema.client import ErrorCode
from basertd.server.config import Config, ConfigError, load_config
from basertd.server.durability.durable import EXIT_JOURNAL_FAILED, Durability
from basertd.server.durability.wal_recover import RecoverMode
from basertd.server.fleet import Fleet
from basertd.server.frontend.admission import Frontend
from basertd.server.frontend.drain import Drainer
from basertd.server.frontend.restart import requeue
from basertd.server.frontend.resume_limits import ResumeLimiter
from basertd.server.launch import Launch, configure_logging, launch
from basertd.server.observe.kv_events import KvEventsHub, start_kv_events
from basertd.server.observe.metrics import LiveState, Metrics
from basertd.server.observe.metrics_vllm import bind_vllm
from basertd.server.observe.notify import (
    HTTP_FD_NAME,
    Notifier,
    Watchdog,
    adopt_listener,
    adopt_named,
    watchdog_interval,
)
from basertd.server.observe.tracing import Tracing
from basertd.server.ops.cache_verbs import PolicyCacheControl
from basertd.server.ops.control import CacheControl, ControlService
from basertd.server.ops.reload import apply_reload
from basertd.server.ops.worker_changes import apply_changes, prepare_changes, worker_changes
from basertd.server.paths import socket_path
from basertd.server.request.record import GenerationRequest
from basertd.server.request.tokenizer import TokenizerError
from basertd.server.sched.loop import Scheduler
from basertd.server.states import DaemonState, HealthStatus, SlotState
from basertd.server.tasks import cancel_and_wait
from basertd.server.transport.native_api import NativeService
from basertd.server.transport.peercred import OperatorPolicy
from basertd.server.transport.socket_server import ApiServer
from basertd.server.workers.slot import WorkerSlot

if TYPE_CHECKING:
    from basertd.server.transport.http.app import HttpServer

log = structlog.get_logger("basertd.daemon")

VERSION = __version__
STATUS_INTERVAL_S = 2.0
"""Seconds between systemd STATUS= updates (sent only when the line changed)."""


class Daemon:
    """The coordinator (module docstring). ``start()`` then ``stop()``; ``stopped`` is set once
    ``request_stop()`` was called (a signal, or a test). ``config_path`` is the file a reload
    (SIGHUP) reads again (None: nothing to reload).

    Parts: ``fleet`` (workers), ``frontend`` (admission), ``metrics`` (the registry), ``drainer``
    (drain state, in-flight requests), ``operators`` (who may use control verbs), ``control`` (the
    verbs), ``cache_control`` (the prefix-cache verbs' backend) and ``notifier`` (systemd)."""

    def __init__(
        self,
        config: Config,
        *,
        config_path: str | os.PathLike[str] | None = None,
        wal_recover: RecoverMode = "refuse",
        launched: Launch | None = None,
    ) -> None:
        self.config = config
        self.launched = launched
        self.wal_recover = wal_recover
        self.durability: Durability | None = None
        self.config_path = config_path
        self.version = VERSION
        self.metrics = Metrics()
        self.drainer = Drainer(self._cancel)
        self.operators = OperatorPolicy(config.operators.operator_group)
        self.control = ControlService(self)
        self.notifier = Notifier.from_env()
        self._watchdog_interval = watchdog_interval()
        self._listen_fds: list[tuple[int, str]] = []  # systemd's, taken by the launch
        self._shutdown: asyncio.Task | None = None
        self._status_line = ""
        self.runtime_dir: Path | None = None
        self.socket: Path | None = None
        self.workers_dir: Path | None = None
        self.fleet: Fleet | None = None  # type: ignore[assignment]
        self.frontend: Frontend | None = None
        self.cache_control: CacheControl | None = None  # type: ignore[assignment]
        self.api: ApiServer | None = None
        self.http: HttpServer | None = None
        self.started_at = time.monotonic()
        self.state = DaemonState.STARTING
        self._tasks: list[asyncio.Task] = []
        self._reloads: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._created_runtime_dir = False
        self.kv_events: KvEventsHub | None = None
        self.exit_status = 0
        """What ``run`` returns: 0, or ``EXIT_JOURNAL_FAILED`` once the write-ahead log failed."""

    # --- views -----------------------------------------------------------------------------------

    @property
    def slots(self) -> list[WorkerSlot]:
        return self.fleet.slots if self.fleet is not None else []

    @property
    def schedulers(self) -> list[Scheduler]:
        return self.fleet.schedulers if self.fleet is not None else []

    @property
    def requests_total(self) -> int:
        """Requests accepted since start."""
        return self.frontend.requests_total if self.frontend is not None else 0

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the runtime directory, start every worker's supervisor and scheduler, and listen
        on the client socket. Raises ``ConfigError``, ``OSError`` (socket in use, directory not
        writable) or ``basertd.models.ModelUnavailable``; whatever was started is stopped first."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        cfg = self.config
        # The runtime directory, the journal and the spawned workers (``basertd.server.launch``):
        # made before this module was imported when ``basertd serve`` runs, here otherwise.
        early = self.launched
        if early is None:
            early = self.launched = launch(cfg, wal_recover=self.wal_recover)
        early.adopted = True  # stop() releases the directories and the journal from now on
        self.runtime_dir = early.runtime_dir
        # Remove at exit only a directory this daemon created (an empty one, see stop()).
        self._created_runtime_dir = early.created_runtime_dir
        self.workers_dir = early.workers_dir
        journal, early.journal = early.journal, None
        assert journal is not None
        journal.on_commit, journal.on_sync = self.metrics.wal_commit, self.metrics.wal_fsync
        self.durability = Durability(
            journal,
            self.metrics,
            on_failed=self._journal_failed,
            sync_interval_s=cfg.durability.sync_interval_ms / 1000,
        )
        self._listen_fds = early.listen_fds
        self.socket = socket_path(cfg, self.runtime_dir)
        inherited = adopt_listener(self._listen_fds)
        if inherited is not None:
            self.socket = Path(inherited.getsockname())
        self.metrics.tracing = Tracing.start(cfg.tracing)
        fleet = self.fleet = Fleet(cfg, str(self.workers_dir), self.metrics)
        await fleet.build(early.spawned)
        limiter = ResumeLimiter(cfg.durability.resumes_per_s, cfg.durability.resume_burst)
        self.frontend = Frontend(
            fleet, self.metrics, self.drainer, self.public_state, self.durability, limiter
        )
        # One child process per sandbox pool now, so a request right after ready finds one; the
        # rest start one ahead of the jobs (``request.sandbox``).
        self.frontend.start(children=1)
        self.durability.start()
        resumed = requeue(self.durability, fleet, self.metrics, self.drainer)
        self.kv_events = start_kv_events(cfg.kv_events, [w.device for w in cfg.workers])
        if self.kv_events is not None:
            self.metrics.registry.register(self.kv_events.collector())
            fleet.publish_kv_events(self.kv_events)
        self.cache_control = PolicyCacheControl(
            fleet.members, fleet.worker_stats, self.metrics.cache_counters.counter
        )
        fleet.start()
        self.api = ApiServer(
            self.socket,
            int(cfg.socket_mode),
            NativeService(self.frontend, self.control, VERSION, is_operator=self.operators.allows),
            sock=inherited,
            limits=cfg.limits,
            metrics=self.metrics,
        )
        await self.api.start()
        http_socks = adopt_named(self._listen_fds, HTTP_FD_NAME)
        if cfg.http.listen or http_socks:
            # Imported here, not at the top: aiohttp and the dialects (about 0.3 s) load only when
            # HTTP listens, and then after the workers were spawned (``fleet.build``), while they
            # load their models.
            from basertd.server.transport.http.app import HttpServer

            self.http = HttpServer(
                cfg.http,
                self.frontend,
                socket_mode=int(cfg.socket_mode),
                adopted=http_socks,
                compile=cfg.compile,
                on_sandbox_failure=self.metrics.sandbox_failed,
                overview=self.control.overview,
                metrics=self.metrics,
                native_connections=cfg.limits.max_connections,
            )
            await self.http.start(children=1)

        def live() -> LiveState:
            return fleet.live_state(self.drainer.in_flight, self.drainer.draining)

        self.metrics.bind(live, VERSION)
        if cfg.metrics.vllm_compat:
            bind_vllm(self.metrics, live)
        address = cfg.operators.metrics_address()
        if address is not None:
            self.metrics.serve_http(*address)
        self.state = DaemonState.READY
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._notify_ready(), name="sd-notify"))
        if self._watchdog_interval is not None:
            watchdog = Watchdog(
                self.notifier, self._watchdog_interval, lambda: [s.heartbeat for s in fleet.schedulers]
            )
            for sched in fleet.schedulers:
                sched.heartbeat.interval = min(sched.heartbeat.interval, self._watchdog_interval / 4)
            self._tasks.append(loop.create_task(watchdog.run(), name="sd-watchdog"))
        log.info(
            "daemon_started",
            socket=str(self.socket),
            socket_inherited=inherited is not None,
            workers=len(fleet),
            version=VERSION,
            pid=os.getpid(),
            uid=os.geteuid(),
            operator_group=cfg.operators.operator_group,
            watchdog_s=self._watchdog_interval,
            durability=cfg.durability.mode,
            epoch=self.durability.journal.epoch,
            resumed=resumed,
        )

    def _journal_failed(self) -> None:
        """The write-ahead log failed (``Durability.failure``): stop now, exit status
        ``EXIT_JOURNAL_FAILED``."""
        self.exit_status = EXIT_JOURNAL_FAILED
        self.request_stop()

    async def _notify_ready(self) -> None:
        """READY=1 once every worker has handshaken, then a STATUS= line whenever it changes."""
        while not all(slot.state is SlotState.READY for slot in self.slots):
            self.publish_status()
            waits = [asyncio.ensure_future(slot.ready()) for slot in self.slots]
            try:
                await asyncio.wait(waits, timeout=STATUS_INTERVAL_S)
            finally:
                for w in waits:
                    w.cancel()
        self._status_line = self.status_line()
        self.notifier.ready(self._status_line)
        log.info("daemon_ready", workers=len(self.slots))
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            self.publish_status()

    def status_line(self) -> str:
        """The one-line summary systemd shows (``systemctl status``): state (with the reason when
        degraded), workers, lanes, queue."""
        fleet = self.fleet
        if fleet is None or self.frontend is None:
            return f"{self.public_state()}: no workers yet"
        t = fleet.totals()
        per_class = ", ".join(f"{q} {n}" for q, n in t.queued_by_class.items())
        status, reason = self.frontend.health()
        quiet = status in (HealthStatus.OK, HealthStatus.STARTING) or not reason
        head = self.public_state() if quiet else f"{status}: {reason}"
        return (
            f"{head}: workers {t.ready}/{t.total}, lanes {t.lanes_busy}/{t.lanes_max} "
            f"busy, queued {t.queued} ({per_class}), in flight {self.drainer.in_flight}"
        )

    def publish_status(self) -> None:
        """Send the STATUS= line to systemd if it changed."""
        line = self.status_line()
        if line != self._status_line:
            self._status_line = line
            self.notifier.status(line)

    def public_state(self) -> DaemonState:
        """``starting``, ``ready``, ``draining``, ``stopping`` or ``stopped`` (Status and Health)."""
        if self.state is DaemonState.READY and self.drainer.draining:
            return DaemonState.DRAINING
        return self.state

    def request_stop(self) -> None:
        """Ask ``run`` to stop now (what is in flight fails with SHUTTING_DOWN)."""
        self._stop.set()

    def request_shutdown(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop, draining first for ``timeout_s`` seconds (default ``[operators] drain_timeout_s``)
        when ``drain``. A second request while a drain runs stops at once."""
        if not drain or self._shutdown is not None or self.state is not DaemonState.READY:
            if self._shutdown is not None:
                log.warning("shutdown_forced", note="second stop request while draining")
            self.request_stop()
            return
        timeout = self.config.operators.drain_timeout_s if timeout_s is None else timeout_s
        self._shutdown = asyncio.get_running_loop().create_task(self._drain_then_stop(timeout))

    async def _drain_then_stop(self, timeout_s: float) -> None:
        self.notifier.stopping(f"draining for up to {timeout_s:g} s")
        log.info("shutdown_draining", timeout_s=timeout_s, in_flight=self.drainer.in_flight)
        try:
            grace = self.config.operators.drain_grace_s
            outcome = await self.drainer.drain(timeout_s, ErrorCode.SHUTTING_DOWN, grace)
            log.info(
                "shutdown_drained",
                drained=outcome.drained,
                cancelled=outcome.cancelled,
                waited_s=round(outcome.waited_s, 3),
            )
        finally:
            self.request_stop()

    def reload(self) -> None:
        """Re-read the configuration file and apply what can change at run time
        (``basertd.server.ops.reload``; the ``[[workers]]`` tables one worker at a time,
        ``basertd.server.ops.worker_changes``) in a task; reloads run one after another. A file
        that does not validate, or a new worker table whose model or tokenizer does not load,
        changes nothing (logged ``reload_failed``)."""
        if self.config_path is None:
            log.warning("reload_skipped", reason="started without a configuration file")
            return
        if self.fleet is None or self.state is not DaemonState.READY:
            log.warning("reload_skipped", reason=f"the daemon is {self.state}")
            return
        task = asyncio.get_running_loop().create_task(self._reload(self.fleet), name="reload")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _reload(self, fleet: Fleet) -> None:
        async with fleet.changing:
            self.notifier.reloading()
            try:
                new = load_config(self.config_path)
                changes = worker_changes(self.config.workers, new.workers)
                prepared = await prepare_changes(fleet, changes, new.workers)
            except (ConfigError, ModelUnavailable, TokenizerError, OSError, ValueError) as exc:
                log.error("reload_failed", error=str(exc), note="the running configuration is unchanged")
                self.notifier.ready(self.status_line())
                return
            report, self.config = apply_reload(self.config, self.schedulers, new)
            fleet.config = self.config
            self.operators.operator_group = self.config.operators.operator_group
            await apply_changes(fleet, changes, prepared)
            self.metrics.reloads.inc()
            # a reload that left keys unapplied is worth a warning: the file and the daemon disagree
            (log.warning if report.needs_restart else log.info)(
                "reloaded",
                config=str(self.config_path),
                applied=report.applied,
                workers=[c.describe() for c in changes],
                not_reloaded=report.needs_restart,
                note="keys in not_reloaded need a restart" if report.needs_restart else "",
            )
            configure_logging(self.config.log_level)
            self.notifier.ready(self.status_line())

    def _cancel(self, req: GenerationRequest, code: ErrorCode, message: str) -> None:
        if self.frontend is not None:
            self.frontend.cancel(req, code=code, message=message)

    async def wait_stopped(self) -> None:
        """Wait until ``request_stop`` is called."""
        await self._stop.wait()

    async def stop(self) -> None:
        """Stop everything (module docstring). Idempotent; never raises."""
        if self.state in (DaemonState.STOPPING, DaemonState.STOPPED):
            return
        self.state = DaemonState.STOPPING
        self._stop.set()
        self.notifier.stopping("stopping")
        if self._shutdown is not None and self._shutdown is not asyncio.current_task():
            self._shutdown.cancel()
        if self.api is not None:
            self.api.stop_listening()
        if self.http is not None:
            self.http.stop_listening()
        # a reload mid-way: what it handed over fails with the rest
        await cancel_and_wait(list(self._reloads))
        if self.fleet is not None:
            for sched in self.fleet.schedulers:
                await sched.stop()
        if self.durability is not None:
            # what the stop failed with SHUTTING_DOWN stays unfinished in the log (hand-over);
            # every held reply is committed and sent before the connections close
            await self.durability.close()
        if self.http is not None:
            await self.http.stop()
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self.fleet is not None:
            await self.fleet.stop()
        if self.launched is not None:
            self.launched.abandon()  # workers spawned but never adopted; a journal never taken
        if self.api is not None:
            await self.api.stop()
        if self.frontend is not None:
            await self.frontend.close()
        self.metrics.close()
        with contextlib.suppress(Exception):  # export what is pending (the SDK's timeouts bound it)
            await asyncio.to_thread(self.metrics.tracing.close)
        if self.kv_events is not None:
            for m in self.fleet or []:
                m.cache.observe(None)
            self.kv_events.close()
            self.kv_events = None
        self.notifier.close()
        if self.workers_dir is not None:
            shutil.rmtree(self.workers_dir, ignore_errors=True)
        if self._created_runtime_dir and self.runtime_dir is not None:
            with contextlib.suppress(OSError):
                self.runtime_dir.rmdir()  # only when empty: never remove what others put there
        self.state = DaemonState.STOPPED
        log.info("daemon_stopped")


async def run(
    config: Config,
    *,
    ready: asyncio.Event | None = None,
    config_path: str | os.PathLike[str] | None = None,
    wal_recover: RecoverMode = "refuse",
    launched: Launch | None = None,
) -> int:
    """Run the daemon until it is told to stop; returns the exit status (0, or
    ``EXIT_JOURNAL_FAILED`` after a write-ahead log failure). Signals (DESIGN.md "Operators"):
    SIGTERM drains for ``[operators] drain_timeout_s`` then stops (a second SIGTERM stops at
    once); SIGINT stops at once; SIGHUP reloads ``config_path``. ``wal_recover``: what to do with a
    corrupt write-ahead log (``basertd.server.durability.wal_disk.open_journal``'s ``recover``).
    ``launched``: the start's first part, done already (``basertd.server.launch``; the daemon
    takes it over, and releases it whatever happens)."""
    daemon = Daemon(config, config_path=config_path, wal_recover=wal_recover, launched=launched)
    loop = asyncio.get_running_loop()
    installed = []
    handlers = {
        signal.SIGTERM: lambda: daemon.request_shutdown(drain=True),
        signal.SIGINT: daemon.request_stop,
        signal.SIGHUP: daemon.reload,
    }
    for sig, handler in handlers.items():
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handler)
            installed.append(sig)
    try:
        await daemon.start()
        if ready is not None:
            ready.set()
        await daemon.wait_stopped()
        log.info("daemon_stopping")
    finally:
        await daemon.stop()
        for sig in installed:
            loop.remove_signal_handler(sig)
    if daemon.exit_status:
        log.error("daemon_exit", exit_status=daemon.exit_status, reason=daemon.durability.failure)
    return daemon.exit_status
