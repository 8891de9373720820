"""``Sequences``: the llama.cpp engine's bare sequences (ABI section H, "Tick-bundle sequence
lifecycle"; the sequence half of ``Capability.STATE_OPS`` and ``seed_adopt``).

A sequence handle names either a lane's sequence (``lane_sequence``) or a bare sequence this
module owns (``sequence_create``, ``seq_fork``, a restore target). A bare sequence re-enters
through ``seed_adopt`` (a seed lease one admit consumes, held by ``seeds.Seeds``) or
``sequence_publish`` (a cache entry). Every cell change goes through ``cells.Cells``; the state
ops over these sequences (exports, snapshots, restores) are ``ops.StateOps``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from basertd.schema.abi import ALL_SPACES, Status
from basertd.schema.tick import TokenRef
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.model import LlamaModel
from basertd.worker.engines.llamacpp.prefix_cache import prefix_digest, prefix_servable
from basertd.worker.engines.llamacpp.rings import EngineRings
from basertd.worker.engines.llamacpp.seeds import Seeds

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


def check_space(space_id: int) -> None:
    """ERR_UNKNOWN_HANDLE for any state space but the KV space (id 0)."""
    if space_id == ALL_SPACES or space_id != 0:
        raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no state space {space_id}")


class Sequences:
    """Bare sequences and adoption of one engine (module docstring).

    ``lanes`` (tag -> Lane) and ``locked`` (sequence handles with a state op in flight) are the
    engine's own collections, shared; ``new_handle`` issues sequence handles (shared with lanes);
    ``rings`` gives adopted spans; ``model`` the model id and vocabulary size; at most
    ``spare_sequences`` bare and adopted sequences exist at once."""

    def __init__(
        self,
        cells: Cells,
        seeds: Seeds,
        rings: EngineRings,
        lanes: dict[int, Lane],
        locked: set[int],
        new_handle: Callable[[], int],
        model: LlamaModel,
        spare_sequences: int,
    ) -> None:
        self.cells = cells
        self.seeds = seeds
        self.rings = rings
        self.lanes = lanes
        self.locked = locked
        self.new_handle = new_handle
        self.model_id = model.model_id
        self.n_vocab = model.n_vocab
        self.spare_sequences = spare_sequences
        self.bare: dict[int, BareSeq] = {}

    # ------------------------------------------------------------------ handles

    def resolve(self, handle: int) -> tuple[int, BareSeq | None]:
        """(llama seq id, bare record or None for a lane) of a sequence handle;
        ERR_UNKNOWN_HANDLE for one this engine does not hold."""
        b = self.bare.get(handle)
        if b is not None:
            return b.seq, b
        for lane in self.lanes.values():
            if lane.handle == handle:
                return lane.seq, None
        raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no sequence {handle}")

    def lane_of(self, handle: int) -> Lane:
        """The live lane whose sequence handle is ``handle`` (``resolve`` said it is a lane's)."""
        return next(ln for ln in self.lanes.values() if ln.handle == handle)

    def bare_of(self, handle: int) -> BareSeq:
        """The bare sequence ``handle``; ERR_UNKNOWN_HANDLE for a lane's or an unknown one."""
        b = self.bare.get(handle)
        if b is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"{handle} is not a bare sequence of this engine")
        return b

    def idle(self, handle: int) -> None:
        """EBUSY while a state op runs on ``handle`` (ABI rule 98)."""
        if handle in self.locked:
            raise EngineError(Status.EBUSY, f"sequence {handle} has a state op in flight")

    def gen(self, handle: int) -> int:
        """The content generation of a resolved sequence (sizing_gen, rule 96)."""
        b = self.bare.get(handle)
        return b.gen if b is not None else self.lane_of(handle).content_gen

    def provenance(self, handle: int, end: int) -> tuple[bytes, int]:
        """(provenance digest, taint) of ``[0, end)`` of a resolved sequence."""
        b = self.bare.get(handle)
        if b is not None:
            return b.provenance, b.taint
        lane = self.lane_of(handle)
        return prefix_digest(self.model_id, lane.tokens[:end]), lane.taint

    def _spare_left(self) -> bool:
        return len(self.bare) + len(self.seeds.adopted) < self.spare_sequences

    def check_op_target(self, seq: int, space_id: int) -> None:
        """The checks every op makes: ERR_UNKNOWN_HANDLE (space or sequence), EBUSY during another
        op (rule 98). Ops the engine does not serve (demote, promote) run them first."""
        check_space(space_id)
        self.resolve(seq)
        self.idle(seq)

    # ------------------------------------------------------------------ lifecycle

    def lane_sequence(self, lane_tag: int) -> int | None:
        """The sequence handle a live lane owns, or None."""
        lane = self.lanes.get(lane_tag)
        return None if lane is None else lane.handle

    def sequence_create(self) -> int:
        """A new empty bare sequence (a restore target); EngineError(EBUSY) when the spare
        sequences are used up."""
        if not self._spare_left():
            raise EngineError(Status.EBUSY, "every spare sequence is in use")
        b = BareSeq(self.new_handle(), self.cells.take_seq())
        self.bare[b.handle] = b
        return b.handle

    def sequence_free(self, seq: int) -> None:
        """Free a bare sequence: ERR_UNKNOWN_HANDLE for unknown, lane-owned, adopted or freed
        handles (ABI rule 112), EBUSY while an op runs on it."""
        b = self.bare_of(seq)
        self.idle(seq)
        del self.bare[seq]
        self.cells.free_seq(b.seq)

    def seq_fork(self, parent: int, flags: int = 0) -> int:
        """A bare sequence sharing every cell of ``parent`` (lane or bare; refcounted, zero-copy;
        EBUSY during an op or when the spare sequences are used up)."""
        seq, b = self.resolve(parent)
        self.idle(parent)
        if not self._spare_left():
            raise EngineError(Status.EBUSY, "every spare sequence is in use")
        child = BareSeq(self.new_handle(), self.cells.take_seq())
        n = self.cells.length(seq)
        if n:
            self.cells.copy(seq, child.seq, n)
        if b is not None:
            child.provenance, child.taint, child.pending = b.provenance, b.taint, b.pending
        else:
            lane = self.lane_of(parent)
            child.pending = lane.pending_tokens
            child.provenance = prefix_digest(self.model_id, lane.tokens[: n + child.pending])
            child.taint = lane.taint
        self.bare[child.handle] = child
        return child.handle

    def sequence_publish(self, seq: int, tokens: np.ndarray) -> None:
        """Publish a bare sequence's whole-page prefix under ``tokens`` and consume it (ABI rule
        91). ERR_UNKNOWN_HANDLE for anything but an idle bare sequence (EBUSY during an op),
        ERR_OUT_OF_BOUNDARY when ``tokens`` claims more than the sequence holds, REJECT_BOUNDS for
        ids outside the vocabulary, EBUSY when the cache is full; on error nothing changes. A
        sub-page sequence publishes nothing and is still consumed."""
        tokens = np.asarray(tokens, dtype=np.int64)
        b = self.bare_of(seq)
        self.idle(seq)
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
        del self.bare[seq]
        self.seeds.publish(b.seq, tokens.astype(np.int32), min(tokens.shape[0], kv), b.taint, None, None)

    def seed_adopt(self, seq: int, span: TokenRef) -> int:
        """Lease bare sequence ``seq`` whole as the seed of one admit whose prompt starts with
        ``span`` (prompt-ring tokens; ABI rule 86): ERR_UNKNOWN_HANDLE for a lane's or unknown
        sequence, EBUSY during an op, ERR_SEED_UNSERVABLE when ``span`` is empty or not exactly
        the sequence's length, REJECT_BAD_REF_GENERATION for a stale span."""
        toks = self.rings.read_prompt(span).astype(np.int32)
        b = self.bare_of(seq)
        self.idle(seq)
        n = self.cells.length(b.seq) + b.pending
        if toks.shape[0] == 0 or toks.shape[0] != n:
            raise EngineError(
                Status.ERR_SEED_UNSERVABLE, f"span of {toks.shape[0]} over a {n}-token sequence"
            )
        del self.bare[seq]
        return self.seeds.adopt(b, toks)

    def snapshot_boundary(self, seq: int, space_id: int, cap: int) -> int:
        """The longest whole-page length <= ``cap`` (and <= the valid length) whose prefix a seed
        could serve with its sliding window intact, 0 when none (ABI rule 111)."""
        check_space(space_id)
        s, _ = self.resolve(seq)
        page = self.seeds.page
        q = (min(cap, self.cells.length(s)) // page) * page
        pmin, pmax = self.cells.pos_range(s)
        # Servability only gets harder for shorter prefixes: the longest page multiple or nothing.
        return q if q > 0 and prefix_servable(pmin, pmax, q, self.seeds.n_swa) else 0

    def trim(self, seq: int, space_id: int, new_len: int) -> None:
        """Trim a bare sequence to ``new_len`` tokens (any length for paged KV, ABI rule 109):
        REJECT_BOUNDS past the valid length, EBUSY for a lane's sequence or during an op."""
        check_space(space_id)
        s, b = self.resolve(seq)
        if b is None:
            raise EngineError(Status.EBUSY, "a lane's sequence is trimmed by its plan, not here")
        self.idle(seq)
        kv = self.cells.length(s)
        if not 0 <= new_len <= kv + b.pending:
            raise EngineError(Status.REJECT_BOUNDS, f"trim to {new_len} past the valid length")
        b.pending = max(0, new_len - kv)
        self.cells.truncate(s, new_len)  # past the KV (a pending token): no cell changes
        b.gen += 1
