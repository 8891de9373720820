"""The engine protocol every adapter implements (DESIGN.md "Engines").

It mirrors the tick ABI one call for one call, in schema types: a plan in, events out, plus the
prefix-cache, seed-lease, state-op, grammar and logit-bias calls. The worker's Link W server is
written against this protocol only, so libbaseRT, the C reference engine (both through
``basertd.worker.engines.basert``) and llama.cpp (``basertd.worker.engines.llamacpp``) are
interchangeable.

Sequence handles (``seq``) and op handles (``op``) are plain integers that the adapter maps to
its own objects; they are never reused on one engine instance (ABI rule 99).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from basertd.schema.abi import RingKind, RingRole, Status
from basertd.schema.rejection import PlanRejected as PlanRejected  # the one refused-plan error
from basertd.schema.tick import (
    CacheKey,
    MatchResult,
    OpStatus,
    ShedPolicy,
    StateSpaceDesc,
    TickEvents,
    TickPlan,
    TokenRange,
    TokenRef,
)


class EngineError(Exception):
    """A call refused by the engine with an ABI ``Status``; nothing changed (RULES.md preamble)."""

    def __init__(self, status: Status | int, message: str = "") -> None:
        try:
            status = Status(status)
        except ValueError:
            pass
        self.status = status
        name = status.name if isinstance(status, Status) else str(status)
        super().__init__(f"{name}: {message}" if message else name)


class EngineFatal(EngineError):
    """The engine reported BASERT_ERR_FATAL or a fatal tick; the worker must exit (code 70)."""


@dataclass(frozen=True)
class RingMapping:
    """One attached BRTRING1 ring as the engine sees it (BaseRTRingDesc without the pointer).

    ``buffer`` is the writable mapping of the whole segment (ring header at offset 0, ``len`` bytes);
    ``address`` is its base address for C engines. ``role`` is from the engine's side: the prompt
    ring is ENGINE_READS, the emit and logits rings ENGINE_WRITES (DESIGN.md "Rings")."""

    ring_id: int
    kind: RingKind
    role: RingRole
    slots: int
    slot_bytes: int
    buffer: memoryview
    address: int
    length: int


@dataclass(frozen=True)
class TokenizerSpec:
    """How the coordinator builds the same tokenizer the engine uses, without asking the worker.

    ``kind`` is ``"bytes"`` (reference engine: ids 0..2 special, 3..258 the bytes 0x00..0xFF,
    higher ids decode to nothing) or ``"gguf"`` (load ``path`` vocab-only with llama.cpp)."""

    kind: str
    path: str = ""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine reports about itself; the worker turns it into the Link W capability record.

    Sizes are in tokens unless named ``_bytes``."""

    engine: str  # "basert" | "llamacpp"
    engine_version: str
    model: str  # path or name of the loaded model
    model_id: str  # hex digest identifying the weights (identity for cache / snapshot checks)
    vocab_size: int
    context_length: int  # tokens one lane may hold (prompt + generated)
    max_lanes: int  # concurrent lanes
    max_batch_size: int  # the most decodes one tick may carry (ABI rule 31)
    page_size_tokens: int
    pool_bytes: int
    seed_lease_ticks: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int  # -1 when none
    add_bos: bool
    tokenizer: TokenizerSpec
    extra: dict[str, str] = field(default_factory=dict)


PartialEmit = Callable[[int, np.ndarray], None]
"""``on_partial_emit(lane_tag, tokens)``: called on the ticking thread with freshly committed u32
tokens of one lane before ``tick`` returns (ABI rule 64). It must not call back into the engine."""


@runtime_checkable
class Engine(Protocol):
    """One loaded model, driven one tick at a time from one thread."""

    def info(self) -> EngineInfo:
        """Static facts about the engine and model (sizes, vocabulary, TTL, tokenizer)."""
        ...

    def attach_rings(self, rings: Sequence[RingMapping]) -> None:
        """Attach (or re-attach) the rings; all or nothing. Raises EngineError(ERR_RING_LAYOUT)
        (ABI rule 125). Re-attaching resets the engine's writer cursors (rule 130)."""
        ...

    def tick(self, plan: TickPlan, on_partial_emit: PartialEmit | None = None) -> TickEvents:
        """Run one plan. Raises PlanRejected (no state change) or EngineFatal."""
        ...

    def state_spaces(self) -> list[StateSpaceDesc]:
        """The bundle's state spaces (ABI §10 item 2)."""
        ...

    def space_match(self, space_id: int, span: TokenRef) -> MatchResult:
        """Cached prefixes of ``span`` per space; pins nothing (ABI rules 87-88)."""
        ...

    def seed_acquire(self, span: TokenRef, prefix_len: int, determinism_class: int) -> int:
        """Pin ``span[:prefix_len]`` and return a seed handle for one admit (rules 75-83)."""
        ...

    def seed_release(self, seed_handle: int) -> None:
        """Release an unconsumed seed; EngineError(ERR_UNKNOWN_HANDLE) if unknown (rule 81)."""
        ...

    def seed_lease_ticks(self) -> int:
        """The declared seed-lease TTL in ticks (rule 84)."""
        ...

    def seed_adopt(self, seq: int, span: TokenRef) -> int:
        """Lease a bare restored sequence as the seed of the next admit (rule 86)."""
        ...

    def cache_evict(self, policy: ShedPolicy, bytes_target: int) -> int:
        """Evict inside ``policy``; returns bytes freed (rule 89)."""
        ...

    def cache_evict_entries(self, keys: Sequence[CacheKey]) -> None:
        """Drop the named physical cache variants."""
        ...

    def lane_sequence(self, lane_tag: int) -> int | None:
        """The sequence a live lane owns, or None."""
        ...

    def sequence_create(self) -> int:
        """A bare, empty sequence (a restore target)."""
        ...

    def sequence_free(self, seq: int) -> None:
        """Free a bare sequence; EngineError(ERR_UNKNOWN_HANDLE) otherwise (rule 112)."""
        ...

    def sequence_publish(self, seq: int, tokens: np.ndarray) -> None:
        """Publish a bare sequence's whole-page prefix under ``tokens``; consumes it (rule 91)."""
        ...

    def seq_fork(self, parent: int, flags: int) -> int:
        """Fork a sequence (refcounted pages); EngineError(EBUSY) during an op (rule 98)."""
        ...

    def export_size(self, seq: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        """``(required_bytes, sizing_gen)`` for a snapshot or demote of ``rng`` (rules 92-95)."""
        ...

    def snapshot(self, seq: int, space_id: int, boundary_pos: int, sizing_gen: int, dst_bytes: int) -> int:
        """Start a snapshot into an engine-held buffer of ``dst_bytes``; returns an op handle."""
        ...

    def restore(self, seq: int, space_id: int, data: bytes) -> int:
        """Start restoring a sealed export into ``seq``; returns an op handle (rules 101-104)."""
        ...

    def snapshot_boundary(self, seq: int, space_id: int, cap: int) -> int:
        """Newest durable boundary <= ``cap`` (rule 111)."""
        ...

    def trim(self, seq: int, space_id: int, new_len: int) -> None:
        """Trim a space to ``new_len`` tokens (rule 109)."""
        ...

    def demote(
        self, seq: int, space_id: int, rng: TokenRange, encoding: int, sizing_gen: int, dst_bytes: int
    ) -> int:
        """Start moving ``rng`` to the host tier; returns an op handle (rules 105-108)."""
        ...

    def promote(self, seq: int, space_id: int, rng: TokenRange, data: bytes) -> int:
        """Start bringing a demoted range back; returns an op handle."""
        ...

    def op_poll(self, op: int) -> OpStatus:
        """State of an op; EngineError(ERR_UNKNOWN_HANDLE) if unknown (rule 99)."""
        ...

    def op_cancel(self, op: int) -> None:
        """Request cancellation (rule 100)."""
        ...

    def op_output(self, op: int) -> bytes:
        """The sealed bytes a DONE snapshot or demote wrote (envelope + payload)."""
        ...

    def grammar_create(self, json_schema: str, kind: str = "json_schema") -> int:
        """A grammar handle for ``json_schema`` (spec text of ``kind``: "json_schema", "lark" or
        "regex"), or 0 on failure (including a kind the engine does not serve)."""
        ...

    def grammar_free(self, handle: int) -> None:
        """EngineError(ERR_UNKNOWN_HANDLE) if absent (rule 113)."""
        ...

    def logit_bias_create(self, tokens: Sequence[int], values: Sequence[float]) -> int:
        """A logit-bias handle, or 0 when empty (rule 113)."""
        ...

    def logit_bias_free(self, handle: int) -> None:
        """EngineError(ERR_UNKNOWN_HANDLE) if absent (rule 113)."""
        ...

    def tokenize(self, text: bytes, add_special: bool) -> list[int]:
        """Token ids of ``text`` with the model's vocabulary."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of ``tokens`` (may end inside a UTF-8 character)."""
        ...

    def stats(self) -> dict[str, int]:
        """Monotonic counters and gauges for health and metrics: at least ``ticks``,
        ``prefill_tokens_total`` (tokens actually prefilled, not served by a seed),
        ``decode_tokens_total``, ``live_lanes``, ``live_seed_leases``, ``cache_entries``,
        ``pool_bytes_used``, ``pool_bytes_total``, ``evictions_total`` where the engine knows them."""
        ...

    def close(self) -> None:
        """Free the model and everything it holds; idempotent."""
        ...
