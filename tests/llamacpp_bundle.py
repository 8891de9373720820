"""The llama.cpp engine behind the Python surface of ``basertd.native.abi.Bundle``, so the tick-ABI
conformance suite (tests/conformance) runs its engine-independent tests on it too.

``LlamaCppBundle`` forwards every call to a ``LlamaCppEngine`` on a tiny random-weight GGUF shaped
like the reference engine's default bundle (the ``conformance_gguf`` fixture: 512-token vocabulary,
64 KV bytes per token, EOS never drawn), turning the engine's errors into the
binding's (``AbiError`` / ``PlanRejected`` with the same status) and ``RingSpec`` addresses into
``RingMapping`` buffers. ``encode_plan`` / ``tick_raw`` / ``read_events`` pass schema objects
through, so the suite's "send this plan, read those events" calls work; hand-built C plans (the
struct and array decoding of RULES.md section C) have no Python equivalent and are not run.

``make_llamacpp_bundle(model_path, **config)`` maps the reference engine's config keywords that
have a llama.cpp meaning (lanes, batch, context, page size, pool size, lease TTL) and skips the
test for the ones that describe the reference engine's synthetic model (scripted tokens, EOS
period, extra state spaces, identities, vocabulary size).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import pytest

from basertd.native.abi import AbiError, ArgumentError, EngineFatal, RingSpec
from basertd.schema.abi import RingKind, RingRole, Status
from basertd.schema.tick import TickEvents, TickPlan
from basertd.worker.engines import base
from basertd.worker.engines.llamacpp import LlamaCppEngine

_MAPPED = {
    "max_lanes",
    "max_batch_size",
    "context_length",
    "page_size_tokens",
    "bytes_per_token",
    "pool_bytes",
    "seed_lease_ticks",
}
_REF_DEFAULTS = {
    "max_lanes": 16,
    "context_length": 1024,
    "page_size_tokens": 16,
    "bytes_per_token": 64,
    "pool_bytes": 1 << 20,
    "seed_lease_ticks": 8,
}


NOT_APPLICABLE = {
    "test_c_arrays.py": "RULES.md section C is the C binding's decoding of raw struct/array memory; the "
    "llama.cpp engine is Python and receives decoded schema records",
    "test_rule_064_no_partial_emits_from_a_legacy_plan": "drives the 152-byte C plan through cffi",
    "test_rule_070_": "reads engine-owned C event memory through cffi; Python events are objects",
    "test_rule_125_": "hand-corrupts C ring descriptors through cffi",
}
"""Conformance tests that cannot run on the llama.cpp engine, by file or test-name prefix, with the
reason (the conformance conftest skips them for the ``llamacpp`` parameter)."""


def not_applicable(nodeid: str) -> str | None:
    """The reason a conformance test id cannot run on the llama.cpp engine, or None."""
    if "[llamacpp" not in nodeid:
        return None
    for key, reason in NOT_APPLICABLE.items():
        if key in nodeid:
            return reason
    return None


class _SequenceLib:
    """The one C entry point the suite calls on sequence handles directly."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine

    def baseRT_tick_sequence_free(self, _bundle, seq: int) -> int:
        try:
            self.engine.sequence_free(seq)
        except base.EngineError as exc:
            return int(exc.status)
        return int(Status.OK)


def _abi(call: str, exc: base.EngineError) -> AbiError:
    if isinstance(exc, base.EngineFatal):
        return EngineFatal(exc.status, call, str(exc))
    return AbiError(exc.status, call, str(exc))


class LlamaCppBundle:
    """``basertd.native.abi.Bundle``'s methods over a ``LlamaCppEngine`` (module docstring)."""

    config = None  # not a RefBundle: reference-only checks skip themselves

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine
        self.handle = id(engine)
        self.lib = _SequenceLib(engine)

    def sequence_pointer(self, seq: int) -> int:
        """Sequence handles are plain integers here."""
        return seq

    def tick(self, plan: TickPlan, on_partial_emit=None) -> TickEvents:
        try:
            return self.engine.tick(plan, on_partial_emit)
        except base.EngineError as exc:
            raise _abi("baseRT_tick", exc) from exc

    def encode_plan(self, plan: TickPlan, partial_emit: bool = False) -> TickPlan:
        return plan

    def tick_raw(self, plan) -> tuple[int, object]:
        if not isinstance(plan, TickPlan):
            pytest.skip("a hand-built C plan has no meaning for the Python llama.cpp engine")
        try:
            return Status.OK, self.engine.tick(plan)
        except base.EngineError as exc:
            return int(exc.status), None

    def read_events(self, events) -> TickEvents:
        return events

    def rings_attach(self, rings: Sequence[RingSpec]) -> None:
        maps = []
        for r in rings:
            buf = memoryview((ctypes.c_char * r.length).from_address(r.address)).cast("B")
            maps.append(
                base.RingMapping(
                    r.ring_id,
                    RingKind(r.kind),
                    RingRole(r.role),
                    r.slots,
                    r.slot_bytes,
                    buf,
                    r.address,
                    r.length,
                )
            )
        try:
            self.engine.attach_rings(maps)
        except base.EngineError as exc:
            raise _abi("baseRT_rings_attach", exc) from exc

    def op_output(self, op: int) -> bytes:
        """As the binding: no output held for ``op`` (unknown, cancelled, already taken, not DONE)
        is the binding's own ArgumentError."""
        try:
            return self.engine.op_output(op)
        except base.EngineError as exc:
            raise ArgumentError(f"op {op}: {exc}") from exc

    def close(self) -> None:
        self.engine.close()

    def __getattr__(self, name: str):
        fn = getattr(self.engine, name)
        if not callable(fn):
            return fn

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except base.EngineError as exc:
                raise _abi(f"baseRT_{name}", exc) from exc

        return call


def make_llamacpp_bundle(model_path, **config) -> LlamaCppBundle:
    """A fresh engine on ``model_path`` sized like a reference bundle of ``config`` (one thread)."""
    foreign = sorted(set(config) - _MAPPED)
    if foreign:
        pytest.skip(f"reference-engine config {foreign} describes its synthetic model; llama.cpp has none")
    cfg = {**_REF_DEFAULTS, **config}
    lanes = cfg["max_lanes"]
    if cfg.get("max_batch_size", lanes) != lanes:
        pytest.skip("the llama.cpp engine's batch size is its lane count")
    pool_tokens = cfg["pool_bytes"] // cfg["bytes_per_token"]
    engine = LlamaCppEngine(
        model_path,
        lanes=lanes,
        context_length=cfg["context_length"],
        page_size_tokens=cfg["page_size_tokens"],
        pool_tokens=pool_tokens,
        seed_lease_ticks=cfg["seed_lease_ticks"],
        n_threads=1,
    )
    return LlamaCppBundle(engine)
