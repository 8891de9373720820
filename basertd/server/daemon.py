"""``basertd serve``: wiring of config, supervisors, schedulers and the client API (issue 7).

``Daemon(config)`` owns, on one asyncio loop: the runtime directory (the client socket, and a
private 0700 ``workers/`` directory holding each worker's ``ipc://`` endpoint), one
``WorkerSlot`` (supervisor) and one ``Scheduler`` per configured worker, the coordinator-side
tokenizers, and the ``ApiServer``. It is the API's ``Service``: it validates and tokenizes each
Generate, routes it to the least busy worker, and answers the client and control requests.

``run(config)`` starts it, stops on SIGTERM/SIGINT, and on every exit path fails what is still
queued or running with SHUTTING_DOWN, closes every worker (SHUTDOWN, then SIGKILL after a grace
period; reaped), and removes the socket and the runtime files it created. The operators issue adds
drain, reload, systemd notification and metrics on top.
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
from basertd.schema import control
from basertd.schema.client import ErrorCode
from basertd.server.api import ApiServer, ClientConnection
from basertd.server.config import Config, WorkerConfig, resolve_runtime_dir, socket_path
from basertd.server.link import LinkError
from basertd.server.requests import AdmissionError, GenerationRequest, sampler_for, validate_generate
from basertd.server.scheduler import Scheduler, WorkerLimits
from basertd.server.supervisor import WorkerSlot
from basertd.server.tokenizer import Tokenizer, TokenizerError, make_tokenizer
from basertd.server.worker_proc import WorkerSpec

log = structlog.get_logger("basertd.daemon")

VERSION = "0.1.0"
WORKER_CLOSE_GRACE_S = 5.0


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


def model_path(worker: WorkerConfig) -> str:
    """The model file a llamacpp worker serves: its ``model`` key, else the default model
    (assembled once; raises ``basertd.models.ModelUnavailable`` when it cannot be)."""
    if worker.model:
        return str(Path(worker.model).expanduser())
    from basertd.models import default_model_path

    return str(default_model_path())


class _Sink:
    """Routes one generation's replies to its connection and forgets the request id once it ends."""

    __slots__ = ("conn", "request_id")

    def __init__(self, conn: ClientConnection, request_id: str) -> None:
        self.conn = conn
        self.request_id = request_id

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def send(self, msg: object) -> None:
        self.conn.send(msg)
        if isinstance(msg, (api.Done, api.Error)):
            self.conn.generations.pop(self.request_id, None)


class Daemon:
    """The coordinator (module docstring). ``start()`` then ``stop()``; ``stopped`` is set once
    ``request_stop()`` was called (a signal, or a test)."""

    def __init__(self, config: Config) -> None:
        self.config = config
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
        existed = bool(cfg.runtime_dir) and Path(cfg.runtime_dir).expanduser().is_dir()
        self.runtime_dir = resolve_runtime_dir(cfg)
        self._created_runtime_dir = bool(cfg.runtime_dir) and not existed
        self.socket = socket_path(cfg, self.runtime_dir)
        self.workers_dir = self.runtime_dir / f"workers-{os.getpid()}"
        self.workers_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.workers_dir, 0o700)
        tokenizer_cache: dict[tuple[str, str], Tokenizer] = {}
        for worker_id, wcfg in enumerate(cfg.workers):
            spec, tok_key, name = self._spec(worker_id, wcfg)
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
            sched = Scheduler(slot, limits, cfg.scheduler, cfg.cache)
            sched_holder.append(sched)
            self.slots.append(slot)
            self.schedulers.append(sched)
        for slot, sched in zip(self.slots, self.schedulers, strict=True):
            slot.start()
            self._tasks.append(
                asyncio.get_running_loop().create_task(sched.run(), name=f"scheduler-{slot.worker_id}")
            )
        self.api = ApiServer(self.socket, int(cfg.socket_mode), self)
        await self.api.start()
        self.state = "ready"
        log.info(
            "daemon_started",
            socket=str(self.socket),
            workers=len(self.slots),
            version=VERSION,
            pid=os.getpid(),
        )

    def _spec(self, worker_id: int, w: WorkerConfig) -> tuple[WorkerSpec, tuple[str, str], str]:
        """The worker spec, the tokenizer it implies (kind, path) and the model's served name."""
        common = dict(
            worker_id=worker_id,
            device=w.device,
            lanes=w.lanes,
            context_length=w.context_length,
            threads=w.threads,
            extra_args=tuple(w.engine_args),
            runtime_dir=str(self.workers_dir),
            start_timeout=120.0,
            log_level=self.config.log_level,
        )
        if w.engine == "llamacpp":
            path = model_path(w)
            return WorkerSpec(engine="llamacpp", model=path, **common), ("gguf", path), Path(path).stem
        lib = str(Path(w.model).expanduser()) if w.model else None
        ref = dict(w.ref_config) if w.ref_config else None
        name = Path(lib).stem if lib else "basert-ref"
        return WorkerSpec(engine="basert", lib=lib, ref_config=ref, **common), ("bytes", ""), name

    def request_stop(self) -> None:
        """Ask ``run`` to stop (signal handlers call this)."""
        self._stop.set()

    async def wait_stopped(self) -> None:
        """Wait until ``request_stop`` is called."""
        await self._stop.wait()

    async def stop(self) -> None:
        """Stop everything (module docstring). Idempotent; never raises."""
        if self.state in ("stopping", "stopped"):
            return
        self.state = "stopping"
        self._stop.set()
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

    def _add_bos(self, worker_id: int) -> bool:
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
                tokens = self.tokenizers[wid].encode(msg.text, add_bos=msg.add_special and self._add_bos(wid))
                conn.send(api.TokenizeResult(request_id=msg.request_id, tokens=tokens))
            elif isinstance(msg, api.Models):
                conn.send(api.ModelsResult(request_id=msg.request_id, models=self._models()))
            elif isinstance(msg, api.Health):
                ready = sum(1 for s in self.slots if s.state == "ready")
                status = self.state
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
                await self._control(conn, msg)
        except AdmissionError as exc:
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
        if rid in conn.generations:
            raise AdmissionError(
                ErrorCode.INVALID_REQUEST, f"request id {rid!r} is already running on this connection"
            )
        validate_generate(gen)
        wid = self._route(gen.model)
        tok = self.tokenizers[wid]
        if gen.prompt is not None:
            prompt = tok.encode(gen.prompt, add_bos=self._add_bos(wid))
        else:
            prompt = list(gen.prompt_tokens or [])
            bad = [t for t in prompt if not 0 <= t < tok.vocab_size]
            if bad:
                raise AdmissionError(
                    ErrorCode.INVALID_REQUEST,
                    f"prompt_tokens hold ids outside the vocabulary (0..{tok.vocab_size - 1})",
                )
        sched = self.schedulers[wid]
        sched.check_admission(len(prompt), gen.max_tokens, gen.qos)
        req = GenerationRequest(
            request_id=rid,
            prompt=prompt,
            max_tokens=gen.max_tokens,
            sampler=sampler_for(gen),
            sink=_Sink(conn, rid),
            tokenizer=tok,
            stop=list(gen.stop),
            qos=gen.qos,
            stream=gen.stream,
        )
        conn.generations[rid] = req
        self.requests_total += 1
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

    # --- control -----------------------------------------------------------------------------

    async def _pong(self, i: int) -> Any:
        proc = self.slots[i].proc
        if proc is None or not proc.link.alive:
            return None
        try:
            return await proc.link.ping(timeout=1.0)
        except LinkError:
            return None

    async def _control(self, conn: ClientConnection, msg: Any) -> None:
        rid = getattr(msg, "request_id", "")
        now = time.monotonic()
        if isinstance(msg, control.Status):
            conn.send(
                control.StatusResult(
                    request_id=rid,
                    version=VERSION,
                    state=self.state,
                    uptime_s=now - self.started_at,
                    workers_ready=sum(1 for s in self.slots if s.state == "ready"),
                    workers_total=len(self.slots),
                    lanes_busy=sum(s.busy_lanes for s in self.schedulers),
                    lanes_max=sum(s.limits.max_lanes for s in self.schedulers),
                    queued=sum(len(s.queues) for s in self.schedulers),
                    requests_total=self.requests_total,
                )
            )
        elif isinstance(msg, control.Workers):
            pongs = await asyncio.gather(*(self._pong(i) for i in range(len(self.slots))))
            rows = []
            for i, (slot, sched, pong) in enumerate(zip(self.slots, self.schedulers, pongs, strict=True)):
                stats = getattr(pong, "stats", None) or {}
                rows.append(
                    control.WorkerRow(
                        worker_id=i,
                        engine=self.config.workers[i].engine,
                        model=self.model_names[i],
                        state=slot.state,
                        pid=slot.proc.pid if slot.proc is not None else 0,
                        lanes_busy=sched.busy_lanes,
                        lanes_max=sched.limits.max_lanes,
                        queue_depth=len(sched.queues),
                        respawns=slot.respawns,
                        pool_used_bytes=int(stats.get("pool_bytes_used", 0)),
                        pool_total_bytes=int(stats.get("pool_bytes_total", 0)),
                        ticks_run=sched.ticks_run,
                        engine_lanes=int(stats.get("live_lanes", 0)),
                        seed_leases=int(stats.get("live_seed_leases", 0)),
                    )
                )
            conn.send(control.WorkersResult(request_id=rid, workers=rows))
        elif isinstance(msg, control.Lanes):
            rows = [
                control.LaneRow(
                    worker_id=sched.worker_id,
                    lane_tag=lane.tag,
                    request_id=lane.request.request_id,
                    qos=lane.request.qos,
                    state=lane.phase,
                    prompt_tokens=lane.prompt_len,
                    generated_tokens=len(lane.request.generated),
                    cached_tokens=lane.request.cached_tokens,
                    age_s=now - lane.admitted_at,
                )
                for sched in self.schedulers
                if msg.worker_id in (None, sched.worker_id)
                for lane in sched.lanes.values()
            ]
            conn.send(control.LanesResult(request_id=rid, lanes=rows))
        elif isinstance(msg, control.Queue):
            totals: dict[str, list[float]] = {}
            for sched in self.schedulers:
                for qos, depth, wait in sched.queue_rows(now):
                    t = totals.setdefault(qos, [0, 0.0])
                    t[0] += depth
                    t[1] = max(t[1], wait)
            rows = [control.QueueRow(qos=q, depth=int(d), oldest_wait_s=w) for q, (d, w) in totals.items()]
            conn.send(control.QueueResult(request_id=rid, classes=rows))
        elif isinstance(msg, control.CacheStats):
            pongs = await asyncio.gather(*(self._pong(i) for i in range(len(self.slots))))
            rows = []
            for i, pong in enumerate(pongs):
                stats = getattr(pong, "stats", None) or {}
                rows.append(
                    control.CacheStatsRow(
                        worker_id=i,
                        entries=int(stats.get("cache_entries", 0)),
                        bytes=int(stats.get("cache_bytes", 0)),
                        evictions=int(stats.get("evictions_total", 0)),
                    )
                )
            conn.send(control.CacheStatsResult(request_id=rid, workers=rows))
        else:
            verb = type(msg).__name__
            conn.send(
                api.Error(
                    code=ErrorCode.INVALID_REQUEST,
                    request_id=rid,
                    message=f"control verb {verb!r} is not served by this version (see the operators issue)",
                )
            )


async def run(config: Config, *, ready: asyncio.Event | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT (or ``request_stop``); returns the exit status (0)."""
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, daemon.request_stop)
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
