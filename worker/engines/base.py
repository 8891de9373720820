"""The engine protocol every adapter implements (DESIGN.md "Engines").

It mirrors the tick ABI one call for one call, in schema types: a plan in, events out, plus the
prefix-cache, seed-lease, state-op, grammar and logit-bias calls. ``Engine`` is a core every
engine implements (facts, rings, tick, state spaces, stats, tokenizer, close) plus optional
``Capability`` groups whose methods default, here and only here, to
``EngineError(ERR_OP_UNSUPPORTED)``: an engine states what it lacks by not defining it, and
``Engine.capabilities()`` lists what it serves. The worker's Link W server is written against this
class only, so libbaseRT, the C reference engine (both through ``basertd.worker.engines.basert``)
and llama.cpp (``basertd.worker.engines.llamacpp``) are interchangeable.

Sequence handles (``seq``) and op handles (``op``) are plain integers that the adapter maps to
its own objects; they are never reused on one engine instance (ABI rule 99).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from basertd.schema.abi import RingKind, RingRole, Status, status_name
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
        status = Status.of(status)
        self.status = status
        name = status_name(status)
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


PartialEmit = Callable[..., None]
"""``on_partial_emit(lane_tag, tokens)``: called on the ticking thread with freshly committed u32
tokens of one lane before ``tick`` returns (ABI rule 64). It must not call back into the engine.

A callback may also have a ``spec(lane_tag, proposed, accepted)`` method: an engine that
speculates calls it just before each of a lane's partial emits with the drafts the lane proposed
and had accepted so far this tick (cumulative over the tick's rounds, as its emit's SpecStats will
count them), so a request that ends on a partial emit reports them. The C ABI's callback carries
tokens only, so engines behind it never call ``spec``."""


class Capability(enum.Enum):
    """An optional part of the engine surface. An engine serves a capability when its class defines
    every method of the capability (``CAPABILITY_METHODS``); the ``Engine`` base class answers the
    rest with ``EngineError(ERR_OP_UNSUPPORTED)`` (ABI rule 16), so an engine states what it lacks
    by not defining it. ``Engine.capabilities()`` may narrow the set per instance (a library that
    lacks a function)."""

    PREFIX_CACHE = "prefix_cache"  # matches, seed leases, eviction (ABI rules 75-91)
    STATE_OPS = "state_ops"  # sequences, forks, snapshots, restores, trims, op polling (rules 92-112)
    HOST_TIER = "host_tier"  # demote / promote of KV ranges to host memory (rules 105-108)
    GRAMMAR = "grammar"  # grammar handles for constrained lanes (rule 113)
    LOGIT_BIAS = "logit_bias"  # logit-bias handles (rule 113)
    TICK_YIELD = "tick_yield"  # ending a tick early at a step boundary (DESIGN.md "Front ends ... yield")
    EMBEDDINGS = "embeddings"  # pooled embeddings of inputs, between ticks (Link W EMBED)
    SCORING = "scoring"  # prompt log-probabilities, between ticks (Link W SCORE)
    SPECULATION = "speculation"  # speculation-strategy registration (tick ABI §2, rules 114-122)


CAPABILITY_METHODS: dict[Capability, tuple[str, ...]] = {
    Capability.PREFIX_CACHE: (
        "space_match",
        "seed_acquire",
        "seed_release",
        "seed_lease_ticks",
        "seed_adopt",
        "cache_evict",
        "cache_evict_entries",
    ),
    Capability.STATE_OPS: (
        "lane_sequence",
        "sequence_create",
        "sequence_free",
        "sequence_publish",
        "seq_fork",
        "export_size",
        "snapshot",
        "restore",
        "snapshot_boundary",
        "trim",
        "op_poll",
        "op_cancel",
        "op_output",
    ),
    Capability.HOST_TIER: ("demote", "promote"),
    Capability.GRAMMAR: ("grammar_create", "grammar_free"),
    Capability.LOGIT_BIAS: ("logit_bias_create", "logit_bias_free"),
    Capability.TICK_YIELD: ("attach_control",),
    Capability.EMBEDDINGS: ("embed", "embed_chunk", "embed_cancel"),
    Capability.SCORING: ("score",),
    Capability.SPECULATION: ("strategy_register",),
}
"""The methods of each capability: an engine defines all of them or none."""


class ServedBy:
    """An ``Engine`` method an engine serves through one of its parts: ``seq_fork =
    ServedBy("sequences")`` in an engine class makes ``engine.seq_fork`` the ``seq_fork`` of
    ``engine.sequences`` (same name, same signature), so an adapter composes one part per
    capability instead of writing a forwarding method for each call. The contract is the
    ``Engine`` method's docstring (the ABI rule); what the engine decides where the ABI leaves a
    choice is in the part's method. It counts for its ``Capability`` as a defined method does."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        contract = getattr(Engine, name, None)
        self.__doc__ = f"``{self.part}.{name}``: {contract.__doc__ if contract is not None else ''}"

    def __get__(self, engine: object, owner: type | None = None) -> Any:
        if engine is None:
            return self
        return getattr(getattr(engine, self.part), self.name)


def unsupported(engine: object, capability: Capability, call: str) -> EngineError:
    """The error an engine's missing capability answers: ``EngineError(ERR_OP_UNSUPPORTED)``
    naming the engine class, the call and the capability (ABI rule 16)."""
    return EngineError(
        Status.ERR_OP_UNSUPPORTED,
        f"{type(engine).__name__} does not serve {call} (no {capability.value} capability)",
    )


class Engine(abc.ABC):
    """One loaded model, driven one tick at a time from one thread.

    The core (abstract here) is what every engine must do: ``info``, ``attach_rings``, ``tick``,
    ``state_spaces``, ``stats``, ``tokenize``, ``detokenize``, ``close``. Everything else belongs to
    one ``Capability``; a method an engine does not define raises ``unsupported`` (a demote or
    promote after ``check_op_target``), and ``capabilities()`` says which
    are served. Defining part of a capability is a TypeError when the class is created."""

    _served: frozenset[Capability] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        served = set()
        for cap, names in CAPABILITY_METHODS.items():
            own = [n for n in names if getattr(cls, n) is not getattr(Engine, n)]
            if own and len(own) != len(names):
                missing = sorted(set(names) - set(own))
                raise TypeError(f"{cls.__name__} serves part of {cap.value}: it lacks {', '.join(missing)}")
            if own:
                served.add(cap)
        cls._served = frozenset(served)

    def capabilities(self) -> frozenset[Capability]:
        """The capabilities this engine serves: those its class defines, unless narrowed."""
        return self._served

    def supports(self, capability: Capability) -> bool:
        """Whether ``capability`` is in ``capabilities()``."""
        return capability in self.capabilities()

    # -- core --------------------------------------------------------------------------------------

    @abc.abstractmethod
    def info(self) -> EngineInfo:
        """Static facts about the engine and model (sizes, vocabulary, TTL, tokenizer)."""

    @abc.abstractmethod
    def attach_rings(self, rings: Sequence[RingMapping]) -> None:
        """Attach (or re-attach) the rings; all or nothing. Raises EngineError(ERR_RING_LAYOUT)
        (ABI rule 125). Re-attaching resets the engine's writer cursors (rule 130)."""

    @abc.abstractmethod
    def tick(self, plan: TickPlan, on_partial_emit: PartialEmit | None = None) -> TickEvents:
        """Run one plan. Raises PlanRejected (no state change) or EngineFatal."""

    @abc.abstractmethod
    def state_spaces(self) -> list[StateSpaceDesc]:
        """The bundle's state spaces (ABI §10 item 2); empty for an engine without state."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Monotonic counters and gauges for health and metrics: at least ``ticks``,
        ``prefill_tokens_total`` (tokens actually prefilled, not served by a seed),
        ``decode_tokens_total``, ``live_lanes``, ``live_seed_leases``, ``cache_entries``,
        ``pool_bytes_used``, ``pool_bytes_total``, ``evictions_total`` where the engine knows them."""

    @abc.abstractmethod
    def tokenize(self, text: bytes, add_special: bool) -> list[int]:
        """Token ids of ``text`` with the model's vocabulary."""

    @abc.abstractmethod
    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of ``tokens`` (may end inside a UTF-8 character)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the model and everything it holds; idempotent."""

    # -- Capability.PREFIX_CACHE -------------------------------------------------------------------

    def space_match(self, space_id: int, span: TokenRef) -> MatchResult:
        """Cached prefixes of ``span`` per space; pins nothing (ABI rules 87-88)."""
        raise unsupported(self, Capability.PREFIX_CACHE, "space_match")

    def seed_acquire(self, span: TokenRef, prefix_len: int, determinism_class: int) -> int:
        """Pin ``span[:prefix_len]`` and return a seed handle for one admit (rules 75-83)."""
        raise unsupported(self, Capability.PREFIX_CACHE, "seed_acquire")

    def seed_release(self, seed_handle: int) -> None:
        """Release an unconsumed seed; EngineError(ERR_UNKNOWN_HANDLE) if unknown (rule 81)."""
        raise unsupported(self, Capability.PREFIX_CACHE, "seed_release")

    def seed_lease_ticks(self) -> int:
        """The declared seed-lease TTL in ticks (rule 84)."""
        raise unsupported(self, Capability.PREFIX_CACHE, "seed_lease_ticks")

    def seed_adopt(self, seq: int, span: TokenRef) -> int:
        """Lease a bare restored sequence as the seed of the next admit (rule 86)."""
        raise unsupported(self, Capability.PREFIX_CACHE, "seed_adopt")

    def cache_evict(self, policy: ShedPolicy, bytes_target: int) -> int:
        """Evict inside ``policy``; returns bytes freed (rule 89)."""
        raise unsupported(self, Capability.PREFIX_CACHE, "cache_evict")

    def cache_evict_entries(self, keys: Sequence[CacheKey]) -> None:
        """Drop the named physical cache variants."""
        raise unsupported(self, Capability.PREFIX_CACHE, "cache_evict_entries")

    # -- Capability.STATE_OPS ----------------------------------------------------------------------

    def check_op_target(self, seq: int, space_id: int) -> None:
        """The checks every state op on ``seq`` makes before anything else: ERR_UNKNOWN_HANDLE
        (space or sequence), EBUSY during another op (rule 98). A host-tier op the engine does not
        serve runs them before answering ERR_OP_UNSUPPORTED. The default checks nothing."""
        return None

    def lane_sequence(self, lane_tag: int) -> int | None:
        """The sequence a live lane owns, or None."""
        raise unsupported(self, Capability.STATE_OPS, "lane_sequence")

    def sequence_create(self) -> int:
        """A bare, empty sequence (a restore target)."""
        raise unsupported(self, Capability.STATE_OPS, "sequence_create")

    def sequence_free(self, seq: int) -> None:
        """Free a bare sequence; EngineError(ERR_UNKNOWN_HANDLE) otherwise (rule 112)."""
        raise unsupported(self, Capability.STATE_OPS, "sequence_free")

    def sequence_publish(self, seq: int, tokens: np.ndarray) -> None:
        """Publish a bare sequence's whole-page prefix under ``tokens``; consumes it (rule 91)."""
        raise unsupported(self, Capability.STATE_OPS, "sequence_publish")

    def seq_fork(self, parent: int, flags: int) -> int:
        """Fork a sequence (refcounted pages); EngineError(EBUSY) during an op (rule 98)."""
        raise unsupported(self, Capability.STATE_OPS, "seq_fork")

    def export_size(self, seq: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        """``(required_bytes, sizing_gen)`` for a snapshot or demote of ``rng`` (rules 92-95)."""
        raise unsupported(self, Capability.STATE_OPS, "export_size")

    def snapshot(self, seq: int, space_id: int, boundary_pos: int, sizing_gen: int, dst_bytes: int) -> int:
        """Start a snapshot into an engine-held buffer of ``dst_bytes``; returns an op handle."""
        raise unsupported(self, Capability.STATE_OPS, "snapshot")

    def restore(self, seq: int, space_id: int, data: bytes) -> int:
        """Start restoring a sealed export into ``seq``; returns an op handle (rules 101-104)."""
        raise unsupported(self, Capability.STATE_OPS, "restore")

    def snapshot_boundary(self, seq: int, space_id: int, cap: int) -> int:
        """Newest durable boundary <= ``cap`` (rule 111)."""
        raise unsupported(self, Capability.STATE_OPS, "snapshot_boundary")

    def trim(self, seq: int, space_id: int, new_len: int) -> None:
        """Trim a space to ``new_len`` tokens (rule 109)."""
        raise unsupported(self, Capability.STATE_OPS, "trim")

    def op_poll(self, op: int) -> OpStatus:
        """State of an op; EngineError(ERR_UNKNOWN_HANDLE) if unknown (rule 99)."""
        raise unsupported(self, Capability.STATE_OPS, "op_poll")

    def op_cancel(self, op: int) -> None:
        """Request cancellation (rule 100)."""
        raise unsupported(self, Capability.STATE_OPS, "op_cancel")

    def op_output(self, op: int) -> bytes:
        """The sealed bytes a DONE snapshot or demote wrote (envelope + payload)."""
        raise unsupported(self, Capability.STATE_OPS, "op_output")

    # -- Capability.HOST_TIER ----------------------------------------------------------------------

    def demote(
        self, seq: int, space_id: int, rng: TokenRange, encoding: int, sizing_gen: int, dst_bytes: int
    ) -> int:
        """Start moving ``rng`` to the host tier; returns an op handle (rules 105-108)."""
        self.check_op_target(seq, space_id)
        raise unsupported(self, Capability.HOST_TIER, "demote")

    def promote(self, seq: int, space_id: int, rng: TokenRange, data: bytes) -> int:
        """Start bringing a demoted range back; returns an op handle."""
        self.check_op_target(seq, space_id)
        raise unsupported(self, Capability.HOST_TIER, "promote")

    # -- Capability.GRAMMAR ------------------------------------------------------------------------

    def grammar_create(self, json_schema: str, kind: str = "json_schema") -> int:
        """A grammar handle for ``json_schema`` (spec text of ``kind``: "json_schema", "lark" or
        "regex"), or 0 on failure (including a kind the engine does not serve)."""
        raise unsupported(self, Capability.GRAMMAR, "grammar_create")

    def grammar_free(self, handle: int) -> None:
        """EngineError(ERR_UNKNOWN_HANDLE) if absent (rule 113)."""
        raise unsupported(self, Capability.GRAMMAR, "grammar_free")

    # -- Capability.LOGIT_BIAS ---------------------------------------------------------------------

    def logit_bias_create(self, tokens: Sequence[int], values: Sequence[float]) -> int:
        """A logit-bias handle, or 0 when empty (rule 113)."""
        raise unsupported(self, Capability.LOGIT_BIAS, "logit_bias_create")

    def logit_bias_free(self, handle: int) -> None:
        """EngineError(ERR_UNKNOWN_HANDLE) if absent (rule 113)."""
        raise unsupported(self, Capability.LOGIT_BIAS, "logit_bias_free")

    # -- Capability.TICK_YIELD ---------------------------------------------------------------------

    def attach_control(self, control: Any) -> bool:
        """Read ``control``'s yield word (a ``basertd.shm.ControlBlock``) during ticks, ending the
        tick in flight at its next step boundary once it is set; True when attached (the capability
        record then says ``extra["yield"] = "step"``). The worker calls it only when
        ``supports(Capability.TICK_YIELD)``."""
        raise unsupported(self, Capability.TICK_YIELD, "attach_control")

    # -- Capability.EMBEDDINGS ---------------------------------------------------------------------

    def embed(self, inputs: Sequence[np.ndarray]) -> np.ndarray:
        """The pooled, L2-normalised embeddings of ``inputs`` (token-id arrays) as an
        ``(len(inputs), dim)`` float32 array; called between ticks. EngineError(REJECT_BOUNDS) for
        an empty or over-long input or an id outside the vocabulary."""
        raise unsupported(self, Capability.EMBEDDINGS, "embed")

    def embed_chunk(self, input_id: int, chunk: int, tokens: np.ndarray, last: bool) -> np.ndarray | None:
        """Chunk ``chunk`` (0, 1, ... in order) of one long input named ``input_id`` (non-zero),
        ``tokens`` at the positions after the earlier chunks, whose state the engine keeps between
        calls so that ticks run between them; the input's ``(dim,)`` float32 unit vector when
        ``last`` (equal to ``embed`` of the whole input up to float noise), else None. One input
        open at a time. EngineError: EBUSY for chunk 0 while another is open, ERR_UNKNOWN_HANDLE
        for a later chunk of an input not open (lost with a restart), REJECT_BOUNDS for a chunk out
        of order, no tokens, an id outside the vocabulary, an input over the context length; a
        refusal changes nothing (Link W EMBED with ``input_id``)."""
        raise unsupported(self, Capability.EMBEDDINGS, "embed_chunk")

    def embed_cancel(self, input_id: int) -> None:
        """Drop the open chunked input ``input_id``; EngineError(ERR_UNKNOWN_HANDLE) when it is
        not the one open (Link W EMBED_CANCEL)."""
        raise unsupported(self, Capability.EMBEDDINGS, "embed_cancel")

    # -- Capability.SCORING ------------------------------------------------------------------------

    def score(self, tokens: np.ndarray, top_k: int) -> Any:
        """Each token's log-probability after the ones before it and the ``top_k`` likeliest
        tokens there (``llamacpp.score.Scores``: ``logprobs`` (n-1,), ``top_ids`` /
        ``top_logprobs`` (n-1, top_k)); called between ticks. EngineError(REJECT_BOUNDS) for
        fewer than 2 or over context-length tokens, an id outside the vocabulary, a bad top_k."""
        raise unsupported(self, Capability.SCORING, "score")

    # -- Capability.SPECULATION --------------------------------------------------------------------

    def strategy_register(self, reg: Any) -> Any:
        """Register a speculation strategy at load, before admission (a
        ``basertd.native.abi.StrategyRegistration``); returns its ``StrategyGrant`` (slot,
        certificates, reserved bytes) or raises EngineError(ERR_REGISTRATION_REFUSED) with nothing
        registered (ABI rules 114-118)."""
        raise unsupported(self, Capability.SPECULATION, "strategy_register")
