"""The KV pool ledger: which KV cells of the unified llama.cpp cache each sequence holds.

llama.cpp's unified cache is ``n_cells`` cells; a cell holds one position and the set of sequences
that own it. ``llama_memory_seq_cp`` adds owners (zero-copy sharing), ``llama_memory_seq_rm`` removes
them, and a cell is free when its last owner goes (``../shared/reference/llamacpp-notes.md`` section
2). The ledger mirrors exactly that with a reference count per cell and, per sequence, the cell of
each position ``[0, length)``. It is how the engine knows before a tick whether the plan fits
(ABI rules 50-52: NEEDS_REPLAN with nothing changed), what retiring or evicting frees, and what the
mem counters report. It tracks the global (full-attention) cache; the sliding-window cache of SWA
models holds at most as many cells and may hold fewer (it prunes), so the ledger is exact for the
binding constraint.

Cell identities here are the ledger's own and need not equal llama.cpp's cell indices: only counts
and sharing matter.
"""

from __future__ import annotations

import numpy as np


class PoolExhausted(Exception):
    """An allocation asked for more free cells than exist; callers check ``free`` first."""


class _SeqCells:
    __slots__ = ("cells", "length")

    def __init__(self, capacity: int) -> None:
        self.cells = np.empty(max(capacity, 16), np.int32)
        self.length = 0

    def view(self) -> np.ndarray:
        return self.cells[: self.length]

    def reserve(self, n: int) -> None:
        if n > self.cells.shape[0]:
            grown = np.empty(max(n, 2 * self.cells.shape[0]), np.int32)
            grown[: self.length] = self.cells[: self.length]
            self.cells = grown


class CellLedger:
    """Reference-counted KV cells per sequence id (positions are always ``[0, length)``).

    All lengths are in tokens (one token = one cell). Methods raise KeyError for an unknown
    sequence, PoolExhausted when an allocation exceeds ``free``, ValueError for a bad range."""

    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self._rc = np.zeros(n_cells, np.int32)
        self._free = np.arange(n_cells - 1, -1, -1, dtype=np.int32)  # a stack: top at _n_free - 1
        self._n_free = n_cells
        self._seqs: dict[int, _SeqCells] = {}

    # --- queries ----------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Free cells."""
        return self._n_free

    @property
    def used(self) -> int:
        """Cells owned by at least one sequence."""
        return self.n_cells - self._n_free

    def length(self, seq: int) -> int:
        """Tokens held by ``seq`` (0 for a sequence the ledger does not know)."""
        s = self._seqs.get(seq)
        return 0 if s is None else s.length

    def cells(self, seq: int) -> np.ndarray:
        """The cells of ``seq``'s positions ``[0, length)`` (a read-only view; do not keep it)."""
        s = self._seqs.get(seq)
        if s is None:
            return np.zeros(0, np.int32)
        v = s.view()
        v.flags.writeable = False
        return v

    def exclusive(self, seq: int, start: int = 0) -> int:
        """Cells of ``seq`` from position ``start`` on that no other sequence owns: what dropping
        them would free."""
        s = self._seqs.get(seq)
        if s is None or start >= s.length:
            return 0
        return int(np.count_nonzero(self._rc[s.cells[start : s.length]] == 1))

    def freed_by(self, drops: list[tuple[int, int]]) -> int:
        """Cells that would become free if every ``(seq, keep)`` in ``drops`` were truncated to its
        first ``keep`` positions, counting cells shared only among the dropped ranges. Pure."""
        parts = [self._seqs[s].cells[k : self._seqs[s].length] for s, k in drops if s in self._seqs]
        parts = [p for p in parts if p.size]
        if not parts:
            return 0
        cells = np.concatenate(parts)
        uniq, counts = np.unique(cells, return_counts=True)
        return int(np.count_nonzero(self._rc[uniq] == counts))

    # --- changes ----------------------------------------------------------------------------

    def _alloc(self, n: int) -> np.ndarray:
        if n > self._n_free:
            raise PoolExhausted(f"need {n} KV cells, {self._n_free} free")
        top = self._n_free
        self._n_free -= n
        cells = self._free[top - n : top][::-1].copy()
        self._rc[cells] = 1
        return cells

    def _release(self, cells: np.ndarray) -> None:
        if cells.size == 0:
            return
        self._rc[cells] -= 1
        gone = cells[self._rc[cells] == 0]
        self._free[self._n_free : self._n_free + gone.shape[0]] = gone
        self._n_free += gone.shape[0]

    def append(self, seq: int, n: int) -> None:
        """Give ``seq`` ``n`` fresh cells for its next positions (creates the sequence if new)."""
        s = self._seqs.get(seq)
        if s is None:
            s = self._seqs[seq] = _SeqCells(n)
        if n <= 0:
            return
        if n == 1 and self._n_free and s.length < s.cells.shape[0]:
            # a decode step's one cell, the same one ``_alloc(1)`` takes, in scalar operations:
            # the slice, copy and fancy-indexed stores cost about as much as the rest of a decode
            # unit's Python (profiled on a single stream)
            self._n_free -= 1
            cell = self._free[self._n_free]
            self._rc[cell] = 1
            s.cells[s.length] = cell
            s.length += 1
            return
        cells = self._alloc(n)
        s.reserve(s.length + n)
        s.cells[s.length : s.length + n] = cells
        s.length += n

    def share(self, src: int, dst: int, n: int) -> None:
        """``dst`` (empty or new) now also owns ``src``'s first ``n`` cells (``llama_memory_seq_cp``)."""
        s = self._seqs[src]
        if not 0 <= n <= s.length:
            raise ValueError(f"cannot share {n} of {s.length} positions")
        d = self._seqs.get(dst)
        if d is not None and d.length:
            raise ValueError(f"sequence {dst} is not empty")
        d = self._seqs[dst] = _SeqCells(n)
        d.cells[:n] = s.cells[:n]
        d.length = n
        self._rc[d.cells[:n]] += 1

    def truncate(self, seq: int, keep: int) -> None:
        """Drop ``seq``'s positions ``[keep, length)`` (``llama_memory_seq_rm(seq, keep, -1)``)."""
        s = self._seqs[seq]
        if keep < 0:
            raise ValueError("keep must be >= 0")
        if keep >= s.length:
            return
        self._release(s.cells[keep : s.length].copy())
        s.length = keep

    def drop(self, seq: int) -> None:
        """Forget ``seq`` entirely, freeing the cells only it owned. Unknown sequences are ignored."""
        s = self._seqs.pop(seq, None)
        if s is not None:
            self._release(s.cells[: s.length].copy())
