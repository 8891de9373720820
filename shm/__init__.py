"""Anonymous shared-memory segments (memfd) and BRTRING1 rings (DESIGN.md "Rings").

``Segment`` (``basertd.shm.segment``) is one memfd mapping handed to a child by descriptor;
``RingWriter`` / ``RingReader`` (``basertd.shm.ring``) are the single writer and the readers of one
ring laid out exactly as the tick ABI's ring comment says (ABI rules 123-130); ``ControlBlock``
(``basertd.shm.control``) is the per-worker control segment holding the yield word."""

from basertd.shm.control import CONTROL_BYTES, ControlBlock, YieldReason
from basertd.shm.errors import (
    BadPayload,
    RingClosed,
    RingError,
    RingLayoutError,
    SegmentError,
    SpanTooLarge,
    StaleRef,
)
from basertd.shm.ring import (
    ELEM_BYTES,
    MIN_SLOT_BYTES,
    RING_HEADER_BYTES,
    SLOT_HEADER_BYTES,
    RingReader,
    RingWriter,
    ring_bytes,
    slot_bytes_for,
)
from basertd.shm.segment import Segment

__all__ = [
    "CONTROL_BYTES",
    "ELEM_BYTES",
    "MIN_SLOT_BYTES",
    "RING_HEADER_BYTES",
    "SLOT_HEADER_BYTES",
    "BadPayload",
    "ControlBlock",
    "RingClosed",
    "RingError",
    "RingLayoutError",
    "RingReader",
    "RingWriter",
    "Segment",
    "SegmentError",
    "SpanTooLarge",
    "StaleRef",
    "YieldReason",
    "ring_bytes",
    "slot_bytes_for",
]
