"""Helpers of the tick-ABI conformance tests of sections C-G and J: a bundle with real rings.

``Rig`` wraps one ``abi.Bundle`` (the reference engine's ``RefBundle`` or a real libbaseRT's) with
three BRTRING1 rings in memfd segments (``ring_rig.RingRig``), attached through
``baseRT_rings_attach``:

- ring 1, prompt tokens (ENGINE_READS, TOKENS), written by the test with ``RingWriter``;
- ring 2, emitted tokens (ENGINE_WRITES, TOKENS), read with ``RingReader``;
- ring 3, HOST logits rows (ENGINE_WRITES, LOGITS), read with ``RingReader``.

Plans are built from schema records and sent through ``Bundle.tick``; ``plan_seq`` increases by
one per call. ``Rig.state()`` is the reference engine's observable state (counters and every
lane it holds), used to show that a refused plan changed nothing; ``need_ref`` skips a test on a
foreign library, saying which reference-only call it needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pytest
from ring_rig import EMIT_RING as EMIT_RING
from ring_rig import LOGITS_RING as LOGITS_RING
from ring_rig import PROMPT_RING as PROMPT_RING
from ring_rig import RingRig, geometry

from basertd.native.abi import PlanRejected, RingSpec
from basertd.native.ref import RefBundle
from basertd.schema.abi import Sampling, SamplingFlag, Status
from basertd.schema.tick import (
    LaneAdmit,
    LaneCommit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    SamplingParams,
    ShedPolicy,
    TickEvents,
    TickPlan,
    TokenRef,
)

ALL_EVICTABLE = ShedPolicy(evictable_cache_classes=~0 & 0xFFFFFFFFFFFFFFFF, max_evict_bytes=2**64 - 1)
"""A shed envelope that lets the engine evict any unpinned cache entry."""


def need_ref(bundle, what: str = "the reference engine's test surface") -> RefBundle:
    """The bundle as a RefBundle, or skip: foreign libraries lack the baseRT_ref_* calls."""
    if not isinstance(bundle, RefBundle):
        pytest.skip(f"needs {what} (baseRT_ref_*), which a real libbaseRT does not export")
    return bundle


def P(tag: int, offset: int, count: int) -> LanePrefill:
    """A prefill record: ``count`` prompt tokens from ``offset``."""
    return LanePrefill(lane_tag=tag, token_offset=offset, token_count=count)


def D(tag: int, n: int = 1) -> LaneDecode:
    """A decode grant of ``n`` tokens."""
    return LaneDecode(lane_tag=tag, max_new_tokens=n)


def R(tag: int, publish: bool = False) -> LaneRetire:
    """A retire record, publishing the lane's prefix when ``publish``."""
    return LaneRetire(lane_tag=tag, publish_to_cache=int(publish))


def C(tag: int, token: int, nonce: int) -> LaneCommit:
    """A HOST commit of ``token`` answering the row whose generation is ``nonce``."""
    return LaneCommit(lane_tag=tag, token_id=token, logits_nonce=nonce)


class Rig:
    """A bundle plus its prompt, emit and logits rings (see the module docstring)."""

    def __init__(
        self,
        bundle,
        *,
        vocab: int = 512,
        prompt_slots: int = 64,
        token_slot_elems: int = 64,
        emit_slots: int = 256,
        logits_slots: int = 8,
    ) -> None:
        self.bundle = bundle
        self.vocab = vocab
        self.seq = 0
        self.rings = RingRig(
            geometry(
                prompt_slots=prompt_slots,
                prompt_slot_tokens=token_slot_elems,
                emit_slots=emit_slots,
                emit_slot_tokens=token_slot_elems,
                logits_slots=logits_slots,
                vocab=vocab,
            ),
            name="conformance",
        )
        self.segments = self.rings.segments  # 0 prompt, 1 emit, 2 logits; tests may add more
        self.prompt, self.emit, self.logits = self.rings.prompt, self.rings.emit, self.rings.logits
        self.specs = list(self.rings.specs)
        try:
            bundle.rings_attach(self.specs)
        except BaseException:
            self.rings.close()
            raise

    def spec(
        self, ring_id: int, kind: int, role: int, slots: int, slot_bytes: int, seg_index: int
    ) -> RingSpec:
        """A RingSpec over segment ``seg_index`` (0 prompt, 1 emit, 2 logits)."""
        seg = self.segments[seg_index]
        return RingSpec(ring_id, kind, role, slots, slot_bytes, seg.address, seg.length)

    @property
    def ref(self) -> RefBundle:
        """The bundle as a RefBundle, or skip the test (see ``need_ref``)."""
        return need_ref(self.bundle)

    def close(self) -> None:
        """Free the bundle first (it holds pointers into the rings), then the rings."""
        self.bundle.close()
        self.rings.close()

    # -- tokens -------------------------------------------------------------------------------

    def put(self, tokens: Iterable[int]) -> TokenRef:
        """Write prompt tokens into ring 1; returns their span."""
        return self.prompt.write(np.asarray(list(tokens), dtype=np.uint32))

    def emitted(self, events: TickEvents, tag: int) -> list[int]:
        """The tokens the emit of lane ``tag`` carries ([] when it has no emit)."""
        e = self.emit_of(events, tag)
        return [] if e is None else self.emit.read(e.token_ref).tolist()

    @staticmethod
    def emit_of(events: TickEvents, tag: int):
        """The emit record of lane ``tag`` in ``events``, or None."""
        found = [e for e in events.emits if e.lane_tag == tag]
        assert len(found) <= 1, f"lane {tag} has {len(found)} emits in one tick"
        return found[0] if found else None

    def row(self, events: TickEvents, tag: int) -> np.ndarray:
        """The logits row a HOST lane's emit names."""
        return self.logits.read_row(self.emit_of(events, tag).logits_row)

    # -- plans --------------------------------------------------------------------------------

    @staticmethod
    def admit(
        tag: int,
        span: TokenRef,
        *,
        sampling: int = Sampling.GPU_GREEDY,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        **fields,
    ) -> LaneAdmit:
        """An admit record (schema field names as keywords)."""
        params = SamplingParams(
            temperature=temperature, flags=int(SamplingFlag.IGNORE_EOS) if ignore_eos else 0
        )
        return LaneAdmit(lane_tag=tag, prompt=span, sampling=sampling, params=params, **fields)

    def plan(
        self,
        admits: Sequence = (),
        commits: Sequence = (),
        prefills: Sequence = (),
        decodes: Sequence = (),
        retires: Sequence = (),
        *,
        budget: int = 1 << 16,
        max_decode_lanes: int | None = None,
        flags: int = 0,
        shed: ShedPolicy | None = None,
        plan_seq: int | None = None,
    ) -> TickPlan:
        """A TickPlan with the next plan_seq (or ``plan_seq``)."""
        if plan_seq is None:
            self.seq += 1
            plan_seq = self.seq
        return TickPlan(
            plan_seq=plan_seq,
            flags=flags,
            prefill_token_budget=budget,
            max_decode_lanes=len(decodes) if max_decode_lanes is None else max_decode_lanes,
            admits=list(admits),
            commits=list(commits),
            prefills=list(prefills),
            decodes=list(decodes),
            retires=list(retires),
            shed_policy=shed or ShedPolicy(),
        )

    def tick(self, *args, on_partial_emit=None, **kwargs) -> TickEvents:
        """Build and run a plan; raises PlanRejected on refusal."""
        return self.bundle.tick(self.plan(*args, **kwargs), on_partial_emit=on_partial_emit)

    def start(self, tag: int, tokens: Sequence[int], decode: int = 0, **admit_fields) -> TickEvents:
        """Admit lane ``tag`` with prompt ``tokens``, prefill all of it and decode ``decode``
        tokens, in one tick."""
        n = len(tokens) - admit_fields.get("decode_replay", 0)
        a = self.admit(tag, self.put(tokens), **admit_fields)
        return self.tick([a], prefills=[P(tag, 0, n)], decodes=[D(tag, decode)] if decode else [])

    def state(self):
        """The reference engine's observable state (counters without rejected_plans, and every
        lane it holds); None on a foreign library."""
        if not isinstance(self.bundle, RefBundle):
            return None
        stats = self.bundle.stats()
        stats.pop("rejected_plans")
        lanes = {}
        for tag in self.tags:
            try:
                lanes[tag] = self.bundle.lane_info(tag)
            except Exception:
                lanes[tag] = None
        return stats, lanes

    tags: tuple[int, ...] = (*range(16), 0xFFFFFFFFFFFFFFFF)

    def rejects(self, status: Status, *args, **kwargs) -> None:
        """Assert the plan is refused with ``status`` and (reference engine) nothing changed."""
        before = self.state()
        with pytest.raises(PlanRejected) as info:
            self.tick(*args, **kwargs)
        assert info.value.status == status, f"expected {status!r}, got {info.value.status!r}"
        assert self.state() == before, "a refused plan changed engine state"


def xfail_unless_reference(bundle, feature: str) -> None:
    """Called when an engine refused ``feature`` with OP_UNSUPPORTED / REGISTRATION_REFUSED, which
    the ABI allows an engine to do: xfail on engines other than the reference. The reference
    engine implements every rule, so there the caller re-raises and the test fails."""
    from basertd.native.ref import RefBundle

    if not isinstance(bundle, RefBundle):
        pytest.xfail(f"this engine does not serve {feature}")
