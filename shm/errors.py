"""Typed errors of the shared-memory layer, each carrying the baseRT status it stands for
(CONTRIBUTING.md "Habits"; ABI rules 125-129)."""

from __future__ import annotations

from basertd.schema.abi import Status


class RingError(Exception):
    """Base of every ``basertd.shm`` error. ``status`` is the ABI ``Status`` the failure maps to, so a
    worker can report it unchanged (for example as a plan rejection)."""

    status: Status = Status.ERR_FATAL

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class StaleRef(RingError):
    """A ``TokenRef``/``RingRef`` that does not resolve: generation 0, an index or count out of range,
    a slot recycled or being rewritten, or a payload length that does not match the reference.
    BASERT_REJECT_BAD_REF_GENERATION (ABI rules 127-129)."""

    status = Status.REJECT_BAD_REF_GENERATION


class RingLayoutError(RingError):
    """A ring header or mapping that does not match the expected ring_id, slot_bytes, slots or length,
    or a geometry this implementation refuses. BASERT_ERR_RING_LAYOUT, -131 (ABI rule 125)."""

    status = Status.ERR_RING_LAYOUT


class SpanTooLarge(RingError):
    """A span that needs more slots than the ring has (or a row longer than one slot).
    BASERT_REJECT_BOUNDS."""

    status = Status.REJECT_BOUNDS


class BadPayload(RingError):
    """Values that are not a 1-D array of the ring's element type (u32 token ids in range for TOKENS,
    floats for LOGITS), or an ``out`` array of the wrong dtype, shape or writability.
    BASERT_REJECT_BOUNDS."""

    status = Status.REJECT_BOUNDS


class RingClosed(RingError):
    """A ring used after ``close()`` or after its segment was closed. BASERT_ERR_UNKNOWN_HANDLE."""

    status = Status.ERR_UNKNOWN_HANDLE


class SegmentError(RingError):
    """A memfd segment that cannot be created or attached: a bad length, a descriptor that is not
    open, a file shorter than the announced length (BASERT_ERR_BUFFER_TOO_SMALL), or an OS error."""

    status = Status.ERR_BUFFER_TOO_SMALL
