"""``Cells``: llama.cpp's KV memory, the cell ledger that mirrors it, and the sequence ids.

Every change to a sequence's cells goes through one method here that makes the llama.cpp memory
call and the matching ``pool.CellLedger`` update together (``../shared/reference/llamacpp-notes.md``
section 2: ``llama_memory_seq_cp`` shares cells, ``llama_memory_seq_rm`` removes a sequence's
ownership), so the ledger the plan validation trusts (ABI rules 50-52) never drifts from what
llama.cpp holds. The one exception is ``grow``: ``llama_decode`` writes the KV (``rounds``), and
``grow`` charges the cells it wrote.

Sequence ids are ``0 .. n_seq_max - 2``, handed out lowest first; ``n_seq_max - 1`` is the scratch
sequence (``with_prefix``), never in the ledger. Lengths are tokens (one token = one cell).

**Per-lane streams** (``streams``: ``kv_unified = false``, ``context.KV_LAYOUTS``). Every sequence id
is a KV stream of its own and a query attends only to its own stream's cells, which is what makes an
8-lane decode step cheaper than in the unified cache. Lanes take ids ``0 .. lanes - 1``
(``take_lane_seq``, lowest first), so the decoding lanes of a round are consecutive ids and llama.cpp
puts their rows in one ubatch (its per-stream split only groups consecutive ids); bare sequences and
the scratch take the ids above. A cache entry stays in the stream its lane computed it in (a retired
lane's stream is kept as the entry, as llama-server keeps an idle slot's KV), or takes an id above the
lanes' (a restore: ``take_entry_seq``); a lane stream an entry holds is handed back to the lanes by
moving the entry to a free id above them (``move_stream``, ``seeds.Seeds.vacate_lane_streams``). A
copy between streams cannot share cells: it copies
the whole source stream and drops the destination's tail (``llama_memory_seq_cp(src, dst, -1, -1)``
then ``seq_rm``; a partial cross-stream copy is a hard abort in llama.cpp), and llama.cpp performs the
data copy at the start of the next ``llama_decode``. Until then the destination's buffer is stale and
the source's buffer must not be overwritten, so a state read of either, or a load into either, first
runs that update (``flush``: a one-token ``llama_decode`` on the scratch sequence, removed again).
The ledger then charges the destination private cells (``pool.CellLedger.append``). A lane whose
stream sits above a free lane stream is moved down into it (``move_stream``, the engine does it
after a tick's admits) and a lane that decodes trades streams with a lane that still prefills or a
cache entry below it (``swap_streams``), so the decoding lanes stay consecutive.
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Callable
from typing import TypeVar

import llama_cpp as L
import numpy as np

from basertd.schema.abi import Status
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.batch import TokenBatch
from basertd.worker.engines.llamacpp.pool import CellLedger

T = TypeVar("T")


class Cells:
    """The KV cells of one llama.cpp context (``ctx``, a unified cache of ``n_cells`` cells the
    ledger enforces, or per-lane streams when ``lanes`` is given: module docstring) and its
    ``n_seq_max`` sequence ids.

    ``version`` counts changes to existing sequences' cells (every method but ``take_seq`` and
    ``grow``): what cached per-entry sums (evictable bytes) compare against."""

    def __init__(
        self, ctx: L.llama_context_p, n_cells: int, n_seq_max: int, lanes: int | None = None
    ) -> None:
        self.ctx = ctx
        self.mem = L.llama_get_memory(ctx)
        self.ledger = CellLedger(n_cells)
        self.scratch_seq = n_seq_max - 1
        self.streams = lanes is not None
        self._lanes = first = 0 if lanes is None else lanes
        self.free_lane_seqs = list(range(first))  # ascending: already a heap
        self.free_seqs = list(range(first, n_seq_max - 1))
        self.version = 0
        self.pending: set[int] = set()
        """Streams a copy not yet performed by llama.cpp reads or writes (per-lane streams)."""
        self.flushes = 0
        self.moves = 0
        self._flush_batch = TokenBatch(1, 1) if self.streams else None
        self.grow: Callable[[int, int], None] = self._grow_streams if self.streams else self.ledger.append
        """``grow(seq, n)``: ``llama_decode`` wrote ``n`` positions at the end of ``seq``."""

    # ------------------------------------------------------------------ sequence ids

    def take_seq(self) -> int:
        """The lowest free sequence id (empty) outside the lanes' ids; EngineError(EBUSY) when
        none is left."""
        if not self.free_seqs:
            raise EngineError(Status.EBUSY, "no free llama.cpp sequence id")
        return heapq.heappop(self.free_seqs)

    def take_lane_seq(self) -> int:
        """The sequence id for a new lane: ``take_seq``'s in the unified cache, the lowest free
        lane id with per-lane streams (EngineError(EBUSY) when none is left)."""
        if not self.streams:
            return self.take_seq()
        if not self.free_lane_seqs:
            raise EngineError(Status.EBUSY, "no free lane stream")
        return heapq.heappop(self.free_lane_seqs)

    @property
    def entry_seq_free(self) -> bool:
        """Whether ``take_entry_seq`` has an id to give."""
        return bool(self.free_seqs or self.free_lane_seqs)

    def take_entry_seq(self) -> int:
        """A free sequence id for a restored cache entry: ``take_seq``'s, else (per-lane) the
        lowest free lane stream (entries may live there: module docstring); EngineError(EBUSY)
        when none is left."""
        if self.free_seqs or not self.free_lane_seqs:
            return self.take_seq()
        return heapq.heappop(self.free_lane_seqs)

    @property
    def free_lane_streams(self) -> int:
        """Free lane streams (per-lane; 0 in the unified cache)."""
        return len(self.free_lane_seqs)

    def lane_stream(self, seq: int) -> bool:
        """Whether ``seq`` is one of the lanes' streams (never in the unified cache)."""
        return self.streams and seq < self._lanes

    def free_seq(self, seq: int) -> None:
        """Remove every cell of ``seq`` from llama.cpp and the ledger; the id becomes free."""
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.ledger.drop(seq)
        heapq.heappush(self.free_lane_seqs if self.streams and seq < self._lanes else self.free_seqs, seq)
        self.version += 1

    # ------------------------------------------------------------------ cell changes

    def copy(self, src: int, dst: int, n: int) -> None:
        """``dst`` (empty) holds ``src``'s first ``n`` positions: shared cells in the unified cache
        (zero-copy, refcounted), a copy of the stream with per-lane streams (module docstring)."""
        if self.streams:
            if src == dst:
                raise ValueError("a stream copy needs two sequences")
            L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
            L.llama_memory_seq_rm(self.mem, dst, n, -1)
            self.pending.update((src, dst))
            self.ledger.drop(dst)
            self.ledger.append(dst, n)
        else:
            L.llama_memory_seq_cp(self.mem, src, dst, 0, n)
            self.ledger.share(src, dst, n)
        self.version += 1

    def move_stream(self, src: int, dst: int) -> None:
        """Per-lane streams: what stream ``src`` holds (a lane or a cache entry) moves to the free
        stream ``dst`` (taken with ``take_lane_seq`` / ``take_seq``), performed by llama.cpp at the
        next ``llama_decode`` like a copy; ``src`` becomes free. llama.cpp puts only consecutive
        stream ids in one ubatch, so a gap below a decoding lane costs one more pass over the
        weights per round (module docstring)."""
        n = self.ledger.length(src)
        L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        L.llama_memory_seq_rm(self.mem, src, -1, -1)
        self.pending.update((src, dst))
        self.ledger.drop(dst)
        self.ledger.append(dst, n)
        self.ledger.drop(src)
        heapq.heappush(self.free_lane_seqs if src < self._lanes else self.free_seqs, src)
        self.moves += 1
        self.version += 1

    def swap_streams(self, a: int, b: int) -> None:
        """Per-lane streams: what streams ``a`` and ``b`` hold (lanes, cache entries) trade
        streams, through the scratch stream (three stream copies llama.cpp performs in order at
        the next ``llama_decode``). The scratch sequence must be empty."""
        na, nb = self.ledger.length(a), self.ledger.length(b)
        s = self.scratch_seq
        L.llama_memory_seq_cp(self.mem, a, s, -1, -1)
        L.llama_memory_seq_cp(self.mem, b, a, -1, -1)
        L.llama_memory_seq_cp(self.mem, s, b, -1, -1)
        L.llama_memory_seq_rm(self.mem, s, -1, -1)
        self.pending.update((a, b, s))
        for seq, n in ((a, nb), (b, na)):
            self.ledger.drop(seq)
            self.ledger.append(seq, n)
        self.moves += 1
        self.version += 1

    def lane_gap(self, seq: int) -> bool:
        """Per-lane streams: whether a lane stream below ``seq`` is free."""
        return self.streams and bool(self.free_lane_seqs) and self.free_lane_seqs[0] < seq

    def into_lane(self, seq: int, n: int) -> int:
        """The sequence a lane runs on holding ``seq``'s first ``n`` positions (0: empty): ``seq``
        itself in the unified cache; per-lane, a copy in the lowest free lane stream, ``seq``
        freed. EngineError(EBUSY) when no lane stream is free."""
        if not self.streams or self.lane_stream(seq):
            return seq
        lane = self.take_lane_seq()
        if n:
            self.copy(seq, lane, n)
        self.free_seq(seq)
        return lane

    def _grow_streams(self, seq: int, n: int) -> None:
        self.pending.clear()  # a llama_decode ran: it performed every queued copy first
        self.ledger.append(seq, n)

    def flush(self) -> None:
        """Make llama.cpp perform the queued stream copies now (module docstring): one token
        decoded at the end of the scratch sequence and removed again. The abort callback cutting
        it changes nothing: the copies run before the graph. EngineError(ERR_FATAL) when llama.cpp
        fails the call."""
        if not self.pending:
            return
        b = self._flush_batch
        assert b is not None
        b.clear()
        pos = int(L.llama_memory_seq_pos_max(self.mem, self.scratch_seq)) + 1
        b.add(np.zeros(1, np.int32), pos, self.scratch_seq, True)
        rc = int(L.llama_decode(self.ctx, b.whole()))
        L.llama_memory_seq_rm(self.mem, self.scratch_seq, pos, -1)
        if rc not in (0, 2):
            raise EngineError(Status.ERR_FATAL, f"llama_decode returned {rc} performing stream copies")
        self.pending.clear()
        self.flushes += 1

    def truncate(self, seq: int, keep: int) -> None:
        """Drop ``seq``'s positions ``[keep, ..)``; a ``keep`` at or past its length changes
        nothing."""
        L.llama_memory_seq_rm(self.mem, seq, keep, -1)
        self.ledger.truncate(seq, keep)
        self.version += 1

    def clear(self, seq: int) -> None:
        """Empty ``seq`` (it keeps its id)."""
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        if self.ledger.length(seq):
            self.ledger.truncate(seq, 0)
        self.version += 1

    def load(self, seq: int, payload: bytes | bytearray | memoryview, end: int) -> bool:
        """Load a ``llama_state_seq_get_data`` payload of positions ``[0, end)`` into the empty
        ``seq`` (read in place when the buffer is writable, else from a copy). False (and ``seq``
        left empty) when llama.cpp refuses it or it does not hold exactly those positions."""
        if seq in self.pending:
            self.flush()  # a queued copy would overwrite what is loaded (module docstring)
        view = memoryview(payload).cast("B")
        size = len(view)
        arr = ctypes.c_uint8 * size
        src = arr.from_buffer_copy(view) if view.readonly else arr.from_buffer(view)
        try:
            n = int(L.llama_state_seq_set_data(self.ctx, src, size, seq))
        finally:
            del src
            view.release()
        if n == 0 or self.pos_range(seq)[1] != end - 1:
            L.llama_memory_seq_rm(self.mem, seq, -1, -1)
            return False
        self.ledger.append(seq, end)
        self.version += 1
        return True

    def with_prefix(self, seq: int, end: int, fn: Callable[[int], T]) -> T:
        """``fn(seq id)`` on ``seq`` itself when it holds exactly ``end`` tokens, else on the
        scratch sequence holding a shared copy of its first ``end`` cells (emptied afterwards; the
        ledger never sees it)."""
        if self.ledger.length(seq) == end:
            if seq in self.pending:
                self.flush()
            return fn(seq)
        if self.streams:
            L.llama_memory_seq_cp(self.mem, seq, self.scratch_seq, -1, -1)
            L.llama_memory_seq_rm(self.mem, self.scratch_seq, end, -1)
            self.pending.update((seq, self.scratch_seq))
            self.flush()
        else:
            L.llama_memory_seq_cp(self.mem, seq, self.scratch_seq, 0, end)
        try:
            return fn(self.scratch_seq)
        finally:
            L.llama_memory_seq_rm(self.mem, self.scratch_seq, -1, -1)

    # ------------------------------------------------------------------ queries

    def length(self, seq: int) -> int:
        """Tokens ``seq`` holds (0 for an unknown one)."""
        return self.ledger.length(seq)

    @property
    def free(self) -> int:
        """Free cells."""
        return self.ledger.free

    def pos_range(self, seq: int) -> tuple[int, int]:
        """(pos_min, pos_max) llama.cpp reports for ``seq`` (the sliding-window cache on SWA
        models); (-1, -1) when empty."""
        return (
            int(L.llama_memory_seq_pos_min(self.mem, seq)),
            int(L.llama_memory_seq_pos_max(self.mem, seq)),
        )
