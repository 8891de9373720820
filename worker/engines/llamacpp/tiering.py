"""``Tiering``: the moves of the llama.cpp engine's prefixes between its KV pool and its host tier
(``host_tier.HostTier``), for ``seeds.Seeds``: ``demote`` captures an entry about to be evicted
(at its end and, on a sliding-window model, at its prompt's last page ``mark``), ``promote``
restores the demoted entry that serves a seed into a resident one (room made by evicting, i.e.
demoting, least recently used unpinned entries) after checking its snapshot (envelope, length,
provenance, llama.cpp's load, the restored window); a refused snapshot is dropped and counted.

A restore keeps only the window of its end on a sliding-window model, so there a demoted entry
serves exactly its own length (``servable_len``); without a window any page multiple up to it.

A capture that would only repeat a held prefix is skipped (``near_duplicate``): requests that share
a long prefix and differ in a short tail (one system prompt, many questions) would otherwise each
keep a snapshot of the whole prefix for the sake of its last few pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import structlog

from basertd.schema.abi import DeterminismClass
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.host_tier import HostEntry, HostTier, capture
from basertd.worker.engines.llamacpp.prefix_cache import (
    CACHE_CLASS,
    CacheEntry,
    PrefixCache,
    common_prefix,
    prefix_digest,
    prefix_servable,
    window_intact,
)
from basertd.worker.engines.llamacpp.state import open_sealed

if TYPE_CHECKING:
    from basertd.worker.engines.llamacpp.model import LlamaModel

log = structlog.get_logger("basertd.worker.host_tier")

NEAR_DUPLICATE_SHARE = 32
"""A capture of ``n`` tokens is skipped when the pool or the tier already holds, with its taint, a
prefix of it of at least ``n - n // NEAR_DUPLICATE_SHARE`` tokens that can seed a lane at its own
length: that prefix serves the same prompt sent again with at most 1/32 of it (about 3 %) left to
prefill, while a snapshot of its own would cost the bytes of the whole prefix's KV (about 7 KiB a
token on the default model)."""


class Tiering:
    """Moves between ``cache`` (resident entries over ``cells``) and ``host`` for ``model`` (its id,
    sliding window); ``identity`` seals and checks the snapshots; ``evict(entry)`` evicts a
    resident entry (demoting it) to make room for a restore."""

    def __init__(
        self,
        cells: Cells,
        cache: PrefixCache,
        host: HostTier,
        model: LlamaModel,
        identity: bytes,
        evict: Callable[[CacheEntry], object],
    ) -> None:
        self.cells = cells
        self.cache = cache
        self.host = host
        self.identity = identity
        self.page = cache.page
        self.model_id = model.model_id
        self.n_swa = model.n_swa
        self._evict = evict

    def servable_len(self, h: HostEntry, limit: int) -> int:
        """Longest page multiple <= ``limit`` of the demoted ``h`` that can seed a lane once
        restored: any without a sliding window, else ``h``'s own length only (a restore keeps the
        window of its end alone: ``host_tier``)."""
        q = (min(limit, h.length) // self.page) * self.page
        if self.n_swa > 0 and q != h.length:
            return 0
        return q

    def promote(self, prefix: np.ndarray, determinism_class: int) -> CacheEntry | None:
        """Restore the demoted entry that serves ``prefix`` best (untainted first, then most
        recent) into a resident entry, or None: nothing serves it, no room can be made, or its
        snapshot is refused (counted, and dropped: never used unverified)."""
        n = prefix.shape[0]
        best: HostEntry | None = None
        for h in self.host:
            if determinism_class == DeterminismClass.DETERMINISTIC and h.taint:
                continue
            if h.length < n or common_prefix(h.tokens, prefix) < n or self.servable_len(h, n) != n:
                continue
            if best is None or (h.taint, -h.lru) < (best.taint, -best.lru):
                best = h
        if best is None:
            return None
        self.host.remove(best)  # out of reach of the demotions that make room for it
        seq = self._room_for(best.length)
        if seq is None:
            self.host.put(best)
            return None
        t0 = time.perf_counter_ns()
        why = self._load(best, seq)
        if why:
            self.cells.free_seq(seq)
            self.host.refused(best)
            log.warning("host_snapshot_refused", tokens=best.length, reason=why)
            return None
        self.host.restored(best, time.perf_counter_ns() - t0)
        return self.cache.add(seq, best.tokens, best.digest, best.taint)

    def _room_for(self, n: int) -> int | None:
        """A free sequence id and ``n`` free cells for a restored entry, evicting (demoting) least
        recently used unpinned entries as needed; None when that cannot be done."""
        victims = self.cache.eviction_order(CACHE_CLASS)
        while victims and not self._has_room(n):
            self._evict(victims.pop(0))
        if not self._has_room(n):
            return None
        try:
            return self.cells.take_entry_seq()
        except EngineError:
            return None

    def _has_room(self, n: int) -> bool:
        cells = self.cells
        return len(self.cache.entries) < self.cache.max_entries and cells.free >= n and cells.entry_seq_free

    def _load(self, h: HostEntry, seq: int) -> str:
        """Load ``h``'s snapshot into the empty ``seq`` after checking it names exactly ``h``'s
        tokens on this engine; "" when it did, else why not (``seq`` left for the caller to free)."""
        try:
            env, payload = open_sealed(h.blob, identity=self.identity)
        except EngineError as exc:
            return f"{exc.status.name}: {exc}"
        with payload:
            if env.range.end != h.length:
                return f"the snapshot holds {env.range.end} tokens, the entry {h.length}"
            if env.provenance_digest != h.digest or env.taint_bits != h.taint:
                return "the snapshot's provenance is not the entry's"
            if prefix_digest(self.model_id, h.tokens) != h.digest:
                return "the entry's tokens do not match its digest"
            if not self.cells.load(seq, payload, h.length):
                return "llama.cpp refused the payload"
        pmin, pmax = self.cells.pos_range(seq)
        if not window_intact(pmin, pmax, h.length, self.n_swa):
            return f"restored positions [{pmin}, {pmax}] cannot continue at {h.length}"
        return ""

    def snapshot(self, seq: int, tokens: np.ndarray, taint: int) -> bool:
        """Capture the first ``tokens.shape[0]`` positions of the live sequence ``seq`` (a lane
        whose prefill just passed that page boundary; ``tokens`` its tokens there) into the host
        tier, unless the pool or the tier already holds that prefix or its window is gone.
        True when a snapshot was kept."""
        digest = prefix_digest(self.model_id, tokens)
        if self.cache.find_identical(digest, taint) is not None or self.host.has(digest, taint):
            return False
        if self.near_duplicate(tokens, taint):
            return False
        pmin, pmax = self.cells.pos_range(seq)
        if not prefix_servable(pmin, pmax, tokens.shape[0], self.n_swa):
            return False
        if not self._keep(seq, tokens.copy(), digest, taint):
            return False
        self.host.snapshots_total += 1
        return True

    def demote(self, entry: CacheEntry) -> int:
        """Capture ``entry`` (resident, about to be evicted: its sequence is cut here) into the
        host tier at its end and, on a sliding-window model, at its ``mark`` too (``host_tier``);
        returns the snapshots kept (0 when the tier is off, no boundary can seed a lane, or
        nothing fits). A boundary the tier already holds is only marked recently used. The mark
        is captured after cutting the sequence to it, which copies nothing (a capture of a shorter
        prefix of a live sequence goes through the scratch sequence: ``Cells.with_prefix``)."""
        if not self.host.enabled or self.cells.length(entry.seq) != entry.length:
            return 0
        pmin, pmax = self.cells.pos_range(entry.seq)
        ends = [entry.length]
        if self.n_swa > 0 and 0 < entry.mark < entry.length:
            ends.append(entry.mark)
        kept = 0
        for end in ends:
            if not prefix_servable(pmin, pmax, end, self.n_swa):
                continue
            toks = entry.tokens[:end]
            digest = entry.digest if end == entry.length else prefix_digest(self.model_id, toks)
            if self.host.touch(digest, entry.taint):
                continue
            if self.near_duplicate(toks, entry.taint, besides=entry):
                continue
            self.cells.truncate(entry.seq, end)
            if self._keep(entry.seq, toks, digest, entry.taint):
                self.host.demotions_total += 1
                kept += 1
        return kept

    def near_duplicate(self, tokens: np.ndarray, taint: int, besides: CacheEntry | None = None) -> bool:
        """Whether a resident entry (other than ``besides``, the one being demoted) or a demoted
        one holds, with ``taint``, a page-aligned prefix of ``tokens`` short of it by at most
        ``1 / NEAR_DUPLICATE_SHARE`` of its length (module docstring); counted in the tier's
        ``near_duplicates_total`` when it does."""
        n = tokens.shape[0]
        floor = n - n // NEAR_DUPLICATE_SHARE
        held = [(h.tokens, h.taint) for h in self.host]
        held += [(e.tokens, e.taint) for e in self.cache.entries.values() if e is not besides]
        for toks, t in held:
            length = toks.shape[0]
            if t != taint or not floor <= length < n or length % self.page:
                continue
            if common_prefix(toks, tokens) >= length:
                self.host.near_duplicates_total += 1
                return True
        return False

    def _keep(self, seq: int, tokens: np.ndarray, digest: bytes, taint: int) -> bool:
        """Seal the first ``tokens.shape[0]`` positions of ``seq`` (their provenance ``digest``)
        and put them in the host tier; False when llama.cpp wrote nothing or it does not fit
        (counted as dropped)."""
        n = tokens.shape[0]

        def grab(s: int) -> bytearray | None:
            return capture(
                self.cells.ctx,
                s,
                identity=self.identity,
                provenance=digest,
                taint=taint,
                n_tokens=n,
                max_bytes=self.host.capacity,
            )

        blob = self.cells.with_prefix(seq, n, grab)
        if blob is None:
            self.host.dropped_total += 1
            return False
        return self.host.put(HostEntry(tokens, digest, taint, blob))
