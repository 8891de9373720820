"""``StateOps``: the llama.cpp engine's state ops (ABI section H: exports, snapshots, restores;
the op half of ``Capability.STATE_OPS``) over the bare and lane sequences of ``sequences``.

Snapshots export ``[0, end)`` of a sequence with ``llama_state_seq_get_data`` (through the
scratch sequence, ``Cells.with_prefix``, when ``end`` is short of the sequence's length) and seal
it (``state``); restores check the envelope at submission and load with
``llama_state_seq_set_data`` into an empty bare sequence, whose cells are then private (a restore
never re-shares cells with a resident prefix). Every cell change goes through ``cells.Cells``.

Ops are asynchronous in the ABI: submission validates and claims the sequence (plans naming its
lane are TRANSFER_LOCKED, rule 49; a second op EBUSY, rule 98), the work runs at the start of the
next accepted tick (after that tick's validation) and is reported in its op_completions (rule 69),
as in the reference engine; ``op_poll`` only reports. Op handles are never reused (rule 99).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp as L

from basertd.schema.abi import Encoding, OpState, Status
from basertd.schema.tick import ENVELOPE_BYTES, OpComplete, OpStatus, TokenRange
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.sequences import Sequences, check_space
from basertd.worker.engines.llamacpp.state import STATE_VERSION_TAG, open_sealed, seal

_ZERO32 = bytes(32)


@dataclass(eq=False)
class Op:
    """One state op: ``kind`` "snapshot" or "restore" on sequence handle ``handle``."""

    op: int
    kind: str
    handle: int
    end: int = 0
    payload: bytes = b""
    provenance: bytes = _ZERO32
    taint: int = 0
    state: OpState = OpState.RUNNING
    error: int = 0
    bytes_moved: int = 0
    output: bytes | None = None
    total: int = 0


class StateOps:
    """The state ops of one engine (module docstring) over ``sequences`` (``Sequences``: handles,
    bare sequences, the ``locked`` set shared with the engine); ``identity`` is the compat identity
    sealed into exports and checked on restores."""

    version_tag = STATE_VERSION_TAG

    def __init__(self, sequences: Sequences, identity: bytes) -> None:
        self.sequences = sequences
        self.cells = sequences.cells
        self.locked = sequences.locked
        self.identity = identity
        self.ops: dict[int, Op] = {}
        self._next_op = 1
        self._completions: list[OpComplete] = []

    # ------------------------------------------------------------------ exports

    def _check_export(self, handle: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        check_space(space_id)
        seq, _ = self.sequences.resolve(handle)
        if encoding != Encoding.LOSSLESS:
            raise EngineError(Status.ERR_OP_UNSUPPORTED, "only lossless KV exports")
        valid = self.cells.length(seq)
        if rng.start > rng.end or rng.end > valid or rng.end == 0:
            raise EngineError(
                Status.REJECT_BOUNDS, f"range [{rng.start}, {rng.end}) of a {valid}-token sequence"
            )
        if rng.start != 0:
            raise EngineError(Status.ERR_OP_UNSUPPORTED, "KV exports start at position 0")
        return seq, valid

    def _state_size(self, seq: int, end: int) -> int:
        ctx = self.cells.ctx
        return int(self.cells.with_prefix(seq, end, lambda s: L.llama_state_seq_get_size(ctx, s)))

    def export_size(self, seq: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        """``(ENVELOPE_BYTES + payload bytes, sizing_gen)`` of a lossless export of
        ``[0, rng.end)``. ERR_UNKNOWN_HANDLE (space or sequence), ERR_OP_UNSUPPORTED (lossy, or a
        range not starting at 0), REJECT_BOUNDS (empty, reversed or past the valid length) - ABI
        rules 92-94."""
        s, _ = self._check_export(seq, space_id, rng, encoding)
        return ENVELOPE_BYTES + self._state_size(s, rng.end), self.sequences.gen(seq)

    def snapshot(self, seq: int, space_id: int, boundary_pos: int, sizing_gen: int, dst_bytes: int) -> int:
        """Start a snapshot of ``[0, boundary_pos)``. Synchronous refusals, no op handle and nothing
        written: the export_size errors, EBUSY during another op (rule 98), ERR_STALE_SIZING when
        the sequence advanced since sizing (rule 96), ERR_BUFFER_TOO_SMALL (rule 97)."""
        rng = TokenRange(start=0, end=boundary_pos)
        s, _ = self._check_export(seq, space_id, rng, Encoding.LOSSLESS)
        self.sequences.idle(seq)
        if sizing_gen != self.sequences.gen(seq):
            raise EngineError(Status.ERR_STALE_SIZING, "the sequence changed since export_size")
        need = ENVELOPE_BYTES + self._state_size(s, boundary_pos)
        if dst_bytes < need:
            raise EngineError(Status.ERR_BUFFER_TOO_SMALL, f"{dst_bytes} bytes < {need}")
        return self._submit(Op(0, "snapshot", seq, end=boundary_pos, total=need))

    def restore(self, seq: int, space_id: int, data: bytes) -> int:
        """Start restoring a sealed export into an empty bare sequence. Synchronous refusals:
        ERR_UNKNOWN_HANDLE (space, or not a bare sequence), EBUSY (op in flight, or the target is
        not empty), and the envelope checks of ABI rules 101-103."""
        check_space(space_id)
        b = self.sequences.bare_of(seq)
        self.sequences.idle(seq)
        if self.cells.length(b.seq):
            raise EngineError(Status.EBUSY, "restore targets must be empty")
        env, payload = open_sealed(data, identity=self.identity)
        op = Op(0, "restore", seq, end=env.range.end, payload=bytes(payload), total=len(data))
        op.provenance, op.taint = env.provenance_digest, env.taint_bits
        return self._submit(op)

    def _submit(self, op: Op) -> int:
        op.op = self._next_op
        self._next_op += 1
        self.ops[op.op] = op
        self.locked.add(op.handle)
        return op.op

    # ------------------------------------------------------------------ execution

    def _run(self, op: Op) -> None:
        try:
            if op.kind == "snapshot":
                self._run_snapshot(op)
            else:
                self._run_restore(op)
        finally:
            self.locked.discard(op.handle)
            op.payload = b""
            self._completions.append(
                OpComplete(op=op.op, state=op.state, error=op.error, bytes_moved=op.bytes_moved)
            )

    def _run_snapshot(self, op: Op) -> None:
        seq, _ = self.sequences.resolve(op.handle)
        ctx = self.cells.ctx

        def export(s: int) -> bytes:
            size = int(L.llama_state_seq_get_size(ctx, s))
            buf = (ctypes.c_uint8 * size)()
            n = int(L.llama_state_seq_get_data(ctx, buf, size, s))
            return bytes(buf)[:n]

        payload = self.cells.with_prefix(seq, op.end, export)
        prov, taint = self.sequences.provenance(op.handle, op.end)
        if not payload:
            op.state, op.error = OpState.FAILED, int(Status.ERR_FATAL) & 0xFFFFFFFF
            return
        op.output = seal(payload, identity=self.identity, provenance=prov, taint=taint, n_tokens=op.end)
        op.state = OpState.DONE
        op.bytes_moved = len(op.output)

    def _run_restore(self, op: Op) -> None:
        b = self.sequences.bare[op.handle]
        if op.end > self.cells.free:
            op.state, op.error = OpState.FAILED, int(Status.NEEDS_REPLAN) & 0xFFFFFFFF
            return
        if not self.cells.load(b.seq, op.payload, op.end):
            op.state, op.error = OpState.FAILED, int(Status.ERR_ENVELOPE_MISMATCH) & 0xFFFFFFFF
            return
        b.provenance, b.taint = op.provenance, op.taint
        b.gen += 1
        op.state = OpState.DONE
        op.bytes_moved = op.total

    def run_pending(self) -> None:
        """Complete every running op (called at the start of a tick, after its validation)."""
        for op in list(self.ops.values()):
            if op.state == OpState.RUNNING:
                self._run(op)

    def op_poll(self, op: int) -> OpStatus:
        """State of an op (RUNNING until the next accepted tick runs it); ERR_UNKNOWN_HANDLE for a
        handle this engine never returned (ABI rule 99)."""
        rec = self.ops.get(op)
        if rec is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no op {op}")
        return OpStatus(state=rec.state, error=rec.error, bytes_moved=rec.bytes_moved)

    def op_cancel(self, op: int) -> None:
        """Cancel a running op: CANCELLED, no output, claim released; a finished op is left as it
        is (ABI rule 100)."""
        rec = self.ops.get(op)
        if rec is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no op {op}")
        if rec.state == OpState.RUNNING:
            rec.state = OpState.CANCELLED
            rec.payload = b""
            self.locked.discard(rec.handle)
            self._completions.append(OpComplete(op=rec.op, state=rec.state, bytes_moved=0))

    def op_output(self, op: int) -> bytes:
        """The sealed bytes of a DONE snapshot (envelope + payload, ABI rule 95), handed over once:
        the engine keeps no copy afterwards, and a second call raises ERR_UNKNOWN_HANDLE."""
        rec = self.ops.get(op)
        if rec is None or rec.kind != "snapshot":
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no snapshot op {op}")
        if rec.state == OpState.RUNNING:
            raise EngineError(Status.EBUSY, f"op {op} is still running")
        if rec.output is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"op {op} has no output ({rec.state.name})")
        out, rec.output = rec.output, None
        return out

    def take_completions(self) -> list[OpComplete]:
        """Terminal op states not yet reported; the tick reports them (ABI rule 69)."""
        out, self._completions = self._completions, []
        return out

    def retained_bytes(self) -> int:
        """Host bytes held by op payloads and outputs."""
        return sum(len(o.payload) + (len(o.output) if o.output else 0) for o in self.ops.values())
