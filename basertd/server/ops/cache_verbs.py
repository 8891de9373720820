"""The daemon's cache verbs (``basertctl cache stats|ls|pin|unpin|evict``) over the workers'
prefix-cache policies (``basertd.server.cache.policy``): each verb runs on a worker between two
ticks, so nothing races a tick's prompt-ring writes or leases. Raises ``ControlError``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog

from basertd.schema import control
from basertd.schema.abi import Tier
from basertd.schema.client import ErrorCode
from basertd.server.cache.commands import Command, DropPin, Evict, HoldPin, ListEntries
from basertd.server.cache.policy import PinHold, WorkerCache
from basertd.server.cache.prefix_index import page_hashes
from basertd.server.fleet import STALE_KEY
from basertd.server.ops.control_errors import ControlError
from basertd.server.workers.link_errors import LinkError

log = structlog.get_logger("basertd.cache")


class SchedulerLike(Protocol):
    """What the verbs need of a scheduler (``basertd.server.sched.loop.Scheduler``)."""

    async def command(self, cmd: Command, timeout: float = ...) -> Any: ...

    async def warm_prefix(self, tokens: list[int], timeout: float) -> None: ...


class CacheWorker(Protocol):
    """What the verbs need of a worker (``basertd.server.fleet.Member``): its id, the scheduler
    that runs its commands and its prefix-cache policy."""

    @property
    def worker_id(self) -> int: ...

    @property
    def scheduler(self) -> SchedulerLike: ...

    @property
    def cache(self) -> WorkerCache: ...


FRESH_TRIES = 3
"""How many times ``evict`` asks for the counters after an eviction while they come from an
earlier PONG (each ask waits up to ``fleet.PONG_TIMEOUT_S``)."""


@dataclass
class PinRecord:
    """A pin across workers: ``pin_id`` and the prefix length (tokens) pinned on each worker."""

    pin_id: int
    lengths: dict[int, int] = field(default_factory=dict)


class PolicyCacheControl:
    """The ``basertd.server.ops.control.CacheControl`` of the prefix-cache policy: ``cache stats`` /
    ``ls`` / ``pin`` / ``unpin`` / ``evict`` served from the workers' ``WorkerCache`` objects,
    through typed commands each worker's scheduler runs between two ticks
    (``basertd.server.cache.commands``), so nothing races a tick's prompt-ring writes or leases.
    ``engine_stats(worker_id)`` answers a worker's engine counters (PONG) and
    ``counter(name, worker_id)`` a metrics counter. Methods raise ``ControlError``."""

    def __init__(
        self,
        workers: Sequence[CacheWorker],
        engine_stats: Callable[[int], Awaitable[dict[str, int] | None]],
        counter: Callable[[str, int], int],
        *,
        pin_timeout_s: float = 120.0,
    ) -> None:
        self.workers = workers
        self.engine_stats = engine_stats
        self.counter = counter
        self.pin_timeout_s = pin_timeout_s
        self.pins: dict[int, PinRecord] = {}
        self._next_pin = 1

    async def stats(self) -> list[control.CacheStatsRow]:
        """One row per worker (``CacheControl.stats``)."""
        rows = []
        for w in self.workers:
            i = w.worker_id
            engine = await self.engine_stats(i) or {}
            own = w.cache.stats_row(engine)
            rows.append(
                control.CacheStatsRow(
                    worker_id=i,
                    entries=int(engine.get("cache_entries", 0)),
                    bytes=int(engine.get("cache_bytes", 0)),
                    pinned_entries=own["pinned_entries"],
                    pinned_bytes=own["pinned_bytes"],
                    hits=self.counter("basertd_prefix_cache_hits_total", i),
                    misses=self.counter("basertd_prefix_cache_misses_total", i),
                    cached_tokens=self.counter("basertd_cached_tokens_total", i),
                    evictions=int(engine.get("evictions_total", 0)),
                    evicted_bytes=own["evicted_bytes"],
                    host_entries=int(engine.get("host_entries", 0)),
                    host_bytes=int(engine.get("host_bytes", 0)),
                    host_capacity_bytes=int(engine.get("host_capacity_bytes", 0)),
                    host_restores=int(engine.get("host_restores_total", 0)),
                    host_restore_s=int(engine.get("host_restore_ns_total", 0)) / 1e9,
                    host_refused=int(engine.get("host_refused_total", 0)),
                )
            )
        return rows

    async def entries(self, worker_id: int | None, limit: int) -> list[control.CacheEntryRow]:
        """Cached prefixes, verified against the engines, most recently used first."""
        now = time.monotonic()
        rows: list[tuple[float, control.CacheEntryRow]] = []
        for w in self.workers:
            if worker_id is not None and w.worker_id != worker_id:
                continue
            wc = w.cache
            found = await self._send(w, ListEntries())
            for e, tier in found:
                row = control.CacheEntryRow(
                    worker_id=w.worker_id,
                    prefix_tokens=e.length,
                    bytes=e.length * wc.bytes_per_token,
                    pin_id=e.pin_id,
                    hits=e.hits,
                    idle_s=max(0.0, now - e.last_used),
                    head=[int(t) for t in e.tokens[:8]],
                    tier="host" if tier == Tier.HOST else "pool",
                )
                rows.append((e.last_used, row))
        rows.sort(key=lambda r: r[0], reverse=True)
        return [r for _, r in rows[:limit]]

    async def pin(self, tokens_by_worker: dict[int, list[int]]) -> control.CachePinResult:
        """Pin each worker's prefix (its whole pages): warm it with an internal one-token request
        when it is not cached, then hold it with a renewed lease. Raises ``ControlError``
        INVALID_REQUEST (cache disabled, shorter than a page, more whole pages than a lane's
        context leaves room for beside one generated token), WORKER_FAILED, TIMEOUT."""
        by_id = {w.worker_id: w for w in self.workers}
        pin_id = self._next_pin
        record = PinRecord(pin_id)
        for wid, tokens in tokens_by_worker.items():
            w = by_id[wid]
            wc = w.cache
            if not wc.enabled:
                raise ControlError(
                    ErrorCode.INVALID_REQUEST, "the prefix cache is disabled ([cache] enabled)"
                )
            n = (len(tokens) // wc.page) * wc.page
            if n == 0:
                raise ControlError(
                    ErrorCode.INVALID_REQUEST,
                    f"the prefix is {len(tokens)} tokens; pins hold whole pages of {wc.page} tokens",
                )
            most = ((wc.context_length - 1) // wc.page) * wc.page  # a seed leaves a token to generate
            if wc.context_length and n > most:
                raise ControlError(
                    ErrorCode.INVALID_REQUEST,
                    f"the prefix is {n} tokens in whole pages; worker {wid}'s lanes hold"
                    f" {wc.context_length} tokens with the one they generate, so a pin holds at most {most}",
                )
            arr = np.array(tokens[:n], dtype=np.uint32)
            hold = PinHold(pin_id, arr, page_hashes(arr, wc.page))
            if not await self._send(w, HoldPin(hold)):
                await w.scheduler.warm_prefix([int(t) for t in arr], self.pin_timeout_s)
                if not await self._send(w, HoldPin(hold)):
                    raise ControlError(
                        ErrorCode.INTERNAL,
                        f"worker {wid}: the prefix was prefilled but is not served by the cache",
                    )
            wc.pins[pin_id] = hold
            record.lengths[wid] = n
        self._next_pin += 1
        self.pins[pin_id] = record
        log.info("cache_pinned", pin_id=pin_id, workers=sorted(record.lengths), tokens=record.lengths)
        return control.CachePinResult(pin_id=pin_id, tokens=min(record.lengths.values(), default=0))

    async def unpin(self, pin_id: int) -> None:
        """Drop pin ``pin_id`` everywhere; ``ControlError(NOT_FOUND)`` when unknown."""
        record = self.pins.pop(pin_id, None)
        if record is None:
            raise ControlError(ErrorCode.NOT_FOUND, f"no pin {pin_id}")
        for w in self.workers:
            if w.worker_id not in record.lengths:
                continue
            try:
                await self._send(w, DropPin(pin_id))
            except ControlError:
                await w.cache.drop_pin(None, pin_id)  # the worker is down: its lease died with it
        log.info("cache_unpinned", pin_id=pin_id)

    async def evict(self, worker_id: int | None, bytes_target: int) -> control.CacheEvictResult:
        """Evict unpinned prefixes on one or every worker (``CacheControl.evict``)."""
        freed = entries = 0
        for w in self.workers:
            if worker_id is not None and w.worker_id != worker_id:
                continue
            before = await self.engine_stats(w.worker_id) or {}
            try:
                freed += await self._send(w, Evict(bytes_target))
            except ControlError as exc:
                if exc.code != ErrorCode.WORKER_FAILED or worker_id is not None:
                    raise
                continue
            after = await self._fresh_stats(w.worker_id)
            entries += max(0, int(before.get("cache_entries", 0)) - int(after.get("cache_entries", 0)))
        log.info("cache_evicted", worker_id=worker_id, bytes_target=bytes_target, bytes_freed=freed)
        return control.CacheEvictResult(bytes_freed=freed, entries=entries)

    async def _fresh_stats(self, worker_id: int) -> dict[str, int]:
        """The engine's counters answered after now: asked up to ``FRESH_TRIES`` times while the
        answer is an earlier PONG's (``STALE_KEY``: the worker is inside a tick); {} when none."""
        stats: dict[str, int] = {}
        for _ in range(FRESH_TRIES):
            stats = await self.engine_stats(worker_id) or {}
            if STALE_KEY not in stats:
                break
        return stats

    async def _send(self, w: CacheWorker, cmd: Command) -> Any:
        """Run ``cmd`` on ``w``'s scheduler loop between two ticks; ``ControlError`` WORKER_FAILED when
        the worker is not running, TIMEOUT when no gap between ticks came."""
        try:
            return await w.scheduler.command(cmd)
        except LinkError as exc:
            raise ControlError(ErrorCode.WORKER_FAILED, f"worker {w.worker_id}: {exc}") from None
        except TimeoutError:
            raise ControlError(ErrorCode.TIMEOUT, f"worker {w.worker_id} is busy or not running") from None
