"""cffi ABI-mode binding of any shared library that exports the baseRT tick ABI.

``BasertLib(path)`` opens the library with ``ffi.dlopen`` (no compiler needed) using the
declarations of ``native/basert_tick.h``; ``Bundle`` wraps one ``baseRT_model_t`` of it with one
method per ABI function, speaking ``basertd.schema.tick`` records and ints:

- status codes come back as ``AbiError(status)`` (``status`` a ``basertd.schema.abi.Status``):
  ``PlanRejected`` for tick codes -100..-114, ``EngineFatal`` for -1;
- plans are written into one reused 8-byte-aligned arena per bundle (``_plan.PlanArena``);
- events and every other engine-owned array are read fail-closed by RULES.md section C
  (``_events.ArrayReader``), raising ``EventsMalformed`` instead of trusting the library;
- arguments that do not fit the ABI raise ``ArgumentError`` before any C call.

Creating a bundle is not part of the tick ABI: a real libbaseRT loads models through baseRT.h,
which basertd does not have, and the reference engine through its own ``baseRT_ref_*`` surface
(``basertd.native.ref``). ``Bundle`` therefore takes a handle from whoever created it, plus an
optional function that frees it.

Low-level access for conformance tests (rules 17-26 send deliberately broken plans):
``BasertLib.ffi`` / ``BasertLib.lib`` are the raw cffi objects, ``Bundle.encode_plan`` writes a
plan into the arena and returns the ``BaseRTTickPlan *`` for editing, ``Bundle.tick_raw`` runs
any plan pointer and returns the raw status, and ``Bundle.read_events`` decodes the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from basertd.native._cdef import declared_functions, ffi_source, tick_cdef
from basertd.native._errors import (
    PLAN_REJECTION_RANGE,
    AbiError,
    ArgumentError,
    BindingError,
    EngineFatal,
    EventsMalformed,
    HandleCreateFailed,
    LibraryError,
    LibraryNotFound,
    MissingSymbols,
    PartialEmitCallbackError,
    PlanRejected,
    error_for,
)
from basertd.native._events import DEFAULT_MAX_ARRAY_BYTES, ArrayReader
from basertd.native._layout import has_symbol, tick_ffi
from basertd.native._plan import PLAN_LEGACY_SIZE, PLAN_SIZE, PlanArena
from basertd.native._strategy import (
    Artifact,
    CapabilityReq,
    ExactnessCert,
    RegistrationMarshal,
    StrategyGrant,
    StrategyRegistration,
    TapSpec,
    read_grant,
)
from basertd.schema.abi import OpState, Status
from basertd.schema.tick import (
    CacheKey,
    MatchResult,
    MediaInfo,
    OpStatus,
    ShedPolicy,
    StateSpaceDesc,
    TickEvents,
    TickPlan,
    TokenRange,
    TokenRef,
)

__all__ = [
    "ENVELOPE_BYTES",
    "PLAN_LEGACY_SIZE",
    "PLAN_REJECTION_RANGE",
    "PLAN_SIZE",
    "TICK_FUNCTIONS",
    "AbiError",
    "ArgumentError",
    "Artifact",
    "BasertLib",
    "BindingError",
    "Bundle",
    "CapabilityReq",
    "EngineFatal",
    "EventsMalformed",
    "ExactnessCert",
    "HandleCreateFailed",
    "LibraryError",
    "LibraryNotFound",
    "MissingSymbols",
    "PartialEmitCallbackError",
    "PartialEmitFn",
    "PlanRejected",
    "RingSpec",
    "StrategyGrant",
    "StrategyRegistration",
    "TapSpec",
    "error_for",
]

TICK_FUNCTIONS: tuple[str, ...] = tuple(declared_functions(tick_cdef()))
"""Every function of ``basert_tick.h`` (34); a library lacking any is refused (MissingSymbols)."""

ENVELOPE_BYTES = 136
"""sizeof(BaseRTStateEnvelope), the header of every sealed export (ABI rules 10, 95)."""
_PAYLOAD_LEN_AT = 120  # offsetof(BaseRTStateEnvelope, payload_len)

PartialEmitFn = Callable[[int, np.ndarray], None]
"""``fn(lane_tag, tokens)``: tokens is a fresh ``uint32`` numpy copy (ABI rule 64)."""

_TERMINAL = (OpState.DONE, OpState.FAILED, OpState.CANCELLED)
_CALL_ERRORS = (OverflowError, TypeError, ValueError)


class RingSpec(NamedTuple):
    """One ring for ``Bundle.rings_attach`` (becomes a 48-byte BaseRTRingDesc, ABI rule 9).

    ``kind`` is a RingKind, ``role`` a RingRole (engine's side), ``slot_bytes`` includes the
    16-byte slot header, ``address``/``length`` the caller's mapping in bytes (rules 123-125)."""

    ring_id: int
    kind: int
    role: int
    slots: int
    slot_bytes: int
    address: int
    length: int


class BasertLib:
    """A shared library exporting the tick ABI, opened with cffi ABI mode (``ffi.dlopen``).

    ``extra_cdef`` adds declarations (e.g. the reference engine's ``baseRT_ref_*`` functions;
    they may use the header's types) whose functions become required too. ``max_array_bytes``
    caps one engine-output array when reading (RULES.md rule 23).

    Raises ``LibraryNotFound`` when ``path`` is not a file, ``LibraryError`` when dlopen fails,
    ``MissingSymbols`` when any declared function is not exported."""

    def __init__(
        self, path: str | Path, extra_cdef: str = "", max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES
    ):
        p = Path(path)
        if not p.is_file():
            raise LibraryNotFound(f"no tick-ABI library at {p}")
        self.path = str(p)
        self.ffi = tick_ffi(extra_cdef)
        try:
            self.lib = self.ffi.dlopen(self.path)
        except OSError as e:
            raise LibraryError(f"cannot open {p}: {e}") from e
        self.functions = tuple(declared_functions(ffi_source(extra_cdef)))
        missing = [name for name in self.functions if not has_symbol(self.lib, name)]
        if missing:
            raise MissingSymbols(self.path, missing)
        self.reader = ArrayReader(self.ffi, max_array_bytes)

    def address(self, cdata) -> int:
        """The integer address of a pointer cdata (0 for NULL)."""
        return int(self.ffi.cast("uintptr_t", cdata))

    def bundle(self, handle, free: Callable[[object], None] | None = None) -> Bundle:
        """Wrap a ``baseRT_model_t`` created elsewhere (see the module docstring)."""
        return Bundle(self, handle, free)


class _Loan:
    """A caller-owned buffer lent to the engine for one state op (schema §3.2)."""

    __slots__ = ("buf", "length", "output", "state")

    def __init__(self, buf, length: int, output: bool) -> None:
        self.buf = buf
        self.length = length
        self.output = output
        self.state: int | None = None


class Bundle:
    """One engine bundle (a ``baseRT_model_t``) driven through ``BasertLib``; one tick at a time.

    ``handle`` is the bundle pointer (cdata or int address); ``free(handle)``, when given, is
    called once by ``close()``. Sequences (``baseRT_sequence_t``) are exposed as stable integer
    ids (never reused on a Bundle); op handles are the engine's own u64 ids. Buffers lent for
    snapshot/restore/demote/promote are owned here until their op is terminal, so keep the
    Bundle alive (or ``close()`` it, which frees the model first) while ops are in flight.

    Every method raises ``AbiError`` (status from the library), ``ArgumentError`` (bad input,
    nothing sent) or ``EventsMalformed`` (engine output breaking RULES.md section C)."""

    def __init__(self, basert: BasertLib, handle, free: Callable[[object], None] | None = None) -> None:
        self.basert = basert
        self.ffi = ffi = basert.ffi
        self.lib = basert.lib
        self.handle = ffi.cast("baseRT_model_t", handle)
        self._free = free
        self._closed = False
        self._reader = basert.reader
        self._arena = PlanArena(ffi)
        self._events_out = ffi.new("const BaseRTTickEvents **")
        self._tick = self.lib.baseRT_tick
        self._partial_fn: PartialEmitFn | None = None
        self._partial_exc: BaseException | None = None
        self._callback = ffi.callback(
            "void(*)(void *, uint64_t, const uint32_t *, uint32_t)", self._on_partial_emit
        )
        self._callback_addr = basert.address(self._callback)
        self._seqs: dict[int, object] = {}
        self._seq_keys: dict[tuple, int] = {}
        self._next_seq = 1
        self._loans: dict[int, _Loan] = {}

    # -- helpers -------------------------------------------------------------------------------

    def _check(self, status: int, call: str) -> None:
        if status:
            raise error_for(status, call)

    def _call(self, name: str, *args) -> None:
        try:
            status = getattr(self.lib, name)(*args)
        except _CALL_ERRORS as e:
            raise ArgumentError(f"{name}: {e}") from e
        self._check(status, name)

    def _struct(self, ctype: str, init: dict):
        try:
            return self.ffi.new(ctype + " *", init)[0]
        except _CALL_ERRORS as e:
            raise ArgumentError(f"{ctype}: {e}") from e

    def _tokenref(self, span: TokenRef):
        return self._struct(
            "BaseRTTokenRef",
            {
                "ring_id": span.ring_id,
                "index": span.index,
                "count": span.count,
                "generation": span.generation,
            },
        )

    def _range(self, rng: TokenRange):
        return self._struct("BaseRTTokenRange", {"start": rng.start, "end": rng.end})

    def _seq(self, seq_id: int, call: str):
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise AbiError(
                Status.ERR_UNKNOWN_HANDLE, call, f"sequence id {seq_id!r} was not issued"
            ) from None

    def _seq_id(self, ptr, key: tuple) -> int:
        full = (*key, self.basert.address(ptr))
        sid = self._seq_keys.get(full)
        if sid is None:
            sid = self._next_seq
            self._next_seq += 1
            self._seq_keys[full] = sid
            self._seqs[sid] = ptr
        return sid

    def _forget_seq(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        for k, v in list(self._seq_keys.items()):
            if v == seq_id:
                del self._seq_keys[k]

    def sequence_pointer(self, seq_id: int):
        """The ``baseRT_sequence_t`` cdata behind ``seq_id`` (for raw ABI calls in tests).
        Raises AbiError(ERR_UNKNOWN_HANDLE) for an id this Bundle never issued or has dropped."""
        return self._seq(seq_id, "sequence_pointer")

    # -- tick ----------------------------------------------------------------------------------

    def _on_partial_emit(self, _user, lane_tag, tokens, n_tokens) -> None:
        # Runs inside baseRT_tick on the ticking thread; nothing may propagate into C.
        try:
            fn = self._partial_fn
            if fn is None:
                return
            if n_tokens and tokens == self.ffi.NULL:
                raise EventsMalformed("on_partial_emit", f"{n_tokens} tokens at a NULL pointer")
            if n_tokens:
                arr = np.frombuffer(self.ffi.buffer(tokens, 4 * n_tokens), np.uint32).copy()
            else:
                arr = np.zeros(0, np.uint32)
            fn(lane_tag, arr)
        except BaseException as e:  # re-raised by tick() once C has returned
            if self._partial_exc is None:
                self._partial_exc = e

    def encode_plan(self, plan: TickPlan, partial_emit: bool = False):
        """Write ``plan`` into this bundle's arena; returns the ``BaseRTTickPlan *`` (valid until
        the next encode or tick). ``partial_emit`` installs the bundle's callback (168-byte plan
        with PARTIAL_EMITS) but no Python function. Raises ArgumentError."""
        return self._arena.encode(plan, self._callback_addr if partial_emit else 0)

    def tick_raw(self, plan_ptr) -> tuple[int, int]:
        """Run ``baseRT_tick`` on any ``BaseRTTickPlan *`` (e.g. hand-made, deliberately broken);
        returns ``(status, events_address)`` without raising on status. The events stay readable
        until the next tick (ABI rule 70); decode them with ``read_events``."""
        self._events_out[0] = self.ffi.NULL
        status = self._tick(self.handle, plan_ptr, self._events_out)
        return status, self.basert.address(self._events_out[0])

    def read_events(self, address: int) -> TickEvents:
        """Decode engine events at ``address`` fail-closed (raises EventsMalformed)."""
        events = self._reader.events(address)
        self._note_completions(events)
        return events

    def tick(self, plan: TickPlan, on_partial_emit: PartialEmitFn | None = None) -> TickEvents:
        """Run one tick: ``plan`` in, schema ``TickEvents`` out (ABI §1, rules 53-70).

        With ``on_partial_emit`` the plan is sent at 168 bytes with PARTIAL_EMITS and the
        function gets ``(lane_tag, uint32 numpy copy)`` for each partial emit on this thread
        before the tick returns; without, the 152-byte plan is sent with the flag cleared.
        Raises ``PlanRejected`` (-100..-114, nothing changed), ``EngineFatal``, ``AbiError``,
        ``ArgumentError`` (plan does not fit the ABI; nothing sent), ``EventsMalformed`` (bad
        events, or ``plan_seq`` not echoed, rule 55) and ``PartialEmitCallbackError`` (the
        callback raised; the tick completed, the events are on the error)."""
        ptr = self._arena.encode(plan, self._callback_addr if on_partial_emit is not None else 0)
        self._partial_fn = on_partial_emit
        self._partial_exc = None
        self._events_out[0] = self.ffi.NULL
        try:
            status = self._tick(self.handle, ptr, self._events_out)
        finally:
            self._partial_fn = None
        exc, self._partial_exc = self._partial_exc, None
        if status:
            raise error_for(status, "baseRT_tick") from exc
        events = self.read_events(self.basert.address(self._events_out[0]))
        if events.plan_seq != plan.plan_seq:
            raise EventsMalformed("events.plan_seq", f"{events.plan_seq} does not echo plan {plan.plan_seq}")
        if exc is not None:
            raise PartialEmitCallbackError(events) from exc
        return events

    # -- rings, spaces ---------------------------------------------------------------------------

    def rings_attach(self, rings: Sequence[RingSpec]) -> None:
        """Attach or re-attach rings, all or nothing (``baseRT_rings_attach``, rules 125, 130).
        Raises AbiError(ERR_RING_LAYOUT) on a header/size mismatch."""
        ffi = self.ffi
        try:
            descs = [
                {
                    "struct_size": ffi.sizeof("BaseRTRingDesc"),
                    "ring_id": r.ring_id,
                    "kind": r.kind,
                    "role": r.role,
                    "slots": r.slots,
                    "slot_bytes": r.slot_bytes,
                    "base": ffi.cast("void *", r.address),
                    "len": r.length,
                }
                for r in rings
            ]
            arr = ffi.new("BaseRTRingDesc[]", descs) if descs else ffi.NULL
        except _CALL_ERRORS as e:
            raise ArgumentError(f"rings_attach: {e}") from e
        self._call("baseRT_rings_attach", self.handle, arr, len(descs))

    def state_spaces(self) -> list[StateSpaceDesc]:
        """The bundle's state spaces (``baseRT_state_spaces``), read fail-closed."""
        out = self.ffi.new("BaseRTArray *")
        self._call("baseRT_state_spaces", self.handle, out)
        return self._reader.state_spaces((self.basert.address(out.data), out.count, out.elem_size))

    def space_match(self, space_id: int, span: TokenRef, media_deps: Sequence[bytes] = ()) -> MatchResult:
        """Cached prefixes of ``span`` per space; pins nothing (rules 87-88). ``space_id`` may be
        ALL_SPACES; ``media_deps`` are 32-byte blob hashes."""
        deps = self._bytes32_array(media_deps, "media_deps")
        out = self.ffi.new("const BaseRTMatchResult **")
        self._call("baseRT_space_match", self.handle, space_id, self._tokenref(span), deps[0], out)
        return self._reader.match_result(self.basert.address(out[0]))

    def _bytes32_array(self, items: Sequence[bytes], what: str) -> tuple:
        for b in items:
            if len(b) != 32:
                raise ArgumentError(f"{what}: each entry must be 32 bytes, got {len(b)}")
        if not items:
            # The empty array of rule 21: count 0, NULL data, elem_size 0 (a nonzero elem_size
            # below the record's min prefix would be BAD_STRIDE, rule 24).
            return self._struct("BaseRTArray", {"data": self.ffi.NULL, "count": 0, "elem_size": 0}), None
        buf = self.ffi.new("uint64_t[]", 4 * len(items))
        self.ffi.memmove(buf, b"".join(items), 32 * len(items))
        arr = self._struct("BaseRTArray", {"data": buf, "count": len(items), "elem_size": 32})
        return arr, buf

    # -- seeds -----------------------------------------------------------------------------------

    def seed_acquire(self, span: TokenRef, prefix_len: int, determinism_class: int) -> int:
        """Pin ``span[:prefix_len]`` tokens and return a seed handle (rules 75-83)."""
        out = self.ffi.new("uint64_t *")
        self._call(
            "baseRT_seed_acquire", self.handle, self._tokenref(span), prefix_len, determinism_class, out
        )
        return int(out[0])

    def seed_release(self, seed_handle: int) -> None:
        """Release an unconsumed seed; AbiError(ERR_UNKNOWN_HANDLE) if unknown (rule 81)."""
        self._call("baseRT_seed_release", self.handle, seed_handle)

    def seed_lease_ticks(self) -> int:
        """The engine's declared seed-lease TTL in ticks (rule 84)."""
        out = self.ffi.new("uint64_t *")
        self._call("baseRT_seed_lease_ticks", self.handle, out)
        return int(out[0])

    def seed_adopt(self, seq: int, span: TokenRef) -> int:
        """Lease bare sequence ``seq`` (covering ``span``) as the next admit's seed (rule 86)."""
        out = self.ffi.new("uint64_t *")
        self._call("baseRT_seed_adopt", self.handle, self._seq(seq, "seed_adopt"), self._tokenref(span), out)
        return int(out[0])

    # -- sequences -------------------------------------------------------------------------------

    def lane_sequence(self, lane_tag: int) -> int | None:
        """Id of the sequence live lane ``lane_tag`` owns, or None (engine returned NULL)."""
        try:
            ptr = self.lib.baseRT_tick_lane_sequence(self.handle, lane_tag)
        except _CALL_ERRORS as e:
            raise ArgumentError(f"lane_sequence: {e}") from e
        if ptr == self.ffi.NULL:
            return None
        return self._seq_id(ptr, ("lane", lane_tag))

    def sequence_create(self) -> int:
        """A new bare, caller-owned sequence (a restore target). Raises HandleCreateFailed."""
        ptr = self.lib.baseRT_tick_sequence_create(self.handle)
        if ptr == self.ffi.NULL:
            raise HandleCreateFailed("baseRT_tick_sequence_create returned NULL")
        return self._seq_id(ptr, ("bare", self._next_seq))

    def sequence_free(self, seq: int) -> None:
        """Free a bare sequence; the id is dropped on success (rule 112)."""
        self._call("baseRT_tick_sequence_free", self.handle, self._seq(seq, "sequence_free"))
        self._forget_seq(seq)

    def sequence_publish(self, seq: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Publish bare sequence ``seq``'s whole blocks under ``tokens`` (u32 ids); consumes it on
        success, leaves it on error (rule 91)."""
        arr = self._u32(tokens, "sequence_publish")
        ptr = self.ffi.cast("const uint32_t *", arr.ctypes.data) if len(arr) else self.ffi.NULL
        self._call(
            "baseRT_tick_sequence_publish", self.handle, self._seq(seq, "sequence_publish"), ptr, len(arr)
        )
        self._forget_seq(seq)

    def seq_fork(self, parent: int, flags: int = 0) -> int:
        """Fork ``parent`` (ForkFlag bits); returns the child's id (rule 98: EBUSY during an op)."""
        out = self.ffi.new("baseRT_sequence_t *")
        self._call("baseRT_seq_fork", self._seq(parent, "seq_fork"), out, flags)
        return self._seq_id(out[0], ("fork",))

    @staticmethod
    def _u32(tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
        try:
            a = np.asarray(tokens)
            if a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() > 0xFFFFFFFF):
                raise ValueError("token ids must be integers in 0..2**32-1")
            return np.ascontiguousarray(a, dtype=np.uint32).reshape(-1)
        except (TypeError, ValueError, OverflowError) as e:
            raise ArgumentError(f"{what}: {e}") from e

    # -- state ops -------------------------------------------------------------------------------

    def export_size(self, seq: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        """``(required_bytes, sizing_gen)`` for exporting ``rng`` (rules 92-96)."""
        req = self.ffi.new("uint64_t *")
        gen = self.ffi.new("uint64_t *")
        self._call(
            "baseRT_space_export_size",
            self._seq(seq, "export_size"),
            space_id,
            self._range(rng),
            encoding,
            req,
            gen,
        )
        return int(req[0]), int(gen[0])

    def _loan(self, nbytes: int, data: bytes | None = None) -> tuple:
        if nbytes < 0:
            raise ArgumentError(f"buffer length {nbytes} is negative")
        buf = self.ffi.new("uint64_t[]", max(1, (nbytes + 7) // 8))
        if data:
            self.ffi.memmove(buf, data, nbytes)
        return buf, self._struct("BaseRTBuf", {"ptr": buf, "len": nbytes})

    def _submit(self, call: str, args: tuple, buf, nbytes: int, output: bool) -> int:
        op = self.ffi.new("baseRT_op_t *")
        self._call(call, *args, op)
        self._loans[int(op[0])] = _Loan(buf, nbytes, output)
        return int(op[0])

    def snapshot(self, seq: int, space_id: int, boundary_pos: int, sizing_gen: int, dst_bytes: int) -> int:
        """Start a snapshot into a ``dst_bytes`` buffer this Bundle owns; returns the op handle.
        Fetch the sealed bytes with ``op_output`` once DONE (rules 95-98, 110)."""
        buf, dst = self._loan(dst_bytes)
        s = self._seq(seq, "snapshot")
        return self._submit(
            "baseRT_space_snapshot", (s, space_id, boundary_pos, dst, sizing_gen), buf, dst_bytes, True
        )

    def restore(self, seq: int, space_id: int, data: bytes) -> int:
        """Start restoring sealed export ``data`` into ``seq`` (a copy is lent until terminal;
        rules 101-104)."""
        buf, src = self._loan(len(data), bytes(data))
        return self._submit(
            "baseRT_space_restore", (self._seq(seq, "restore"), space_id, src), buf, len(data), False
        )

    def snapshot_boundary(self, seq: int, space_id: int, cap: int) -> int:
        """Newest durable snapshot boundary <= ``cap`` tokens, 0 if none (rule 111)."""
        out = self.ffi.new("uint64_t *")
        self._call("baseRT_space_snapshot_boundary", self._seq(seq, "snapshot_boundary"), space_id, cap, out)
        return int(out[0])

    def trim(self, seq: int, space_id: int, new_len: int) -> None:
        """Trim a space of ``seq`` to ``new_len`` tokens (rule 109)."""
        self._call("baseRT_space_trim", self._seq(seq, "trim"), space_id, new_len)

    def demote(
        self, seq: int, space_id: int, rng: TokenRange, encoding: int, sizing_gen: int, dst_bytes: int
    ) -> int:
        """Start demoting ``rng`` into a ``dst_bytes`` buffer this Bundle owns; returns the op
        handle; ``op_output`` gives the bytes once DONE (rules 105-108)."""
        buf, dst = self._loan(dst_bytes)
        args = (self._seq(seq, "demote"), space_id, self._range(rng), encoding, dst, sizing_gen)
        return self._submit("baseRT_space_demote", args, buf, dst_bytes, True)

    def promote(self, seq: int, space_id: int, rng: TokenRange, data: bytes) -> int:
        """Start promoting demoted bytes ``data`` back over ``rng`` (rule 105)."""
        buf, src = self._loan(len(data), bytes(data))
        args = (self._seq(seq, "promote"), space_id, self._range(rng), src)
        return self._submit("baseRT_space_promote", args, buf, len(data), False)

    def _settle(self, op: int, state: int) -> None:
        loan = self._loans.get(op)
        if loan is None or state not in _TERMINAL:
            return
        loan.state = state
        if not (loan.output and state == OpState.DONE):
            del self._loans[op]  # the engine is done with the buffer; nothing to hand out

    def _note_completions(self, events: TickEvents) -> None:
        for c in events.op_completions:
            self._settle(c.op, c.state)

    def op_poll(self, op: int) -> OpStatus:
        """State of op ``op`` (rule 99: AbiError(ERR_UNKNOWN_HANDLE) if unknown)."""
        out = self.ffi.new("BaseRTOpStatus *", {"struct_size": self.ffi.sizeof("BaseRTOpStatus")})
        self._call("baseRT_op_poll", self.handle, op, out)
        self._settle(op, out.state)
        return OpStatus(state=out.state, error=out.error, bytes_moved=out.bytes_moved)

    def op_cancel(self, op: int) -> None:
        """Request cancellation of ``op`` (rule 100)."""
        self._call("baseRT_op_cancel", self.handle, op)

    def op_output(self, op: int) -> bytes:
        """The sealed bytes (136-byte envelope + payload) a DONE snapshot or demote wrote; the
        buffer is released, so this answers once per op. Polls the op if its end was not seen.
        Raises ArgumentError when this Bundle holds no output for ``op`` or it is not DONE, and
        EventsMalformed when the buffer does not start with an envelope whose payload fits."""
        loan = self._loans.get(op)
        if loan is None or not loan.output:
            raise ArgumentError(f"op {op}: no snapshot/demote output is held for it")
        if loan.state is None:
            self.op_poll(op)
        if loan.state != OpState.DONE:
            raise ArgumentError(f"op {op} is not DONE (state {loan.state})")
        data = bytes(self.ffi.buffer(loan.buf, loan.length))
        if len(data) < ENVELOPE_BYTES:
            raise EventsMalformed(
                "op_output", f"{len(data)} bytes cannot hold a {ENVELOPE_BYTES}-byte envelope"
            )
        payload = int.from_bytes(data[_PAYLOAD_LEN_AT : _PAYLOAD_LEN_AT + 8], "little")
        if ENVELOPE_BYTES + payload > len(data):
            raise EventsMalformed("op_output", f"payload_len {payload} overruns the {len(data)}-byte buffer")
        del self._loans[op]
        return data[: ENVELOPE_BYTES + payload]

    # -- cache -----------------------------------------------------------------------------------

    def cache_evict(self, policy: ShedPolicy, bytes_target: int) -> int:
        """Evict up to ``bytes_target`` bytes inside ``policy``; returns bytes freed (rule 89)."""
        lanes = self._u64(policy.victim_lanes, "cache_evict.victim_lanes")
        pol = self.ffi.new(
            "BaseRTShedPolicy *",
            {
                "victim_lanes": {
                    "data": self.ffi.cast("void *", lanes.ctypes.data) if len(lanes) else self.ffi.NULL,
                    "count": len(lanes),
                    "elem_size": 8,
                },
                "evictable_cache_classes": policy.evictable_cache_classes,
                "protected_quota_bytes": policy.protected_quota_bytes,
                "max_evict_bytes": policy.max_evict_bytes,
            },
        )
        out = self.ffi.new("uint64_t *")
        self._call("baseRT_cache_evict", self.handle, pol, bytes_target, out)
        return int(out[0])

    @staticmethod
    def _u64(values: Sequence[int], what: str) -> np.ndarray:
        try:
            return np.array(values, dtype=np.uint64).reshape(-1)
        except (TypeError, ValueError, OverflowError) as e:
            raise ArgumentError(f"{what}: {e}") from e

    def cache_evict_entries(self, keys: Sequence[CacheKey]) -> None:
        """Drop the named physical cache variants (64-byte BaseRTCacheKey records)."""
        flat = []
        for k in keys:
            flat += [k.compat_key, k.provenance_digest]
        arr, keep = self._bytes32_array(flat, "cache_evict_entries")
        if keys:
            arr.count, arr.elem_size = len(keys), 64
        self._call("baseRT_cache_evict_entries", self.handle, arr)
        del keep

    # -- grammar, logit bias ------------------------------------------------------------------

    @staticmethod
    def _cstr(s: str, what: str) -> bytes:
        b = s.encode()
        if b"\0" in b:
            raise ArgumentError(f"{what}: text contains a NUL byte")
        return b

    def grammar_create(self, json_schema: str) -> int:
        """A grammar handle for a JSON schema, or 0 when the engine refuses it."""
        return int(
            self.lib.baseRT_tick_grammar_create(self.handle, self._cstr(json_schema, "grammar_create"))
        )

    def grammar_create_structural(self, tag_json: str) -> int:
        """A grammar handle for a structural tag, or 0 when the engine refuses it."""
        b = self._cstr(tag_json, "grammar_create_structural")
        return int(self.lib.baseRT_tick_grammar_create_structural(self.handle, b))

    def grammar_free(self, handle: int) -> None:
        """Free a grammar handle; AbiError(ERR_UNKNOWN_HANDLE) if absent (rule 113)."""
        self._call("baseRT_tick_grammar_free", self.handle, handle)

    def logit_bias_create(self, tokens: Sequence[int], values: Sequence[float]) -> int:
        """A logit-bias handle adding ``values[i]`` to token ``tokens[i]``'s logit; 0 when the
        engine refuses (rule 113: empty). Raises ArgumentError on unequal lengths."""
        if len(tokens) != len(values):
            raise ArgumentError(f"logit_bias_create: {len(tokens)} tokens but {len(values)} values")
        try:
            t = np.ascontiguousarray(tokens, dtype=np.int32)
            v = np.ascontiguousarray(values, dtype=np.float32)
        except (TypeError, ValueError, OverflowError) as e:
            raise ArgumentError(f"logit_bias_create: {e}") from e
        n = len(t)
        tp = self.ffi.cast("const int32_t *", t.ctypes.data) if n else self.ffi.NULL
        vp = self.ffi.cast("const float *", v.ctypes.data) if n else self.ffi.NULL
        return int(self.lib.baseRT_tick_logit_bias_create(self.handle, tp, vp, n))

    def logit_bias_free(self, handle: int) -> None:
        """Free a logit-bias handle; AbiError(ERR_UNKNOWN_HANDLE) if absent (rule 113)."""
        self._call("baseRT_tick_logit_bias_free", self.handle, handle)

    # -- media -----------------------------------------------------------------------------------

    @staticmethod
    def _media_info(out) -> MediaInfo:
        return MediaInfo(
            n_tokens=out.n_tokens,
            image_token_id=out.image_token_id,
            boi_token_id=out.boi_token_id,
            eoi_token_id=out.eoi_token_id,
            preprocess_fp=out.preprocess_fp,
        )

    def media_probe(self, image_path: str) -> MediaInfo:
        """How many placeholder tokens ``image_path`` expands to (no encoder run)."""
        out = self.ffi.new("BaseRTMediaInfo *")
        self._call("baseRT_media_probe", self.handle, self._cstr(image_path, "media_probe"), out)
        return self._media_info(out)

    def media_encode(self, image_path: str) -> tuple[int, MediaInfo]:
        """Encode ``image_path``; returns ``(media_handle, info)``."""
        h = self.ffi.new("uint64_t *")
        out = self.ffi.new("BaseRTMediaInfo *")
        self._call("baseRT_media_encode", self.handle, self._cstr(image_path, "media_encode"), h, out)
        return int(h[0]), self._media_info(out)

    def media_release(self, media_handle: int) -> None:
        """Release an encoded media handle."""
        self._call("baseRT_media_release", self.handle, media_handle)

    def media_bind(self, lane_tag: int, media_handle: int, token_offset: int) -> None:
        """Bind media to lane ``lane_tag`` at prompt offset ``token_offset`` (tokens)."""
        self._call("baseRT_media_bind", self.handle, lane_tag, media_handle, token_offset)

    # -- strategies ------------------------------------------------------------------------------

    def strategy_register(self, reg: StrategyRegistration) -> StrategyGrant:
        """Register a speculation strategy; returns the grant (rules 114-122). Refusal is
        AbiError(ERR_REGISTRATION_REFUSED)."""
        m = RegistrationMarshal(self.ffi)
        c = m.build(reg)
        out = self.ffi.new("const BaseRTStrategyGrant **")
        self._call("baseRT_strategy_register", self.handle, c, out)
        return read_grant(self._reader, self.basert.address(out[0]))

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the model with the ``free`` given at construction (once), then drop lent buffers
        and sequence ids. Idempotent. Without ``free`` the model stays its creator's to free."""
        if self._closed:
            return
        self._closed = True
        if self._free is not None:
            self._free(self.handle)
        self._loans.clear()
        self._seqs.clear()
        self._seq_keys.clear()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
