"""The per-worker control segment: a yield word the coordinator sets and the engine reads between
steps of a tick (DESIGN.md "Rings"; the tick ABI's successor calls it the control segment).

Layout (64 bytes, one memfd per worker incarnation, little-endian, 8-byte aligned fields):

====== ====== ==========================================================================
offset bytes  field
====== ====== ==========================================================================
0      8      magic ``b"BRTCTL01"`` (written once by the coordinator before the worker starts)
8      4      version (1)
12     4      reserved, 0
16     8      yield word: 0 = run ticks to the end; nonzero = a ``YieldReason`` the coordinator
              set: end the tick in flight at the next step boundary
24     8      yields taken: the engine's count of ticks it ended early (engine writes)
32     32     reserved, 0
====== ====== ==========================================================================

Protocol: the coordinator calls ``request_yield(reason)`` when work arrives that outranks the tick
in flight (an interactive request, a cancel, a drain) and ``clear_yield()`` once the plan serving it
is sent. The engine reads the word between steps (``llama_decode`` calls, the reference engine's
prefill steps); when it is nonzero and the tick has done at least one step, the engine ends the
tick with what it has done: prefill progress reported exactly as a budget-shed chunk (ABI rules 56,
57), decode lanes with fewer tokens than granted and finish NONE. The word stays set until the
coordinator clears it, so a plan sent before the clear still runs its first step (progress is never
lost to a stale word). An engine that cannot yield ignores the segment.

Memory ordering (the argument ``brt_ring.h`` makes for the rings, here much shorter): each word is
one naturally aligned 64-bit location with a single writer (the yield word: the coordinator; the
yields-taken word: the engine), accessed with single 8-byte loads and stores (numpy scalar access
over the mapping; ``__atomic_load_n`` in C), which are single-copy atomic on x86-64 and AArch64, so
a reader never sees a torn value. No other data is published through the word (the plan travels on
Link W, which orders itself), so no acquire/release pairing is needed: a reader that misses a store
made a moment ago sees it at the next step boundary, which costs at most one step of latency and
never correctness. ``clear_yield`` racing with the engine's read only decides whether the current
tick ends one step earlier.
"""

from __future__ import annotations

import os
from enum import IntEnum

import numpy as np

from basertd.schema.abi import Status
from basertd.shm.errors import SegmentError
from basertd.shm.segment import Segment

CONTROL_MAGIC = b"BRTCTL01"
CONTROL_VERSION = 1
CONTROL_BYTES = 64
"""Length of a control segment in bytes."""
YIELD_WORD_OFFSET = 16
"""Byte offset of the yield word (C engines are handed ``segment.address + YIELD_WORD_OFFSET``)."""
YIELDS_TAKEN_OFFSET = 24


class YieldReason(IntEnum):
    """Why the coordinator asks the tick in flight to end early (the yield word's value)."""

    NONE = 0
    URGENT_ADMIT = 1
    """A request that outranks running work waits (an interactive request behind batch work)."""
    CANCEL = 2
    """A running request was cancelled."""
    DRAIN = 3
    """The worker is being drained or stopped."""
    ITL_BOUND = 4
    """A streaming lane would otherwise wait past its inter-token latency bound."""
    ADMIT = 5
    """A request a free lane could take waits while the tick in flight runs decode rounds past
    ``decode_grant`` (``[scheduler] decode_tick_s``: a fast engine's long ticks) or prefills past
    ``prefill_budget`` (``long_prefill_budget``: a long tick)."""


class ControlBlock:
    """One control segment, seen from either side (``create`` in the coordinator, ``attach`` in the
    worker). Owns its ``Segment``; ``close`` releases it (idempotent). Raises SegmentError for a
    segment of the wrong size or without the magic (status ERR_RING_LAYOUT)."""

    def __init__(self, segment: Segment) -> None:
        """Private: use :meth:`create` or :meth:`attach`."""
        self.segment = segment
        self._words = np.frombuffer(segment.buffer, dtype="<u8", count=CONTROL_BYTES // 8)

    @classmethod
    def create(cls, name: str = "brt-control") -> ControlBlock:
        """A fresh, formatted segment with the yield word clear."""
        seg = Segment.create(CONTROL_BYTES, name=name)
        buf = seg.buffer
        buf[0:8] = CONTROL_MAGIC
        buf[8:12] = CONTROL_VERSION.to_bytes(4, "little")
        return cls(seg)

    @classmethod
    def attach(cls, fd: int) -> ControlBlock:
        """Attach an inherited control segment descriptor; it becomes owned by the block. Raises
        SegmentError (fd left open) when the segment is too small or not a control segment."""
        try:
            head = os.pread(fd, 12, 0)
        except OSError as exc:
            raise SegmentError(f"descriptor {fd} cannot be read: {exc}", Status.ERR_FATAL) from exc
        if head[:8] != CONTROL_MAGIC or int.from_bytes(head[8:12], "little") != CONTROL_VERSION:
            raise SegmentError(f"fd {fd} is not a version-1 control segment", Status.ERR_RING_LAYOUT)
        seg = Segment.attach(fd, CONTROL_BYTES)
        return cls(seg)

    @property
    def fd(self) -> int:
        """The memfd descriptor (pass it to the worker with ``pass_fds``)."""
        return self.segment.fd

    @property
    def yield_word_address(self) -> int:
        """Address of the yield word in this process (for C engines; 8-byte aligned)."""
        return self.segment.address + YIELD_WORD_OFFSET

    def request_yield(self, reason: int = YieldReason.URGENT_ADMIT) -> None:
        """Ask the tick in flight (and every tick until ``clear_yield``) to end at its next step
        boundary. ``reason`` must be nonzero (ValueError otherwise)."""
        if not 0 < int(reason) < 1 << 64:
            raise ValueError(f"yield reason must be a nonzero u64, got {reason}")
        self._words[YIELD_WORD_OFFSET // 8] = int(reason)

    def clear_yield(self) -> None:
        """Let ticks run to their end again."""
        self._words[YIELD_WORD_OFFSET // 8] = 0

    def yield_reason(self) -> int:
        """The yield word now (0: none)."""
        return int(self._words[YIELD_WORD_OFFSET // 8])

    @property
    def yields_taken(self) -> int:
        """Ticks the engine ended early so far (engine-written)."""
        return int(self._words[YIELDS_TAKEN_OFFSET // 8])

    def note_yield_taken(self) -> None:
        """Engine side: count one tick ended early."""
        self._words[YIELDS_TAKEN_OFFSET // 8] += 1

    def close(self) -> None:
        """Release the mapping and the descriptor. Idempotent."""
        self._words = np.zeros(CONTROL_BYTES // 8, dtype="<u8")  # drop the view of the mapping
        self.segment.close()

    def __enter__(self) -> ControlBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
