"""Published prefixes, seed leases and eviction order for the llama.cpp engine (ABI section G).

A cache entry is a llama.cpp sequence id that keeps the KV cells of ``tokens`` (a whole number of
pages): retiring a lane with ``publish_to_cache`` hands the lane's sequence to the cache, trimmed to
its last whole page, so publishing copies nothing. A seeded admit shares an entry's first ``p``
cells with ``llama_memory_seq_cp`` (zero-copy in the unified cache) and prefills only the suffix.

Leases pin entries: ``seed_acquire`` validates the prefix, pins the entry and returns a handle that
one admit consumes (ABI rules 81-83); an unconsumed lease expires ``ttl`` ticks after the tick count
at which it was taken. ``seed_adopt`` leases a bare restored sequence instead (rule 86).

Sliding-window models (Gemma 3): llama.cpp may reuse the cells of an entry's positions that are out
of the entry's own window, so an entry can lose the window needed to branch off before its end
(``../shared/reference/llamacpp-notes.md`` section 2). ``prefix_servable`` answers, from the
entry's ``llama_memory_seq_pos_min``, whether a prefix of length ``p`` still has every windowed key
a lane continuing at ``p`` needs; matches and seeds only offer servable prefixes, and the engine
re-checks the admit's actual shape before and after sharing (falling back to a cold prefill), so
output never depends on the cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

CACHE_CLASS = 1
"""The cache class (a bit of ShedPolicy.evictable_cache_classes) of every published entry."""


def prefix_digest(model_id: str, tokens: np.ndarray) -> bytes:
    """32-byte provenance digest of a token prefix on a model: BLAKE2b-256 over the model id and
    the tokens as little-endian u32 (the entry's identity in matches, envelopes and CacheKeys)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(model_id.encode())
    h.update(np.ascontiguousarray(tokens, dtype="<u4").tobytes())
    return h.digest()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def window_intact(pos_min: int, pos_max: int, next_pos: int, n_swa: int) -> bool:
    """True when a sequence whose (sliding-window) cache holds positions ``[pos_min, pos_max]``
    (``llama_memory_seq_pos_min/max``; -1, -1 when empty) can decode its next token at ``next_pos``
    exactly as if nothing had ever been evicted.

    Needs ``pos_max == next_pos - 1`` and every key the query at ``next_pos`` attends to: llama.cpp
    masks key ``p0`` for query ``p1`` when ``p1 - p0 >= n_swa`` (``llama_hparams::is_masked_swa``,
    standard and chunked windows), so keys from ``next_pos - n_swa + 1`` on must be present. This is
    one position less strict than ``pos_min <= max(0, p - n_swa)`` in the reference notes, and it is
    what llama.cpp itself keeps when it prunes (positions from ``pos_max + 2 - n_swa`` on, observed
    on 0c1e57098): with the notes' rule every pruned entry would be refused. Without a window
    (``n_swa`` 0) every position must be present."""
    if next_pos == 0:
        return pos_max < 0
    if pos_max != next_pos - 1 or pos_min < 0:
        return False
    if n_swa <= 0:
        return pos_min == 0
    return pos_min <= max(0, next_pos - n_swa + 1)


def prefix_servable(src_pos_min: int, src_pos_max: int, p: int, n_swa: int) -> bool:
    """True when the first ``p`` positions of a sequence holding ``[src_pos_min, src_pos_max]`` can
    seed a lane that shares ``[0, p)`` and decodes on from position ``p`` (``window_intact`` of the
    shared copy). When llama.cpp prunes a sequence it keeps exactly the positions from
    ``pos_max + 2 - n_swa`` on, so a pruned entry still serves its full length.

    An admit whose seed covers its whole prefill must instead re-decode position ``p - 1`` (for
    its logits) from a copy of ``[0, p - 1)``, which needs one more position of window; the engine
    checks that shape at admit and falls back to a cold prefill when it does not hold."""
    if p <= 0 or src_pos_max < p - 1 or src_pos_min > p - 1:
        return False
    return window_intact(src_pos_min, p - 1, p, n_swa)


@dataclass(eq=False)
class CacheEntry:
    """One published prefix: ``seq`` (llama.cpp sequence id) holds the KV of ``tokens``.

    ``digest`` is ``prefix_digest(tokens)``; ``taint`` the provenance taint bits (sticky);
    ``pins`` the live leases on it; ``lru`` a counter stamp (higher = more recent); ``mark`` a
    shorter boundary (a page multiple, 0: none) worth a snapshot of its own when the entry is
    demoted to the host tier on a sliding-window model (``host_tier``)."""

    entry_id: int
    seq: int
    tokens: np.ndarray
    digest: bytes
    taint: int = 0
    pins: int = 0
    lru: int = 0
    cache_class: int = CACHE_CLASS
    mark: int = 0

    @property
    def length(self) -> int:
        """Tokens held."""
        return int(self.tokens.shape[0])


@dataclass(eq=False)
class Lease:
    """A seed lease: ``prefix`` tokens served by cache entry ``entry_id`` (or, when adopted, by the
    bare sequence handle ``adopted``, whose KV covers ``len(prefix) - pending`` of them), for
    admits of ``determinism_class``. Valid for ticks whose index is <= ``expires_after_tick``."""

    handle: int
    prefix: np.ndarray
    determinism_class: int
    expires_after_tick: int
    entry_id: int = 0
    adopted: int = 0
    taint: int = 0
    pending: int = 0  # adopted: tokens of ``prefix`` past the sequence's KV (0 or 1)


@dataclass
class PrefixCache:
    """Entries by id, leases by handle, an LRU clock. Pure bookkeeping: the engine does the
    llama.cpp calls and the KV ledger updates."""

    page: int
    max_entries: int
    entries: dict[int, CacheEntry] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    _next_entry: int = 1
    _next_lease: int = 1
    _clock: int = 0

    def touch(self, entry: CacheEntry) -> None:
        """Mark ``entry`` most recently used."""
        self._clock += 1
        entry.lru = self._clock

    def add(self, seq: int, tokens: np.ndarray, digest: bytes, taint: int, mark: int = 0) -> CacheEntry:
        """Record a new entry (the caller checked capacity and duplicates)."""
        e = CacheEntry(self._next_entry, seq, tokens, digest, taint, mark=mark)
        self._next_entry += 1
        self.entries[e.entry_id] = e
        self.touch(e)
        return e

    def find_identical(self, digest: bytes, taint: int) -> CacheEntry | None:
        """The entry with exactly these tokens and taint, if any (ABI rule 90)."""
        for e in self.entries.values():
            if e.digest == digest and e.taint == taint:
                return e
        return None

    def remove(self, entry: CacheEntry) -> None:
        """Forget ``entry`` (the caller frees its sequence)."""
        self.entries.pop(entry.entry_id, None)

    def eviction_order(self, classes: int) -> list[CacheEntry]:
        """Unpinned entries of the given cache classes, least recently used first (ABI rule 89)."""
        cands = [e for e in self.entries.values() if e.pins == 0 and e.cache_class & classes]
        return sorted(cands, key=lambda e: e.lru)

    def new_lease(self, prefix: np.ndarray, det: int, expires: int, **kw: int) -> Lease:
        """Create and record a lease (the caller pinned what it covers)."""
        lease = Lease(self._next_lease, prefix, det, expires, **kw)
        self._next_lease += 1
        self.leases[lease.handle] = lease
        return lease

    def expired(self, tick_index: int) -> list[Lease]:
        """Leases that no tick from ``tick_index`` on may use."""
        return [le for le in self.leases.values() if le.expires_after_tick < tick_index]
