"""The control API: handlers of every ``basertctl`` verb and their peer-credential guard.

``ControlService(host).handle(conn, msg)`` answers one ``basertd.schema.control`` request on the
client socket (DESIGN.md "Operators"). Before any handler runs, the peer's kernel credentials
(``conn.credentials``, SO_PEERCRED / SO_PEERGROUPS) must satisfy the daemon's
``OperatorPolicy`` (root, the daemon's user, the ``[operators] operator_group``); anyone else gets
``Error(PERMISSION_DENIED)``, one ``control_denied`` warning in the log and a count in
``basertd_control_denied_total``, and nothing changes. Generation stays open to whoever can open
the socket (its mode and group decide that).

Handlers raise ``ControlError(code, message)`` for refusals (NOT_FOUND for an unknown worker or
pin, INVALID_REQUEST for bad arguments, SHUTTING_DOWN while stopping); ``handle`` turns it into
``Error`` and never lets anything else escape as a traceback.

The handlers see the daemon only through ``ControlHost``, a narrow protocol (the daemon satisfies
it); the prefix-cache verbs go through ``CacheControl``, served by the prefix-cache policy
(``basertd.server.ops.cache_verbs.PolicyCacheControl``). ``config check`` reads its file off the event
loop and refuses anything but a regular file (a named pipe would block the read forever).
"""

from __future__ import annotations

import asyncio
import grp
import math
import os
import stat
import time
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.client import ErrorCode
from basertd.server.config import Config, ConfigError, parse_config
from basertd.server.config_sections import DEFAULT_KV_LAYOUT
from basertd.server.observe.overview import Header, ServedWorker, lane_row, overview
from basertd.server.observe.windows import HISTORY_S
from basertd.server.ops import worker_changes
from basertd.server.ops.control_errors import ControlError
from basertd.server.ops.reload import config_changes
from basertd.server.states import DaemonState

if TYPE_CHECKING:
    from basertd.server.fleet import Fleet, Member
    from basertd.server.frontend.drain import Drainer
    from basertd.server.observe.metrics import Metrics
    from basertd.server.transport.peercred import OperatorPolicy
    from basertd.server.transport.socket_server import ClientConnection

log = structlog.get_logger("basertd.control")

MAX_CONFIG_BYTES = 1 << 20
"""Largest configuration file ``config check`` reads."""
RESTART_TIMEOUT_S = 180.0
"""Seconds ``restart-worker`` waits for the new incarnation to handshake."""
STOP_TIMEOUT_HINT_S = 90.0
"""TimeoutStopSec of the shipped basertd.service; a drain timeout near it gets a warning."""


@dataclass(frozen=True, slots=True)
class Verb:
    """One control verb: basertctl's ``name`` of it (for messages, logs and metric labels), its
    ``handler`` (the request in, the reply out; raises ``ControlError``) and whether it only
    reads (``view``: no log line per call)."""

    name: str
    handler: Callable[[Any], Awaitable[Any]]
    view: bool = False


class CacheControl(Protocol):
    """What the prefix-cache verbs need (implemented by ``cache_verbs.PolicyCacheControl`` over
    each worker's prefix-cache policy). Worker ids are validated by the caller; methods raise
    ``ControlError``."""

    async def stats(self) -> list[control.CacheStatsRow]:
        """One row per worker: entries, bytes (pinned among them), hits / misses, cached tokens,
        evictions and evicted bytes."""
        ...

    async def entries(self, worker_id: int | None, limit: int) -> list[control.CacheEntryRow]:
        """Cached prefixes of ``worker_id`` (None: all), most recently used first, at most
        ``limit``."""
        ...

    async def pin(self, tokens_by_worker: dict[int, list[int]]) -> control.CachePinResult:
        """Pin the given prefix (token ids, per worker) in the protected cache class; one pin id
        covers every worker named."""
        ...

    async def unpin(self, pin_id: int) -> None:
        """Drop pin ``pin_id`` (``ControlError(NOT_FOUND)`` if unknown)."""
        ...

    async def evict(self, worker_id: int | None, bytes_target: int) -> control.CacheEvictResult:
        """Evict unpinned prefixes: up to ``bytes_target`` bytes (0: all unpinned) per worker."""
        ...


class ControlHost(Protocol):
    """What the control verbs need of the daemon (``basertd.server.daemon.Daemon`` is one)."""

    config: Config
    version: str
    started_at: float
    metrics: Metrics
    operators: OperatorPolicy
    drainer: Drainer
    fleet: Fleet
    cache_control: CacheControl

    @property
    def state(self) -> str: ...

    @property
    def requests_total(self) -> int: ...

    def public_state(self) -> str: ...

    def publish_status(self) -> None: ...

    def request_shutdown(self, *, drain: bool = True, timeout_s: float | None = None) -> None: ...


def _kv_layout(member: Member) -> str:
    """The KV layout the worker's running engine reports (capability ``extra["kv_layout"]``), else
    the one configured for a llamacpp worker; "" for other engines."""
    proc = member.slot.proc
    if proc is not None and "kv_layout" in proc.capabilities.extra:
        return str(proc.capabilities.extra["kv_layout"])
    return (member.config.kv_layout or DEFAULT_KV_LAYOUT) if member.config.engine == "llamacpp" else ""


def _worker_ids(fleet: Fleet, worker_id: int | None) -> list[int]:
    try:
        return fleet.worker_ids(worker_id)
    except LookupError as exc:
        raise ControlError(ErrorCode.NOT_FOUND, str(exc)) from None


def read_config_file(path: str) -> str:
    """The text of the configuration file ``path``. Raises ``OSError`` (or ``ValueError``) for
    anything but a readable regular file of at most ``MAX_CONFIG_BYTES`` UTF-8 bytes; opening
    never blocks (O_NONBLOCK: a FIFO is refused, not waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise OSError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8")


def _timeout(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ControlError(ErrorCode.INVALID_REQUEST, f"timeout must be a finite number >= 0, got {value}")
    return value


def check_config_text(text: str, source: str, running: Config | None = None) -> control.ConfigCheckResult:
    """Validate configuration ``text`` (TOML) without applying it. Errors: anything
    ``basertd serve`` would refuse (the key is named). Warnings: model and draft model files that
    do not exist, a socket open to others, an operator group unknown to this system, a drain
    timeout that does not fit the unit's TimeoutStopSec, and, against the ``running``
    configuration, which changed keys a reload (SIGHUP) applies and which need a restart."""
    try:
        cfg = parse_config(tomllib.loads(text), source=source)
    except tomllib.TOMLDecodeError as exc:
        return control.ConfigCheckResult(ok=False, errors=[f"{source}: invalid TOML: {exc}"])
    except ConfigError as exc:
        return control.ConfigCheckResult(ok=False, errors=exc.errors)
    warnings = []
    for i, w in enumerate(cfg.workers):
        if w.model and not Path(w.model).expanduser().exists():
            warnings.append(f"workers[{i}].model: {w.model} does not exist (here)")
        if w.draft_model and not Path(w.draft_model).expanduser().exists():
            warnings.append(f"workers[{i}].draft_model: {w.draft_model} does not exist (here)")
    draft = cfg.speculation.draft_model
    if draft and not Path(draft).expanduser().exists():
        warnings.append(f"speculation.draft_model: {draft} does not exist (here)")
    if int(cfg.socket_mode) & 0o007:
        warnings.append(f"socket_mode {int(cfg.socket_mode):04o} lets every local user generate")
    group = cfg.operators.operator_group
    if group:
        try:
            grp.getgrnam(group)
        except KeyError:
            warnings.append(f"operators.operator_group: no group {group!r} on this system")
    if cfg.operators.drain_timeout_s + 10 > STOP_TIMEOUT_HINT_S:
        warnings.append(
            f"operators.drain_timeout_s {cfg.operators.drain_timeout_s:g} s: raise TimeoutStopSec of "
            f"basertd.service above {cfg.operators.drain_timeout_s + 10:g} s"
        )
    if running is not None:
        changes = config_changes(running, cfg)
        if changes.applied:
            warnings.append("a reload (SIGHUP) applies: " + ", ".join(changes.applied))
        if changes.needs_restart:
            warnings.append("changed, needs a restart: " + ", ".join(changes.needs_restart))
    return control.ConfigCheckResult(ok=True, warnings=warnings)


class ControlService:
    """Answers control verbs for one daemon (module docstring): one ``Verb`` per request type
    (``verbs``), as ``basertd.server.transport.native_api.NativeService`` does for client frames."""

    def __init__(self, host: ControlHost) -> None:
        self.d = host
        self.verbs: dict[type, Verb] = {
            control.Status: Verb("status", self._status, view=True),
            control.Workers: Verb("workers", self._workers, view=True),
            control.Lanes: Verb("lanes", self._lanes, view=True),
            control.Queue: Verb("queue", self._queue, view=True),
            control.CacheStats: Verb("cache stats", self._cache_stats, view=True),
            control.CacheList: Verb("cache ls", self._cache_list, view=True),
            control.CachePin: Verb("cache pin", self._cache_pin),
            control.CacheUnpin: Verb("cache unpin", self._cache_unpin),
            control.CacheEvict: Verb("cache evict", self._cache_evict),
            control.Drain: Verb("drain", self._drain),
            control.Resume: Verb("resume", self._resume),
            control.RestartWorker: Verb("restart-worker", self._restart_worker),
            control.Metrics: Verb("metrics", self._metrics, view=True),
            control.Shutdown: Verb("shutdown", self._shutdown),
            control.ConfigCheck: Verb("config check", self._config_check),
            control.Overview: Verb("overview", self._overview, view=True),
        }
        """The handler of each control request type (``verbs[type(msg)]``)."""

    async def handle(self, conn: ClientConnection, msg: Any) -> None:
        """Check the peer, run the verb's handler (``verbs``), send its result or a typed ``Error``."""
        rid = getattr(msg, "request_id", "")
        entry = self.verbs.get(type(msg))
        if entry is None:
            conn.send(
                api.Error(
                    code=ErrorCode.INVALID_REQUEST,
                    request_id=rid,
                    message=f"{type(msg).__name__} is not a request this daemon serves",
                )
            )
            return
        verb = entry.name
        peer = conn.credentials
        if not self.d.operators.allows(peer):
            log.warning("control_denied", verb=verb, uid=peer.uid, gid=peer.gid, pid=peer.pid)
            self.d.metrics.control_denied(verb)
            conn.send(
                api.Error(
                    code=ErrorCode.PERMISSION_DENIED,
                    request_id=rid,
                    message=f"{verb} is for {self.d.operators.describe()}; you are {peer.describe()}",
                )
            )
            return
        try:
            reply = await entry.handler(msg)
        except ControlError as exc:
            conn.send(api.Error(code=exc.code, request_id=rid, message=exc.message))
            return
        except Exception as exc:  # a handler bug: typed error to the operator, traceback to the log
            log.exception("control_failed", verb=verb)
            conn.send(api.Error(code=ErrorCode.INTERNAL, request_id=rid, message=f"{verb} failed: {exc!r}"))
            return
        reply.request_id = rid
        conn.send(reply)
        if not entry.view:
            log.info("control", verb=verb, uid=peer.uid, pid=peer.pid)

    def _check_running(self) -> None:
        if self.d.state in (DaemonState.STOPPING, DaemonState.STOPPED):
            raise ControlError(ErrorCode.SHUTTING_DOWN, "basertd is shutting down")

    # --- views -----------------------------------------------------------------------------------

    async def _status(self, msg: control.Status) -> control.StatusResult:
        d = self.d
        t = d.fleet.totals()
        return control.StatusResult(
            version=d.version,
            state=d.public_state(),
            uptime_s=time.monotonic() - d.started_at,
            workers_ready=t.ready,
            workers_total=t.total,
            lanes_busy=t.lanes_busy,
            lanes_max=t.lanes_max,
            queued=t.queued,
            requests_total=d.requests_total,
            problems=d.fleet.problems(),
            speculation=[
                control.SpeculationRow(
                    strategy=name,
                    drafted_tokens=dr,
                    accepted_tokens=ac,
                    acceptance_rate=ac / dr if dr else 0.0,
                )
                for name, (dr, ac) in sorted(t.speculation.items())
            ],
        )

    async def _workers(self, msg: control.Workers) -> control.WorkersResult:
        d = self.d
        all_stats = await asyncio.gather(*(d.fleet.worker_stats(i) for i in range(len(d.fleet))))
        rows = []
        for m, snap, stats in zip(d.fleet, d.fleet.snapshots(), all_stats, strict=True):
            stats = stats or {}
            rows.append(
                control.WorkerRow(
                    worker_id=snap.worker_id,
                    engine=m.config.engine,
                    model=m.model_name,
                    state=(
                        DaemonState.DRAINING  # a serving worker of a draining daemon
                        if snap.ready and d.drainer.draining
                        else snap.state
                    ),
                    pid=snap.pid,
                    lanes_busy=snap.lanes_busy,
                    lanes_max=snap.limits.max_lanes,
                    queue_depth=snap.queued,
                    respawns=snap.respawns,
                    pool_used_bytes=int(stats.get("pool_bytes_used", 0)),
                    pool_total_bytes=int(stats.get("pool_bytes_total", 0)),
                    ticks_run=snap.ticks_run,
                    engine_lanes=int(stats.get("live_lanes", 0)),
                    seed_leases=int(stats.get("live_seed_leases", 0)),
                    engine_stats={k: int(v) for k, v in stats.items()},
                    last_error=snap.last_error,
                    kv_layout=_kv_layout(m),
                )
            )
        return control.WorkersResult(workers=rows)

    async def _lanes(self, msg: control.Lanes) -> control.LanesResult:
        wanted = set(_worker_ids(self.d.fleet, msg.worker_id))
        rows = [
            lane_row(snap, lane)
            for snap in self.d.fleet.snapshots()
            if snap.worker_id in wanted
            for lane in snap.lanes
        ]
        return control.LanesResult(lanes=rows)

    async def _queue(self, msg: control.Queue) -> control.QueueResult:
        totals: dict[str, list[float]] = {}
        for snap in self.d.fleet.snapshots():
            for row in snap.queues:
                t = totals.setdefault(row.qos, [0, 0.0])
                t[0] += row.depth
                t[1] = max(t[1], row.oldest_wait_s)
        return control.QueueResult(
            classes=[control.QueueRow(qos=q, depth=int(d), oldest_wait_s=w) for q, (d, w) in totals.items()]
        )

    def overview(self, history_s: int = 0) -> control.OverviewResult:
        """The live picture (``basertd.server.observe.overview``) with ``history_s`` seconds of
        per-second series; also served to the web page at ``/`` (``transport.http.opsview``).
        Raises ``ControlError(INVALID_REQUEST)`` for ``history_s`` outside 0..``HISTORY_S``."""
        if not 0 <= history_s <= HISTORY_S:
            raise ControlError(
                ErrorCode.INVALID_REQUEST, f"history_s must be within 0..{HISTORY_S}, got {history_s}"
            )
        d = self.d
        header = Header(
            version=d.version,
            state=d.public_state(),
            uptime_s=time.monotonic() - d.started_at,
            requests_total=d.requests_total,
            in_flight=d.drainer.in_flight,
            problems=d.fleet.problems(),
        )
        served = [
            ServedWorker(snap, m.model_name, m.config.engine)
            for m, snap in zip(d.fleet, d.fleet.snapshots(), strict=True)
        ]
        return overview(header, served, d.metrics.windows, time.monotonic(), history_s)

    async def _overview(self, msg: control.Overview) -> control.OverviewResult:
        return self.overview(msg.history_s)

    async def _metrics(self, msg: control.Metrics) -> control.MetricsResult:
        return control.MetricsResult(text=self.d.metrics.exposition())

    async def _config_check(self, msg: control.ConfigCheck) -> control.ConfigCheckResult:
        if (msg.path is None) == (msg.text is None):
            raise ControlError(ErrorCode.INVALID_REQUEST, "give exactly one of path and text")
        if msg.path is not None:
            try:
                text = await asyncio.to_thread(read_config_file, msg.path)
            except (OSError, ValueError) as exc:
                return control.ConfigCheckResult(ok=False, errors=[f"{msg.path}: cannot read: {exc}"])
            return check_config_text(text, msg.path, self.d.config)
        return check_config_text(msg.text or "", "<text>", self.d.config)

    # --- prefix cache ----------------------------------------------------------------------------

    async def _cache_stats(self, msg: control.CacheStats) -> control.CacheStatsResult:
        return control.CacheStatsResult(workers=await self.d.cache_control.stats())

    async def _cache_list(self, msg: control.CacheList) -> control.CacheListResult:
        _worker_ids(self.d.fleet, msg.worker_id)
        if msg.limit < 1:
            raise ControlError(ErrorCode.INVALID_REQUEST, f"limit must be >= 1, got {msg.limit}")
        return control.CacheListResult(entries=await self.d.cache_control.entries(msg.worker_id, msg.limit))

    async def _cache_pin(self, msg: control.CachePin) -> control.CachePinResult:
        if (msg.tokens is None) == (msg.text is None):
            raise ControlError(ErrorCode.INVALID_REQUEST, "give exactly one of tokens and text")
        by_worker: dict[int, list[int]] = {}
        for i in _worker_ids(self.d.fleet, msg.worker_id):
            tok = self.d.fleet[i].tokenizer
            if msg.text is not None:
                bos = self.d.fleet.add_bos(i)
                tokens = await asyncio.to_thread(tok.encode, msg.text, add_bos=bos)
            else:
                tokens = list(msg.tokens or [])
                if any(not 0 <= t < tok.vocab_size for t in tokens):
                    raise ControlError(
                        ErrorCode.INVALID_REQUEST, f"tokens outside the vocabulary (0..{tok.vocab_size - 1})"
                    )
            if not tokens:
                raise ControlError(ErrorCode.EMPTY_PROMPT, "the prefix to pin is empty")
            by_worker[i] = tokens
        return await self.d.cache_control.pin(by_worker)

    async def _cache_unpin(self, msg: control.CacheUnpin) -> control.ControlOk:
        await self.d.cache_control.unpin(msg.pin_id)
        return control.ControlOk(message=f"pin {msg.pin_id} dropped")

    async def _cache_evict(self, msg: control.CacheEvict) -> control.CacheEvictResult:
        _worker_ids(self.d.fleet, msg.worker_id)
        if msg.bytes_target < 0:
            raise ControlError(
                ErrorCode.INVALID_REQUEST, f"bytes_target must be >= 0, got {msg.bytes_target}"
            )
        return await self.d.cache_control.evict(msg.worker_id, msg.bytes_target)

    # --- steering --------------------------------------------------------------------------------

    async def _drain(self, msg: control.Drain) -> control.DrainResult:
        timeout = _timeout(msg.timeout_s)
        self._check_running()
        grace = self.d.config.operators.drain_grace_s
        self.d.drainer.begin(ErrorCode.DRAINING, grace)
        self.d.publish_status()
        outcome = await self.d.drainer.drain(timeout, ErrorCode.DRAINING, grace)
        self.d.publish_status()
        left = self.d.drainer.in_flight if outcome.resumed else outcome.cancelled
        return control.DrainResult(drained=outcome.drained, lanes_active=left, waited_s=outcome.waited_s)

    async def _resume(self, msg: control.Resume) -> control.ControlOk:
        self._check_running()
        if self.d.drainer.code is ErrorCode.SHUTTING_DOWN and self.d.drainer.draining:
            raise ControlError(ErrorCode.SHUTTING_DOWN, "basertd is draining to stop; it cannot resume")
        resumed = self.d.drainer.resume()
        self.d.publish_status()
        return control.ControlOk(message="accepting requests" if resumed else "was not draining")

    async def _restart_worker(self, msg: control.RestartWorker) -> control.RestartWorkerResult:
        self._check_running()
        (wid,) = _worker_ids(self.d.fleet, msg.worker_id)
        slot = self.d.fleet[wid].slot
        old = slot.proc
        log.warning("worker_restart_by_operator", worker_id=wid, pid=old.pid if old else 0)
        try:
            # its running requests are handed over (moved to a peer or waiting), not failed
            await asyncio.wait_for(worker_changes.restart(self.d.fleet, wid), RESTART_TIMEOUT_S)
            proc = await asyncio.wait_for(slot.ready(), RESTART_TIMEOUT_S)
        except TimeoutError:
            raise ControlError(
                ErrorCode.TIMEOUT, f"worker {wid} did not come back within {RESTART_TIMEOUT_S:g} s"
            ) from None
        return control.RestartWorkerResult(worker_id=wid, pid=proc.pid)

    async def _shutdown(self, msg: control.Shutdown) -> control.ControlOk:
        timeout = _timeout(msg.timeout_s)
        self._check_running()
        self.d.request_shutdown(drain=msg.drain, timeout_s=timeout)
        how = f"draining for up to {timeout:g} s, then stopping" if msg.drain else "stopping now"
        return control.ControlOk(message=how)
