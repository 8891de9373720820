"""The numbers admission and planning need from one worker (DESIGN.md "Scheduling")."""

from __future__ import annotations

from typing import Any

from basertd.schema import link
from basertd.schema.abi import SpaceKind

ALL_GRAMMAR_KINDS = ("json_schema", "lark", "regex")
"""Every grammar kind GRAMMAR_CREATE can carry (``basertd.grammar_compile.GRAMMAR_KINDS``)."""
TICK_ABI_GRAMMAR_KINDS = ("json_schema",)
"""The kinds a worker whose capability record names none compiles: the tick ABI's
``grammar_create`` takes a JSON schema only."""


def grammar_kinds_of(extra: dict[str, str]) -> tuple[str, ...]:
    """The grammar kinds a worker compiles: its capability record's ``extra["grammar_kinds"]``
    (comma-separated), else the tick ABI's (``TICK_ABI_GRAMMAR_KINDS``)."""
    listed = extra.get("grammar_kinds")
    if listed is None:
        return TICK_ABI_GRAMMAR_KINDS
    return tuple(k for k in listed.split(",") if k in ALL_GRAMMAR_KINDS)


class WorkerLimits:
    """The numbers admission and planning need from a worker's capability record (or, before
    the first handshake, from its config): context length, lanes and max batch size, page size
    (tokens), KV capacity (tokens), the prompt tokens one plan may write into the prompt ring and
    the grammar kinds it compiles (``grammar_kinds_of``; every kind until the first handshake) and
    the speculation strategies it registered (``link.StrategyOffer``; none until then)."""

    def __init__(
        self,
        context_length: int,
        max_lanes: int,
        max_batch_size: int,
        page_tokens: int,
        kv_tokens: int,
        max_admit_tokens: int,
        grammar_kinds: tuple[str, ...] = ALL_GRAMMAR_KINDS,
        strategies: tuple[link.StrategyOffer, ...] = (),
    ) -> None:
        self.context_length = context_length
        self.max_lanes = max_lanes
        self.max_batch_size = max_batch_size
        self.page_tokens = page_tokens
        self.kv_tokens = kv_tokens
        self.max_admit_tokens = max_admit_tokens
        self.grammar_kinds = grammar_kinds
        self.strategies = strategies

    @classmethod
    def from_worker(cls, proc: Any) -> WorkerLimits:
        """Limits of a started worker (``basertd.server.workers.process.WorkerProcess``). KV capacity:
        the pool bytes over the bytes per token of its paged state spaces when it reports them,
        else ``max_lanes * context_length``."""
        caps = proc.capabilities
        per_token = sum(
            s.bytes_per_token
            for s in caps.state_spaces
            if s.kind in (SpaceKind.PAGED_TOKEN_KV, SpaceKind.DEPTH_PAGED_KV) and s.bytes_per_token
        )
        kv = caps.max_lanes * caps.context_length
        if per_token and caps.pool_bytes:
            kv = caps.pool_bytes // per_token
        return cls(
            context_length=caps.context_length,
            max_lanes=caps.max_lanes,
            max_batch_size=max(1, caps.max_batch_size),
            page_tokens=max(1, caps.page_size_tokens),
            kv_tokens=kv,
            max_admit_tokens=proc.prompt_ring.max_span_elems // 2,
            grammar_kinds=grammar_kinds_of(caps.extra),
            strategies=tuple(getattr(caps, "strategies", ())),
        )
