"""Bare sequences and state ops of the llama.cpp engine (ABI section H, "Tick-bundle sequence
lifecycle").

A sequence handle names either a lane's sequence (``Engine.lane_sequence``) or a bare sequence this
module owns (``create``, ``fork``, a restore target). Snapshots export ``[0, end)`` of a sequence
with ``llama_state_seq_get_data`` (through the engine's scratch sequence when ``end`` is short of
the sequence's length) and seal it (``state``); restores check the envelope at submission and load
with ``llama_state_seq_set_data`` into an empty bare sequence, whose cells are then private (a
restore never re-shares cells with a resident prefix). A restored sequence re-enters through
``adopt`` (a seed lease one admit consumes) or ``publish`` (a cache entry).

Ops are asynchronous in the ABI: submission validates and claims the sequence (plans naming its
lane are TRANSFER_LOCKED, rule 49; a second op EBUSY, rule 98), the work runs at the start of the
next accepted tick (after that tick's validation) and is reported in its op_completions (rule 69),
as in the reference engine; ``poll`` only reports. Op handles are never reused (rule 99).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llama_cpp as L
import numpy as np

from basertd.schema.abi import ALL_SPACES, Encoding, OpState, Status
from basertd.schema.tick import ENVELOPE_BYTES, OpComplete, OpStatus, TokenRange
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.prefix_cache import Lease, prefix_digest, prefix_servable
from basertd.worker.engines.llamacpp.state import STATE_VERSION_TAG, open_sealed, seal

if TYPE_CHECKING:
    from basertd.worker.engines.llamacpp.engine import LlamaCppEngine

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
    """Bare sequences, adoption and state ops of one engine (see the module docstring)."""

    version_tag = STATE_VERSION_TAG

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.e = engine
        self.bare: dict[int, BareSeq] = {}
        self.leased: dict[int, BareSeq] = {}  # adopted, waiting for their admit
        self.ops: dict[int, Op] = {}
        self._next_op = 1
        self._completions: list[OpComplete] = []

    # ------------------------------------------------------------------ sequence handles

    def _resolve(self, handle: int) -> tuple[int, BareSeq | None]:
        """(llama seq id, bare record or None for a lane) of a sequence handle."""
        b = self.bare.get(handle)
        if b is not None:
            return b.seq, b
        for lane in self.e.lanes.values():
            if lane.handle == handle:
                return lane.seq, None
        raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no sequence {handle}")

    def _bare(self, handle: int) -> BareSeq:
        b = self.bare.get(handle)
        if b is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"{handle} is not a bare sequence of this engine")
        return b

    def _idle(self, handle: int) -> None:
        if handle in self.e.locked:
            raise EngineError(Status.EBUSY, f"sequence {handle} has a state op in flight")

    def _space(self, space_id: int) -> None:
        if space_id == ALL_SPACES or space_id != 0:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no state space {space_id}")

    def _spare_left(self) -> bool:
        return len(self.bare) + len(self.leased) < self.e.spare_sequences

    def bare_seq(self, handle: int, *, leased: bool = False) -> int:
        """llama seq id of a bare (or, with ``leased``, an adopted) sequence."""
        return (self.leased if leased else self.bare)[handle].seq

    def create(self) -> int:
        """A new empty bare sequence; EngineError(EBUSY) when the spare sequences are used up."""
        if not self._spare_left():
            raise EngineError(Status.EBUSY, "every spare sequence is in use")
        b = BareSeq(self.e._new_handle(), self.e._take_seq())
        self.bare[b.handle] = b
        return b.handle

    def free(self, handle: int) -> None:
        """Free a bare sequence: ERR_UNKNOWN_HANDLE for unknown, lane-owned, adopted or freed
        handles (ABI rule 112), EBUSY while an op runs on it."""
        b = self._bare(handle)
        self._idle(handle)
        del self.bare[handle]
        self.e._release_seq(b.seq)

    def fork(self, parent: int) -> int:
        """A bare sequence sharing all of ``parent``'s cells (lane or bare; EBUSY during an op)."""
        seq, b = self._resolve(parent)
        self._idle(parent)
        if not self._spare_left():
            raise EngineError(Status.EBUSY, "every spare sequence is in use")
        child = BareSeq(self.e._new_handle(), self.e._take_seq())
        n = self.e.ledger.length(seq)
        if n:
            L.llama_memory_seq_cp(self.e.mem, seq, child.seq, 0, n)
            self.e.ledger.share(seq, child.seq, n)
        if b is not None:
            child.provenance, child.taint, child.pending = b.provenance, b.taint, b.pending
        else:
            lane = next(ln for ln in self.e.lanes.values() if ln.handle == parent)
            child.pending = lane.pending_tokens
            child.provenance = prefix_digest(self.e.model.model_id, lane.tokens[: n + child.pending])
            child.taint = lane.taint
        self.bare[child.handle] = child
        self.e._evictable_dirty = True
        return child.handle

    def publish(self, handle: int, tokens: np.ndarray) -> None:
        """Publish a bare sequence's whole-page prefix under ``tokens`` and consume it (ABI rule
        91). ERR_UNKNOWN_HANDLE for anything but an idle bare sequence (EBUSY during an op),
        ERR_OUT_OF_BOUNDARY when ``tokens`` claims more than the sequence holds, REJECT_BOUNDS for
        ids outside the vocabulary, EBUSY when the cache is full; on error nothing changes. A
        sub-page sequence publishes nothing and is still consumed."""
        b = self._bare(handle)
        self._idle(handle)
        kv = self.e.ledger.length(b.seq)
        n = kv + b.pending
        if tokens.ndim != 1 or tokens.shape[0] > n:
            raise EngineError(
                Status.ERR_OUT_OF_BOUNDARY, f"{tokens.shape[0]} tokens over a {n}-token sequence"
            )
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.e.n_vocab):
            raise EngineError(Status.REJECT_BOUNDS, "token outside the vocabulary")
        full = len(self.e.cache.entries) >= self.e.cache.max_entries
        if full and tokens.shape[0] >= self.e.page:
            raise EngineError(Status.EBUSY, "the prefix cache is full; evict first")
        del self.bare[handle]
        self.e._publish(b.seq, tokens.astype(np.int32), min(tokens.shape[0], kv), b.taint, None, None)

    # ------------------------------------------------------------------ adoption

    def adopt(self, handle: int, span: np.ndarray) -> int:
        """Lease bare sequence ``handle`` whole as the seed of one admit whose prompt starts with
        ``span`` (ABI rule 86): ERR_UNKNOWN_HANDLE for a lane's or unknown sequence, EBUSY during
        an op, ERR_SEED_UNSERVABLE when ``span`` is empty or not exactly the sequence's length."""
        if handle not in self.bare:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"{handle} is not a bare sequence of this engine")
        self._idle(handle)
        b = self.bare[handle]
        n = self.e.ledger.length(b.seq) + b.pending
        if span.shape[0] == 0 or span.shape[0] != n:
            raise EngineError(
                Status.ERR_SEED_UNSERVABLE, f"span of {span.shape[0]} over a {n}-token sequence"
            )
        del self.bare[handle]
        self.leased[handle] = b
        lease = self.e.cache.new_lease(
            span.copy(),
            0,
            self.e.tick_index + self.e.seed_ttl,
            adopted=handle,
            taint=b.taint,
            pending=b.pending,
        )
        return lease.handle

    def take_adopted(self, lease: Lease) -> int:
        """An admit consumes an adopted lease: the lane takes over the sequence id."""
        return self.leased.pop(lease.adopted).seq

    def free_adopted(self, lease: Lease) -> None:
        """An adopted lease expired or was released: its sequence is freed."""
        b = self.leased.pop(lease.adopted, None)
        if b is not None:
            self.e._release_seq(b.seq)

    # ------------------------------------------------------------------ exports

    def _check_export(self, handle: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        self._space(space_id)
        seq, _ = self._resolve(handle)
        if encoding != Encoding.LOSSLESS:
            raise EngineError(Status.ERR_OP_UNSUPPORTED, "only lossless KV exports")
        valid = self.e.ledger.length(seq)
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
        return next(ln.content_gen for ln in self.e.lanes.values() if ln.handle == handle)

    def _with_prefix(self, seq: int, end: int, fn):
        """Run ``fn(seq_id)`` on ``seq`` itself when it holds exactly ``end`` tokens, else on the
        scratch sequence holding a shared copy of its first ``end`` cells."""
        if self.e.ledger.length(seq) == end:
            return fn(seq)
        scratch = self.e.scratch_seq
        L.llama_memory_seq_cp(self.e.mem, seq, scratch, 0, end)
        try:
            return fn(scratch)
        finally:
            L.llama_memory_seq_rm(self.e.mem, scratch, -1, -1)

    def _state_size(self, seq: int, end: int) -> int:
        return int(self._with_prefix(seq, end, lambda s: L.llama_state_seq_get_size(self.e.ctx, s)))

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
        if self.e.ledger.length(b.seq):
            raise EngineError(Status.EBUSY, "restore targets must be empty")
        env, payload = open_sealed(data, identity=self.e.identity)
        op = Op(0, "restore", handle, end=env.range.end, payload=bytes(payload), total=len(data))
        op.provenance, op.taint = env.provenance_digest, env.taint_bits
        return self._submit(op)

    def _submit(self, op: Op) -> int:
        op.op = self._next_op
        self._next_op += 1
        self.ops[op.op] = op
        self.e.locked.add(op.handle)
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
        q = (min(cap, self.e.ledger.length(seq)) // self.e.page) * self.e.page
        pmin, pmax = self.e.pos_range(seq)
        # Servability only gets harder for shorter prefixes: the longest page multiple or nothing.
        return q if q > 0 and prefix_servable(pmin, pmax, q, self.e.n_swa) else 0

    def trim(self, handle: int, space_id: int, new_len: int) -> None:
        """Trim a bare sequence to ``new_len`` tokens (any length for paged KV, ABI rule 109):
        REJECT_BOUNDS past the valid length, EBUSY for a lane's sequence or during an op."""
        self._space(space_id)
        seq, b = self._resolve(handle)
        if b is None:
            raise EngineError(Status.EBUSY, "a lane's sequence is trimmed by its plan, not here")
        self._idle(handle)
        kv = self.e.ledger.length(seq)
        if not 0 <= new_len <= kv + b.pending:
            raise EngineError(Status.REJECT_BOUNDS, f"trim to {new_len} past the valid length")
        b.pending = max(0, new_len - kv)
        L.llama_memory_seq_rm(self.e.mem, seq, new_len, -1)
        self.e.ledger.truncate(seq, min(new_len, kv))
        b.gen += 1
        self.e._evictable_dirty = True

    # ------------------------------------------------------------------ execution

    def _run(self, op: Op) -> None:
        try:
            if op.kind == "snapshot":
                self._run_snapshot(op)
            else:
                self._run_restore(op)
        finally:
            self.e.locked.discard(op.handle)
            op.payload = b""
            self._completions.append(
                OpComplete(op=op.op, state=op.state, error=op.error, bytes_moved=op.bytes_moved)
            )

    def _run_snapshot(self, op: Op) -> None:
        seq, b = self._resolve(op.handle)

        def export(s: int) -> bytes:
            size = int(L.llama_state_seq_get_size(self.e.ctx, s))
            buf = (ctypes.c_uint8 * size)()
            n = int(L.llama_state_seq_get_data(self.e.ctx, buf, size, s))
            return bytes(buf)[:n]

        payload = self._with_prefix(seq, op.end, export)
        if b is not None:
            prov, taint = b.provenance, b.taint
        else:
            lane = next(ln for ln in self.e.lanes.values() if ln.handle == op.handle)
            prov, taint = prefix_digest(self.e.model.model_id, lane.tokens[: op.end]), lane.taint
        if not payload:
            op.state, op.error = OpState.FAILED, int(Status.ERR_FATAL) & 0xFFFFFFFF
            return
        op.output = seal(payload, identity=self.e.identity, provenance=prov, taint=taint, n_tokens=op.end)
        op.state = OpState.DONE
        op.bytes_moved = len(op.output)

    def _run_restore(self, op: Op) -> None:
        b = self.bare[op.handle]
        if op.end > self.e.ledger.free:
            op.state, op.error = OpState.FAILED, int(Status.NEEDS_REPLAN) & 0xFFFFFFFF
            return
        src = (ctypes.c_uint8 * len(op.payload)).from_buffer_copy(op.payload)
        n = int(L.llama_state_seq_set_data(self.e.ctx, src, len(op.payload), b.seq))
        _, pmax = self.e.pos_range(b.seq)
        if n == 0 or pmax != op.end - 1:
            L.llama_memory_seq_rm(self.e.mem, b.seq, -1, -1)
            op.state, op.error = OpState.FAILED, int(Status.ERR_ENVELOPE_MISMATCH) & 0xFFFFFFFF
            return
        self.e.ledger.append(b.seq, op.end)
        b.provenance, b.taint = op.provenance, op.taint
        b.gen += 1
        op.state = OpState.DONE
        op.bytes_moved = op.total
        self.e._evictable_dirty = True

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
            self.e.locked.discard(op.handle)
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
