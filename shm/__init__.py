"""Anonymous shared-memory segments (memfd) and BRTRING1 rings (DESIGN.md "Rings").

``Segment`` (``basertd.shm.segment``) is one memfd mapping handed to a child by descriptor;
``RingWriter`` / ``RingReader`` (``basertd.shm.ring``) are the single writer and the readers of one
ring laid out exactly as the tick ABI's ring comment says (ABI rules 123-130)."""

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
    "ELEM_BYTES",
    "MIN_SLOT_BYTES",
    "RING_HEADER_BYTES",
    "SLOT_HEADER_BYTES",
    "BadPayload",
    "RingClosed",
    "RingError",
    "RingLayoutError",
    "RingReader",
    "RingWriter",
    "Segment",
    "SegmentError",
    "SpanTooLarge",
    "StaleRef",
    "ring_bytes",
    "slot_bytes_for",
]
