"""The engine's side of its three BRTRING1 rings (DESIGN.md "Rings"; ABI rules 123-130).

Ring roles are told apart by (role, kind) from the engine's side: the prompt ring is
ENGINE_READS/TOKENS (admits and seeds name their tokens there), the emit ring ENGINE_WRITES/TOKENS
(each lane's committed tokens of a tick), the logits ring ENGINE_WRITES/LOGITS (one f32 row per
HOST decode; its generation is the commit nonce). The logits ring is optional: without it HOST
admits are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from basertd.schema.abi import RingKind, RingRole, Status
from basertd.schema.tick import RingRef, TokenRef
from basertd.shm import RingError, RingReader, RingWriter
from basertd.worker.engines.base import EngineError, RingMapping


class EngineRings:
    """Attached rings: ``prompts`` (reader), ``emits`` (writer), ``logits`` (writer or None).

    Build with ``attach``; until then every ring is None and the engine refuses admits."""

    def __init__(self) -> None:
        self.prompts: RingReader | None = None
        self.emits: RingWriter | None = None
        self.logits: RingWriter | None = None

    def attach(self, rings: Sequence[RingMapping]) -> None:
        """Validate every mapping's header and take the rings over, all or nothing.

        Needs exactly one prompt ring and one emit ring, at most one logits ring, distinct ring ids.
        Raises EngineError(ERR_RING_LAYOUT) on a header or size mismatch, a missing or duplicated
        role, or an unknown kind/role; the previous rings stay attached then. On success the writer
        cursors restart at (index 0, generation 1) (ABI rules 125, 130)."""
        by_role: dict[tuple[RingRole, RingKind], RingMapping] = {}
        ids: set[int] = set()
        for m in rings:
            key = (RingRole(m.role), RingKind(m.kind))
            if key not in (
                (RingRole.ENGINE_READS, RingKind.TOKENS),
                (RingRole.ENGINE_WRITES, RingKind.TOKENS),
                (RingRole.ENGINE_WRITES, RingKind.LOGITS),
            ):
                raise EngineError(Status.ERR_RING_LAYOUT, f"ring {m.ring_id}: no use for {key}")
            if key in by_role or m.ring_id in ids:
                raise EngineError(Status.ERR_RING_LAYOUT, f"ring {m.ring_id}: duplicate role or id")
            by_role[key] = m
            ids.add(m.ring_id)
        prompt = by_role.get((RingRole.ENGINE_READS, RingKind.TOKENS))
        emit = by_role.get((RingRole.ENGINE_WRITES, RingKind.TOKENS))
        logits = by_role.get((RingRole.ENGINE_WRITES, RingKind.LOGITS))
        if prompt is None or emit is None:
            raise EngineError(Status.ERR_RING_LAYOUT, "a prompt ring and an emit ring are required")
        probes: list[RingReader] = []
        taken: list = []
        try:
            # Validate every header before taking any writer over: attaching a writer invalidates its
            # slots, which must not happen when another ring of the set is bad.
            for m, kind in ((prompt, RingKind.TOKENS), (emit, RingKind.TOKENS), (logits, RingKind.LOGITS)):
                if m is not None:
                    probes.append(RingReader.attach(m.buffer, m.ring_id, kind, m.slots, m.slot_bytes))
            new_prompts = probes.pop(0)
            taken.append(new_prompts)
            new_emits = RingWriter.attach(
                emit.buffer, emit.ring_id, RingKind.TOKENS, emit.slots, emit.slot_bytes
            )
            taken.append(new_emits)
            new_logits = None
            if logits is not None:
                new_logits = RingWriter.attach(
                    logits.buffer, logits.ring_id, RingKind.LOGITS, logits.slots, logits.slot_bytes
                )
                taken.append(new_logits)
        except (RingError, ValueError) as exc:
            for r in taken:
                r.close()
            raise EngineError(Status.ERR_RING_LAYOUT, str(exc)) from exc
        finally:
            for r in probes:
                r.close()
        self.close()
        self.prompts, self.emits, self.logits = new_prompts, new_emits, new_logits

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
        for r in (self.prompts, self.emits, self.logits):
            if r is not None:
                r.close()
        self.prompts = self.emits = self.logits = None
