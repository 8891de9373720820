"""The control API: handlers of every ``basertctl`` verb and their peer-credential guard (issue 9).

``ControlService(daemon).handle(conn, msg)`` answers one ``basertd.schema.control`` request on the
client socket (DESIGN.md "Operators"). Before any handler runs, the peer's kernel credentials
(``conn.credentials``, SO_PEERCRED / SO_PEERGROUPS) must satisfy the daemon's
``OperatorPolicy`` (root, the daemon's user, the ``[operators] operator_group``); anyone else gets
``Error(PERMISSION_DENIED)``, one ``control_denied`` warning in the log and a count in
``basertd_control_denied_total``, and nothing changes. Generation stays open to whoever can open
the socket (its mode and group decide that).

Handlers raise ``ControlError(code, message)`` for refusals (NOT_FOUND for an unknown worker or
pin, INVALID_REQUEST for bad arguments, SHUTTING_DOWN while stopping); ``handle`` turns it into
``Error`` and never lets anything else escape as a traceback.

The prefix-cache verbs go through the ``CacheControl`` interface. ``EngineCache``, the default,
serves ``cache stats`` and ``cache evict`` from the workers' engines (PONG stats, CACHE_EVICT)
and the coordinator's hit / miss counters; ``cache ls`` / ``pin`` / ``unpin`` need the
coordinator's prefix index and lease keeping (the prefix-cache policy, issue 8), which installs
its own ``CacheControl`` as ``daemon.cache_control``; until then they answer a typed error.
"""

from __future__ import annotations

import asyncio
import grp
import math
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.client import ErrorCode
from basertd.schema.tick import ShedPolicy
from basertd.server.config import Config, ConfigError, parse_config
from basertd.server.link import LinkError
from basertd.server.reload import config_changes

if TYPE_CHECKING:
    from basertd.server.api import ClientConnection
    from basertd.server.daemon import Daemon

log = structlog.get_logger("basertd.control")

U64_MAX = (1 << 64) - 1
PONG_TIMEOUT_S = 1.0
"""Seconds a control verb waits for a worker's PONG before reporting it without engine stats."""
RESTART_TIMEOUT_S = 180.0
"""Seconds ``restart-worker`` waits for the new incarnation to handshake."""
STOP_TIMEOUT_HINT_S = 90.0
"""TimeoutStopSec of the shipped basertd.service; a drain timeout near it gets a warning."""

VERB_NAMES: dict[type, str] = {
    control.Status: "status",
    control.Workers: "workers",
    control.Lanes: "lanes",
    control.Queue: "queue",
    control.CacheStats: "cache stats",
    control.CacheList: "cache ls",
    control.CachePin: "cache pin",
    control.CacheUnpin: "cache unpin",
    control.CacheEvict: "cache evict",
    control.Drain: "drain",
    control.Resume: "resume",
    control.RestartWorker: "restart-worker",
    control.Metrics: "metrics",
    control.Shutdown: "shutdown",
    control.ConfigCheck: "config check",
}
"""basertctl's name of each control verb (for messages, logs and metric labels)."""


class ControlError(Exception):
    """A control verb refused: ``code`` (an ``ErrorCode``) and a message for the operator."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CacheControl(Protocol):
    """What the prefix-cache verbs need (implemented by ``EngineCache`` and by the prefix-cache
    policy, issue 8). Worker ids are validated by the caller; methods raise ``ControlError``."""

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


async def worker_stats(daemon: Daemon, worker_id: int) -> dict[str, int] | None:
    """The engine's ``stats`` of worker ``worker_id`` from a PONG (None when it is not running or
    does not answer within ``PONG_TIMEOUT_S``)."""
    proc = daemon.slots[worker_id].proc
    if proc is None or not proc.link.alive:
        return None
    try:
        pong = await proc.link.ping(timeout=PONG_TIMEOUT_S)
    except LinkError:
        return None
    return dict(pong.stats or {})


class EngineCache:
    """``CacheControl`` over the engines themselves (module docstring)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def _counter(self, name: str, worker: int) -> int:
        value = self.daemon.metrics.registry.get_sample_value(name, {"worker": str(worker)})
        return int(value or 0)

    async def stats(self) -> list[control.CacheStatsRow]:
        ids = range(len(self.daemon.slots))
        all_stats = await asyncio.gather(*(worker_stats(self.daemon, i) for i in ids))
        rows = []
        for i, stats in zip(ids, all_stats, strict=True):
            stats = stats or {}
            rows.append(
                control.CacheStatsRow(
                    worker_id=i,
                    entries=int(stats.get("cache_entries", 0)),
                    bytes=int(stats.get("cache_bytes", 0)),
                    hits=self._counter("basertd_prefix_cache_hits_total", i),
                    misses=self._counter("basertd_prefix_cache_misses_total", i),
                    cached_tokens=self._counter("basertd_cached_tokens_total", i),
                    evictions=int(stats.get("evictions_total", 0)),
                )
            )
        return rows

    def _needs_policy(self, verb: str) -> ControlError:
        return ControlError(
            ErrorCode.INVALID_REQUEST,
            f"{verb} needs the coordinator's prefix-cache index and pins (the prefix-cache policy), "
            "which this build does not have; cache stats and cache evict work",
        )

    async def entries(self, worker_id: int | None, limit: int) -> list[control.CacheEntryRow]:
        raise self._needs_policy("cache ls")

    async def pin(self, tokens_by_worker: dict[int, list[int]]) -> control.CachePinResult:
        raise self._needs_policy("cache pin")

    async def unpin(self, pin_id: int) -> None:
        raise self._needs_policy("cache unpin")

    async def evict(self, worker_id: int | None, bytes_target: int) -> control.CacheEvictResult:
        target = bytes_target or U64_MAX
        policy = ShedPolicy(evictable_cache_classes=U64_MAX, protected_quota_bytes=0, max_evict_bytes=target)
        freed = entries = 0
        for i in _worker_ids(self.daemon, worker_id):
            proc = self.daemon.slots[i].proc
            if proc is None or not proc.link.alive:
                continue
            before = await worker_stats(self.daemon, i) or {}
            try:
                freed += await proc.link.cache_evict(policy, target)
            except LinkError as exc:
                raise ControlError(
                    ErrorCode.WORKER_FAILED, f"worker {i}: cache evict failed: {exc}"
                ) from None
            after = await worker_stats(self.daemon, i) or {}
            entries += max(0, int(before.get("cache_entries", 0)) - int(after.get("cache_entries", 0)))
        log.info("cache_evicted", worker_id=worker_id, bytes_target=bytes_target, bytes_freed=freed)
        return control.CacheEvictResult(bytes_freed=freed, entries=entries)


def _worker_ids(daemon: Daemon, worker_id: int | None) -> list[int]:
    n = len(daemon.slots)
    if worker_id is None:
        return list(range(n))
    if not 0 <= worker_id < n:
        raise ControlError(ErrorCode.NOT_FOUND, f"no worker {worker_id} (workers are 0..{n - 1})")
    return [worker_id]


def _timeout(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ControlError(ErrorCode.INVALID_REQUEST, f"timeout must be a finite number >= 0, got {value}")
    return value


def check_config_text(text: str, source: str, running: Config | None = None) -> control.ConfigCheckResult:
    """Validate configuration ``text`` (TOML) without applying it. Errors: anything
    ``basertd serve`` would refuse (the key is named). Warnings: model files that do not exist, a
    socket open to others, an operator group unknown to this system, a drain timeout that does not
    fit the unit's TimeoutStopSec, and, against the ``running`` configuration, which changed keys a
    reload (SIGHUP) applies and which need a restart."""
    try:
        cfg = parse_config(tomllib.loads(text), source=source)
    except tomllib.TOMLDecodeError as exc:
        return control.ConfigCheckResult(ok=False, errors=[f"{source}: invalid TOML: {exc}"])
    except ConfigError as exc:
        return control.ConfigCheckResult(ok=False, errors=[str(exc)])
    warnings = []
    for i, w in enumerate(cfg.workers):
        if w.model and not Path(w.model).expanduser().exists():
            warnings.append(f"workers[{i}].model: {w.model} does not exist (here)")
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
    """Answers control verbs for one daemon (module docstring)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def handle(self, conn: ClientConnection, msg: Any) -> None:
        """Check the peer, run the verb's handler, send its result or a typed ``Error``."""
        rid = getattr(msg, "request_id", "")
        verb = VERB_NAMES.get(type(msg))
        if verb is None:
            conn.send(
                api.Error(
                    code=ErrorCode.INVALID_REQUEST,
                    request_id=rid,
                    message=f"{type(msg).__name__} is not a request this daemon serves",
                )
            )
            return
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
            reply = await getattr(self, "_" + type(msg).__name__)(msg)
        except ControlError as exc:
            conn.send(api.Error(code=exc.code, request_id=rid, message=exc.message))
            return
        except Exception as exc:  # a handler bug: typed error to the operator, traceback to the log
            log.exception("control_failed", verb=verb)
            conn.send(api.Error(code=ErrorCode.INTERNAL, request_id=rid, message=f"{verb} failed: {exc!r}"))
            return
        reply.request_id = rid
        conn.send(reply)
        if verb not in ("status", "workers", "lanes", "queue", "cache stats", "cache ls", "metrics"):
            log.info("control", verb=verb, uid=peer.uid, pid=peer.pid)

    def _check_running(self) -> None:
        if self.d.state in ("stopping", "stopped"):
            raise ControlError(ErrorCode.SHUTTING_DOWN, "basertd is shutting down")

    # --- views -----------------------------------------------------------------------------------

    async def _Status(self, msg: control.Status) -> control.StatusResult:
        d = self.d
        return control.StatusResult(
            version=d.version,
            state=d.public_state(),
            uptime_s=time.monotonic() - d.started_at,
            workers_ready=sum(1 for s in d.slots if s.state == "ready"),
            workers_total=len(d.slots),
            lanes_busy=sum(s.busy_lanes for s in d.schedulers),
            lanes_max=sum(s.limits.max_lanes for s in d.schedulers),
            queued=sum(len(s.queues) for s in d.schedulers),
            requests_total=d.requests_total,
        )

    async def _Workers(self, msg: control.Workers) -> control.WorkersResult:
        d = self.d
        all_stats = await asyncio.gather(*(worker_stats(d, i) for i in range(len(d.slots))))
        rows = []
        for i, (slot, sched, stats) in enumerate(zip(d.slots, d.schedulers, all_stats, strict=True)):
            stats = stats or {}
            rows.append(
                control.WorkerRow(
                    worker_id=i,
                    engine=d.config.workers[i].engine,
                    model=d.model_names[i],
                    state="draining" if slot.state == "ready" and d.drainer.draining else slot.state,
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
                    engine_stats={k: int(v) for k, v in stats.items()},
                )
            )
        return control.WorkersResult(workers=rows)

    async def _Lanes(self, msg: control.Lanes) -> control.LanesResult:
        now = time.monotonic()
        wanted = set(_worker_ids(self.d, msg.worker_id))
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
            for sched in self.d.schedulers
            if sched.worker_id in wanted
            for lane in sched.lanes.values()
        ]
        return control.LanesResult(lanes=rows)

    async def _Queue(self, msg: control.Queue) -> control.QueueResult:
        now = time.monotonic()
        totals: dict[str, list[float]] = {}
        for sched in self.d.schedulers:
            for qos, depth, wait in sched.queue_rows(now):
                t = totals.setdefault(qos, [0, 0.0])
                t[0] += depth
                t[1] = max(t[1], wait)
        return control.QueueResult(
            classes=[control.QueueRow(qos=q, depth=int(d), oldest_wait_s=w) for q, (d, w) in totals.items()]
        )

    async def _Metrics(self, msg: control.Metrics) -> control.MetricsResult:
        return control.MetricsResult(text=self.d.metrics.exposition())

    async def _ConfigCheck(self, msg: control.ConfigCheck) -> control.ConfigCheckResult:
        if (msg.path is None) == (msg.text is None):
            raise ControlError(ErrorCode.INVALID_REQUEST, "give exactly one of path and text")
        if msg.path is not None:
            try:
                text = Path(msg.path).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                return control.ConfigCheckResult(ok=False, errors=[f"{msg.path}: cannot read: {exc}"])
            return check_config_text(text, msg.path, self.d.config)
        return check_config_text(msg.text or "", "<text>", self.d.config)

    # --- prefix cache ----------------------------------------------------------------------------

    async def _CacheStats(self, msg: control.CacheStats) -> control.CacheStatsResult:
        return control.CacheStatsResult(workers=await self.d.cache_control.stats())

    async def _CacheList(self, msg: control.CacheList) -> control.CacheListResult:
        _worker_ids(self.d, msg.worker_id)
        if msg.limit < 1:
            raise ControlError(ErrorCode.INVALID_REQUEST, f"limit must be >= 1, got {msg.limit}")
        return control.CacheListResult(entries=await self.d.cache_control.entries(msg.worker_id, msg.limit))

    async def _CachePin(self, msg: control.CachePin) -> control.CachePinResult:
        if (msg.tokens is None) == (msg.text is None):
            raise ControlError(ErrorCode.INVALID_REQUEST, "give exactly one of tokens and text")
        by_worker: dict[int, list[int]] = {}
        for i in _worker_ids(self.d, msg.worker_id):
            tok = self.d.tokenizers[i]
            if msg.text is not None:
                tokens = tok.encode(msg.text, add_bos=self.d.add_bos(i))
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

    async def _CacheUnpin(self, msg: control.CacheUnpin) -> control.ControlOk:
        await self.d.cache_control.unpin(msg.pin_id)
        return control.ControlOk(message=f"pin {msg.pin_id} dropped")

    async def _CacheEvict(self, msg: control.CacheEvict) -> control.CacheEvictResult:
        _worker_ids(self.d, msg.worker_id)
        if msg.bytes_target < 0:
            raise ControlError(
                ErrorCode.INVALID_REQUEST, f"bytes_target must be >= 0, got {msg.bytes_target}"
            )
        return await self.d.cache_control.evict(msg.worker_id, msg.bytes_target)

    # --- steering --------------------------------------------------------------------------------

    async def _Drain(self, msg: control.Drain) -> control.DrainResult:
        timeout = _timeout(msg.timeout_s)
        self._check_running()
        self.d.drainer.begin(ErrorCode.DRAINING)
        self.d.publish_status()
        outcome = await self.d.drainer.drain(timeout, ErrorCode.DRAINING)
        self.d.publish_status()
        left = self.d.drainer.in_flight if outcome.resumed else outcome.cancelled
        return control.DrainResult(drained=outcome.drained, lanes_active=left, waited_s=outcome.waited_s)

    async def _Resume(self, msg: control.Resume) -> control.ControlOk:
        self._check_running()
        if self.d.drainer.code is ErrorCode.SHUTTING_DOWN and self.d.drainer.draining:
            raise ControlError(ErrorCode.SHUTTING_DOWN, "basertd is draining to stop; it cannot resume")
        resumed = self.d.drainer.resume()
        self.d.publish_status()
        return control.ControlOk(message="accepting requests" if resumed else "was not draining")

    async def _RestartWorker(self, msg: control.RestartWorker) -> control.RestartWorkerResult:
        self._check_running()
        (wid,) = _worker_ids(self.d, msg.worker_id)
        slot = self.d.slots[wid]
        old = slot.proc
        log.warning("worker_restart_by_operator", worker_id=wid, pid=old.pid if old else 0)
        if slot.given_up:
            slot.poke()
        elif old is not None:
            slot.restart("operator request (basertctl restart-worker)")
        try:
            proc = await asyncio.wait_for(slot.ready(), RESTART_TIMEOUT_S)
        except TimeoutError:
            raise ControlError(
                ErrorCode.TIMEOUT, f"worker {wid} did not come back within {RESTART_TIMEOUT_S:g} s"
            ) from None
        return control.RestartWorkerResult(worker_id=wid, pid=proc.pid)

    async def _Shutdown(self, msg: control.Shutdown) -> control.ControlOk:
        timeout = _timeout(msg.timeout_s)
        self._check_running()
        self.d.request_shutdown(drain=msg.drain, timeout_s=timeout)
        how = f"draining for up to {timeout:g} s, then stopping" if msg.drain else "stopping now"
        return control.ControlOk(message=how)
