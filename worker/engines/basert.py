"""The ``basert`` engine: any tick-ABI library through ``basertd.native.abi`` (DESIGN.md "Engines").

``BasertEngine`` implements the ``Engine`` protocol over one ``basertd.native.abi.Bundle``. Every
call goes through the binding; its errors are mapped, so the worker sees only the protocol's:

- ``native PlanRejected`` (-100..-114) -> ``PlanRejected`` (engine state unchanged);
- ``native EngineFatal`` (-1) and ``EventsMalformed`` (the library broke the array rules of
  RULES.md section C: its state cannot be trusted) -> ``EngineFatal`` (the worker exits 70);
- any other ``AbiError`` -> ``EngineError(status)``;
- ``ArgumentError`` (a value that does not fit the ABI; nothing was called) -> ``PlanRejected``
  (REJECT_BOUNDS) for a plan, else ``EngineError(REJECT_BOUNDS)``;
- ``HandleCreateFailed`` -> ``EngineError(ERR_OP_UNSUPPORTED)``.

``open_engine(options)`` is the registry's factory. Two ways to get a bundle:

- **by path** (``--model BUNDLE``, with ``--lib LIB`` or the reference engine by default): the
  library is opened with the tick ABI and baseRT.h's loader (``basertd.native.basert_api``;
  ``MissingSymbols`` -> exit 3 listing every absent function, a baseRT version other than 0.3.x ->
  exit 3), and ``baseRT_load_model_ex(model, kernel_library, context_length or 0, {paged_kv,
  prefix_cache, max_batch_size = lanes})`` loads the bundle (NULL -> exit 3 with
  ``baseRT_get_error``). ``baseRT_capabilities`` and ``baseRT_capability_descriptor`` go into the
  capability record's ``extra`` (``basert_caps``, ``capability_descriptor``, ``prefix_cache`` and
  ``prefix_cache_reason``); sizes come from the descriptor's ``serving`` object where it has them,
  else from the options and the tick ABI. The vocabulary facts come from a tokenizer-only handle
  (``baseRT_load_tokenizer_only``), which also serves ``tokenize`` / ``detokenize``. The tokenizer
  named in the record is ``TokenizerSpec("basert", path=model)`` with the library in
  ``extra["library"]``, so the coordinator opens its own tokenizer-only handle.
- **the reference engine's private factory** (no ``--model``, or ``--model`` naming the library):
  a reference bundle built from ``--ref-config`` (fields of ``basertd.native.ref.RefConfig``),
  with ``--lanes`` setting max_lanes and max_batch_size and ``--context-length`` the context
  length. A library without the ``baseRT_ref_*`` factory and no ``--model`` is refused (exit 3).

The model is freed (``baseRT_free_model``) on every exit path: a failure after loading closes the
bundle before raising, and ``close()`` frees it.

The reference engine's synthetic model uses the "bytes" vocabulary (``TokenizerSpec("bytes")``:
ids 0 unk, 1 BOS, 2 EOS, 3..258 the bytes); ``tokenize`` / ``detokenize`` implement it here.
``model_id`` is an xxh3-128 of the config fields that decide the tokens (the tick delay is left
out), so two workers with the same model answer the same id.

Test hooks ride in ``--ref-config`` as ``test_*`` keys, never set in production configs: only then
is ``basertd.worker.engines.ref_hooks`` imported, and its ``HookedEngine`` (a test subclass) is
returned instead, so this module's ``tick`` carries no test code (``ref_hooks`` lists the keys).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

import basertd
from basertd.native import abi as nabi
from basertd.schema.abi import Status
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
from basertd.worker.engines import EngineLoadError, EngineOptionError, EngineOptions
from basertd.worker.engines.base import (
    Capability,
    Engine,
    EngineError,
    EngineFatal,
    EngineInfo,
    PartialEmit,
    PlanRejected,
    RingMapping,
    TokenizerSpec,
)

__all__ = ["BOS_ID", "BYTE_BASE", "EOS_ID", "BasertEngine", "open_engine"]

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
"""Special ids of the "bytes" vocabulary."""
BYTE_BASE = 3
"""Id of byte 0x00 in the "bytes" vocabulary; byte b is id ``BYTE_BASE + b``."""


def _map(exc: Exception, *, plan: bool = False) -> EngineError | PlanRejected:
    """The protocol error for a binding error (module docstring)."""
    if isinstance(exc, nabi.EngineFatal):
        return EngineFatal(Status.ERR_FATAL, str(exc))
    if isinstance(exc, nabi.EventsMalformed):
        return EngineFatal(Status.ERR_FATAL, f"engine output breaks the ABI array rules: {exc}")
    if isinstance(exc, nabi.AbiError):
        return EngineError(exc.status, str(exc))
    if isinstance(exc, nabi.ArgumentError):
        cls = PlanRejected if plan else EngineError
        return cls(Status.REJECT_BOUNDS, str(exc))
    if isinstance(exc, nabi.HandleCreateFailed):
        return EngineError(Status.ERR_OP_UNSUPPORTED, str(exc))
    return EngineError(Status.ERR_FATAL, f"{type(exc).__name__}: {exc}")


_BINDING_ERRORS = (nabi.AbiError, nabi.BindingError)


class BasertEngine(Engine):
    """``Engine`` over one tick-ABI bundle (``basertd.native.abi.Bundle``).

    ``bundle``: the bundle (closed by ``close``, which frees the model when the bundle was given a
    ``free``). ``info``: the static facts the creator knows. ``stats``: a function returning the
    engine's counters (``Engine.stats`` names), or None to report only what this adapter counts
    (ticks, decode tokens). ``keepalive``: objects that must outlive the bundle (configs, libs)."""

    def __init__(
        self,
        bundle: nabi.Bundle,
        info: EngineInfo,
        *,
        stats: Callable[[], dict[str, int]] | None = None,
        keepalive: Sequence[Any] = (),
        tokenizer: Any = None,
    ) -> None:
        self.bundle = bundle
        self._tokenizer = tokenizer
        self._info = info
        self._stats_fn = stats
        self._keepalive = list(keepalive)
        self._ticks = 0
        self._decode_tokens = 0
        self._closed = False

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except _BINDING_ERRORS as exc:
            raise _map(exc) from exc

    # -- facts -----------------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        """Static facts (sizes in tokens unless named _bytes)."""
        return self._info

    def capabilities(self) -> frozenset[Capability]:
        """Every capability; the library answers ERR_OP_UNSUPPORTED itself for an op it lacks.
        TICK_YIELD only when it can read a yield word (``baseRT_ref_set_yield_word``: the
        reference engine)."""
        caps = super().capabilities()
        if getattr(self.bundle, "set_yield_word", None) is None:
            caps -= {Capability.TICK_YIELD}
        return caps

    def state_spaces(self) -> list[StateSpaceDesc]:
        """The bundle's state spaces (``baseRT_state_spaces``)."""
        return self._call(self.bundle.state_spaces)

    def stats(self) -> dict[str, int]:
        """The engine's counters (``Engine.stats``); the adapter's own tick and decode counts when
        the library offers none."""
        if self._stats_fn is not None:
            return self._stats_fn()
        return {"ticks": self._ticks, "decode_tokens_total": self._decode_tokens}

    # -- rings and ticks -------------------------------------------------------------------------

    def attach_rings(self, rings: Sequence[RingMapping]) -> None:
        """``baseRT_rings_attach``, all or nothing (ABI rules 125, 130)."""
        specs = [
            nabi.RingSpec(r.ring_id, int(r.kind), int(r.role), r.slots, r.slot_bytes, r.address, r.length)
            for r in rings
        ]
        self._call(self.bundle.rings_attach, specs)

    def tick(self, plan: TickPlan, on_partial_emit: PartialEmit | None = None) -> TickEvents:
        """One ``baseRT_tick``. Raises ``PlanRejected`` (nothing changed) or ``EngineFatal``.
        If ``on_partial_emit`` raises, the tick still completes and that exception is re-raised
        (the events are then lost to the caller: the worker's callback never raises)."""
        try:
            events = self.bundle.tick(plan, on_partial_emit)
        except nabi.PartialEmitCallbackError as exc:
            cause = exc.__cause__
            raise (cause if cause is not None else _map(exc)) from None
        except _BINDING_ERRORS as exc:
            raise _map(exc, plan=True) from exc
        self._ticks += 1
        self._decode_tokens += sum(e.n_tokens for e in events.emits)
        return events

    def attach_control(self, control: Any) -> bool:
        """Attach the worker's control segment (``basertd.shm.ControlBlock``) so ticks end early at a
        step boundary when its yield word is set. Only libraries with ``baseRT_ref_set_yield_word``
        (the reference engine) can; others return False and finish every tick. On success the
        capability record says ``extra["yield"] = "step"``."""
        if not self.supports(Capability.TICK_YIELD):
            return False
        self._call(self.bundle.set_yield_word, control.yield_word_address)
        self._keepalive.append(control)
        self._info.extra["yield"] = "step"
        return True

    # -- cache and seeds -------------------------------------------------------------------------

    def space_match(self, space_id: int, span: TokenRef) -> MatchResult:
        """``baseRT_space_match``; pins nothing (rule 87)."""
        return self._call(self.bundle.space_match, space_id, span)

    def seed_acquire(self, span: TokenRef, prefix_len: int, determinism_class: int) -> int:
        """``baseRT_seed_acquire`` (rules 75-83)."""
        return self._call(self.bundle.seed_acquire, span, prefix_len, determinism_class)

    def seed_release(self, seed_handle: int) -> None:
        """``baseRT_seed_release`` (rule 81)."""
        self._call(self.bundle.seed_release, seed_handle)

    def seed_lease_ticks(self) -> int:
        """``baseRT_seed_lease_ticks`` (rule 84)."""
        return self._call(self.bundle.seed_lease_ticks)

    def seed_adopt(self, seq: int, span: TokenRef) -> int:
        """``baseRT_seed_adopt`` (rule 86)."""
        return self._call(self.bundle.seed_adopt, seq, span)

    def cache_evict(self, policy: ShedPolicy, bytes_target: int) -> int:
        """``baseRT_cache_evict``: bytes freed (rule 89)."""
        return self._call(self.bundle.cache_evict, policy, bytes_target)

    def cache_evict_entries(self, keys: Sequence[CacheKey]) -> None:
        """``baseRT_cache_evict_entries``; an empty list is the empty array of ABI rule 21."""
        self._call(self.bundle.cache_evict_entries, keys)

    # -- sequences and state ops -----------------------------------------------------------------

    def lane_sequence(self, lane_tag: int) -> int | None:
        """The sequence a live lane owns, or None."""
        return self._call(self.bundle.lane_sequence, lane_tag)

    def sequence_create(self) -> int:
        """A bare sequence."""
        return self._call(self.bundle.sequence_create)

    def sequence_free(self, seq: int) -> None:
        """Free a bare sequence (rule 112)."""
        self._call(self.bundle.sequence_free, seq)

    def sequence_publish(self, seq: int, tokens: np.ndarray) -> None:
        """Publish a bare sequence (rule 91)."""
        self._call(self.bundle.sequence_publish, seq, tokens)

    def seq_fork(self, parent: int, flags: int) -> int:
        """Fork a sequence (rule 98)."""
        return self._call(self.bundle.seq_fork, parent, flags)

    def export_size(self, seq: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        """``(required_bytes, sizing_gen)`` (rules 92-96)."""
        return self._call(self.bundle.export_size, seq, space_id, rng, encoding)

    def snapshot(self, seq: int, space_id: int, boundary_pos: int, sizing_gen: int, dst_bytes: int) -> int:
        """Start a snapshot; returns the op handle."""
        return self._call(self.bundle.snapshot, seq, space_id, boundary_pos, sizing_gen, dst_bytes)

    def restore(self, seq: int, space_id: int, data: bytes) -> int:
        """Start a restore; returns the op handle (rules 101-104)."""
        return self._call(self.bundle.restore, seq, space_id, data)

    def snapshot_boundary(self, seq: int, space_id: int, cap: int) -> int:
        """Newest durable boundary <= cap (rule 111)."""
        return self._call(self.bundle.snapshot_boundary, seq, space_id, cap)

    def trim(self, seq: int, space_id: int, new_len: int) -> None:
        """Trim a space (rule 109)."""
        self._call(self.bundle.trim, seq, space_id, new_len)

    def demote(
        self, seq: int, space_id: int, rng: TokenRange, encoding: int, sizing_gen: int, dst_bytes: int
    ) -> int:
        """Start a demote; returns the op handle (rules 105-108)."""
        return self._call(self.bundle.demote, seq, space_id, rng, encoding, sizing_gen, dst_bytes)

    def promote(self, seq: int, space_id: int, rng: TokenRange, data: bytes) -> int:
        """Start a promote; returns the op handle."""
        return self._call(self.bundle.promote, seq, space_id, rng, data)

    def op_poll(self, op: int) -> OpStatus:
        """State of an op (rule 99)."""
        return self._call(self.bundle.op_poll, op)

    def op_cancel(self, op: int) -> None:
        """Cancel an op (rule 100)."""
        self._call(self.bundle.op_cancel, op)

    def op_output(self, op: int) -> bytes:
        """Sealed bytes of a DONE snapshot or demote."""
        return self._call(self.bundle.op_output, op)

    # -- grammar, bias, vocabulary ---------------------------------------------------------------

    def grammar_create(self, json_schema: str, kind: str = "json_schema") -> int:
        """A grammar handle or 0 (the tick ABI compiles JSON schemas only: 0 for other kinds)."""
        if kind != "json_schema":
            return 0
        return self._call(self.bundle.grammar_create, json_schema)

    def grammar_free(self, handle: int) -> None:
        """Free a grammar (rule 113)."""
        self._call(self.bundle.grammar_free, handle)

    def logit_bias_create(self, tokens: Sequence[int], values: Sequence[float]) -> int:
        """A logit-bias handle or 0 (rule 113)."""
        return self._call(self.bundle.logit_bias_create, tokens, values)

    def logit_bias_free(self, handle: int) -> None:
        """Free a logit-bias table (rule 113)."""
        self._call(self.bundle.logit_bias_free, handle)

    def strategy_register(self, reg: Any) -> Any:
        """``baseRT_strategy_register`` (tick ABI §2): the library's grant, or
        EngineError(ERR_REGISTRATION_REFUSED) (rules 114-118). The reference engine grants slots
        and certificates but never drafts."""
        return self._call(self.bundle.strategy_register, reg)

    def tokenize(self, text: bytes, add_special: bool) -> list[int]:
        """With a tokenizer handle: ``baseRT_encode`` (BOS first when ``add_special`` and the
        library did not add it, dropped when not). Else the "bytes" vocabulary: ``[BOS]`` when
        ``add_special``, then ``3 + b`` per byte. Raises
        ``EngineError(ERR_OP_UNSUPPORTED)`` when the vocabulary cannot hold the byte ids."""
        if self._tokenizer is not None:
            return encode_with_bos(self._tokenizer, bytes(text).decode("utf-8", "replace"), add_special)
        if self._info.tokenizer.kind != "bytes" or self._info.vocab_size < BYTE_BASE + 256:
            raise EngineError(Status.ERR_OP_UNSUPPORTED, "this bundle's vocabulary has no byte tokens")
        ids = [BYTE_BASE + b for b in bytes(text)]
        return [BOS_ID, *ids] if add_special else ids

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The tokens' raw bytes (``baseRT_decode_token_raw``), or for the "bytes" vocabulary one
        byte per id in 3..258, nothing for the others."""
        if self._tokenizer is not None:
            return b"".join(self._tokenizer.piece(int(t)) for t in tokens)
        return bytes(t - BYTE_BASE for t in tokens if BYTE_BASE <= t < BYTE_BASE + 256)

    def close(self) -> None:
        """Free the bundle (and its model); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.bundle.close()
        finally:
            if self._tokenizer is not None:
                self._tokenizer.close()
            self._keepalive.clear()


def encode_with_bos(tok: Any, text: str, add_bos: bool) -> list[int]:
    """``tok.encode(text)`` with BOS first exactly when ``add_bos`` (a BOS the library added
    itself is dropped when not asked for, unless the text spells the BOS string)."""
    ids = tok.encode(text)
    has = bool(ids) and ids[0] == tok.bos_id
    if add_bos and not has:
        return [tok.bos_id, *ids]
    if not add_bos and has and not (tok.bos_token and text.startswith(tok.bos_token)):
        return ids[1:]
    return ids


# --- the factory --------------------------------------------------------------------------------

_MODEL_FIELDS_EXCLUDED = frozenset({"tick_delay_us", "prefill_step_tokens", "prefill_step_us"})
TEST_HOOK_PREFIX = "test_"
"""``--ref-config`` keys starting with this are test hooks (``ref_hooks``), never config fields."""


def model_digest(cfg: Any) -> str:
    """Hex xxh3-128 of the reference config fields that decide the generated tokens (a
    ``RefConfig`` dataclass; the tick delay is left out)."""
    fields_ = {k: v for k, v in asdict(cfg).items() if k not in _MODEL_FIELDS_EXCLUDED}
    return xxhash.xxh3_128_hexdigest(json.dumps(fields_, sort_keys=True, default=repr).encode())


def _is_shared_object(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def loads_by_path(options: EngineOptions) -> bool:
    """Whether ``options`` name a bundle file to load with ``baseRT_load_model_ex`` (module
    docstring) rather than the reference engine's private factory."""
    model = options.model
    if model is None or model == options.lib:
        return False
    library_like = _is_shared_object(model) or Path(model).suffix == ".so" or ".so." in Path(model).name
    if library_like and options.lib is not None:
        raise EngineOptionError("--model", "basert takes one library, as --lib or --model")
    return not library_like


def open_engine(options: EngineOptions) -> BasertEngine:
    """The registry's factory (module docstring). Raises ``EngineOptionError`` (exit 2: a
    ``--ref-config`` field that does not exist or does not fit, or one given with a bundle file),
    ``EngineLoadError`` (exit 3: the library is missing, cannot be opened, lacks a needed
    function, reports another baseRT version, the bundle does not load, or the engine refused the
    config)."""
    if loads_by_path(options):
        from basertd.worker.engines.basert_load import open_path_loaded

        return open_path_loaded(options)
    lib_path = options.lib
    if options.model is not None:
        if lib_path is not None and options.model != lib_path:
            raise EngineOptionError("--model", "basert takes one library, as --lib or --model")
        lib_path = options.model
    try:
        from basertd.native import ref as nref
    except ImportError as exc:  # pragma: no cover - the module ships with the package
        raise EngineLoadError(f"the reference engine surface is unavailable: {exc}") from None
    hooks = {k: v for k, v in options.ref_config.items() if k.startswith(TEST_HOOK_PREFIX)}
    if hooks:
        from basertd.worker.engines.ref_hooks import check_hooks

        check_hooks(hooks)  # EngineOptionError before anything is loaded
    cfg = _ref_config(nref, options)
    try:
        lib = nref.open_ref_lib(lib_path)
    except FileNotFoundError as exc:
        raise EngineLoadError(str(exc)) from None
    except nabi.MissingSymbols as exc:
        if lib_path is None:
            raise EngineLoadError(
                f"the reference engine library is out of date (run `make native`): {exc}"
            ) from None
        if all(name.startswith("baseRT_ref_") for name in exc.missing):
            raise EngineLoadError(
                f"{lib_path} offers no way to create a bundle without --model: name the bundle to "
                "load with baseRT_load_model_ex as --model (worker config key `model`)"
            ) from None
        raise EngineLoadError(f"{lib_path} is not a tick-ABI library: {exc}") from None
    except nabi.LibraryError as exc:
        raise EngineLoadError(str(exc)) from None
    try:
        bundle = nref.create_ref_bundle(cfg, lib=lib)
    except nabi.ArgumentError as exc:
        raise EngineOptionError("--ref-config", str(exc)) from None
    except nabi.AbiError as exc:
        raise EngineLoadError(f"the reference engine refused the config: {exc}") from None
    try:
        info = EngineInfo(
            engine="basert",
            engine_version=f"ref {basertd.__version__}",
            model=f"ref-synthetic:{cfg.arch}",
            model_id=cfg.identity.hex() if cfg.identity else model_digest(cfg),
            vocab_size=cfg.vocab_size,
            context_length=cfg.context_length,
            max_lanes=cfg.max_lanes,
            max_batch_size=cfg.max_batch_size,
            page_size_tokens=cfg.page_size_tokens,
            pool_bytes=cfg.pool_bytes,
            seed_lease_ticks=bundle.seed_lease_ticks(),
            eos_token_ids=(cfg.eos_token,),
            bos_token_id=BOS_ID,
            add_bos=False,
            tokenizer=TokenizerSpec("bytes"),
            extra={
                "library": lib.path,
                "eos_period": str(cfg.eos_period),
                "tick_delay_us": str(cfg.tick_delay_us),
                "grammar_kinds": "json_schema",
            },
        )
    except BaseException:
        bundle.close()
        raise
    if hooks:
        from basertd.worker.engines.ref_hooks import HookedEngine

        return HookedEngine(bundle, info, stats=bundle.stats, keepalive=(lib,), hooks=hooks)
    return BasertEngine(bundle, info, stats=bundle.stats, keepalive=(lib,))


def _ref_config(nref: Any, options: EngineOptions) -> Any:
    """A ``RefConfig`` from ``--ref-config`` plus ``--lanes`` (max_lanes and max_batch_size) and
    ``--context-length``. JSON forms: ``spaces`` a list of ``RefSpace`` field objects, ``identity``
    64 hex digits. Raises ``EngineOptionError`` naming the flag."""
    known = {f.name for f in fields(nref.RefConfig)}
    values = {k: v for k, v in options.ref_config.items() if not k.startswith(TEST_HOOK_PREFIX)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise EngineOptionError(
            "--ref-config", f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    if options.lanes is not None:
        values.setdefault("max_lanes", options.lanes)
        values.setdefault("max_batch_size", options.lanes)
    if options.context_length is not None:
        values.setdefault("context_length", options.context_length)
    try:
        if "spaces" in values:
            values["spaces"] = tuple(nref.RefSpace(**s) for s in values["spaces"])
        if isinstance(values.get("identity"), str):
            values["identity"] = bytes.fromhex(values["identity"])
        if "scripted_tokens" in values:
            values["scripted_tokens"] = tuple(values["scripted_tokens"])
        cfg = nref.RefConfig(**values)
    except (TypeError, ValueError) as exc:
        raise EngineOptionError("--ref-config", str(exc)) from None
    for name in ("vocab_size", "max_lanes", "max_batch_size", "context_length", "pool_bytes"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise EngineOptionError("--ref-config", f"{name} must be an integer, got {v!r}")
    return cfg
