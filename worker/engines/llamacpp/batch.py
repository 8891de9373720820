"""One reusable ``llama_batch`` over numpy arrays, filled a lane's run at a time.

``llama_batch_init`` allocates one malloc'd seq-id slot per row, which forces a Python loop per
token to fill. This batch instead owns numpy arrays (``token``, ``pos``, ``n_seq_id``, one seq id
per row, ``logits`` flags) and an array of pointers to the seq-id slots, and hands llama.cpp a
``llama_batch`` struct pointing into them: a prefill chunk of any length is a few slice
assignments. The struct is built once; ``decode`` passes a shifted copy for each ``n_batch``-sized
part, so a round larger than ``n_batch`` never reaches llama.cpp's ``n_batch`` GGML_ASSERT.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import llama_cpp as L
import numpy as np

ABORTED = 2
"""``llama_decode``'s return code when the abort callback ended it (the ubatches before the
aborted one stay in the context's memory)."""


class BatchDecodeError(Exception):
    """``llama_decode`` returned ``rc`` != 0 for the part of the batch starting at row ``start``
    (rows ``[start, end)``); the parts before it were decoded."""

    def __init__(self, rc: int, start: int, end: int) -> None:
        super().__init__(f"llama_decode returned {rc} for batch rows [{start}, {end})")
        self.rc = rc
        self.start = start
        self.end = end


class TokenBatch:
    """A batch of up to ``capacity`` tokens, each in exactly one sequence.

    Rows are appended with ``add``; ``decode`` runs them through llama.cpp in parts of at most
    ``n_batch`` rows and calls ``on_part(start, end)`` after each part, while that part's logits
    are valid (``llama_get_logits_ith(ctx, i - start)`` for row ``i``)."""

    def __init__(self, capacity: int, n_batch: int) -> None:
        self.capacity = capacity
        self.n_batch = n_batch
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        addr = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *(ctypes.cast(addr + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity))
        )
        self._ptr_size = ctypes.sizeof(ctypes.c_void_p)
        self._head = self._struct(0, 0)  # the struct for parts starting at row 0, built once
        self.n = 0
        self.split = 0  # the last decode's ``split``
        self.parts: list[tuple[int, int]] = []  # (rows, ns) of each llama_decode of the last decode
        self.aborted = False  # the last decode ended at a part the abort callback cut

    def clear(self) -> None:
        """Empty the batch."""
        self.n = 0

    def add(self, tokens: np.ndarray, pos0: int, seq: int, want_last: bool, every: bool = False) -> int:
        """Append ``tokens`` at positions ``pos0 ..`` of sequence ``seq``; when ``want_last`` the
        last one produces a logits row, when ``every`` each one does (a speculative run). Returns
        the row index of the last token. The caller keeps ``n`` within ``capacity`` (ValueError
        otherwise)."""
        k = tokens.shape[0]
        i = self.n
        if k == 0 or i + k > self.capacity:
            raise ValueError(f"cannot add {k} tokens to a batch holding {i} of {self.capacity}")
        self.token[i : i + k] = tokens
        self.pos[i : i + k] = np.arange(pos0, pos0 + k, dtype=np.int32)
        self.seq[i : i + k] = seq
        self.logits[i : i + k] = 1 if every else 0
        if want_last:
            self.logits[i + k - 1] = 1
        self.n = i + k
        return i + k - 1

    def whole(self) -> L.llama_batch:
        """The ``llama_batch`` of rows ``[0, n)``, for one ``llama_decode`` of them all (valid
        until the next ``decode``)."""
        self._head.n_tokens = self.n
        return self._head

    def _struct(self, start: int, end: int) -> L.llama_batch:
        b = L.llama_batch()
        b.n_tokens = end - start
        b.token = ctypes.cast(self.token.ctypes.data + 4 * start, ctypes.POINTER(ctypes.c_int32))
        b.embd = None
        b.pos = ctypes.cast(self.pos.ctypes.data + 4 * start, ctypes.POINTER(ctypes.c_int32))
        b.n_seq_id = ctypes.cast(self.n_seq_id.ctypes.data + 4 * start, ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(
            ctypes.addressof(self._seq_ptrs) + self._ptr_size * start,
            ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)),
        )
        b.logits = ctypes.cast(self.logits.ctypes.data + start, ctypes.POINTER(ctypes.c_int8))
        return b

    def part_end(self, start: int) -> int:
        """Where the ``llama_decode`` of the part starting at row ``start`` ends (``decode``)."""
        end = min(self.n, start + self.n_batch)
        return self.split if start < self.split < end else end

    def decode(
        self,
        ctx: L.llama_context_p,
        on_part: Callable[[int, int], None],
        stop: Callable[[int], bool] | None = None,
        arm: Callable[[int], None] | None = None,
        split: int = 0,
    ) -> int:
        """Decode the rows, ``n_batch`` rows per ``llama_decode``, calling ``on_part(start, end)``
        after each successful part. Before every part but the first, ``stop(rows_done)`` may end
        the call early (a yield inside a tick); before every part, ``arm(start)`` may arm or disarm
        the context's abort callback for it. A part the abort callback ended (``llama_decode``
        returns 2; llama.cpp drops that ubatch's cells, and a part is one ubatch when ``n_batch``
        <= n_ubatch) ends the call with ``aborted`` set. Returns the rows decoded (``n`` unless
        stopped or aborted); ``parts`` then holds ``(rows, ns)`` of every successful llama_decode.
        Raises BatchDecodeError on any other nonzero return code. A part with logits rows is timed
        to ``llama_synchronize``: on a GPU backend ``llama_decode`` returns once its work is queued
        (the logits read in ``on_part`` would wait for it anyway), and the time of a decode step is
        what ``rates`` and ``verify_cost`` measure; a part without logits (a prefill chunk's middle)
        is left asynchronous, timed to its return.

        ``split`` (0 < split < n): rows ``[0, split)`` go in a ``llama_decode`` of their own and
        the rest from ``split`` on. The engine puts its decode rows there: llama.cpp's CPU flash
        attention computes a 64-query tile against every KV tile that any query of it may see, so
        one decode row per lane sharing a tile with a prefill chunk makes that chunk's queries
        attend over every lane's keys (measured: 60-70-row mixed rounds ran at 4-15 ms a row,
        against 2.6 ms a row for a 512-row chunk alone). The two are one step for ``stop``: it is
        not asked at ``split``."""
        self.parts = []
        self.aborted = False
        self.split = split
        start = 0
        while start < self.n:
            if start and start != split and stop is not None and stop(start):
                return start
            if arm is not None:
                arm(start)
            end = self.part_end(start)
            if start == 0:
                part = self._head
                part.n_tokens = end
            else:
                part = self._struct(start, end)
            t = time.perf_counter_ns()
            rc = L.llama_decode(ctx, part)
            if rc == ABORTED:
                self.aborted = True
                return start
            if rc != 0:
                raise BatchDecodeError(int(rc), start, end)
            if self.logits[start:end].any():  # its logits are read next anyway: wait here
                L.llama_synchronize(ctx)
            self.parts.append((end - start, time.perf_counter_ns() - t))
            on_part(start, end)
            start = end
        return start
