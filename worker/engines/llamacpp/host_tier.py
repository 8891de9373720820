"""``HostTier``: prefixes evicted from the KV pool, kept in the worker's own memory as sealed
sequence states and restored into the pool when a prompt needs them again (DESIGN.md "Engine
speed, speculation, the tree, routers": evicted prefixes go to a bounded host-memory tier and come
back by restore).

**What an entry is.** When ``seeds.Seeds`` evicts a cache entry of ``n`` tokens (a page multiple),
the entry's sequence is exported with ``llama_state_seq_get_data`` (``capture``) and sealed in the
ABI's state envelope (``state.envelope``: compat identity, provenance digest of the tokens, taint,
range ``[0, n)``, XXH3-64 of the payload).

**Sliding-window models** (Gemma 3). Restoring a sequence state makes llama.cpp prune the window
cache to the window of the restored end: whatever the blob held, the restored sequence keeps window
positions ``[n - n_swa, n - 1]`` only (observed on 0c1e57098 with ``swa_full`` on and off). So
a snapshot can seed a lane at exactly the length it was taken at and at no shorter prefix
(``../shared/reference/llamacpp-notes.md`` section 2; ``prefix_cache.window_intact``), and an
entry is captured at two boundaries: its end, and the page boundary before the end of the prompt
of the lane that published it (``CacheEntry.mark``; a prompt sent again seeds there and prefills
its last tokens). By the time an entry is evicted its lane may have decoded far enough for
llama.cpp to have reused the cells of that mark's window, so a long prompt (``seeds.
PROMPT_SNAPSHOT_MIN_TOKENS``) is also captured at that boundary while its prefill passes it
(``Tiering.snapshot``: the window of the boundary is intact at the end of the ``llama_decode``
that crossed it). Without a window a snapshot serves every page multiple up to its length.

**Restore** (``Seeds.seed_acquire``, between ticks): the envelope is opened against this engine
(``state.open_sealed``: size, magic, space kind, payload length, compat identity, checksum; ABI
rules 101-103), its range and provenance must name the entry's own tokens, llama.cpp must accept
the payload (``llama_state_seq_set_data``; a payload of another layout is refused there), and the
restored sequence must hold positions up to ``n - 1`` with the window a query at ``n`` needs.
Any failure drops the entry, counts it in ``refused_total`` and leaves the prefix to a cold
prefill: a snapshot is never used unverified. A restored entry leaves the tier (one copy of a
prefix, in one tier).

**Bounds.** ``capacity`` bytes (``[cache] host_bytes``) cover the sealed blobs; putting an entry
first drops the least recently used ones until it fits (``dropped_total``); a blob larger than the
whole capacity is not kept. 0 turns the tier off. Sizes are bytes, lengths tokens.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from basertd.schema.tick import ENVELOPE_BYTES
from basertd.worker.engines.llamacpp.state import envelope


@dataclass(eq=False)
class HostEntry:
    """One demoted prefix: ``tokens`` (int32, a page multiple), their provenance ``digest``
    (``prefix_cache.prefix_digest``), ``taint`` bits, the sealed ``blob`` (envelope + payload)
    and an LRU stamp; ``charged`` the bytes the tier counted for it when it was put."""

    tokens: np.ndarray
    digest: bytes
    taint: int
    blob: bytearray
    lru: int = 0
    charged: int = 0

    @property
    def length(self) -> int:
        """Tokens held."""
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the entry takes in the tier (the sealed blob)."""
        return len(self.blob)


def capture(
    ctx: L.llama_context_p,
    seq: int,
    *,
    identity: bytes,
    provenance: bytes,
    taint: int,
    n_tokens: int,
    max_bytes: int,
) -> bytearray | None:
    """The sealed state of sequence ``seq`` (holding exactly ``n_tokens`` positions) in one buffer:
    ``ENVELOPE_BYTES`` of envelope, then llama.cpp's payload written in place (no second copy).
    None when llama.cpp writes nothing or the blob would exceed ``max_bytes`` (nothing copied)."""
    size = int(L.llama_state_seq_get_size(ctx, seq))
    if size <= 0 or ENVELOPE_BYTES + size > max_bytes:
        return None
    buf = bytearray(ENVELOPE_BYTES + size)
    dst = (ctypes.c_uint8 * size).from_buffer(buf, ENVELOPE_BYTES)
    n = int(L.llama_state_seq_get_data(ctx, dst, size, seq))
    del dst  # the buffer may be resized only once no ctypes view exports it
    if n <= 0:
        return None
    if n < size:
        del buf[ENVELOPE_BYTES + n :]
    payload = memoryview(buf)[ENVELOPE_BYTES:]
    try:
        head = envelope(payload, identity=identity, provenance=provenance, taint=taint, n_tokens=n_tokens)
    finally:
        payload.release()
    buf[:ENVELOPE_BYTES] = head
    return buf


class HostTier:
    """Demoted prefixes of one engine within ``capacity`` bytes (module docstring), keyed by
    (digest, taint). Pure bookkeeping and counters; ``seeds.Seeds`` captures and restores.

    Counters (``stats``): ``demotions_total`` (evicted entries captured into the tier; counted by
    the caller), ``snapshots_total`` (prompts captured at their last page boundary as their
    prefill passed it: ``Tiering.snapshot``), ``near_duplicates_total`` (captures skipped because
    a held prefix nearly covers them: ``Tiering.near_duplicate``), ``dropped_total`` (entries pushed out
    to make room, or too large to keep), ``restores_total`` / ``restored_tokens_total`` /
    ``restore_ns_total`` (restores that served, their tokens and their wall time in ns),
    ``refused_total`` (snapshots refused at restore: corrupt, another model or layout, wrong
    length, or llama.cpp would not load them)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self._entries: dict[tuple[bytes, int], HostEntry] = {}
        self.bytes = 0
        self._clock = 0
        self.demotions_total = 0
        self.snapshots_total = 0
        self.near_duplicates_total = 0
        self.dropped_total = 0
        self.restores_total = 0
        self.restored_tokens_total = 0
        self.restore_ns_total = 0
        self.refused_total = 0

    @property
    def enabled(self) -> bool:
        """The tier keeps anything (capacity > 0)."""
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[HostEntry]:
        return iter(list(self._entries.values()))

    def has(self, digest: bytes, taint: int) -> bool:
        """Whether an entry of ``digest`` and ``taint`` is kept."""
        return (digest, taint) in self._entries

    def touch(self, digest: bytes, taint: int) -> bool:
        """Mark the entry of ``digest`` and ``taint`` most recently used; False when none is kept."""
        entry = self._entries.get((digest, taint))
        if entry is None:
            return False
        self._clock += 1
        entry.lru = self._clock
        return True

    def fits(self, nbytes: int) -> bool:
        """Whether a blob of ``nbytes`` can be kept at all."""
        return 0 < nbytes <= self.capacity

    def put(self, entry: HostEntry) -> bool:
        """Keep ``entry`` (most recently used), replacing one of the same (digest, taint) and
        dropping least recently used entries until it fits. False, and nothing changed, when it
        cannot fit in the whole capacity."""
        if not self.fits(entry.nbytes):
            self.dropped_total += 1
            return False
        old = self._entries.get((entry.digest, entry.taint))
        if old is not None:
            self.remove(old)
        while self.bytes + entry.nbytes > self.capacity:
            victim = min(self._entries.values(), key=lambda e: e.lru)
            self.remove(victim)
            self.dropped_total += 1
        self._clock += 1
        entry.lru = self._clock
        entry.charged = entry.nbytes
        self._entries[(entry.digest, entry.taint)] = entry
        self.bytes += entry.charged
        return True

    def remove(self, entry: HostEntry) -> None:
        """Forget ``entry`` (its bytes are released with the last reference)."""
        if self._entries.get((entry.digest, entry.taint)) is entry:
            del self._entries[(entry.digest, entry.taint)]
            self.bytes -= entry.charged

    def discard(self, digest: bytes, taint: int | None = None) -> int:
        """Forget the entries of ``digest`` (of one ``taint``, or every taint when None); returns
        how many went."""
        gone = [e for e in self._entries.values() if e.digest == digest and taint in (None, e.taint)]
        for e in gone:
            self.remove(e)
        return len(gone)

    def refused(self, entry: HostEntry) -> None:
        """``entry``'s snapshot failed a check at restore: forget it and count it."""
        self.remove(entry)
        self.refused_total += 1

    def restored(self, entry: HostEntry, ns: int) -> None:
        """``entry`` went back into the pool in ``ns`` nanoseconds: it leaves the tier."""
        self.remove(entry)
        self.restores_total += 1
        self.restored_tokens_total += entry.length
        self.restore_ns_total += ns

    def clear(self) -> None:
        """Forget every entry (counted as dropped)."""
        self.dropped_total += len(self._entries)
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        """The tier's gauges and counters for ``Engine.stats()`` (names prefixed ``host_``)."""
        return {
            "host_entries": len(self._entries),
            "host_bytes": self.bytes,
            "host_capacity_bytes": self.capacity,
            "host_demotions_total": self.demotions_total,
            "host_snapshots_total": self.snapshots_total,
            "host_near_duplicates_total": self.near_duplicates_total,
            "host_dropped_total": self.dropped_total,
            "host_restores_total": self.restores_total,
            "host_restored_tokens_total": self.restored_tokens_total,
            "host_restore_ns_total": self.restore_ns_total,
            "host_refused_total": self.refused_total,
        }
