"""Marshalling a schema ``TickPlan`` into one reused, 8-byte aligned C arena.

Arena layout for one plan (every part a multiple of 8 bytes, so every array is 8-byte aligned,
ABI rule 20): ``BaseRTTickPlan`` (168 bytes) | admits (144 each) | commits (24) | prefills (16) |
decodes (16) | retires (16) | shed_policy.victim_lanes (u64 each). The arena grows geometrically
when a plan does not fit and never shrinks, so a warm arena allocates nothing per tick. Records
are written through numpy structured views whose dtypes come from the cffi layout
(``basertd.native._layout``); the used bytes are zeroed first, so every pad byte is 0 (the writer
zero-pads, schema §1.1).
"""

from __future__ import annotations

from collections.abc import Sequence

import cffi
import numpy as np
from msgspec.structs import astuple

from basertd.native._errors import ArgumentError
from basertd.native._layout import record_dtype
from basertd.schema.abi import TickFlag
from basertd.schema.tick import LaneAdmit, TickPlan

PLAN_SIZE = 168
"""sizeof(BaseRTTickPlan) with the partial-emit tail (ABI rule 6)."""
PLAN_LEGACY_SIZE = 152
"""The v1 plan prefix, sent when no partial-emit callback is installed (ABI rule 6)."""
MIN_ARENA_BYTES = 4096

_ID32 = 32


def _admit_row(a: LaneAdmit) -> tuple:
    hsi = a.host_sampler_identity
    if len(hsi) != _ID32:
        raise ArgumentError(f"admit {a.lane_tag}: host_sampler_identity must be 32 bytes, got {len(hsi)}")
    return (
        a.lane_tag,
        astuple(a.prompt),
        a.seed_handle,
        a.sampling,
        a.logit_bias_handle,
        astuple(a.params),
        a.rng_counter_base,
        a.grammar_handle,
        a.strategy_slot,
        a.determinism_class,
        a.minimum_exactness,
        a.allow_approximate,
        a.want_logprobs,
        a.required_cert_id,
        hsi,
        a.grammar_replay,
        a.decode_replay,
    )


class PlanArena:
    """Writes ``TickPlan``s into one C buffer owned by this object (one per bundle).

    ``encode`` returns a ``BaseRTTickPlan *`` into the arena, valid until the next ``encode``.
    Not thread-safe: one tick at a time per bundle, like the ABI itself."""

    def __init__(self, ffi: cffi.FFI) -> None:
        self.ffi = ffi
        self._plan_dt = record_dtype(ffi, "BaseRTTickPlan")
        self._dts = [
            record_dtype(ffi, c)
            for c in ("BaseRTLaneAdmit", "BaseRTLaneCommit", "BaseRTLanePrefill", "BaseRTLaneDecode")
        ] + [record_dtype(ffi, "BaseRTLaneRetire")]
        self._sizes = [dt.itemsize for dt in self._dts]
        self._u64 = np.dtype("<u8")
        self.capacity = 0
        self.grows = 0
        self._mem = None
        self._u8: np.ndarray = np.zeros(0, np.uint8)
        self._base = 0
        self._plan_ptr = None
        self._ensure(MIN_ARENA_BYTES)

    def _ensure(self, need: int) -> None:
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity, MIN_ARENA_BYTES)
        cap = (cap + 7) & ~7
        self._mem = self.ffi.new("uint64_t[]", cap // 8)
        self._u8 = np.frombuffer(self.ffi.buffer(self._mem), np.uint8)
        self._base = int(self.ffi.cast("uintptr_t", self._mem))
        self._plan_ptr = self.ffi.cast("BaseRTTickPlan *", self._mem)
        self.capacity = cap
        self.grows += 1

    @property
    def address(self) -> int:
        """Address of the arena (and of the plan struct at its start)."""
        return self._base

    def encode(self, plan: TickPlan, partial_emit: int = 0, partial_user: int = 0):
        """Write ``plan`` and return a ``BaseRTTickPlan *`` cdata into the arena.

        ``partial_emit`` is the address of an ``on_partial_emit`` C function or 0. With one, the
        plan is written at 168 bytes with ``TickFlag.PARTIAL_EMITS`` set; without, at the 152-byte
        legacy size with the flag cleared (a flag without a callback means nothing; ABI rule 64).
        Raises ``ArgumentError`` when a value does not fit its C field (negative, too wide, wrong
        type, a host_sampler_identity that is not 32 bytes); the previous plan in the arena is
        then no longer valid, and no engine call has been made."""
        groups: list[Sequence] = [plan.admits, plan.commits, plan.prefills, plan.decodes, plan.retires]
        victims = plan.shed_policy.victim_lanes
        need = (
            PLAN_SIZE + sum(len(g) * s for g, s in zip(groups, self._sizes, strict=True)) + 8 * len(victims)
        )
        self._ensure(need)
        u8 = self._u8
        u8[:need] = 0
        off = PLAN_SIZE
        arrays = []
        names = ("admits", "commits", "prefills", "decodes", "retires")
        try:
            for name, group, dt, size in zip(names, groups, self._dts, self._sizes, strict=True):
                n = len(group)
                if n:
                    view = u8[off : off + n * size].view(dt)
                    try:
                        view[:] = (
                            [_admit_row(a) for a in group] if name == "admits" else list(map(astuple, group))
                        )
                    except (OverflowError, ValueError, TypeError) as e:
                        raise ArgumentError(f"plan.{name}: {e}") from e
                    arrays.append((self._base + off, n, size))
                    off += n * size
                else:
                    arrays.append((0, 0, size))
            nv = len(victims)
            if nv:
                try:
                    u8[off : off + 8 * nv].view(self._u64)[:] = victims
                except (OverflowError, ValueError, TypeError) as e:
                    raise ArgumentError(f"plan.shed_policy.victim_lanes: {e}") from e
                victim_arr = (self._base + off, nv, 8)
            else:
                victim_arr = (0, 0, 8)
            sp = plan.shed_policy
            flags = int(plan.flags)
            if partial_emit:
                flags |= TickFlag.PARTIAL_EMITS
                size = PLAN_SIZE
            else:
                flags &= ~int(TickFlag.PARTIAL_EMITS)
                size = PLAN_LEGACY_SIZE
            row = (
                size,
                plan.plan_seq,
                flags,
                plan.prefill_token_budget,
                plan.max_decode_lanes,
                *arrays,
                (victim_arr, sp.evictable_cache_classes, sp.protected_quota_bytes, sp.max_evict_bytes),
                partial_emit,
                partial_user,
            )
            try:
                u8[:PLAN_SIZE].view(self._plan_dt)[0] = row
            except (OverflowError, ValueError, TypeError) as e:
                raise ArgumentError(f"plan: {e}") from e
        except ArgumentError:
            u8[:PLAN_SIZE] = 0
            raise
        return self._plan_ptr
