"""BRTRING1 rings over shared memory: one ``RingWriter`` per ring, any number of ``RingReader``s.

Layout (ABI rules 123-124, DESIGN.md "Rings"): a 64-byte header (u64 magic ``RING_MAGIC`` at 0,
ring_id u32 at 8, slot_bytes u32 at 12, slots u32 at 16, the rest zero), then ``slots`` slots of
``slot_bytes`` bytes, each {generation u64 at +0, payload_len u32 at +8, pad u32 at +12, payload at
+16}. TOKENS rings carry u32 token ids, LOGITS rings f32 logits; both use 4-byte elements.

Every store and load of a generation, every payload copy and every validation happens in C
(``native/brt_ring.c`` through ``basertd.native._ringc``), one foreign call per span; the publication
protocol (generation 0 while a slot is rewritten, release/acquire fences around the payload) is
documented in ``native/brt_ring.h``. A reader therefore returns either exactly the payload published
under a reference's generation, or raises ``StaleRef`` - never torn data (ABI rule 129).

Spans. ``RingWriter.write`` publishes n elements over ceil(n / capacity_elems) consecutive slots
(wrapping), slot j getting generation G + j, and returns one ``TokenRef(ring_id, index, count=n,
generation=G)``. Every slot but the last is full, so a reader checks each slot's payload_len against
the reference's count. The empty span: writing zero elements consumes no slot and returns
``TokenRef(ring_id, index=0, count=0, generation=0)``; a reference with count 0 reads as an empty
array exactly when its index and generation are 0 (the all-zero ``TokenRef()`` an emit without
tokens carries), and any other count-0 reference is ``StaleRef``. A non-empty reference with
generation 0 never resolves (ABI rule 127).

Rings are built over a ``Segment`` (they are then closed with it) or over any writable, 8-byte
aligned buffer such as a ``RingMapping.buffer``; a buffer-backed ring holds a view of the buffer
until ``close()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from basertd.native._ringc import ffi, lib
from basertd.schema.abi import RingKind
from basertd.schema.tick import RingRef, TokenRef
from basertd.shm.errors import BadPayload, RingClosed, RingLayoutError, SpanTooLarge, StaleRef
from basertd.shm.segment import Segment

RING_HEADER_BYTES = 64
"""Bytes of the ring header; slot 0 starts here (ABI rule 123)."""
SLOT_HEADER_BYTES = 16
"""Bytes of a slot's header (generation u64, payload_len u32, pad u32); included in slot_bytes."""
MIN_SLOT_BYTES = int(lib.BRT_RING_MIN_SLOT_BYTES)
"""Smallest slot_bytes accepted (a slot must hold 8 payload bytes); slot_bytes must also be a multiple
of 8 so that every generation is an aligned 64-bit atomic."""

ELEM_BYTES = 4
"""Bytes per element of both ring kinds (u32 token id, f32 logit)."""
_DTYPES = {RingKind.TOKENS: np.dtype("<u4"), RingKind.LOGITS: np.dtype("<f4")}
_U32 = (1 << 32) - 1
_BYTES = "uint8_t[]"
_from_buffer = ffi.from_buffer
_write = lib.brt_ring_write
_read = lib.brt_ring_read
_read_slot = lib.brt_ring_read_slot
_ERR_BOUNDS = lib.BRT_RING_ERR_BOUNDS

assert lib.BRT_RING_HEADER_BYTES == RING_HEADER_BYTES
assert lib.BRT_RING_SLOT_HEADER_BYTES == SLOT_HEADER_BYTES


def ring_bytes(slots: int, slot_bytes: int) -> int:
    """Bytes a ring of ``slots`` slots of ``slot_bytes`` bytes needs: ``64 + slots * slot_bytes``
    (ABI rule 125: a mapping shorter than this is a layout error)."""
    return RING_HEADER_BYTES + slots * slot_bytes


def slot_bytes_for(elems: int) -> int:
    """The smallest valid slot_bytes whose payload holds ``elems`` 4-byte elements
    (``16 + 4 * elems`` rounded up to a multiple of 8, at least ``MIN_SLOT_BYTES``)."""
    if elems < 1:
        raise SpanTooLarge(f"a slot holds at least one element, asked for {elems}")
    need = SLOT_HEADER_BYTES + ELEM_BYTES * elems
    return max(MIN_SLOT_BYTES, (need + 7) // 8 * 8)


def _is_u32(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _U32


def _resolve_target(target: Segment | Any) -> tuple[Any, int, Segment | None]:
    """(buffer object, mapped length in bytes, owning segment or None) for a Segment or a buffer."""
    if isinstance(target, Segment):
        return target.buffer, target.length, target
    try:
        view = memoryview(target)
    except TypeError as exc:
        raise RingLayoutError(
            f"a ring needs a Segment or a writable buffer, got {type(target).__name__}"
        ) from exc
    if view.readonly:
        raise RingLayoutError("a ring needs a writable buffer")
    if not view.c_contiguous:
        raise RingLayoutError("a ring needs a contiguous buffer")
    return target, view.nbytes, None


class _Ring:
    """Shared state of RingWriter and RingReader: the mapping, the validated geometry and the C
    ``brt_ring`` record (base pointer, length, ids, writer cursor)."""

    def __init__(
        self,
        target: Segment | Any,
        ring_id: int,
        kind: RingKind,
        slots: int,
        slot_bytes: int,
        *,
        format_fresh: bool,
    ) -> None:
        if not (_is_u32(ring_id) and _is_u32(slots) and _is_u32(slot_bytes)):
            raise RingLayoutError(
                f"ring_id, slots and slot_bytes must be u32, got {ring_id!r}, {slots!r}, {slot_bytes!r}"
            )
        try:
            kind = RingKind(kind)
        except ValueError:
            kind = RingKind.UNSPECIFIED
        if kind not in _DTYPES:
            raise RingLayoutError(f"ring kind must be TOKENS or LOGITS, got {kind!r}")
        if lib.brt_ring_check_geometry(slot_bytes, slots) != 0:
            raise RingLayoutError(
                f"bad ring geometry: slots={slots} (>= 1), slot_bytes={slot_bytes} "
                f"(>= {MIN_SLOT_BYTES} and a multiple of 8)"
            )
        buf, length, segment = _resolve_target(target)
        need = ring_bytes(slots, slot_bytes)
        if length < need:
            raise RingLayoutError(f"mapping of {length} bytes is shorter than the {need} the ring needs")
        handle = ffi.from_buffer(buf, require_writable=True)
        try:
            if int(ffi.cast("uintptr_t", handle)) % 8:
                raise RingLayoutError("ring memory must be 8-byte aligned")
            if format_fresh and lib.brt_ring_format(handle, ring_id, slot_bytes, slots) != 0:
                raise RingLayoutError("cannot format the ring")  # excluded by the checks above
            ring = ffi.new("brt_ring *")
            if lib.brt_ring_attach(ring, handle, length, ring_id, slot_bytes, slots) != 0:
                raise RingLayoutError(
                    f"ring header does not match ring_id={ring_id} slot_bytes={slot_bytes} slots={slots} "
                    f"over {length} bytes (BASERT_ERR_RING_LAYOUT)"
                )
            if segment is not None:
                segment._register(self)
        except BaseException:
            ffi.release(handle)
            raise
        self._handle = handle
        self._ring = ring
        self._segment = segment
        self._closed = False
        self.ring_id = ring_id
        self.kind = kind
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.dtype = _DTYPES[kind]
        self._cap = int(lib.brt_ring_capacity(ring, ELEM_BYTES))
        self._max_elems = min(self._cap * slots, _U32)

    @property
    def capacity_elems(self) -> int:
        """Elements (tokens or floats) one slot's payload holds: ``(slot_bytes - 16) // 4``."""
        return self._cap

    @property
    def max_span_elems(self) -> int:
        """Largest span, in elements, the ring can hold: ``slots * capacity_elems``."""
        return self._max_elems

    @property
    def closed(self) -> bool:
        """True after ``close()`` (or after the segment was closed)."""
        return self._closed

    def _live(self) -> Any:
        if self._closed:
            raise RingClosed(f"ring {self.ring_id} is closed")
        return self._ring

    def slot_generation(self, index: int) -> int:
        """Current generation of slot ``index`` (an acquire load; 0 = never written or being
        rewritten). Raises StaleRef for an index outside ``[0, slots)``."""
        ring = self._live()
        if not _is_u32(index) or index >= self.slots:
            raise StaleRef(f"slot index {index!r} outside [0, {self.slots})")
        return int(lib.brt_ring_slot_generation(ring, index))

    def close(self) -> None:
        """Releases the view of the ring memory. Idempotent; the memory itself belongs to the segment
        or buffer owner."""
        if self._closed:
            return
        self._closed = True
        ffi.release(self._handle)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RingWriter(_Ring):
    """The single writer of one ring. Not thread-safe: one writer, one thread (ABI "one writer per
    ring"). Cursor: ``next_index`` / ``next_generation``, (0, 1) after create or attach (rules 126,
    130)."""

    @classmethod
    def create(
        cls, segment: Segment | Any, ring_id: int, kind: RingKind, slots: int, slot_bytes: int
    ) -> RingWriter:
        """Formats a fresh ring (header written, every slot generation 0) at the start of ``segment``
        (a Segment or a writable buffer) and returns its writer.

        ``slots`` >= 1; ``slot_bytes`` includes the 16-byte slot header, is a multiple of 8 and at
        least 24. Raises RingLayoutError (ERR_RING_LAYOUT, nothing written) for a bad geometry or
        kind, or a mapping shorter than ``ring_bytes(slots, slot_bytes)``."""
        return cls(segment, ring_id, kind, slots, slot_bytes, format_fresh=True)

    @classmethod
    def attach(
        cls, segment: Segment | Any, ring_id: int, kind: RingKind, slots: int, slot_bytes: int
    ) -> RingWriter:
        """Becomes the writer of an existing ring after validating its header against ``ring_id``,
        ``slot_bytes``, ``slots`` and the mapped length (RingLayoutError otherwise, nothing changed;
        ABI rule 125). The cursor restarts at (index 0, generation 1) (rule 130), and every slot of
        the previous lifetime is invalidated so no old reference can resolve to new data."""
        writer = cls(segment, ring_id, kind, slots, slot_bytes, format_fresh=False)
        lib.brt_ring_invalidate(writer._ring)
        return writer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._span = ffi.new("brt_span *")

    @property
    def next_index(self) -> int:
        """Slot the next write starts at, in ``[0, slots)``."""
        return int(self._ring.next_index)

    @property
    def next_generation(self) -> int:
        """Generation the next write's first slot gets (>= 1)."""
        return int(self._ring.next_generation)

    def _coerce(self, values: Any) -> np.ndarray:
        arr = values if isinstance(values, np.ndarray) else np.asarray(values)
        if arr.ndim != 1:
            raise BadPayload(f"ring payload must be 1-D, got shape {arr.shape}")
        if arr.dtype == self.dtype:
            return np.ascontiguousarray(arr)
        if self.kind == RingKind.TOKENS:
            if arr.dtype.kind not in "iu":
                if arr.size == 0:
                    return np.empty(0, self.dtype)
                raise BadPayload(f"token ids must be integers, got {arr.dtype}")
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _U32):
                raise BadPayload("token ids must lie in [0, 2**32)")
        elif arr.dtype.kind != "f":
            if arr.size == 0:
                return np.empty(0, self.dtype)
            raise BadPayload(f"logits must be floats, got {arr.dtype}")
        return np.ascontiguousarray(arr, dtype=self.dtype)

    def write(self, values: Any) -> TokenRef:
        """Publishes ``values`` (1-D; u32 token ids for TOKENS rings, floats stored as f32 for LOGITS)
        over consecutive slots from the cursor and returns its ``TokenRef`` (first slot, element
        count, first generation). One foreign call.

        Zero elements: no slot is used, returns ``TokenRef(ring_id, 0, 0, 0)``. Raises BadPayload
        (wrong shape, dtype or token range) or SpanTooLarge (more than ``max_span_elems`` elements),
        both before anything is written; RingClosed after close."""
        if self._closed:
            raise RingClosed(f"ring {self.ring_id} is closed")
        arr = self._coerce(values)
        n = arr.shape[0]
        if n > self._max_elems:
            raise SpanTooLarge(
                f"span of {n} elements needs more than the ring's {self.slots} slots of {self._cap} elements"
            )
        span = self._span
        rc = _write(self._ring, _from_buffer(arr) if n else ffi.NULL, n, ELEM_BYTES, span)
        if rc != 0:
            raise SpanTooLarge(f"ring refused a span of {n} elements (status {rc})")
        return TokenRef(ring_id=self.ring_id, index=span.index, count=n, generation=span.generation)

    def write_row(self, row: Any) -> RingRef:
        """Publishes one row (1-D, 1 to ``capacity_elems`` elements; a logits row for LOGITS rings) in
        exactly one slot and returns its ``RingRef``, whose generation is the row's logits nonce
        (ABI rule 65). Raises BadPayload for an empty or malformed row, SpanTooLarge for a row longer
        than one slot; nothing is written then."""
        ring = self._live()
        arr = self._coerce(row)
        n = arr.shape[0]
        if n == 0:
            raise BadPayload("a ring row holds at least one element")
        if n > self._cap:
            raise SpanTooLarge(f"row of {n} elements exceeds one slot of {self._cap} elements")
        span = self._span
        rc = lib.brt_ring_write(ring, ffi.from_buffer(arr), n, ELEM_BYTES, span)
        if rc != 0:
            raise SpanTooLarge(f"ring refused a row of {n} elements (status {rc})")
        return RingRef(ring_id=self.ring_id, index=span.index, generation=span.generation)

    def invalidate(self) -> None:
        """Stores generation 0 in every slot: every reference published so far becomes stale. The
        cursor is unchanged."""
        lib.brt_ring_invalidate(self._live())


class RingReader(_Ring):
    """A reader of one ring; it never writes ring memory. Reads are safe concurrently with the
    writer (in this or another process) and from several threads."""

    @classmethod
    def attach(
        cls, segment: Segment | Any, ring_id: int, kind: RingKind, slots: int, slot_bytes: int
    ) -> RingReader:
        """Validates the header at the start of ``segment`` (a Segment or a writable buffer) against
        ``ring_id``, ``slot_bytes``, ``slots`` and the mapped length; raises RingLayoutError
        (ERR_RING_LAYOUT, -131) on any mismatch or a kind other than TOKENS/LOGITS (ABI rule 125)."""
        return cls(segment, ring_id, kind, slots, slot_bytes, format_fresh=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._n_out = ffi.new("uint32_t *")

    def _out(self, out: np.ndarray | None, n: int) -> np.ndarray:
        if out is None:
            return np.empty(n, self.dtype)
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != self.dtype
            or out.shape != (n,)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise BadPayload(f"out must be a writable contiguous {self.dtype} array of shape ({n},)")
        return out

    def read(self, ref: TokenRef, out: np.ndarray | None = None) -> np.ndarray:
        """The ``ref.count`` elements of the span ``ref`` names, as a private array (u32 for TOKENS,
        f32 for LOGITS), or copied into ``out`` (same dtype, shape ``(count,)``) and returned.

        Raises StaleRef (REJECT_BAD_REF_GENERATION) when the reference is for another ring, has
        generation 0, an index outside ``[0, slots)`` or a count beyond ``max_span_elems``, or when any
        slot of the span is recycled, being rewritten or holds a different payload length than the
        span implies (ABI rules 127-129). ``out`` is unspecified after StaleRef. One foreign call.

        Slots carry no end-of-span mark: a count that is a multiple of ``capacity_elems`` and shorter
        than the published span reads exactly that prefix (whole slots of the same publication); any
        other count that differs from the published one is StaleRef."""
        if self._closed:
            raise RingClosed(f"ring {self.ring_id} is closed")
        count = ref.count
        if count == 0:
            if ref.index == 0 and ref.generation == 0:
                return self._out(out, 0)
            raise StaleRef(f"empty reference with index {ref.index} and generation {ref.generation}")
        if ref.ring_id != self.ring_id:
            raise StaleRef(f"reference to ring {ref.ring_id} read from ring {self.ring_id}")
        try:
            if not 0 < count <= self._max_elems:
                raise StaleRef(f"reference count {count} is outside the ring")
            dst = np.empty(count, self.dtype) if out is None else self._out(out, count)
            # index >= slots and generation 0 are refused in C; a negative or oversized field is refused
            # by cffi's integer conversion (OverflowError), a non-integer by TypeError.
            rc = _read(
                self._ring, ref.index, ref.generation, count, ELEM_BYTES, _from_buffer(_BYTES, dst, True)
            )
        except (TypeError, OverflowError) as exc:
            raise StaleRef(f"reference fields out of range: {ref!r}") from exc
        if rc != 0:
            raise StaleRef(f"span (index {ref.index}, count {count}, generation {ref.generation}) is stale")
        return dst

    def read_row(self, ref: RingRef, out: np.ndarray | None = None) -> np.ndarray:
        """The row in slot ``ref.index`` published under ``ref.generation``, as a private array of the
        row's own length (or copied into ``out``, which must then have exactly that length).

        Raises StaleRef for a reference to another ring, generation 0, an out-of-range index, a slot
        recycled or being rewritten (ABI rules 127-129); BadPayload for an ``out`` of the wrong shape.
        One foreign call."""
        if self._closed:
            raise RingClosed(f"ring {self.ring_id} is closed")
        if ref.ring_id != self.ring_id:
            raise StaleRef(f"reference to ring {ref.ring_id} read from ring {self.ring_id}")
        if out is not None:
            dst = self._out(out, out.shape[0] if isinstance(out, np.ndarray) and out.ndim == 1 else -1)
        else:
            dst = np.empty(self._cap, self.dtype)
        n_out = self._n_out
        try:
            rc = _read_slot(
                self._ring,
                ref.index,
                ref.generation,
                ELEM_BYTES,
                _from_buffer(_BYTES, dst, True),
                dst.shape[0],
                n_out,
            )
        except (TypeError, OverflowError) as exc:
            raise StaleRef(f"reference fields out of range: {ref!r}") from exc
        if rc == _ERR_BOUNDS:
            raise BadPayload(f"row in slot {ref.index} is longer than out ({dst.shape[0]} elements)")
        if rc != 0:
            raise StaleRef(f"row (index {ref.index}, generation {ref.generation}) is stale")
        n = n_out[0]
        if out is not None:
            if n != dst.shape[0]:
                raise BadPayload(f"row holds {n} elements, out has {dst.shape[0]}")
            return dst
        return dst if n == self._cap else dst[:n].copy()
