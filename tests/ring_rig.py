"""The coordinator's half of one engine's rings, for tests that drive an engine in this process.

``RingRig`` creates one memfd segment per ring, formats the BRTRING1 headers (DESIGN.md "Rings"):
ring 1 the prompt ring (tokens, engine reads; the rig keeps its ``RingWriter``), ring 2 the emit
ring (tokens, engine writes) and, optionally, ring 3 the logits ring (f32 rows, engine writes),
both read back through ``RingReader``. It describes them as the C binding wants them (``specs``:
``basertd.native.abi.RingSpec``) and as Python engines want them (``mappings()``:
``basertd.worker.engines.base.RingMapping``). Sizes: ``slots`` per ring, ``slot_bytes`` with the
16-byte slot header (``slot_bytes_for(elements)``).

Close the engine first (it holds addresses inside the segments), then the rig.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from basertd.native.abi import RingSpec
from basertd.schema.abi import RingKind, RingRole
from basertd.schema.tick import RingRef, TokenRef
from basertd.shm import RingReader, RingWriter, Segment, ring_bytes, slot_bytes_for
from basertd.worker.engines.base import RingMapping

PROMPT_RING, EMIT_RING, LOGITS_RING = 1, 2, 3
RING_SHAPES: dict[int, tuple[RingKind, RingRole]] = {
    PROMPT_RING: (RingKind.TOKENS, RingRole.ENGINE_READS),
    EMIT_RING: (RingKind.TOKENS, RingRole.ENGINE_WRITES),
    LOGITS_RING: (RingKind.LOGITS, RingRole.ENGINE_WRITES),
}
"""Ring id -> (kind, role from the engine's side) of the three rings of one engine."""


def geometry(
    *,
    prompt_slots: int = 64,
    prompt_slot_tokens: int = 64,
    emit_slots: int = 256,
    emit_slot_tokens: int = 64,
    logits_slots: int = 8,
    vocab: int | None = 512,
) -> dict[int, tuple[int, int]]:
    """Ring id -> (slots, slot_bytes) from element counts; ``vocab`` None leaves out the logits ring."""
    out = {
        PROMPT_RING: (prompt_slots, slot_bytes_for(prompt_slot_tokens)),
        EMIT_RING: (emit_slots, slot_bytes_for(emit_slot_tokens)),
    }
    if vocab is not None:
        out[LOGITS_RING] = (logits_slots, slot_bytes_for(vocab))
    return out


class RingRig:
    """Prompt writer, emit and logits readers over fresh memfd segments (module docstring).

    ``shape``: ring id -> (slots, slot_bytes), ring ids from ``RING_SHAPES`` (1 and 2 required).
    ``segments`` lists the rings' segments in ``shape`` order; tests may append more segments
    for the rig to close. ``logits`` is None without ring 3."""

    def __init__(self, shape: Mapping[int, tuple[int, int]], *, name: str = "ring-rig") -> None:
        self.segments: list[Segment] = []
        self.specs: list[RingSpec] = []
        self._mappings: list[RingMapping] = []
        self.logits: RingReader | None = None
        self._rings: list[RingWriter | RingReader] = []
        try:
            for rid, (slots, slot_bytes) in shape.items():
                self._add(rid, slots, slot_bytes, name)
        except BaseException:
            self.close()
            raise

    def _add(self, rid: int, slots: int, slot_bytes: int, name: str) -> None:
        kind, role = RING_SHAPES[rid]
        seg = Segment.create(ring_bytes(slots, slot_bytes), name=name)
        self.segments.append(seg)
        writer = RingWriter.create(seg, rid, kind, slots, slot_bytes)
        if role == RingRole.ENGINE_READS:
            self.prompt = writer
            self._rings.append(writer)
        else:
            writer.close()  # formatted; the engine writes it
            reader = RingReader.attach(seg, rid, kind, slots, slot_bytes)
            self._rings.append(reader)
            if rid == EMIT_RING:
                self.emit = reader
            else:
                self.logits = reader
        where = (seg.address, seg.length)
        self.specs.append(RingSpec(rid, int(kind), int(role), slots, slot_bytes, *where))
        self._mappings.append(RingMapping(rid, kind, role, slots, slot_bytes, seg.buffer, *where))

    def mappings(self) -> list[RingMapping]:
        """The rings as ``Engine.attach_rings`` takes them."""
        return list(self._mappings)

    def put(self, tokens: Sequence[int] | np.ndarray) -> TokenRef:
        """Write prompt tokens (u32) into ring 1; returns their span."""
        return self.prompt.write(np.asarray(tokens, dtype=np.uint32))

    def read(self, ref: TokenRef) -> np.ndarray:
        """The u32 tokens an emit names (ring 2)."""
        return self.emit.read(ref)

    def row(self, ref: RingRef) -> np.ndarray:
        """The f32 logits row a HOST lane's emit names (ring 3)."""
        assert self.logits is not None, "this rig has no logits ring"
        return self.logits.read_row(ref)

    def close(self) -> None:
        """Close the rings, then every segment (the engine must be closed already)."""
        for r in self._rings:
            r.close()
        self._rings.clear()
        for seg in self.segments:
            seg.close()
        self.segments.clear()
