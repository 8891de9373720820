"""``basertd serve``: wiring of config, supervisors, schedulers and the client API (issue 7).

``Daemon(config)`` owns, on one asyncio loop: the runtime directory (the client socket, and a
private 0700 ``workers/`` directory holding each worker's ``ipc://`` endpoint), one
``WorkerSlot`` (supervisor) and one ``Scheduler`` per configured worker, the coordinator-side
tokenizers, and the ``ApiServer``. It is the API's ``Service``: it validates and tokenizes each
Generate, routes it to the least busy worker, and answers the client and control requests.

``run(config)`` starts it and serves until told to stop; on every exit path it fails what is still
queued or running with SHUTTING_DOWN, closes every worker (SHUTDOWN, then SIGKILL after a grace
period; reaped), and removes the socket and the runtime files it created.

Operators (issue 9, DESIGN.md "Operators"): SIGTERM drains first (``basertd.server.drain``: new
requests refused, in-flight ones finish within ``[operators] drain_timeout_s``, the rest are
cancelled typed) and then stops, exit status 0; a second SIGTERM, or SIGINT, stops at once. SIGHUP
reloads the configuration file (``basertd.server.reload``). Control verbs are answered by
``basertd.server.control`` behind the peer-credential guard; every accepted request is observed
for metrics and the access log (``basertd.server.access``); systemd gets READY=1 once every worker
has handshaken, STATUS= lines and watchdog pings, and the client socket may come from
``LISTEN_FDS`` (``basertd.server.notify``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.server.access import ObservedSink
from basertd.server.api import ApiServer, ClientConnection
from basertd.server.cache_policy import PolicyCacheControl, route
from basertd.server.config import (
    Config,
    ConfigError,
    load_config,
    resolve_runtime_dir,
    socket_path,
)
from basertd.server.control import CacheControl, ControlService, EngineCache, worker_stats
from basertd.server.drain import Drainer
from basertd.server.metrics import Metrics, live_state
from basertd.server.notify import Notifier, Watchdog, adopt_listener, listen_fds, watchdog_interval
from basertd.server.peercred import OperatorPolicy
from basertd.server.reload import apply_reload
from basertd.server.requests import (
    QOS_CLASSES,
    AdmissionError,
    GenerationRequest,
    sampler_for,
    validate_generate,
)
from basertd.server.runtime_files import remove_stale_worker_dirs
from basertd.server.scheduler import Scheduler, WorkerLimits
from basertd.server.supervisor import WorkerSlot
from basertd.server.tokenizer import Tokenizer, TokenizerError, make_tokenizer
from basertd.server.worker_specs import worker_spec

log = structlog.get_logger("basertd.daemon")

VERSION = "0.1.0"
WORKER_CLOSE_GRACE_S = 5.0
STATUS_INTERVAL_S = 2.0
"""Seconds between systemd STATUS= updates (sent only when the line changed)."""


def configure_logging(level: str = "info") -> None:
    """structlog JSON lines on stderr at ``level`` (content-free: no prompt text is ever logged)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


class Daemon:
    """The coordinator (module docstring). ``start()`` then ``stop()``; ``stopped`` is set once
    ``request_stop()`` was called (a signal, or a test). ``config_path`` is the file a reload
    (SIGHUP) reads again (None: nothing to reload).

    Operator state: ``metrics`` (the registry), ``drainer`` (drain state, in-flight requests),
    ``operators`` (who may use control verbs), ``control`` (the verbs), ``cache_control`` (the
    prefix-cache verbs' backend: ``EngineCache`` until ``start`` installs the prefix-cache policy,
    ``basertd.server.cache_policy.PolicyCacheControl``) and ``notifier`` (systemd)."""

    def __init__(self, config: Config, *, config_path: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.version = VERSION
        self.metrics = Metrics()
        self.drainer = Drainer(self._cancel)
        self.operators = OperatorPolicy(config.operators.operator_group)
        self.control = ControlService(self)
        self.cache_control: CacheControl = EngineCache(self)
        self.notifier = Notifier.from_env()
        self._watchdog_interval = watchdog_interval()
        self._listen_fds = listen_fds()
        self._shutdown: asyncio.Task | None = None
        self._status_line = ""
        self.runtime_dir: Path | None = None
        self.socket: Path | None = None
        self.workers_dir: Path | None = None
        self.slots: list[WorkerSlot] = []
        self.schedulers: list[Scheduler] = []
        self.tokenizers: list[Tokenizer] = []
        self.model_names: list[str] = []
        self.api: ApiServer | None = None
        self.started_at = time.monotonic()
        self.requests_total = 0
        self.state = "starting"
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self._created_runtime_dir = False
        self._bos: dict[int, bool] = {}

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
        planned = resolve_runtime_dir(cfg, create=False)
        existed = planned.is_dir()
        self.runtime_dir = resolve_runtime_dir(cfg)
        # Remove at exit only a directory this daemon created (an empty one, see stop()).
        self._created_runtime_dir = not existed and self.runtime_dir == planned
        self.socket = socket_path(cfg, self.runtime_dir)
        inherited = adopt_listener(self._listen_fds)
        if inherited is not None:
            self.socket = Path(inherited.getsockname())
        self.workers_dir = self.runtime_dir / f"workers-{os.getpid()}"
        remove_stale_worker_dirs(self.runtime_dir)  # left by a coordinator killed with SIGKILL
        self.workers_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.workers_dir, 0o700)
        tokenizer_cache: dict[tuple[str, str], Tokenizer] = {}
        for worker_id, wcfg in enumerate(cfg.workers):
            spec, tok_key, name = worker_spec(
                worker_id, wcfg, runtime_dir=str(self.workers_dir), log_level=cfg.log_level
            )
            if tok_key not in tokenizer_cache:
                tokenizer_cache[tok_key] = await asyncio.to_thread(make_tokenizer, *tok_key)
            self.tokenizers.append(tokenizer_cache[tok_key])
            self.model_names.append(name)
            sched_holder: list[Scheduler] = []
            slot = WorkerSlot(
                spec,
                close_grace_s=WORKER_CLOSE_GRACE_S,
                on_give_up=lambda err, h=sched_holder: h and h[0].on_give_up(err),
            )
            limits = WorkerLimits(
                context_length=wcfg.context_length,
                max_lanes=wcfg.lanes,
                max_batch_size=wcfg.lanes,
                page_tokens=1,
                kv_tokens=wcfg.lanes * wcfg.context_length,
                max_admit_tokens=spec.prompt_ring.slots * ((spec.prompt_ring.slot_bytes - 16) // 4) // 2,
            )
            sched = Scheduler(
                slot, limits, cfg.scheduler, cfg.cache, metrics=self.metrics, tokenizer=self.tokenizers[-1]
            )
            sched_holder.append(sched)
            self.slots.append(slot)
            self.schedulers.append(sched)
        self.cache_control = PolicyCacheControl(
            self.schedulers, lambda i: worker_stats(self, i), self._counter
        )  # the prefix-cache policy (issue 8) serves every cache verb
        for slot, sched in zip(self.slots, self.schedulers, strict=True):
            slot.start()
            self._tasks.append(
                asyncio.get_running_loop().create_task(sched.run(), name=f"scheduler-{slot.worker_id}")
            )
        self.api = ApiServer(
            self.socket, int(cfg.socket_mode), self, sock=inherited, limits=cfg.limits, metrics=self.metrics
        )
        await self.api.start()
        self.metrics.bind(lambda: live_state(self), VERSION)
        address = cfg.operators.metrics_address()
        if address is not None:
            self.metrics.serve_http(*address)
        self.state = "ready"
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._notify_ready(), name="sd-notify"))
        if self._watchdog_interval is not None:
            watchdog = Watchdog(
                self.notifier, self._watchdog_interval, lambda: [s.heartbeat for s in self.schedulers]
            )
            for sched in self.schedulers:
                sched.heartbeat.interval = min(sched.heartbeat.interval, self._watchdog_interval / 4)
            self._tasks.append(loop.create_task(watchdog.run(), name="sd-watchdog"))
        log.info(
            "daemon_started",
            socket=str(self.socket),
            socket_inherited=inherited is not None,
            workers=len(self.slots),
            version=VERSION,
            pid=os.getpid(),
            uid=os.geteuid(),
            operator_group=cfg.operators.operator_group,
            watchdog_s=self._watchdog_interval,
        )

    async def _notify_ready(self) -> None:
        """READY=1 once every worker has handshaken, then a STATUS= line whenever it changes."""
        while not all(slot.state == "ready" for slot in self.slots):
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
        """The one-line summary systemd shows (``systemctl status``): state, workers, lanes, queue."""
        ready = sum(1 for s in self.slots if s.state == "ready")
        busy = sum(s.busy_lanes for s in self.schedulers)
        lanes = sum(s.limits.max_lanes for s in self.schedulers)
        queued = {q: sum(s.queues.depth(q) for s in self.schedulers) for q in QOS_CLASSES}
        per_class = ", ".join(f"{q} {n}" for q, n in queued.items())
        return (
            f"{self.public_state()}: workers {ready}/{len(self.slots)}, lanes {busy}/{lanes} busy, "
            f"queued {sum(queued.values())} ({per_class}), in flight {self.drainer.in_flight}"
        )

    def publish_status(self) -> None:
        """Send the STATUS= line to systemd if it changed."""
        line = self.status_line()
        if line != self._status_line:
            self._status_line = line
            self.notifier.status(line)

    def public_state(self) -> str:
        """``starting``, ``ready``, ``draining``, ``stopping`` or ``stopped`` (Status and Health)."""
        if self.state == "ready" and self.drainer.draining:
            return "draining"
        return self.state

    def request_stop(self) -> None:
        """Ask ``run`` to stop now (what is in flight fails with SHUTTING_DOWN)."""
        self._stop.set()

    def request_shutdown(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop, draining first for ``timeout_s`` seconds (default ``[operators] drain_timeout_s``)
        when ``drain``. A second request while a drain runs stops at once."""
        if not drain or self._shutdown is not None or self.state != "ready":
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
            outcome = await self.drainer.drain(timeout_s, ErrorCode.SHUTTING_DOWN)
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
        (``basertd.server.reload``); a file that does not validate changes nothing (logged)."""
        if self.config_path is None:
            log.warning("reload_skipped", reason="started without a configuration file")
            return
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload_failed", error=str(exc), note="the running configuration is unchanged")
            self.notifier.ready(self.status_line())
            return
        report = apply_reload(self, new)
        self.operators.operator_group = self.config.operators.operator_group
        self.metrics.reloads.inc()
        # a reload that left keys unapplied is worth a warning: the file and the daemon disagree
        (log.warning if report.needs_restart else log.info)(
            "reloaded",
            config=str(self.config_path),
            applied=report.applied,
            not_reloaded=report.needs_restart,
            note="keys in not_reloaded need a restart" if report.needs_restart else "",
        )
        configure_logging(self.config.log_level)
        self.notifier.ready(self.status_line())

    def _cancel(self, req: GenerationRequest, code: ErrorCode, message: str) -> None:
        if req.worker_id is not None:
            self.schedulers[req.worker_id].cancel(req, code=code, message=message)

    async def wait_stopped(self) -> None:
        """Wait until ``request_stop`` is called."""
        await self._stop.wait()

    async def stop(self) -> None:
        """Stop everything (module docstring). Idempotent; never raises."""
        if self.state in ("stopping", "stopped"):
            return
        self.state = "stopping"
        self._stop.set()
        self.notifier.stopping("stopping")
        if self._shutdown is not None and self._shutdown is not asyncio.current_task():
            self._shutdown.cancel()
        if self.api is not None:
            self.api.stop_listening()
        for sched in self.schedulers:
            await sched.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await asyncio.gather(*(slot.stop() for slot in self.slots), return_exceptions=True)
        if self.api is not None:
            await self.api.stop()
        for tok in {id(t): t for t in self.tokenizers}.values():
            close = getattr(tok, "close", None)
            if close is not None:
                close()
        self.metrics.close()
        self.notifier.close()
        if self.workers_dir is not None:
            shutil.rmtree(self.workers_dir, ignore_errors=True)
        if self._created_runtime_dir and self.runtime_dir is not None:
            with contextlib.suppress(OSError):
                self.runtime_dir.rmdir()  # only when empty: never remove what others put there
        self.state = "stopped"
        log.info("daemon_stopped")

    # --- routing -----------------------------------------------------------------------------

    def _route(self, model: str) -> int:
        """The worker a new request goes to: among those serving ``model`` ("" = any), the least
        loaded one that has not given up (any, if all have)."""
        ids = [i for i, name in enumerate(self.model_names) if model in ("", name)]
        if not ids:
            raise AdmissionError(ErrorCode.NOT_FOUND, f"model {model!r} is not served here")
        alive = [i for i in ids if not self.slots[i].given_up] or ids
        return min(alive, key=lambda i: self.schedulers[i].load())

    def _route_prefix(self, wid: int, prompt: list[int]) -> int:
        """Among the live workers serving the same model with the same vocabulary as ``wid``, the
        one holding the longest cached prefix of ``prompt``, unless it is much busier
        (``cache_policy.route``, ``[cache] route_slack``)."""
        peers = [
            i
            for i, name in enumerate(self.model_names)
            if name == self.model_names[wid]
            and self.tokenizers[i] is self.tokenizers[wid]
            and not self.slots[i].given_up
        ]
        if len(peers) < 2:
            return wid
        options = [(i, self.schedulers[i].cached_prefix(prompt), self.schedulers[i].load()) for i in peers]
        return route(options, self.config.cache.route_slack)

    def _counter(self, name: str, worker_id: int) -> int:
        value = self.metrics.registry.get_sample_value(name, {"worker": str(worker_id)})
        return int(value or 0)

    def add_bos(self, worker_id: int) -> bool:
        """Whether prompts for this worker start with BOS: the capability record of its current (or
        last) incarnation, else what the vocabulary itself says."""
        proc = self.slots[worker_id].proc
        if proc is not None:
            self._bos[worker_id] = bool(proc.capabilities.add_bos)
        known = self._bos.get(worker_id)
        return self.tokenizers[worker_id].add_bos if known is None else known

    # --- Service ---------------------------------------------------------------------------------

    async def handle(self, conn: ClientConnection, msg: Any) -> None:
        """Answer one request (``basertd.server.api.Service``)."""
        try:
            if isinstance(msg, api.Generate):
                self._generate(conn, msg)
            elif isinstance(msg, api.Cancel):
                req = conn.generations.get(msg.request_id)
                if req is not None:
                    self.schedulers[req.worker_id].cancel(req)
            elif isinstance(msg, api.Tokenize):
                wid = self._route(msg.model)
                tokens = self.tokenizers[wid].encode(msg.text, add_bos=msg.add_special and self.add_bos(wid))
                conn.send(api.TokenizeResult(request_id=msg.request_id, tokens=tokens))
            elif isinstance(msg, api.Models):
                conn.send(api.ModelsResult(request_id=msg.request_id, models=self._models()))
            elif isinstance(msg, api.Health):
                ready = sum(1 for s in self.slots if s.state == "ready")
                status = self.public_state()
                if status == "ready":
                    status = "ok" if ready == len(self.slots) else ("degraded" if ready else "starting")
                conn.send(
                    api.HealthResult(
                        request_id=msg.request_id,
                        status=status,
                        workers_ready=ready,
                        workers_total=len(self.slots),
                        version=VERSION,
                    )
                )
            else:
                await self.control.handle(conn, msg)
        except AdmissionError as exc:
            if isinstance(msg, api.Generate):
                self.metrics.admission_error(exc.code)
            conn.send(
                api.Error(code=exc.code, request_id=getattr(msg, "request_id", ""), message=exc.message)
            )
        except TokenizerError as exc:
            conn.send(
                api.Error(
                    code=ErrorCode.INVALID_REQUEST,
                    request_id=getattr(msg, "request_id", ""),
                    message=str(exc),
                )
            )

    def _generate(self, conn: ClientConnection, gen: api.Generate) -> None:
        rid = gen.request_id
        if self.state != "ready":
            raise AdmissionError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        refusal = self.drainer.refusal()
        if refusal is not None:
            raise AdmissionError(*refusal)
        if rid in conn.generations:
            raise AdmissionError(
                ErrorCode.INVALID_REQUEST, f"request id {rid!r} is already running on this connection"
            )
        validate_generate(gen)
        wid = self._route(gen.model)
        tok = self.tokenizers[wid]
        if gen.prompt is not None:
            prompt = tok.encode(gen.prompt, add_bos=self.add_bos(wid))
        else:
            prompt = list(gen.prompt_tokens or [])
            bad = [t for t in prompt if not 0 <= t < tok.vocab_size]
            if bad:
                raise AdmissionError(
                    ErrorCode.INVALID_REQUEST,
                    f"prompt_tokens hold ids outside the vocabulary (0..{tok.vocab_size - 1})",
                )
        wid = self._route_prefix(wid, prompt)
        sched = self.schedulers[wid]
        sched.check_admission(len(prompt), gen.max_tokens, gen.qos)
        sink = ObservedSink(conn, rid, self.metrics, self.drainer)
        req = GenerationRequest(
            request_id=rid,
            prompt=prompt,
            max_tokens=gen.max_tokens,
            sampler=sampler_for(gen),
            sink=sink,
            tokenizer=tok,
            stop=list(gen.stop),
            qos=gen.qos,
            stream=gen.stream,
        )
        conn.generations[rid] = req
        self.requests_total += 1
        sink.attach(req)
        conn.send(api.Accepted(request_id=rid, prompt_tokens=len(prompt), seed=req.sampler.seed))
        sched.submit(req)

    def connection_lost(self, conn: ClientConnection) -> None:
        """Cancel every generation of a gone client (its lanes retire in the next plan)."""
        for req in list(conn.generations.values()):
            if req.worker_id is not None:
                self.schedulers[req.worker_id].cancel(req, message="client disconnected")
        conn.generations.clear()

    def _models(self) -> list[api.ModelInfo]:
        out: dict[str, api.ModelInfo] = {}
        for i, name in enumerate(self.model_names):
            info = out.get(name)
            if info is None:
                w = self.config.workers[i]
                info = out[name] = api.ModelInfo(
                    id=name,
                    engine=w.engine,
                    context_length=self.schedulers[i].limits.context_length,
                    vocab_size=self.tokenizers[i].vocab_size,
                )
            info.workers += 1
        return list(out.values())


async def run(
    config: Config,
    *,
    ready: asyncio.Event | None = None,
    config_path: str | os.PathLike[str] | None = None,
) -> int:
    """Run the daemon until it is told to stop; returns the exit status (0). Signals (issue 9):
    SIGTERM drains for ``[operators] drain_timeout_s`` then stops (a second SIGTERM stops at
    once); SIGINT stops at once; SIGHUP reloads ``config_path``."""
    daemon = Daemon(config, config_path=config_path)
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
    return 0
