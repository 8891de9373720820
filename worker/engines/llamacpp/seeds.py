"""``Seeds``: the llama.cpp engine's prefix seeds (ABI section G; ``Capability.PREFIX_CACHE``
but ``seed_adopt``, which is ``sequences``') over ``prefix_cache`` and ``cells``: matches, seed
leases (acquire, release, adopt, expiry), seating an admit on its lease, publishing a retired
sequence and evicting entries.

Leases live ``seed_lease_ticks`` ticks past the tick count at which they were taken (rule 84);
``end_tick`` advances that count. An adopted sequence (``adopt``, rule 86) is held here until its
admit takes it over or its lease goes, which frees it. Sliding-window rules are
``prefix_cache.prefix_servable`` / ``window_intact`` over ``Cells.pos_range``.

Per-lane streams (``cells``): a published entry stays in the lane stream it was computed in, so a
retire publishes without a copy and the idle lane streams hold the most recent prefixes;
``vacate_lane_streams`` moves such entries to free ids above the lanes' when admits need the streams
(the evictions that make room are the plan's, ``feasibility.check_lane_streams``).

Publishing when ``max_entries`` entries exist first evicts the least recently used unpinned
  entry the plan's shed envelope allows; if none, the retire publishes nothing.

With a host tier (``host_tier.HostTier``, capacity > 0) an evicted entry is first captured into it
(``tiering.Tiering.demote``), matches offer its servable prefixes as ``Tier.HOST`` candidates, and
a seed that no resident entry serves restores one (``Tiering.promote``: room made by evicting, i.e.
demoting, least recently used unpinned entries), so the lease then pins a resident entry like any
other. Dropping
entries by key (``cache_evict_entries``) forgets them in both tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from basertd.schema.abi import ALL_SPACES, DeterminismClass, ShedKind, Status, Tier
from basertd.schema.tick import (
    CacheKey,
    MatchCandidate,
    MatchResult,
    ShedEntry,
    ShedPolicy,
    ShedReport,
    SpaceMatch,
    TokenRef,
)
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.host_tier import HostTier
from basertd.worker.engines.llamacpp.prefix_cache import (
    CacheEntry,
    Lease,
    PrefixCache,
    common_prefix,
    prefix_digest,
    prefix_servable,
    window_intact,
)
from basertd.worker.engines.llamacpp.tiering import Tiering
from basertd.worker.engines.llamacpp.work import SHED_REASON_POOL, SHED_REASON_PUBLISH

if TYPE_CHECKING:
    from basertd.worker.engines.llamacpp.model import LlamaModel
    from basertd.worker.engines.llamacpp.rings import EngineRings
    from basertd.worker.engines.llamacpp.sequences import BareSeq

KV_SPACE_ID = 0
"""space_id of the engine's one state space (PAGED_TOKEN_KV)."""

PROMPT_SNAPSHOT_MIN_TOKENS = 256
"""On a sliding-window model with a host tier, a prompt whose last page boundary is at least this
many tokens in is captured there as its prefill passes it (``Seeds.prompt_mark``), so the same
prompt sent again restores instead of prefilling. Shorter prompts are left out: they prefill in a
fraction of a second, and their snapshots would push the long prefixes a restore saves most on
out of the tier's least-recently-used order."""


class Seeds:
    """Published prefixes and seed leases of one engine over ``cells``, for ``model`` (its id,
    sliding window and KV bytes per token): ``seed_ttl`` is the lease TTL in ticks, ``stats`` the
    engine's counters (``evictions_total``, ``cached_tokens_total``, ``cold_fallbacks_total`` are
    counted here), ``rings`` where spans are read, ``identity`` the compat identity of the
    engine's cache keys and of its host-tier snapshots, ``host`` the host tier (None: off)."""

    def __init__(
        self,
        cells: Cells,
        cache: PrefixCache,
        model: LlamaModel,
        seed_ttl: int,
        stats: dict[str, int],
        rings: EngineRings,
        identity: bytes,
        host: HostTier | None = None,
    ) -> None:
        self.cells = cells
        self.host = host if host is not None else HostTier(0)
        self.rings = rings
        self.identity = identity
        self.cache = cache
        self.page = cache.page
        self.model_id = model.model_id
        self.n_swa = model.n_swa
        self.bytes_per_token = model.kv_bytes_per_token
        self.seed_ttl = seed_ttl
        self.stats = stats
        self.tick_index = 0  # accepted ticks so far: the lease clock
        self.adopted: dict[int, BareSeq] = {}  # bare handle -> adopted sequence awaiting its admit
        self._evictable = 0
        self._evictable_at: int | None = None  # cells.version it was computed at (None: pins moved)
        self.tiering = Tiering(
            cells, cache, self.host, model, identity, lambda e: self.evict(e, None, SHED_REASON_POOL)
        )

    # ------------------------------------------------------------------ matches

    def cached_cells(self) -> int:
        """KV cells the cache entries hold (each cell once, however many entries or lanes share
        it): what ``cache stats`` reports as the cache's bytes."""
        seqs = [self.cells.ledger.cells(e.seq) for e in self.cache.entries.values()]
        return int(np.unique(np.concatenate(seqs)).size) if seqs else 0

    def servable_len(self, entry: CacheEntry, limit: int) -> int:
        """Longest page multiple <= ``limit`` of ``entry`` that can seed a lane (0 if none)."""
        q = (min(limit, entry.length) // self.page) * self.page
        if q == 0:
            return 0
        pmin, pmax = self.cells.pos_range(entry.seq)
        return q if prefix_servable(pmin, pmax, q, self.n_swa) else 0

    def window_ok(self, pos_min: int, share_len: int) -> bool:
        """Whether a sequence holding ``[pos_min, ..]`` can be cut to ``share_len`` tokens and
        continue exactly (``prefix_cache.window_intact``)."""
        if share_len == 0:
            return True
        if pos_min > share_len - 1:
            return False
        return window_intact(pos_min, share_len - 1, share_len, self.n_swa)

    def space_match(self, space_id: int, span: TokenRef) -> MatchResult:
        """Cached prefixes of ``span`` (prompt-ring tokens) that can seed a lane, longest first,
        one per (length, taint), each a page multiple (ABI rules 87, 88); pins nothing. Raises
        EngineError(ERR_UNKNOWN_HANDLE) for another space id, (REJECT_BAD_REF_GENERATION) for a
        stale span."""
        if space_id not in (KV_SPACE_ID, ALL_SPACES):
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no state space {space_id}")
        toks = self.rings.read_prompt(span).astype(np.int32)
        seen: set[tuple[int, int]] = set()
        cands: list[MatchCandidate] = []
        for e in self.cache.entries.values():
            q = self.servable_len(e, common_prefix(e.tokens, toks))
            if q and (q, e.taint) not in seen:
                seen.add((q, e.taint))
                cands.append(
                    MatchCandidate(
                        prefix_len=q,
                        provenance_digest=prefix_digest(self.model_id, toks[:q]),
                        taint_bits=e.taint,
                        resident_tier=Tier.GPU,
                    )
                )
        for h in self.host:
            q = self.tiering.servable_len(h, common_prefix(h.tokens, toks))
            if q and (q, h.taint) not in seen:
                seen.add((q, h.taint))
                cands.append(
                    MatchCandidate(
                        prefix_len=q,
                        provenance_digest=prefix_digest(self.model_id, toks[:q]),
                        taint_bits=h.taint,
                        resident_tier=Tier.HOST,
                    )
                )
        cands.sort(key=lambda c: (-c.prefix_len, c.resident_tier))
        return MatchResult(spaces=[SpaceMatch(space_id=KV_SPACE_ID, candidates=cands)])

    # ------------------------------------------------------------------ leases

    def seed_lease_ticks(self) -> int:
        """The declared seed-lease TTL in ticks (ABI rule 84)."""
        return self.seed_ttl

    def seed_acquire(self, span: TokenRef, prefix_len: int, determinism_class: int) -> int:
        """Pin a cached entry serving ``span[:prefix_len]`` and return a seed handle for one admit,
        valid for this tick and the next ``seed_lease_ticks`` (ABI rules 75-83). Raises
        EngineError: REJECT_BOUNDS for prefix_len 0 or past the span, ERR_SEED_UNSERVABLE when no
        entry serves it (not a page multiple, not cached, window lost, or only tainted variants for
        a DETERMINISTIC seed), REJECT_BAD_REF_GENERATION for a stale span."""
        toks = self.rings.read_prompt(span).astype(np.int32)
        if prefix_len <= 0 or prefix_len > toks.shape[0]:
            raise EngineError(Status.REJECT_BOUNDS, f"prefix_len {prefix_len} outside 1..{toks.shape[0]}")
        if prefix_len % self.page:
            raise EngineError(Status.ERR_SEED_UNSERVABLE, f"{prefix_len} is not a multiple of {self.page}")
        prefix = toks[:prefix_len].copy()
        best: CacheEntry | None = None
        for e in self.cache.entries.values():
            if determinism_class == DeterminismClass.DETERMINISTIC and e.taint:
                continue
            if e.length < prefix_len or common_prefix(e.tokens, prefix) < prefix_len:
                continue
            if self.servable_len(e, prefix_len) != prefix_len:
                continue
            if best is None or (e.taint, -e.lru) < (best.taint, -best.lru):
                best = e
        if best is None:
            best = self.tiering.promote(prefix, determinism_class)
            if best is not None:
                self._evictable_at = None
        if best is None:
            raise EngineError(Status.ERR_SEED_UNSERVABLE, "no cached prefix serves this seed")
        best.pins += 1
        self.cache.touch(best)
        self._evictable_at = None
        lease = self.cache.new_lease(
            prefix,
            determinism_class,
            self.tick_index + self.seed_ttl,
            entry_id=best.entry_id,
            taint=best.taint,
        )
        return lease.handle

    def adopt(self, bare: BareSeq, span: np.ndarray) -> int:
        """Lease the bare sequence ``bare`` (already checked and taken from the bare set by
        ``Sequences.seed_adopt``) as the seed of one admit whose prompt starts with ``span``."""
        self.adopted[bare.handle] = bare
        lease = self.cache.new_lease(
            span.copy(),
            0,
            self.tick_index + self.seed_ttl,
            adopted=bare.handle,
            taint=bare.taint,
            pending=bare.pending,
        )
        return lease.handle

    def seed_release(self, seed_handle: int) -> None:
        """Release an unconsumed lease (an adopted sequence is freed with it);
        EngineError(ERR_UNKNOWN_HANDLE) for an unknown, consumed or expired handle (ABI rule 81)."""
        lease = self.cache.leases.get(seed_handle)
        if lease is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no seed {seed_handle}")
        self._drop_lease(lease)

    def _drop_lease(self, lease: Lease) -> None:
        self.cache.leases.pop(lease.handle, None)
        if lease.adopted:
            b = self.adopted.pop(lease.adopted, None)
            if b is not None:
                self.cells.free_seq(b.seq)
        else:
            e = self.cache.entries.get(lease.entry_id)
            if e is not None:
                e.pins -= 1
        self._evictable_at = None

    def end_tick(self) -> None:
        """An accepted tick ended: the lease clock advances and expired leases go."""
        self.tick_index += 1
        for lease in self.cache.expired(self.tick_index):
            self._drop_lease(lease)

    def source(self, lease: Lease) -> tuple[int, int, int, int]:
        """(seq id, length, pos_min, pos_max) of the sequence a lease serves from."""
        seq = self.adopted[lease.adopted].seq if lease.adopted else self.cache.entries[lease.entry_id].seq
        pmin, pmax = self.cells.pos_range(seq)
        return seq, self.cells.length(seq), pmin, pmax

    def prompt_mark(self, prefill_end: int, kv_len: int) -> int:
        """Where a lane admitted with ``kv_len`` tokens of KV and a prompt ending at
        ``prefill_end`` is snapshotted into the host tier as its prefill passes: the last page
        boundary before ``prefill_end`` (tokens), or 0 (no host tier, no sliding window, a short
        prompt, or a seed that already covers it). ``PROMPT_SNAPSHOT_MIN_TOKENS``."""
        if not self.host.enabled or self.n_swa <= 0:
            return 0
        mark = self._last_page_before(prefill_end)
        return mark if mark >= PROMPT_SNAPSHOT_MIN_TOKENS and mark > kv_len else 0

    def _last_page_before(self, prompt_end: int) -> int:
        """The last page boundary before ``prompt_end`` (tokens; 0 for an unknown end): where the
        same prompt sent again is seeded, its last token left to prefill."""
        return ((prompt_end - 1) // self.page) * self.page if prompt_end > 0 else 0

    def snapshot_prompt(self, seq: int, tokens: np.ndarray, mark: int, taint: int) -> bool:
        """The lane on ``seq`` holding ``tokens`` has prefilled past its ``mark``: keep a host
        snapshot of ``tokens[:mark]`` (``Tiering.snapshot``)."""
        return self.tiering.snapshot(seq, tokens[:mark], taint)

    def seat(self, lease: Lease, share_len: int, cold: bool) -> tuple[int, int, bool]:
        """An admit consumes ``lease``: ``(seq id, taint, cold)`` of the lane's sequence holding
        the lease's first ``share_len`` cells, or nothing when ``cold`` (the validated shape, or a
        window found broken after sharing: the lane then prefills from 0)."""
        seq = self.adopted.pop(lease.adopted).seq if lease.adopted else self.cells.take_lane_seq()
        self.cache.leases.pop(lease.handle, None)
        if lease.adopted:
            if not cold:
                self.cells.truncate(seq, share_len)
            seq = self.cells.into_lane(seq, 0 if cold else share_len)
        else:
            entry = self.cache.entries[lease.entry_id]
            entry.pins -= 1
            self.cache.touch(entry)
            if not cold and share_len:
                self.cells.copy(entry.seq, seq, share_len)
        if not cold and share_len and not window_intact(*self.cells.pos_range(seq), share_len, self.n_swa):
            cold = True  # the shared window is not what it should be: never trust it
        if cold:
            self.cells.clear(seq)
            self.stats["cold_fallbacks_total"] += 1
        else:
            self.stats["cached_tokens_total"] += share_len
        self._evictable_at = None
        return seq, lease.taint, cold

    # ------------------------------------------------------------------ publish and evict

    def publish(
        self,
        seq: int,
        tokens: np.ndarray,
        kv_len: int,
        taint: int,
        policy: ShedPolicy | None,
        shed: ShedReport | None,
        prompt_end: int = 0,
    ) -> bool:
        """Hand ``seq`` to the prefix cache under ``tokens[:whole pages of kv_len]``; the sequence
        is consumed either way (kept as the entry, or freed when nothing is published). A full
        cache first evicts what ``policy`` allows (reported in ``shed`` inside a tick). Returns
        True when an entry now serves those tokens (ABI rules 90, 91). ``prompt_end``: where the
        publishing lane's prompt ended (tokens; 0: unknown): the last page boundary before it is
        the entry's ``mark``, a second host-tier snapshot on sliding-window models."""
        n = (kv_len // self.page) * self.page
        if n == 0:
            self.cells.free_seq(seq)
            return False
        toks = np.array(tokens[:n], dtype=np.int32)
        digest = prefix_digest(self.model_id, toks)
        same = self.cache.find_identical(digest, taint)
        if same is not None:
            self.cache.touch(same)
            self.cells.free_seq(seq)
            return True
        self.cells.truncate(seq, n)
        pmin, pmax = self.cells.pos_range(seq)
        if not prefix_servable(pmin, pmax, n, self.n_swa):
            self.cells.free_seq(seq)  # its window is already gone: it could never seed a lane
            return False
        if len(self.cache.entries) >= self.cache.max_entries:
            victim = self._publish_victim(policy)
            if victim is None:
                self.cells.free_seq(seq)
                return False
            self.evict(victim, shed, SHED_REASON_PUBLISH)
        mark = self._last_page_before(prompt_end)
        self.cache.add(seq, toks, digest, taint, mark=mark if mark < n else 0)
        self.host.discard(digest, taint)  # one copy of a prefix, in one tier
        self._evictable_at = None
        return True

    def lane_stream_entries(self) -> list[CacheEntry]:
        """Per-lane: the entries that hold a lane stream, lowest stream first."""
        cells = self.cells
        held = [e for e in self.cache.entries.values() if cells.lane_stream(e.seq)]
        return sorted(held, key=lambda e: e.seq)

    def vacate_lane_streams(self, n: int) -> None:
        """Per-lane: make at least ``n`` lane streams free by moving the entries that hold the
        lowest ones to free ids above the lanes' (``Cells.move_stream``: one stream copy each, the
        entry keeps its leases), as far as such ids are free; the plan's validation evicted what
        had to go (``feasibility.check_lane_streams``)."""
        cells = self.cells
        held = self.lane_stream_entries()
        while cells.free_lane_streams < n and held and cells.free_seqs:
            e = held.pop(0)
            dst = cells.take_seq()
            cells.move_stream(e.seq, dst)
            e.seq = dst
            self._evictable_at = None

    def _publish_victim(self, policy: ShedPolicy | None) -> CacheEntry | None:
        if policy is None:
            return None
        cands = self.cache.eviction_order(policy.evictable_cache_classes)
        if not cands:
            return None
        ledger = self.cells.ledger
        total = ledger.freed_by([(e.seq, 0) for e in self.cache.entries.values()])
        cap = min(policy.max_evict_bytes, max(0, total * self.bytes_per_token - policy.protected_quota_bytes))
        for e in cands:
            if ledger.exclusive(e.seq) * self.bytes_per_token <= cap:
                return e
        return None

    def evict(self, entry: CacheEntry, shed: ShedReport | None, reason: int, demote: bool = True) -> int:
        """Drop a cache entry from the pool (captured into the host tier first when ``demote`` and
        the tier takes it); returns the pool bytes freed and, inside a tick (``shed``), reports a
        CACHE_EVICTION shed entry (ABI rule 58). An entry no longer cached (a tick's planned
        eviction whose entry the tick's publishing retire already evicted) frees nothing: 0."""
        if self.cache.entries.get(entry.entry_id) is not entry:
            return 0
        freed = self.cells.ledger.exclusive(entry.seq) * self.bytes_per_token
        if demote:
            self.tiering.demote(entry)
        self.cache.remove(entry)
        self.cells.free_seq(entry.seq)
        self.stats["evictions_total"] += 1
        if shed is not None:
            shed.entries.append(
                ShedEntry(
                    lane_tag=0, kind=ShedKind.CACHE_EVICTION, reason=reason, bytes=freed, tokens=entry.length
                )
            )
            shed.evictions_performed += 1
            shed.bytes_evicted += freed
        return freed

    def cache_evict(self, policy: ShedPolicy, bytes_target: int) -> int:
        """Evict unpinned entries of the policy's classes, least recently used first, freeing at
        most min(bytes_target, max_evict_bytes, cached bytes - protected_quota_bytes); returns the
        bytes freed (ABI rule 89)."""
        ledger = self.cells.ledger
        total = ledger.freed_by([(e.seq, 0) for e in self.cache.entries.values()]) * self.bytes_per_token
        cap = min(bytes_target, policy.max_evict_bytes, max(0, total - policy.protected_quota_bytes))
        freed = 0
        for e in self.cache.eviction_order(policy.evictable_cache_classes):
            gain = ledger.exclusive(e.seq) * self.bytes_per_token
            if freed + gain > cap:
                continue
            freed += self.evict(e, None, SHED_REASON_POOL)
        return freed

    def cache_evict_entries(self, keys: Sequence[CacheKey]) -> None:
        """Drop the unpinned entries named by (compat identity, provenance digest of the entry's
        tokens), from the pool and the host tier alike; keys of another identity, naming nothing,
        or naming pinned entries, are left alone."""
        for k in keys:
            if k.compat_key != self.identity:
                continue
            for e in list(self.cache.entries.values()):
                if e.digest == k.provenance_digest and e.pins == 0:
                    self.evict(e, None, SHED_REASON_POOL, demote=False)
            self.host.discard(k.provenance_digest)

    def evictable_bytes(self) -> int:
        """Bytes evicting every unpinned entry would free (recomputed only after a change)."""
        if self._evictable_at != self.cells.version:
            unpinned = [(e.seq, 0) for e in self.cache.entries.values() if e.pins == 0]
            self._evictable = self.cells.ledger.freed_by(unpinned) * self.bytes_per_token
            self._evictable_at = self.cells.version
        return self._evictable
