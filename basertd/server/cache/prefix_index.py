"""The prefix index: a radix index of the prefixes one worker has published, at page granularity
(DESIGN.md "Prefix cache policy"). Pure: no I/O, no engine; ``basertd.server.cache.policy`` keeps
one per worker and explains how it is used (a hint; ``space_match`` is the truth, ABI rules 87, 88).

A prefix of ``n`` whole pages is the path of its chained page hashes ``h1 .. hn``
(``page_hashes``: ``h_i = xxh3_64(tokens of page i, seed=h_(i-1))``), so two prompts share their
first ``k`` pages exactly when they share ``h_k`` (up to 64-bit collisions, which the engine's own
token comparison in ``space_match`` catches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

# --- page hashes ---------------------------------------------------------------------------------


def page_hashes(
    tokens: Sequence[int] | np.ndarray, page: int, known: Sequence[int] = (), salt: int = 0
) -> list[int]:
    """Chained hashes of the whole pages of ``tokens`` (``page`` tokens each): element ``i`` names the
    prefix ``tokens[: (i + 1) * page]``. ``known``: hashes already computed for a prefix of the same
    tokens at the same page size (reused, not recomputed). ``salt``: the seed of the first page's
    hash (a u64; 0 for the shared cache, a tenant's own otherwise: ``[cache] isolate_by_api_key``),
    so two salts never share a path. Raises ValueError for ``page`` < 1."""
    if page < 1:
        raise ValueError(f"page must be >= 1 token, got {page}")
    arr = np.asarray(tokens, dtype="<u4")
    n = arr.shape[0] // page
    out = list(known[:n])
    h = out[-1] if out else salt
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
    """Told when pages enter or leave a ``PrefixIndex`` (``basertd.server.observe.kv_events``): ``stored``
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
        """The engine serves only ``pages_ok`` pages of the path ``hashes``: the unpinned entries
        whose whole path lies on it and is longer are cut to those pages (forgotten when
        ``pages_ok`` is 0), keeping their use stamp and hits, so the prefix the engine still serves
        (a shorter snapshot in its host tier, say) is still hinted. An entry that goes on past the
        path or leaves it is kept: a sliding-window model's host snapshot serves only at its own
        length, so the engine not serving a shorter prefix of it says nothing about it. Returns how
        many entries were cut or forgotten."""
        if pages_ok >= len(hashes):
            return 0
        h = hashes[pages_ok]
        gone = [
            e
            for e in self.entries.values()
            if not e.pin_id
            and pages_ok < len(e.hashes) <= len(hashes)
            and e.hashes[pages_ok] == h
            and e.hashes[-1] == hashes[len(e.hashes) - 1]
        ]
        for e in gone:
            if pages_ok:  # the served part first, so its pages never leave the index
                held = self.entries.get(e.hashes[pages_ok - 1])
                kept = held or self.insert(e.tokens, e.hashes[:pages_ok], e.last_used)
                if kept is not None:
                    kept.last_used = max(kept.last_used, e.last_used)
                    kept.hits = max(kept.hits, e.hits)
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
