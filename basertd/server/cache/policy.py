"""The prefix-cache policy: what the coordinator publishes, seeds, coalesces, pins and evicts
(DESIGN.md "Prefix cache policy").

The engine stores published prefixes (a lane retired with ``publish_to_cache`` leaves its KV
behind, whole pages only) and answers ``space_match`` / ``seed_acquire``; everything else is
decided here, per worker (``WorkerCache``), with the scheduler driving it between ticks.

**Index.** ``PrefixIndex`` (``basertd.server.cache.prefix_index``) is a radix index of the prefixes this
worker has published, at page granularity: a prefix of ``n`` whole pages is the path of its chained
page hashes ``h1 .. hn`` (``page_hashes``: ``h_i = xxh3_64(tokens of page i, seed=h_(i-1))``), so
two prompts share their first ``k`` pages exactly when they share ``h_k`` (up to 64-bit collisions,
which the engine's own token comparison in ``space_match`` catches). Nodes are counted per entry, so
the longest indexed prefix of a prompt is a binary search over its hash path. The index is a *hint*:
it lets a prompt with nothing cached skip the MATCH round trip, and it routes and coalesces.
``space_match`` is the truth (ABI rules 87, 88): a seed is always matched first, then acquired
(rules 75-83) at the longest untainted page multiple the engine offers, and an index path longer
than what the engine matched is pruned.

**Leases.** A seed lease is consumed by the admit of the plan submitted right after it was
acquired (valid for ticks up to ``grant.tick + lease_ticks``, rule 83). A lease whose admit did
not happen (plan rejected, admit refused, admission cut) is released at once; none is kept
across a tick except pins (below). Lease counts therefore return to zero whenever no pin is held.

**Coalescing** (``basertd.server.cache.coalescing.coalesce``). A lane publishes only when it retires. When
a queued request shares at least ``coalesce_min_tokens`` uncached prompt tokens with a live lane, or
with a request queued ahead of it, it waits (it is not offered for admission), and the *leader* gets
a checkpoint at the shared page boundary: its prefill stops there (a lane already past it stops at
once) and it retires with ``publish_to_cache``, is requeued at the head of its class (exactly as a
preemption, after however many tokens it generated) and comes back seeded from its own prefix, with
all its followers seeded from the same entry. A leader that was already decoding (the first request
of a burst, admitted before the others arrived) pauses for a tick and resumes exactly (ABI rules
71-73). So a prefix shared by a burst of requests is prefilled once, by the first of them, and none
of them ever prefills it twice: a request leads at most one checkpoint. A lane retiring with publish
in the plan being built (a finished request) leads too: a request sharing its prefix waits that one
tick and is seeded from it (the next turn of a conversation, sent the moment the previous one
ended). The leader's own seed is its own work, so it reports ``cached_tokens`` 0 (cached tokens
count at a request's first admission only; tokens recomputed or re-seeded after a preemption or
checkpoint never count).

**Pins** (``cache pin``). A pinned prefix is held by a seed lease the scheduler renews before
half its TTL has passed (acquire the new lease, then release the old one), so the engine never
evicts it (pinned blocks are never eligible, rule 89). The ABI lets the engine choose the cache
class of every entry (both of ours use class bit 0), so the "protected class" is this lease plus
``protected_quota_bytes`` = the pinned bytes in every shed envelope. A prefix that is not cached
when pinned is first prefilled by an internal one-token request. After a worker respawn the
pins are warmed and held again.

**Eviction.** After each tick, when pool occupancy (``MemCounters.pool_blocks_used / total``)
is above ``high_watermark``, the scheduler evicts unpinned entries (``cache_evict`` inside a shed
envelope whose protected quota is the pinned bytes) down to ``low_watermark``. Plans also carry
that envelope, so a tick may evict unpinned entries to fit its KV (rules 50, 58).

**Routing** (``route``): with several workers serving the model, a request goes to the worker whose
index holds its longest prefix unless that worker's load (queued + running per lane) exceeds
the least loaded one's by more than ``route_slack``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import structlog

from basertd.schema.abi import Status, Tier
from basertd.schema.tick import MatchResult, ShedPolicy, TokenRef
from basertd.server.cache.prefix_index import IndexEntry, IndexObserver, PrefixIndex, page_hashes
from basertd.server.config_sections import CacheConfig
from basertd.server.observe.snapshot import HostTierCounts
from basertd.server.workers.link_errors import WorkerError

log = structlog.get_logger("basertd.cache")

U64_MAX = (1 << 64) - 1
ALL_CLASSES = U64_MAX
"""``evictable_cache_classes`` of every envelope: any class (the engines put every entry in bit 0;
what must stay is leased, and the protected quota covers it)."""


# --- routing and watermarks ------------------------------------------------------------------------


def route(options: Sequence[tuple[int, int, float]], slack: float) -> int:
    """The worker for a request: ``options`` are (worker id, cached prefix tokens its index holds for
    the prompt, load = (queued + running) / lanes). The least loaded worker, unless another holds a
    longer prefix and its load is at most ``slack`` above the least loaded one's (DESIGN.md "Prefix
    cache policy"). Raises ValueError for no options."""
    if not options:
        raise ValueError("no worker to route to")
    least = min(options, key=lambda o: (o[2], o[0]))
    best = max(options, key=lambda o: (o[1], -o[2], -o[0]))
    if best[1] > least[1] and best[2] - least[2] <= slack:
        return best[0]
    return least[0]


def eviction_target(
    used_blocks: int,
    total_blocks: int,
    block_bytes: int,
    evictable_bytes: int,
    high: float,
    low: float,
) -> int:
    """Bytes to evict so pool occupancy goes from above ``high`` (a fraction of ``total_blocks``)
    down to ``low``; 0 while at or below ``high`` or when nothing is evictable."""
    if total_blocks <= 0 or evictable_bytes <= 0 or used_blocks <= high * total_blocks:
        return 0
    excess = used_blocks - math.floor(low * total_blocks)
    return min(evictable_bytes, max(0, excess) * block_bytes)


# --- per worker ------------------------------------------------------------------------------------


class WorkerLike(Protocol):
    """What the policy needs of a running worker (``basertd.server.workers.prompt_feed.WorkerPort``): its
    link, and the feed that alone writes its prompt ring (ring 1)."""

    link: Any
    feed: Any


@dataclass(frozen=True)
class Seed:
    """An acquired seed lease: ``handle`` for LaneAdmit.seed_handle, ``length`` tokens it covers
    (a page multiple), valid for engine ticks up to ``expires_after``."""

    handle: int
    length: int
    expires_after: int


@dataclass(eq=False)
class PinHold:
    """Pin ``pin_id`` on one worker: the pinned ``tokens`` (whole pages) and their hash path; the
    lease ``handle`` holding it (0: not held, e.g. after a respawn), the engine tick from which
    it is renewed (``renew_at``) and, when it could not be warmed, when to try again
    (``retry_at``, monotonic seconds)."""

    pin_id: int
    tokens: np.ndarray
    hashes: list[int]
    handle: int = 0
    renew_at: int = 0
    retry_at: float = 0.0


def best_candidate(match: MatchResult, limit: int, page: int) -> int:
    """Longest untainted page-multiple prefix (tokens, <= ``limit``) every space of ``match``
    offers (0 when none): per space the longest candidate, then the smallest over spaces."""
    best: int | None = None
    for sp in match.spaces:
        lengths = [c.prefix_len for c in sp.candidates if c.taint_bits == 0 and c.prefix_len <= limit]
        longest = max(lengths, default=0)
        best = longest if best is None else min(best, longest)
    return ((best or 0) // page) * page


def resident_tier(match: MatchResult, length: int) -> Tier:
    """Where ``match`` holds a prefix of ``length`` tokens: ``Tier.GPU`` when every space offers
    an untainted candidate that long in the pool, else ``Tier.HOST``."""
    for sp in match.spaces:
        if not any(
            c.taint_bits == 0 and c.prefix_len >= length and c.resident_tier == Tier.GPU
            for c in sp.candidates
        ):
            return Tier.HOST
    return Tier.GPU


class WorkerCache:
    """The prefix-cache policy of one worker (module docstring); owned by its ``Scheduler``.

    Per incarnation (``attach``): the page size, bytes per token and lease TTL from the capability
    record; an empty index (a new worker has an empty cache). Across incarnations: the pins and
    the counters. ``engine_ticks`` counts the ticks the current incarnation ran (``on_tick``): the
    engine's tick index, against which leases expire (ABI rule 83)."""

    def __init__(self, worker_id: int, config: CacheConfig) -> None:
        self.worker_id = worker_id
        self.config = config
        self.page = 16
        self.bytes_per_token = 0
        self.block_bytes = 0
        self.lease_ticks = 8
        self.context_length = 0
        """Tokens per lane of the current incarnation (0 until the first handshake)."""
        self.observer: IndexObserver | None = None
        self.index = PrefixIndex(self.page, config.index_entries)
        self.pins: dict[int, PinHold] = {}
        self.engine_ticks = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.seeds_acquired = 0
        self.seed_misses = 0
        self.attached = False
        self.host: HostTierCounts | None = None
        """The engine's host tier as last reported (``engine_reported``); None without one."""

    # --- incarnation ---------------------------------------------------------------------------

    def attach(self, caps: Any) -> None:
        """A new worker incarnation handshook with capability record ``caps``: forget the index and
        every lease (the engine's cache is empty), keep the pins (held again by ``renew``)."""
        self.page = max(1, int(caps.page_size_tokens))
        paged = [s for s in caps.state_spaces if s.bytes_per_token]
        self.bytes_per_token = sum(int(s.bytes_per_token) for s in paged)
        self.block_bytes = self.bytes_per_token * self.page
        self.lease_ticks = int(caps.seed_lease_ticks)
        self.context_length = int(caps.context_length)
        extra = getattr(caps, "extra", None) or {}
        capacity = int(extra.get("host_bytes", "0") or 0)
        self.host = HostTierCounts(capacity_bytes=capacity) if "host_bytes" in extra else None
        self.index = PrefixIndex(self.page, self.config.index_entries, self.observer)
        if self.observer is not None:
            self.observer.cleared()
        self.engine_ticks = 0
        for pin in self.pins.values():
            pin.handle = 0
            pin.renew_at = 0
            pin.hashes = page_hashes(pin.tokens, self.page)
        self.attached = True

    def observe(self, observer: IndexObserver | None) -> None:
        """Tell ``observer`` of every page entering or leaving this worker's index from now on,
        and ``cleared()`` at each new incarnation (``basertd.server.observe.kv_events``)."""
        self.observer = observer
        self.index.observer = observer

    def detach(self) -> None:
        """The incarnation is gone: its leases died with it."""
        self.attached = False
        for pin in self.pins.values():
            pin.handle = 0

    @property
    def enabled(self) -> bool:
        """Seeds, coalescing and pins are on (``[cache] enabled`` and publishing)."""
        return self.config.enabled and self.config.publish_on_retire

    def engine_reported(self, stats: dict[str, int]) -> None:
        """The engine's ``stats()`` from a PONG: keep its host-tier counts (``HostTierCounts``)."""
        host = HostTierCounts.of(stats)
        if host is not None:
            self.host = host

    @property
    def host_tier(self) -> bool:
        """The engine keeps evicted prefixes in a host tier (capacity > 0), where matches still
        find them: an eviction then leaves the index alone."""
        return self.host is not None and self.host.capacity_bytes > 0

    def on_tick(self, shed_entries: Sequence[Any]) -> None:
        """An accepted tick ran: count it, and the cache evictions it reports (ABI rule 58)."""
        self.engine_ticks += 1
        for e in shed_entries:
            if e.kind == 2:  # ShedKind.CACHE_EVICTION
                self.evictions += 1
                self.evicted_bytes += int(e.bytes)

    # --- hints ---------------------------------------------------------------------------------

    def hashes(
        self, tokens: Sequence[int] | np.ndarray, known: Sequence[int] = (), salt: int = 0
    ) -> list[int]:
        """``page_hashes`` at this worker's page size (``salt``: the requester's cache salt)."""
        return page_hashes(tokens, self.page, known, salt)

    def hint(self, hashes: Sequence[int], limit: int) -> int:
        """Tokens the index says are cached for the path ``hashes`` (a page multiple <= ``limit``)."""
        if not self.enabled:
            return 0
        pages = min(self.index.longest(hashes), limit // self.page)
        return pages * self.page

    def published(
        self,
        tokens: np.ndarray | Sequence[int],
        kv_tokens: int,
        hashes: Sequence[int] = (),
        now: float | None = None,
    ) -> None:
        """A lane retired with ``publish_to_cache`` holding the KV of ``kv_tokens`` of ``tokens``:
        the engine keeps its whole pages (ABI rule 91). ``now``: monotonic seconds, the entry's
        last use (the scheduler core passes the loop's clock; None: read it)."""
        pages = kv_tokens // self.page
        if pages <= 0:
            return
        arr = np.asarray(tokens, dtype=np.uint32)[: pages * self.page]
        path = page_hashes(arr, self.page, hashes)
        self.index.insert(arr, path, time.monotonic() if now is None else now)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the held pins (the protected quota of every shed envelope)."""
        return sum(p.tokens.shape[0] for p in self.pins.values() if p.handle) * self.bytes_per_token

    def shed_policy(self, max_evict_bytes: int = 0) -> ShedPolicy:
        """The envelope of plans and evictions: every class evictable, the pinned bytes protected,
        at most ``max_evict_bytes`` (0: no cap) evicted."""
        return ShedPolicy(
            evictable_cache_classes=ALL_CLASSES,
            protected_quota_bytes=self.pinned_bytes,
            max_evict_bytes=max_evict_bytes or U64_MAX,
        )

    # --- seeds ---------------------------------------------------------------------------------

    async def seed(self, proc: WorkerLike, ref: TokenRef, hashes: Sequence[int], limit: int) -> Seed | None:
        """Match, then acquire the longest cached prefix (<= ``limit`` tokens) of the prompt at
        ``ref`` (in the prompt ring, the admit's own ref), or None. The index path ``hashes`` is
        pruned to what the engine serves. Raises ``LinkError`` when the worker is gone."""
        try:
            match = await proc.link.match(ref)
        except WorkerError as exc:
            log.warning("match_refused", worker_id=self.worker_id, status=str(exc.status))
            return None
        indexed = self.index.longest(hashes) * self.page
        if self.config.isolate_by_api_key:  # never beyond what this salt's requests published
            limit = min(limit, indexed)
        length = best_candidate(match, limit, self.page)
        if length < indexed:
            self.index.prune(hashes, length // self.page)
        if length < self.page:
            self.seed_misses += 1
            return None
        try:
            grant = await proc.link.seed_acquire(ref, length, 0)
        except WorkerError as exc:  # refused: the prefix went between match and acquire (rule 87)
            if exc.status != Status.ERR_SEED_UNSERVABLE:
                log.warning("seed_refused", worker_id=self.worker_id, status=str(exc.status))
            self.index.prune(hashes, 0)
            self.seed_misses += 1
            return None
        self.seeds_acquired += 1
        entry = self.index.find(hashes, length // self.page)
        if entry is not None:
            entry.hits += 1
            entry.last_used = time.monotonic()
        return Seed(grant.seed_handle, length, grant.tick + grant.lease_ticks)

    async def release(self, proc: WorkerLike, handle: int) -> None:
        """Release an unconsumed lease (an already expired or consumed one is fine: rule 81)."""
        try:
            await proc.link.seed_release(handle)
        except WorkerError as exc:
            if exc.status != Status.ERR_UNKNOWN_HANDLE:
                log.warning("seed_release_failed", worker_id=self.worker_id, status=str(exc.status))

    # --- pins ----------------------------------------------------------------------------------

    async def hold(self, proc: WorkerLike, pin: PinHold) -> bool:
        """Acquire a lease on ``pin``'s prefix (True), releasing the lease it replaces; False when
        the engine no longer serves the whole prefix (the pin then needs warming again)."""
        ref = proc.feed.write(pin.tokens)
        n = int(pin.tokens.shape[0])
        try:
            match = await proc.link.match(ref)
        except WorkerError:
            return False
        if best_candidate(match, n, self.page) < n:
            return False
        try:
            grant = await proc.link.seed_acquire(ref, n, 0)
        except WorkerError as exc:
            if exc.status != Status.ERR_SEED_UNSERVABLE:
                log.warning("pin_seed_refused", worker_id=self.worker_id, status=str(exc.status))
            return False
        old, pin.handle = pin.handle, grant.seed_handle
        pin.renew_at = grant.tick + max(0, grant.lease_ticks // 2)
        if old:
            await self.release(proc, old)
        entry = self.index.insert(pin.tokens, pin.hashes, time.monotonic())
        if entry is not None:
            entry.pin_id = pin.pin_id
        return True

    def renewals_due(self) -> list[PinHold]:
        """Held pins whose lease must be renewed before the next tick (half the TTL has passed)."""
        return [p for p in self.pins.values() if p.handle and self.engine_ticks >= p.renew_at]

    async def renew(self, proc: WorkerLike) -> list[PinHold]:
        """Renew every lease due (``renewals_due``); returns the pins that could not be renewed
        (their prefix is gone: they are unheld and need warming again)."""
        lost = []
        for pin in self.renewals_due():
            if not await self.hold(proc, pin):
                await self.release(proc, pin.handle)
                pin.handle = 0
                lost.append(pin)
                log.warning("pin_lost", worker_id=self.worker_id, pin_id=pin.pin_id)
        return lost

    async def drop_pin(self, proc: WorkerLike | None, pin_id: int) -> bool:
        """Forget pin ``pin_id`` here and release its lease; False when it is not pinned here. An
        index entry it marked goes to another pin of the same prefix if one is left (an entry names
        one pin), else it is unpinned."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        if pin.handle and proc is not None:
            await self.release(proc, pin.handle)
        for e in self.index.entries.values():
            if e.pin_id == pin_id:
                same = [p.pin_id for p in self.pins.values() if p.hashes == e.hashes]
                e.pin_id = max(same, default=0)
        return True

    # --- eviction ------------------------------------------------------------------------------

    def watermark_target(self, mem: Any) -> int:
        """Bytes the pool must shed after a tick with memory counters ``mem`` (``eviction_target``
        with the configured watermarks); 0 when within them."""
        if self.config.high_watermark <= 0:
            return 0
        return eviction_target(
            int(mem.pool_blocks_used),
            int(mem.pool_blocks_total),
            self.block_bytes,
            int(mem.pool_bytes_evictable),
            self.config.high_watermark,
            self.config.low_watermark,
        )

    async def evict(self, proc: WorkerLike, bytes_target: int) -> int:
        """CACHE_EVICT inside the shed envelope (pins protected): up to ``bytes_target`` bytes (0:
        everything unpinned); returns the bytes freed (ABI rule 89). An eviction of everything
        clears the unpinned index unless the engine has a host tier (the prefixes went there and
        matches still find them); a partial one leaves the index to be corrected by matches."""
        target = bytes_target or U64_MAX
        freed = await proc.link.cache_evict(self.shed_policy(target), target)
        if freed:
            self.evicted_bytes += freed
        if bytes_target == 0 and not self.host_tier:
            self.index.clear(keep_pinned=True)
        return freed

    async def verified_entries(self, proc: WorkerLike) -> list[tuple[IndexEntry, Tier]]:
        """The index, each entry checked against ``space_match`` with the tier that holds it
        (``Tier.GPU``: the engine's KV pool; ``Tier.HOST``: only its host-memory tier): an entry
        the engine no longer serves in full is cut to what it serves (``PrefixIndex.prune``;
        forgotten when that is nothing). Most recently used first."""
        out: list[tuple[IndexEntry, Tier]] = []
        listed: set[int] = set()  # ids of the entries in ``out`` (a cut one may come up again)
        for e in self.index.by_recency():
            if id(e) in listed:
                continue
            ref = proc.feed.write(e.tokens)
            try:
                match = await proc.link.match(ref)
            except WorkerError:
                continue
            served = best_candidate(match, e.length, self.page)
            if served >= e.length:
                out.append((e, resident_tier(match, e.length)))
                listed.add(id(e))
            elif not e.pin_id:
                pages = served // self.page
                self.index.prune(e.hashes, pages)
                cut = self.index.find(e.hashes, pages)
                if cut is not None and cut.length == served and id(cut) not in listed:
                    out.append((cut, resident_tier(match, served)))
                    listed.add(id(cut))
        return out

    def stats_row(self, engine: dict[str, int]) -> dict[str, int]:
        """The policy's part of a ``cache stats`` row (pinned entries and bytes, evicted bytes)."""
        held = [p for p in self.pins.values() if p.handle]
        return {
            "pinned_entries": len(held),
            "pinned_bytes": sum(p.tokens.shape[0] for p in held) * self.bytes_per_token,
            "evicted_bytes": self.evicted_bytes,
        }
