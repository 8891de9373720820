"""Bare sequences and state ops of the llama.cpp engine (ABI section H, "Tick-bundle sequence
lifecycle").

A sequence handle names either a lane's sequence (``Engine.lane_sequence``) or a bare sequence this
module owns (``create``, ``fork``, a restore target). Snapshots export ``[0, end)`` of a sequence
with ``llama_state_seq_get_data`` (through the scratch sequence, ``Cells.with_prefix``, when ``end``
is short of the sequence's length) and seal it (``state``); restores check the envelope at submission and load
with ``llama_state_seq_set_data`` into an empty bare sequence, whose cells are then private (a
restore never re-shares cells with a resident prefix). A restored sequence re-enters through
``adopt`` (a seed lease one admit consumes, held by ``seeds.Seeds``) or ``publish`` (a cache
entry). Every cell change goes through ``cells.Cells``.

Ops are asynchronous in the ABI: submission validates and claims the sequence (plans naming its
lane are TRANSFER_LOCKED, rule 49; a second op EBUSY, rule 98), the work runs at the start of the
next accepted tick (after that tick's validation) and is reported in its op_completions (rule 69),
as in the reference engine; ``poll`` only reports. Op handles are never reused (rule 99).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from basertd.schema.abi import ALL_SPACES, Encoding, OpState, Status
from basertd.schema.tick import ENVELOPE_BYTES, OpComplete, OpStatus, TokenRange
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.model import LlamaModel
from basertd.worker.engines.llamacpp.prefix_cache import prefix_digest, prefix_servable
from basertd.worker.engines.llamacpp.seeds import Seeds
from basertd.worker.engines.llamacpp.state import STATE_VERSION_TAG, open_sealed, seal

_ZERO32 = bytes(32)


@dataclass(eq=False)
class BareSeq:
    """A sequence no lane owns: llama.cpp id ``seq``, provenance and taint of what it holds,
    ``gen`` its content generation (sizing_gen, rule 96). ``pending`` counts tokens it holds
    without their KV: a fork of a lane includes the lane's last committed token, whose KV the
    lane's next decode would have computed (0 or 1); its length is KV + pending."""

    handle: int
    seq: int
    provenance: bytes = _ZERO32
    taint: int = 0
    gen: int = 0
    pending: int = 0


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
    """Bare sequences, adoption and state ops of one engine (see the module docstring).

    ``lanes`` (tag -> Lane) and ``locked`` (sequence handles with an op in flight) are the
    engine's own collections, shared; ``new_handle`` issues sequence handles (shared with lanes);
    ``model`` gives the model id and vocabulary size; ``identity`` is the compat identity sealed
    into exports; at most ``spare_sequences`` bare and adopted sequences exist at once."""

    version_tag = STATE_VERSION_TAG

    def __init__(
        self,
        cells: Cells,
        seeds: Seeds,
        lanes: dict[int, Lane],
        locked: set[int],
        new_handle: Callable[[], int],
        model: LlamaModel,
        identity: bytes,
        spare_sequences: int,
    ) -> None:
        self.cells = cells
        self.seeds = seeds
        self.lanes = lanes
        self.locked = locked
        self.new_handle = new_handle
        self.model_id = model.model_id
        self.n_vocab = model.n_vocab
        self.identity = identity
        self.spare_sequences = spare_sequences
        self.bare: dict[int, BareSeq] = {}
        self.ops: dict[int, Op] = {}
        self._next_op = 1
        self._completions: list[OpComplete] = []

    # ------------------------------------------------------------------ sequence handles

    def _resolve(self, handle: int) -> tuple[int, BareSeq | None]:
        """(llama seq id, bare record or None for a lane) of a sequence handle."""
        b = self.bare.get(handle)
        if b is not None:
            return b.seq, b
        for lane in self.lanes.values():
            if lane.handle == handle:
                return lane.seq, None
        raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no sequence {handle}")

    def _bare(self, handle: int) -> BareSeq:
        b = self.bare.get(handle)
        if b is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"{handle} is not a bare sequence of this engine")
        return b

    def _idle(self, handle: int) -> None:
        if handle in self.locked:
            raise EngineError(Status.EBUSY, f"sequence {handle} has a state op in flight")

    def _space(self, space_id: int) -> None:
        if space_id == ALL_SPACES or space_id != 0:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no state space {space_id}")

    def _spare_left(self) -> bool:
        return len(self.bare) + len(self.seeds.adopted) < self.spare_sequences

    def create(self) -> int:
        """A new empty bare sequence; EngineError(EBUSY) when the spare sequences are used up."""
        if not self._spare_left():
            raise EngineError(Status.EBUSY, "every spare sequence is in use")
        b = BareSeq(self.new_handle(), self.cells.take_seq())
        self.bare[b.handle] = b
        return b.handle

    def free(self, handle: int) -> None:
        """Free a bare sequence: ERR_UNKNOWN_HANDLE for unknown, lane-owned, adopted or freed
        handles (ABI rule 112), EBUSY while an op runs on it."""
        b = self._bare(handle)
        self._idle(handle)
        del self.bare[handle]
        self.cells.free_seq(b.seq)

    def fork(self, parent: int) -> int:
        """A bare sequence sharing all of ``parent``'s cells (lane or bare; EBUSY during an op)."""
        seq, b = self._resolve(parent)
        self._idle(parent)
        if not self._spare_left():
            raise EngineError(Status.EBUSY, "every spare sequence is in use")
        child = BareSeq(self.new_handle(), self.cells.take_seq())
        n = self.cells.length(seq)
        if n:
            self.cells.copy(seq, child.seq, n)
        if b is not None:
            child.provenance, child.taint, child.pending = b.provenance, b.taint, b.pending
        else:
            lane = next(ln for ln in self.lanes.values() if ln.handle == parent)
            child.pending = lane.pending_tokens
            child.provenance = prefix_digest(self.model_id, lane.tokens[: n + child.pending])
            child.taint = lane.taint
        self.bare[child.handle] = child
        return child.handle

    def publish(self, handle: int, tokens: np.ndarray) -> None:
        """Publish a bare sequence's whole-page prefix under ``tokens`` and consume it (ABI rule
        91). ERR_UNKNOWN_HANDLE for anything but an idle bare sequence (EBUSY during an op),
        ERR_OUT_OF_BOUNDARY when ``tokens`` claims more than the sequence holds, REJECT_BOUNDS for
        ids outside the vocabulary, EBUSY when the cache is full; on error nothing changes. A
        sub-page sequence publishes nothing and is still consumed."""
        b = self._bare(handle)
        self._idle(handle)
        kv = self.cells.length(b.seq)
        n = kv + b.pending
        if tokens.ndim != 1 or tokens.shape[0] > n:
            raise EngineError(
                Status.ERR_OUT_OF_BOUNDARY, f"{tokens.shape[0]} tokens over a {n}-token sequence"
            )
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
            raise EngineError(Status.REJECT_BOUNDS, "token outside the vocabulary")
        cache = self.seeds.cache
        if len(cache.entries) >= cache.max_entries and tokens.shape[0] >= cache.page:
            raise EngineError(Status.EBUSY, "the prefix cache is full; evict first")
        del self.bare[handle]
        self.seeds.publish(b.seq, tokens.astype(np.int32), min(tokens.shape[0], kv), b.taint, None, None)

    # ------------------------------------------------------------------ adoption

    def adopt(self, handle: int, span: np.ndarray) -> int:
        """Lease bare sequence ``handle`` whole as the seed of one admit whose prompt starts with
        ``span`` (ABI rule 86): ERR_UNKNOWN_HANDLE for a lane's or unknown sequence, EBUSY during
        an op, ERR_SEED_UNSERVABLE when ``span`` is empty or not exactly the sequence's length."""
        if handle not in self.bare:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"{handle} is not a bare sequence of this engine")
        self._idle(handle)
        b = self.bare[handle]
        n = self.cells.length(b.seq) + b.pending
        if span.shape[0] == 0 or span.shape[0] != n:
            raise EngineError(
                Status.ERR_SEED_UNSERVABLE, f"span of {span.shape[0]} over a {n}-token sequence"
            )
        del self.bare[handle]
        return self.seeds.adopt(b, span)

    # ------------------------------------------------------------------ exports

    def _check_export(self, handle: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        self._space(space_id)
        seq, _ = self._resolve(handle)
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

    def _gen(self, handle: int) -> int:
        b = self.bare.get(handle)
        if b is not None:
            return b.gen
        return next(ln.content_gen for ln in self.lanes.values() if ln.handle == handle)

    def _state_size(self, seq: int, end: int) -> int:
        ctx = self.cells.ctx
        return int(self.cells.with_prefix(seq, end, lambda s: L.llama_state_seq_get_size(ctx, s)))

    def export_size(self, handle: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        """``(ENVELOPE_BYTES + payload bytes, sizing_gen)`` of a lossless export of
        ``[0, rng.end)``. ERR_UNKNOWN_HANDLE (space or sequence), ERR_OP_UNSUPPORTED (lossy, or a
        range not starting at 0), REJECT_BOUNDS (empty, reversed or past the valid length) - ABI
        rules 92-94."""
        seq, _ = self._check_export(handle, space_id, rng, encoding)
        return ENVELOPE_BYTES + self._state_size(seq, rng.end), self._gen(handle)

    def snapshot(self, handle: int, space_id: int, boundary_pos: int, sizing_gen: int, dst_bytes: int) -> int:
        """Start a snapshot of ``[0, boundary_pos)``. Synchronous refusals, no op handle and nothing
        written: the export_size errors, EBUSY during another op (rule 98), ERR_STALE_SIZING when
        the sequence advanced since sizing (rule 96), ERR_BUFFER_TOO_SMALL (rule 97)."""
        rng = TokenRange(start=0, end=boundary_pos)
        seq, _ = self._check_export(handle, space_id, rng, Encoding.LOSSLESS)
        self._idle(handle)
        if sizing_gen != self._gen(handle):
            raise EngineError(Status.ERR_STALE_SIZING, "the sequence changed since export_size")
        need = ENVELOPE_BYTES + self._state_size(seq, boundary_pos)
        if dst_bytes < need:
            raise EngineError(Status.ERR_BUFFER_TOO_SMALL, f"{dst_bytes} bytes < {need}")
        return self._submit(Op(0, "snapshot", handle, end=boundary_pos, total=need))

    def restore(self, handle: int, space_id: int, data: bytes) -> int:
        """Start restoring a sealed export into an empty bare sequence. Synchronous refusals:
        ERR_UNKNOWN_HANDLE (space, or not a bare sequence), EBUSY (op in flight, or the target is
        not empty), and the envelope checks of ABI rules 101-103."""
        self._space(space_id)
        b = self._bare(handle)
        self._idle(handle)
        if self.cells.length(b.seq):
            raise EngineError(Status.EBUSY, "restore targets must be empty")
        env, payload = open_sealed(data, identity=self.identity)
        op = Op(0, "restore", handle, end=env.range.end, payload=bytes(payload), total=len(data))
        op.provenance, op.taint = env.provenance_digest, env.taint_bits
        return self._submit(op)

    def _submit(self, op: Op) -> int:
        op.op = self._next_op
        self._next_op += 1
        self.ops[op.op] = op
        self.locked.add(op.handle)
        return op.op

    def check_target(self, handle: int, space_id: int) -> None:
        """The checks every op makes: ERR_UNKNOWN_HANDLE (space or sequence), EBUSY during another
        op (rule 98). Ops the engine does not serve run them first (``Engine.check_op_target``)."""
        self._space(space_id)
        self._resolve(handle)
        self._idle(handle)

    def snapshot_boundary(self, handle: int, space_id: int, cap: int) -> int:
        """The longest whole-page length <= ``cap`` (and <= the valid length) whose prefix a seed
        could serve with its sliding window intact, 0 when none (ABI rule 111)."""
        self._space(space_id)
        seq, _ = self._resolve(handle)
        page = self.seeds.page
        q = (min(cap, self.cells.length(seq)) // page) * page
        pmin, pmax = self.cells.pos_range(seq)
        # Servability only gets harder for shorter prefixes: the longest page multiple or nothing.
        return q if q > 0 and prefix_servable(pmin, pmax, q, self.seeds.n_swa) else 0

    def trim(self, handle: int, space_id: int, new_len: int) -> None:
        """Trim a bare sequence to ``new_len`` tokens (any length for paged KV, ABI rule 109):
        REJECT_BOUNDS past the valid length, EBUSY for a lane's sequence or during an op."""
        self._space(space_id)
        seq, b = self._resolve(handle)
        if b is None:
            raise EngineError(Status.EBUSY, "a lane's sequence is trimmed by its plan, not here")
        self._idle(handle)
        kv = self.cells.length(seq)
        if not 0 <= new_len <= kv + b.pending:
            raise EngineError(Status.REJECT_BOUNDS, f"trim to {new_len} past the valid length")
        b.pending = max(0, new_len - kv)
        self.cells.truncate(seq, new_len)  # past the KV (a pending token): no cell changes
        b.gen += 1

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
        seq, b = self._resolve(op.handle)

        ctx = self.cells.ctx

        def export(s: int) -> bytes:
            size = int(L.llama_state_seq_get_size(ctx, s))
            buf = (ctypes.c_uint8 * size)()
            n = int(L.llama_state_seq_get_data(ctx, buf, size, s))
            return bytes(buf)[:n]

        payload = self.cells.with_prefix(seq, op.end, export)
        if b is not None:
            prov, taint = b.provenance, b.taint
        else:
            lane = next(ln for ln in self.lanes.values() if ln.handle == op.handle)
            prov, taint = prefix_digest(self.model_id, lane.tokens[: op.end]), lane.taint
        if not payload:
            op.state, op.error = OpState.FAILED, int(Status.ERR_FATAL) & 0xFFFFFFFF
            return
        op.output = seal(payload, identity=self.identity, provenance=prov, taint=taint, n_tokens=op.end)
        op.state = OpState.DONE
        op.bytes_moved = len(op.output)

    def _run_restore(self, op: Op) -> None:
        b = self.bare[op.handle]
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

    def poll(self, op_handle: int) -> OpStatus:
        """State of an op (RUNNING until the next accepted tick runs it); ERR_UNKNOWN_HANDLE for a
        handle this engine never returned (ABI rule 99)."""
        op = self.ops.get(op_handle)
        if op is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no op {op_handle}")
        return OpStatus(state=op.state, error=op.error, bytes_moved=op.bytes_moved)

    def cancel(self, op_handle: int) -> None:
        """Cancel a running op: CANCELLED, no output, claim released; a finished op is left as it
        is (ABI rule 100)."""
        op = self.ops.get(op_handle)
        if op is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no op {op_handle}")
        if op.state == OpState.RUNNING:
            op.state = OpState.CANCELLED
            op.payload = b""
            self.locked.discard(op.handle)
            self._completions.append(OpComplete(op=op.op, state=op.state, bytes_moved=0))

    def output(self, op_handle: int) -> bytes:
        """The sealed bytes of a DONE snapshot (envelope + payload, ABI rule 95), handed over once:
        the engine keeps no copy afterwards, and a second call raises ERR_UNKNOWN_HANDLE."""
        op = self.ops.get(op_handle)
        if op is None or op.kind != "snapshot":
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no snapshot op {op_handle}")
        if op.state == OpState.RUNNING:
            raise EngineError(Status.EBUSY, f"op {op_handle} is still running")
        if op.output is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"op {op_handle} has no output ({op.state.name})")
        out, op.output = op.output, None
        return out

    def take_completions(self) -> list[OpComplete]:
        """Terminal op states not yet reported; the tick reports them (ABI rule 69)."""
        out, self._completions = self._completions, []
        return out

    def retained_bytes(self) -> int:
        """Host bytes held by op payloads and outputs."""
        return sum(len(o.payload) + (len(o.output) if o.output else 0) for o in self.ops.values())
