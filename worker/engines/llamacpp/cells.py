"""``Cells``: llama.cpp's KV memory, the cell ledger that mirrors it, and the sequence ids.

Every change to a sequence's cells goes through one method here that makes the llama.cpp memory
call and the matching ``pool.CellLedger`` update together (``../shared/reference/llamacpp-notes.md``
section 2: ``llama_memory_seq_cp`` shares cells, ``llama_memory_seq_rm`` removes a sequence's
ownership), so the ledger the plan validation trusts (ABI rules 50-52) never drifts from what
llama.cpp holds. The one exception is ``grow``: ``llama_decode`` writes the KV (``rounds``), and
``grow`` charges the cells it wrote.

Sequence ids are ``0 .. n_seq_max - 2``, handed out lowest first; ``n_seq_max - 1`` is the scratch
sequence (``with_prefix``), never in the ledger. Lengths are tokens (one token = one cell).
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Callable
from typing import TypeVar

import llama_cpp as L

from basertd.schema.abi import Status
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.pool import CellLedger

T = TypeVar("T")


class Cells:
    """The KV cells of one llama.cpp context (``ctx``, a unified cache of ``n_cells`` cells the
    ledger enforces) and its ``n_seq_max`` sequence ids.

    ``version`` counts changes to existing sequences' cells (every method but ``take_seq`` and
    ``grow``): what cached per-entry sums (evictable bytes) compare against."""

    def __init__(self, ctx: L.llama_context_p, n_cells: int, n_seq_max: int) -> None:
        self.ctx = ctx
        self.mem = L.llama_get_memory(ctx)
        self.ledger = CellLedger(n_cells)
        self.scratch_seq = n_seq_max - 1
        self.free_seqs = list(range(n_seq_max - 1))
        heapq.heapify(self.free_seqs)
        self.version = 0
        self.grow: Callable[[int, int], None] = self.ledger.append
        """``grow(seq, n)``: ``llama_decode`` wrote ``n`` positions at the end of ``seq``."""

    # ------------------------------------------------------------------ sequence ids

    def take_seq(self) -> int:
        """The lowest free sequence id (empty); EngineError(EBUSY) when none is left."""
        if not self.free_seqs:
            raise EngineError(Status.EBUSY, "no free llama.cpp sequence id")
        return heapq.heappop(self.free_seqs)

    def free_seq(self, seq: int) -> None:
        """Remove every cell of ``seq`` from llama.cpp and the ledger; the id becomes free."""
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.ledger.drop(seq)
        heapq.heappush(self.free_seqs, seq)
        self.version += 1

    # ------------------------------------------------------------------ cell changes

    def copy(self, src: int, dst: int, n: int) -> None:
        """``dst`` (empty) shares ``src``'s first ``n`` cells (zero-copy, refcounted)."""
        L.llama_memory_seq_cp(self.mem, src, dst, 0, n)
        self.ledger.share(src, dst, n)
        self.version += 1

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
            return fn(seq)
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
