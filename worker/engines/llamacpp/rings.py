"""The engine's side of its BRTRING1 rings (DESIGN.md "Rings"; ABI rules 123-130).

Ring roles are told apart by (role, kind) from the engine's side: the prompt ring is
ENGINE_READS/TOKENS (admits and seeds name their tokens there), the emit ring ENGINE_WRITES/TOKENS
(each lane's committed tokens of a tick), the logits ring ENGINE_WRITES/LOGITS (one f32 row per
HOST decode; its generation is the commit nonce). The logits ring is optional: without it HOST
admits are refused (HOST_RULES).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from basertd.schema.abi import RingKind, RingRole, Status
from basertd.schema.tick import RingRef, TokenRef
from basertd.shm import RingError, RingReader, RingWriter
from basertd.worker.engines.base import EngineError, RingMapping

_ROLES = {
    (RingRole.ENGINE_READS, RingKind.TOKENS): "prompts",
    (RingRole.ENGINE_WRITES, RingKind.TOKENS): "emits",
    (RingRole.ENGINE_WRITES, RingKind.LOGITS): "logits",
}


class EngineRings:
    """Attached rings by ring_id; ``prompts`` (reader), ``emits`` (writer) and ``logits`` (writer
    or None) are the lowest-id ring of each role (as the reference engine picks them).

    Until a prompt ring is attached admits are refused (BAD_REF_GENERATION), until an emit ring is
    attached decodes are (BOUNDS)."""

    def __init__(self) -> None:
        self._rings: dict[int, tuple[str, RingReader | RingWriter]] = {}
        self.prompts: RingReader | None = None
        self.emits: RingWriter | None = None
        self.logits: RingWriter | None = None

    def attach(self, rings: Sequence[RingMapping]) -> None:
        """Attach or re-attach rings, replacing by ring_id; all or nothing.

        Every mapping's header is checked against its ring_id, slot_bytes, slots and length before
        anything changes. Raises EngineError(ERR_RING_LAYOUT) on a mismatch, a kind/role with no use
        here, or a ring_id twice in one call; the attached rings stay as they were then. Each ring
        attached here starts its writer cursor at (index 0, generation 1); rings not named keep
        theirs (ABI rules 125, 130)."""
        seen: set[int] = set()
        for m in rings:
            if (RingRole(m.role), RingKind(m.kind)) not in _ROLES:
                raise EngineError(Status.ERR_RING_LAYOUT, f"ring {m.ring_id}: no use for {m.role}/{m.kind}")
            if m.ring_id in seen:
                raise EngineError(Status.ERR_RING_LAYOUT, f"ring {m.ring_id} twice")
            seen.add(m.ring_id)
        probes: list[RingReader] = []
        taken: dict[int, tuple[str, RingReader | RingWriter]] = {}
        try:
            # Every header first: attaching a writer invalidates its slots, which must not happen
            # when another ring of the call is bad.
            for m in rings:
                probes.append(RingReader.attach(m.buffer, m.ring_id, RingKind(m.kind), m.slots, m.slot_bytes))
            for m in rings:
                role = _ROLES[(RingRole(m.role), RingKind(m.kind))]
                cls = RingReader if role == "prompts" else RingWriter
                taken[m.ring_id] = (
                    role,
                    cls.attach(m.buffer, m.ring_id, RingKind(m.kind), m.slots, m.slot_bytes),
                )
        except (RingError, ValueError) as exc:
            for _, r in taken.values():
                r.close()
            raise EngineError(Status.ERR_RING_LAYOUT, str(exc)) from exc
        finally:
            for r in probes:
                r.close()
        for rid, entry in taken.items():
            old = self._rings.pop(rid, None)
            if old is not None:
                old[1].close()
            self._rings[rid] = entry
        for role in ("prompts", "emits", "logits"):
            ids = sorted(rid for rid, (r, _) in self._rings.items() if r == role)
            setattr(self, role, self._rings[ids[0]][1] if ids else None)

    @property
    def attached(self) -> bool:
        """True once a prompt and an emit ring are attached."""
        return self.prompts is not None and self.emits is not None

    def read_prompt(self, ref: TokenRef) -> np.ndarray:
        """Copy the tokens ``ref`` names out of the prompt ring (uint32, shape (count,)).

        Raises EngineError(REJECT_BAD_REF_GENERATION) for a stale or foreign reference (ABI rule 35)
        and for a ring that is not attached."""
        if self.prompts is None:
            raise EngineError(Status.REJECT_BAD_REF_GENERATION, "no prompt ring attached")
        try:
            return self.prompts.read(ref)
        except RingError as exc:
            raise EngineError(Status.REJECT_BAD_REF_GENERATION, str(exc)) from exc

    def write_tokens(self, tokens: np.ndarray) -> TokenRef:
        """Publish one lane's committed tokens in the emit ring; raises RingError when they do not fit."""
        assert self.emits is not None
        return self.emits.write(tokens)

    def write_row(self, row: np.ndarray) -> RingRef:
        """Publish one logits row in the logits ring; raises RingError when it does not fit one slot."""
        assert self.logits is not None
        return self.logits.write_row(row)

    def close(self) -> None:
        """Release the views of the ring memory (the memory is the worker's). Idempotent."""
        for _, r in self._rings.values():
            r.close()
        self._rings.clear()
        self.prompts = self.emits = self.logits = None
