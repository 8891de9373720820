"""The prefix-cache policy: what the coordinator publishes, seeds, coalesces, pins and evicts
(DESIGN.md "Prefix cache policy", issue 8).

The engine stores published prefixes (a lane retired with ``publish_to_cache`` leaves its KV
behind, whole pages only) and answers ``space_match`` / ``seed_acquire``; everything else is
decided here, per worker (``WorkerCache``), with the scheduler driving it between ticks.

**Index.** ``PrefixIndex`` is a radix index of the prefixes this worker has published, at page
granularity: a prefix of ``n`` whole pages is the path of its chained page hashes
``h1 .. hn`` (``page_hashes``: ``h_i = xxh3_64(tokens of page i, seed=h_(i-1))``), so two prompts
share their first ``k`` pages exactly when they share ``h_k`` (up to 64-bit collisions, which the
engine's own token comparison in ``space_match`` catches). Nodes are counted per entry, so the
longest indexed prefix of a prompt is a binary search over its hash path. The index is a *hint*:
it lets a prompt with nothing cached skip the MATCH round trip, and it routes and coalesces.
``space_match`` is the truth (ABI rules 87, 88): a seed is always matched first, then acquired
(rules 75-83) at the longest untainted page multiple the engine offers, and an index path longer
than what the engine matched is pruned.

**Leases.** A seed lease is consumed by the admit of the plan submitted right after it was
acquired (valid for ticks up to ``grant.tick + lease_ticks``, rule 83). A lease whose admit did
not happen (plan rejected, admit refused, admission cut) is released at once; none is kept
across a tick except pins (below). Lease counts therefore return to zero whenever no pin is held.

**Coalescing** (``coalesce``). A lane publishes only when it retires. When a queued request
shares at least ``coalesce_min_tokens`` uncached prompt tokens with a live lane, or with a request
queued ahead of it, it waits (it is not offered for admission), and the *leader* gets a
checkpoint at the shared page boundary: its prefill stops there (a lane already past it stops
at once) and it retires with ``publish_to_cache``, is requeued at the head of its class (exactly
as a preemption, after however many tokens it generated) and comes back seeded from its own
prefix, with all its followers seeded from the same entry. A leader that was already decoding
(the first request of a burst, admitted before the others arrived) pauses for a tick and
resumes exactly (ABI rules 71-73). So a prefix shared by a burst of requests is prefilled once,
by the first of them, and none of them ever prefills it twice: a request leads at most one
checkpoint. A lane retiring with publish in the plan being built (a finished request) leads too:
a request sharing its prefix waits that one tick and is seeded from it (the next turn of a
conversation, sent the moment the previous one ended).
The leader's own seed is its own work, so it reports ``cached_tokens`` 0 (cached tokens count at
a request's first admission only; tokens recomputed or re-seeded after a preemption or
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog
import xxhash

from basertd.schema import control
from basertd.schema.abi import Status
from basertd.schema.client import ErrorCode
from basertd.schema.tick import MatchResult, ShedPolicy, TokenRef
from basertd.server.config import CacheConfig
from basertd.server.errors import ControlError
from basertd.server.link import LinkError, WorkerError

log = structlog.get_logger("basertd.cache")

U64_MAX = (1 << 64) - 1
ALL_CLASSES = U64_MAX
"""``evictable_cache_classes`` of every envelope: any class (the engines put every entry in bit 0;
what must stay is leased, and the protected quota covers it)."""


# --- page hashes ---------------------------------------------------------------------------------


def page_hashes(tokens: Sequence[int] | np.ndarray, page: int, known: Sequence[int] = ()) -> list[int]:
    """Chained hashes of the whole pages of ``tokens`` (``page`` tokens each): element ``i`` names the
    prefix ``tokens[: (i + 1) * page]``. ``known``: hashes already computed for a prefix of the same
    tokens at the same page size (reused, not recomputed). Raises ValueError for ``page`` < 1."""
    if page < 1:
        raise ValueError(f"page must be >= 1 token, got {page}")
    arr = np.asarray(tokens, dtype="<u4")
    n = arr.shape[0] // page
    out = list(known[:n])
    h = out[-1] if out else 0
    for i in range(len(out), n):
        h = xxhash.xxh3_64_intdigest(arr[i * page : (i + 1) * page].tobytes(), seed=h)
        out.append(h)
    return out


def lcp_pages(a: Sequence[int], b: Sequence[int]) -> int:
    """Pages two hash paths share (their chains agree up to there and differ after)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- the index -----------------------------------------------------------------------------------


@dataclass(eq=False)
class IndexEntry:
    """One published prefix: ``tokens`` (whole pages, uint32), its hash path, ``last_used``
    (monotonic seconds), ``hits`` (seeds served from it), ``pin_id`` (0: not pinned)."""

    tokens: np.ndarray
    hashes: list[int]
    last_used: float
    hits: int = 0
    pin_id: int = 0

    @property
    def length(self) -> int:
        """Tokens of the prefix."""
        return int(self.tokens.shape[0])


class IndexObserver(Protocol):
    """Told when pages enter or leave a ``PrefixIndex`` (``basertd.server.kv_events``): ``stored``
    a chain of page hashes following ``parent`` (None: the first page of a prompt) with their
    tokens, ``removed`` hashes, ``cleared`` when a new worker incarnation starts empty."""

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: np.ndarray) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class PrefixIndex:
    """Radix index of published prefixes of one worker at ``page``-token granularity (module
    docstring), holding at most ``max_entries`` entries (the least recently used unpinned one is
    forgotten first; the engine may still hold it, it is then only found again by publishing).
    ``observer`` (optional) is told of every page (node) that enters or leaves the index."""

    def __init__(self, page: int, max_entries: int = 1024, observer: IndexObserver | None = None) -> None:
        if page < 1 or max_entries < 1:
            raise ValueError("page and max_entries must be >= 1")
        self.page = page
        self.max_entries = max_entries
        self.nodes: dict[int, int] = {}
        self.entries: dict[int, IndexEntry] = {}
        self.observer = observer

    def __len__(self) -> int:
        return len(self.entries)

    def longest(self, hashes: Sequence[int]) -> int:
        """Whole pages of the longest indexed prefix of the path ``hashes``."""
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in self.nodes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, tokens: np.ndarray, hashes: Sequence[int], now: float) -> IndexEntry | None:
        """Record the published prefix ``tokens[: len(hashes) * page]`` (None when under a page).
        Publishing the same prefix again refreshes its entry."""
        n = len(hashes)
        if n == 0:
            return None
        key = hashes[-1]
        entry = self.entries.get(key)
        if entry is not None:
            entry.last_used = now
            return entry
        entry = IndexEntry(np.array(tokens[: n * self.page], dtype=np.uint32), list(hashes), now)
        self.entries[key] = entry
        new = [i for i, h in enumerate(entry.hashes) if h not in self.nodes]
        for h in entry.hashes:
            self.nodes[h] = self.nodes.get(h, 0) + 1
        if self.observer is not None and new:
            self._tell_stored(entry, new)
        while len(self.entries) > self.max_entries:
            victims = [e for e in self.entries.values() if not e.pin_id]
            if not victims:
                break
            self.remove(min(victims, key=lambda e: e.last_used))
        return entry

    def remove(self, entry: IndexEntry) -> None:
        """Forget ``entry`` (no-op if absent)."""
        if self.entries.pop(entry.hashes[-1], None) is None:
            return
        gone = []
        for h in entry.hashes:
            c = self.nodes.get(h, 0) - 1
            if c > 0:
                self.nodes[h] = c
            elif self.nodes.pop(h, None) is not None:
                gone.append(h)
        if self.observer is not None and gone:
            self.observer.removed(gone)

    def _tell_stored(self, entry: IndexEntry, new: list[int]) -> None:
        """``observer.stored`` for each run of consecutive new pages of ``entry`` (indices)."""
        assert self.observer is not None
        start = prev = new[0]
        for i in [*new[1:], -1]:
            if i == prev + 1:
                prev = i
                continue
            parent = entry.hashes[start - 1] if start > 0 else None
            toks = entry.tokens[start * self.page : (prev + 1) * self.page]
            self.observer.stored(entry.hashes[start : prev + 1], parent, toks)
            start = prev = i

    def find(self, hashes: Sequence[int], pages: int) -> IndexEntry | None:
        """An entry whose path passes through ``hashes[pages - 1]`` (the one ending there first)."""
        if pages <= 0:
            return None
        exact = self.entries.get(hashes[pages - 1])
        if exact is not None:
            return exact
        h = hashes[pages - 1]
        for e in self.entries.values():
            if len(e.hashes) >= pages and e.hashes[pages - 1] == h:
                return e
        return None

    def prune(self, hashes: Sequence[int], pages_ok: int) -> int:
        """The engine serves only ``pages_ok`` pages of the path ``hashes``: forget the unpinned
        entries that claim more of it. Returns how many were forgotten."""
        if pages_ok >= len(hashes):
            return 0
        h = hashes[pages_ok]
        gone = [
            e
            for e in self.entries.values()
            if not e.pin_id and len(e.hashes) > pages_ok and e.hashes[pages_ok] == h
        ]
        for e in gone:
            self.remove(e)
        return len(gone)

    def clear(self, *, keep_pinned: bool = True) -> None:
        """Forget every entry (pinned ones too unless ``keep_pinned``)."""
        for e in list(self.entries.values()):
            if not (keep_pinned and e.pin_id):
                self.remove(e)

    def by_recency(self) -> list[IndexEntry]:
        """Entries, most recently used first."""
        return sorted(self.entries.values(), key=lambda e: e.last_used, reverse=True)


# --- coalescing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueuedPrompt:
    """A queued request as coalescing sees it: ``key``, its prompt's page hash path, the pages the
    index says are cached, its prefill end (tokens), whether it may lead (a request leads at most
    one checkpoint), and its QoS rank (it never waits for a leader of a lower class)."""

    key: int
    hashes: Sequence[int]
    cached_pages: int
    prefill_end: int
    can_lead: bool = True
    rank: int = 0


@dataclass(frozen=True)
class PrefillingLane:
    """A live lane that may lead (prefilling or decoding): ``tag``, its prompt's hash path, tokens
    prefilled so far, its prefill end, whether it may lead, its QoS rank, and whether it retires
    with publish in the plan being built (its prefix is cached one tick from now, with no pause
    for anyone: such a lane leads requests of every class)."""

    tag: int
    hashes: Sequence[int]
    prefilled: int
    prefill_end: int
    can_lead: bool = True
    rank: int = 0
    retiring: bool = False


@dataclass
class Coalescing:
    """The decision of one ``coalesce`` pass: ``blocked`` request keys (not offered for admission),
    checkpoints (tokens) for queued leaders (``leader_checkpoints``, by key) and live leader lanes
    (``lane_checkpoints``, by tag)."""

    blocked: set[int] = field(default_factory=set)
    leader_checkpoints: dict[int, int] = field(default_factory=dict)
    lane_checkpoints: dict[int, int] = field(default_factory=dict)


def coalesce(
    queued: Sequence[QueuedPrompt], lanes: Sequence[PrefillingLane], page: int, min_tokens: int
) -> Coalescing:
    """Which queued requests wait for a leader's prefix, and where the leaders checkpoint (module
    docstring). ``queued`` in admission order. A request waits when a live lane (a decoding one
    only of its own class), or a request queued ahead of it, of its class or a higher one, shares
    with it at least ``min_tokens`` tokens (whole pages, within the leader's prefill end) beyond
    what the index says is cached for it. Pure."""
    out = Coalescing()
    m = max(1, -(-min_tokens // page)) if min_tokens > 0 else 0
    if m == 0:
        return out
    by_group: dict[int, list[PrefillingLane]] = {}
    for ln in lanes:
        if ln.can_lead and len(ln.hashes) >= m:
            by_group.setdefault(ln.hashes[m - 1], []).append(ln)
    leaders: dict[int, QueuedPrompt] = {}
    for q in queued:
        if len(q.hashes) < m:
            continue
        group = q.hashes[m - 1]
        best: tuple[int, int] | None = None  # (shared pages, lane tag)
        for ln in by_group.get(group, ()):
            decoding = ln.prefilled >= ln.prefill_end
            if not ln.retiring and (ln.rank > q.rank or (decoding and ln.rank != q.rank)):
                continue  # never pause a decoding lane for a request of a lower class
            shared = min(lcp_pages(q.hashes, ln.hashes), ln.prefill_end // page)
            if shared - q.cached_pages >= m and (best is None or shared > best[0]):
                best = (shared, ln.tag)
        if best is not None:
            out.blocked.add(q.key)
            out.lane_checkpoints[best[1]] = max(out.lane_checkpoints.get(best[1], 0), best[0] * page)
            continue
        lead = leaders.get(group)
        if lead is not None and lead.rank <= q.rank:
            shared = min(lcp_pages(q.hashes, lead.hashes), lead.prefill_end // page)
            if shared - q.cached_pages >= m and shared > lead.cached_pages:
                out.blocked.add(q.key)
                cp = out.leader_checkpoints.get(lead.key, 0)
                out.leader_checkpoints[lead.key] = max(cp, shared * page)
                continue
        if q.can_lead and lead is None:
            leaders[group] = q
    return out


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
    """What the policy needs of a running worker (``basertd.server.worker_proc.WorkerProcess``)."""

    link: Any
    prompt_ring: Any
    capabilities: Any


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
        self.observer: IndexObserver | None = None
        self.index = PrefixIndex(self.page, config.index_entries)
        self.pins: dict[int, PinHold] = {}
        self.engine_ticks = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.seeds_acquired = 0
        self.seed_misses = 0
        self.attached = False

    # --- incarnation ---------------------------------------------------------------------------

    def attach(self, caps: Any) -> None:
        """A new worker incarnation handshook with capability record ``caps``: forget the index and
        every lease (the engine's cache is empty), keep the pins (held again by ``renew``)."""
        self.page = max(1, int(caps.page_size_tokens))
        paged = [s for s in caps.state_spaces if s.bytes_per_token]
        self.bytes_per_token = sum(int(s.bytes_per_token) for s in paged)
        self.block_bytes = self.bytes_per_token * self.page
        self.lease_ticks = int(caps.seed_lease_ticks)
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
        and ``cleared()`` at each new incarnation (``basertd.server.kv_events``)."""
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

    def on_tick(self, shed_entries: Sequence[Any]) -> None:
        """An accepted tick ran: count it, and the cache evictions it reports (ABI rule 58)."""
        self.engine_ticks += 1
        for e in shed_entries:
            if e.kind == 2:  # ShedKind.CACHE_EVICTION
                self.evictions += 1
                self.evicted_bytes += int(e.bytes)

    # --- hints ---------------------------------------------------------------------------------

    def hashes(self, tokens: Sequence[int] | np.ndarray, known: Sequence[int] = ()) -> list[int]:
        """``page_hashes`` at this worker's page size."""
        return page_hashes(tokens, self.page, known)

    def hint(self, hashes: Sequence[int], limit: int) -> int:
        """Tokens the index says are cached for the path ``hashes`` (a page multiple <= ``limit``)."""
        if not self.enabled:
            return 0
        pages = min(self.index.longest(hashes), limit // self.page)
        return pages * self.page

    def published(
        self, tokens: np.ndarray | Sequence[int], kv_tokens: int, hashes: Sequence[int] = ()
    ) -> None:
        """A lane retired with ``publish_to_cache`` holding the KV of ``kv_tokens`` of ``tokens``:
        the engine keeps its whole pages (ABI rule 91)."""
        pages = kv_tokens // self.page
        if pages <= 0:
            return
        arr = np.asarray(tokens, dtype=np.uint32)[: pages * self.page]
        path = page_hashes(arr, self.page, hashes)
        self.index.insert(arr, path, time.monotonic())

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
        length = best_candidate(match, limit, self.page)
        if length < self.index.longest(hashes) * self.page:
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
        ref = proc.prompt_ring.write(pin.tokens)
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
        """Forget pin ``pin_id`` here and release its lease; False when it is not pinned here."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        if pin.handle and proc is not None:
            await self.release(proc, pin.handle)
        for e in self.index.entries.values():
            if e.pin_id == pin_id:
                e.pin_id = 0
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
        clears the unpinned index; a partial one leaves the index to be corrected by matches."""
        target = bytes_target or U64_MAX
        freed = await proc.link.cache_evict(self.shed_policy(target), target)
        if freed:
            self.evicted_bytes += freed
        if bytes_target == 0:
            self.index.clear(keep_pinned=True)
        return freed

    async def verified_entries(self, proc: WorkerLike) -> list[IndexEntry]:
        """The index, each entry checked against ``space_match``: entries the engine no longer
        serves in full are forgotten. Most recently used first."""
        out = []
        for e in self.index.by_recency():
            ref = proc.prompt_ring.write(e.tokens)
            try:
                match = await proc.link.match(ref)
            except WorkerError:
                continue
            served = best_candidate(match, e.length, self.page)
            if served >= e.length:
                out.append(e)
            elif not e.pin_id:
                self.index.remove(e)
        return out

    def stats_row(self, engine: dict[str, int]) -> dict[str, int]:
        """The policy's part of a ``cache stats`` row (pinned entries and bytes, evicted bytes)."""
        held = [p for p in self.pins.values() if p.handle]
        return {
            "pinned_entries": len(held),
            "pinned_bytes": sum(p.tokens.shape[0] for p in held) * self.bytes_per_token,
            "evicted_bytes": self.evicted_bytes,
        }


# --- the daemon's cache verbs ----------------------------------------------------------------------


class SchedulerLike(Protocol):
    """What the verbs need of a scheduler (``basertd.server.scheduler.Scheduler``)."""

    worker_id: int
    cache_policy: WorkerCache

    async def between_ticks(self, job: Callable[[Any], Awaitable[Any]], timeout: float = ...) -> Any: ...

    async def warm_prefix(self, tokens: list[int], timeout: float) -> None: ...


@dataclass
class PinRecord:
    """A pin across workers: ``pin_id`` and the prefix length (tokens) pinned on each worker."""

    pin_id: int
    lengths: dict[int, int] = field(default_factory=dict)


class PolicyCacheControl:
    """The ``basertd.server.control.CacheControl`` of the prefix-cache policy: ``cache stats`` /
    ``ls`` / ``pin`` / ``unpin`` / ``evict`` served from the schedulers' ``WorkerCache`` objects,
    through jobs each scheduler runs between two ticks (so nothing races a tick's prompt-ring
    writes or leases). ``engine_stats(worker_id)`` answers a worker's engine counters (PONG) and
    ``counter(name, worker_id)`` a metrics counter. Methods raise ``ControlError``."""

    def __init__(
        self,
        schedulers: Sequence[SchedulerLike],
        engine_stats: Callable[[int], Awaitable[dict[str, int] | None]],
        counter: Callable[[str, int], int],
        *,
        pin_timeout_s: float = 120.0,
    ) -> None:
        self.schedulers = schedulers
        self.engine_stats = engine_stats
        self.counter = counter
        self.pin_timeout_s = pin_timeout_s
        self.pins: dict[int, PinRecord] = {}
        self._next_pin = 1

    async def stats(self) -> list[control.CacheStatsRow]:
        """One row per worker (``CacheControl.stats``)."""
        rows = []
        for sched in self.schedulers:
            i = sched.worker_id
            engine = await self.engine_stats(i) or {}
            own = sched.cache_policy.stats_row(engine)
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
                )
            )
        return rows

    async def entries(self, worker_id: int | None, limit: int) -> list[control.CacheEntryRow]:
        """Cached prefixes, verified against the engines, most recently used first."""
        now = time.monotonic()
        rows: list[tuple[float, control.CacheEntryRow]] = []
        for sched in self.schedulers:
            if worker_id is not None and sched.worker_id != worker_id:
                continue
            wc = sched.cache_policy
            found = await self._job(sched, wc.verified_entries)
            for e in found:
                row = control.CacheEntryRow(
                    worker_id=sched.worker_id,
                    prefix_tokens=e.length,
                    bytes=e.length * wc.bytes_per_token,
                    pin_id=e.pin_id,
                    hits=e.hits,
                    idle_s=max(0.0, now - e.last_used),
                    head=[int(t) for t in e.tokens[:8]],
                )
                rows.append((e.last_used, row))
        rows.sort(key=lambda r: r[0], reverse=True)
        return [r for _, r in rows[:limit]]

    async def pin(self, tokens_by_worker: dict[int, list[int]]) -> control.CachePinResult:
        """Pin each worker's prefix (its whole pages): warm it with an internal one-token request
        when it is not cached, then hold it with a renewed lease. Raises ``ControlError``
        INVALID_REQUEST (cache disabled, shorter than a page), WORKER_FAILED, TIMEOUT."""
        by_sched = {s.worker_id: s for s in self.schedulers}
        pin_id = self._next_pin
        record = PinRecord(pin_id)
        for wid, tokens in tokens_by_worker.items():
            sched = by_sched[wid]
            wc = sched.cache_policy
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
            arr = np.array(tokens[:n], dtype=np.uint32)
            hold = PinHold(pin_id, arr, page_hashes(arr, wc.page))

            async def try_hold(proc: Any, hold: PinHold = hold, wc: WorkerCache = wc) -> bool:
                return await wc.hold(proc, hold)

            if not await self._job(sched, try_hold):
                await sched.warm_prefix([int(t) for t in arr], self.pin_timeout_s)
                if not await self._job(sched, try_hold):
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
        for sched in self.schedulers:
            if sched.worker_id not in record.lengths:
                continue
            wc = sched.cache_policy

            async def drop(proc: Any, wc: WorkerCache = wc) -> bool:
                return await wc.drop_pin(proc, pin_id)

            try:
                await self._job(sched, drop)
            except ControlError:
                await wc.drop_pin(None, pin_id)  # the worker is down: its lease died with it
        log.info("cache_unpinned", pin_id=pin_id)

    async def evict(self, worker_id: int | None, bytes_target: int) -> control.CacheEvictResult:
        """Evict unpinned prefixes on one or every worker (``CacheControl.evict``)."""
        freed = entries = 0
        for sched in self.schedulers:
            if worker_id is not None and sched.worker_id != worker_id:
                continue
            before = await self.engine_stats(sched.worker_id) or {}
            wc = sched.cache_policy

            async def run(proc: Any, wc: WorkerCache = wc) -> int:
                return await wc.evict(proc, bytes_target)

            try:
                freed += await self._job(sched, run)
            except ControlError as exc:
                if exc.code != ErrorCode.WORKER_FAILED or worker_id is not None:
                    raise
                continue
            after = await self.engine_stats(sched.worker_id) or {}
            entries += max(0, int(before.get("cache_entries", 0)) - int(after.get("cache_entries", 0)))
        log.info("cache_evicted", worker_id=worker_id, bytes_target=bytes_target, bytes_freed=freed)
        return control.CacheEvictResult(bytes_freed=freed, entries=entries)

    async def _job(self, sched: SchedulerLike, job: Callable[[Any], Awaitable[Any]]) -> Any:
        try:
            return await sched.between_ticks(job)
        except LinkError as exc:
            raise ControlError(ErrorCode.WORKER_FAILED, f"worker {sched.worker_id}: {exc}") from None
        except TimeoutError:
            raise ControlError(
                ErrorCode.TIMEOUT, f"worker {sched.worker_id} is busy or not running"
            ) from None
