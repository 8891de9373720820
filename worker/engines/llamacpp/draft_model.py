"""Draft-model speculation on the llama.cpp engine: a second GGUF with the target's vocabulary
drafts tokens greedily for the lanes of a certified "draft-model" slot, greedy and sampled alike
(tick ABI §2; RULES.md section I, rules 114-122; ``basertd.worker.engines.draft`` for the
registration).

The drafts are the draft model's argmax chain given a lane's committed tokens: no RNG, so a
proposal is fixed by the lane's history and never depends on the uniform the target verifies it
with. That is what the sampled certificate's rejection rule needs (``speculation``: a one-hot
proposal, accepted with probability ``p(d)``), exactly as for prompt lookup; the slot's greedy and
sampled certificates are both bound to the one loaded draft model (``DraftHost.bind``).

Registration (``DraftHost.open``) refuses with ERR_REGISTRATION_REFUSED, loading nothing that
stays, when the registration does not carry exactly one DRAFT_WEIGHTS artifact, its config record
does not decode, the file does not load (missing, not a GGUF, a recurrent / hybrid / encoder
model), or its vocabulary differs from the target's. Vocabularies are compared by ``n_vocab`` and
then ``vocab_digest``: xxh3-128 over the vocabulary type, the BOS and EOS ids and every token's
text and attribute bits, so two models agree exactly when every id means the same piece (a draft
with another tokenizer would draft ids the target reads as other text: never wrong, since
verification commits the target's tokens, but never accepted either).

Each loaded draft model gets a ``llama_context`` of its own: one sequence per lane (``lanes``
sequences), a unified KV cache of ``lanes * context_length`` cells (each lane may need its whole
context), one thread per llama.cpp call as the engine's context has. Its memory is the file's size
plus those cells at the draft's K+V bytes per token (``nbytes``; the engine's stats report it as
``draft_bytes``).

Drafting (``DraftModel.draft``), for the lanes ``speculation.Speculator.plan`` chose with their
bounded draft lengths ``m``: each lane's draft sequence holds the KV of a prefix of its tokens
(``_LaneDraft``: the tokens it holds, positions ``0 .. n - 1``). It is cut back to the longest
prefix it shares with the lane's committed tokens (drafts the target rejected are dropped there,
``llama_memory_seq_rm``) but one, and the rest is fed in one batch over all drafting lanes (the
prompt on a lane's first round, then the tokens committed since), whose last row per lane gives
the first draft; then ``m - 1`` more single-token decodes, batched over the lanes still drafting,
each the argmax of the draft's logits (no bias, no penalties: the target verifies). The sequence
then holds the lane's tokens and drafts ``1 .. m - 1``. A llama_decode that fails empties the
drafting lanes' sequences and drafts nothing that round (the lane decodes plainly; the next round
feeds it again).

A lane's draft sequence is released (``forget_gone``) at the start of the first tick's rounds
after the lane left the engine (retired, cancelled, preempted, faulted): a draft sequence belongs
to one ``Lane`` object, never to a tag alone.

What drafting costs (``step_ratio``): each ``draft`` call is timed, per ``llama_decode`` it made
(the feed and the ``m - 1`` single-token steps), into a window per number of drafting lanes; its
median over the target's plain step of as many lanes (``verify_cost.VerifyCost.plain_ns``) is what
one drafted token costs in the target's plain steps, which the verify cost of a draft-model lane
adds per draft (``speculation.Speculator.verify``): a draft model is not free, and one as slow as
the target never pays.
"""

from __future__ import annotations

import heapq
import statistics
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llama_cpp as L
import numpy as np
import xxhash

from basertd.schema.abi import ArtifactRole, Status
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.draft import DraftConfig
from basertd.worker.engines.llamacpp.batch import BatchDecodeError, TokenBatch
from basertd.worker.engines.llamacpp.model import LlamaModel

if TYPE_CHECKING:
    from basertd.native.abi import StrategyRegistration
    from basertd.worker.engines.llamacpp.lane import Lane

_N_BATCH = 512


def _refused(why: str) -> EngineError:
    return EngineError(Status.ERR_REGISTRATION_REFUSED, why)


def vocab_digest(model: LlamaModel) -> str:
    """Hex xxh3-128 of ``model``'s vocabulary: its type, ``n_vocab``, BOS and EOS ids, and every
    token's text and attribute bits, in id order (one pass over the vocabulary: 0.5 s for the
    default model's 262,144 tokens here)."""
    v = model.vocab
    h = xxhash.xxh3_128()
    h.update(
        struct.pack("<4i", L.llama_vocab_type(v), model.n_vocab, L.llama_vocab_bos(v), L.llama_vocab_eos(v))
    )
    text, attr = L.llama_vocab_get_text, L.llama_vocab_get_attr
    for t in range(model.n_vocab):
        h.update(text(v, t) or b"")
        h.update(b"\0" + int(attr(v, t)).to_bytes(4, "little", signed=True))
    return h.hexdigest()


@dataclass(eq=False)
class _LaneDraft:
    """One lane's draft sequence: ``seq`` its id, ``toks[:n]`` the tokens whose KV it holds at
    positions ``0 .. n - 1`` (int32, capacity the lane's context)."""

    lane: Lane
    seq: int
    toks: np.ndarray
    n: int = 0


STEP_WINDOW = 15
"""Timed draft calls per number of drafting lanes whose median is that size's draft step."""
MIN_STEPS = 3
"""Timed draft calls of a size before its step is used (until then drafting counts as free)."""


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int32 arrays."""
    k = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if diff.size else k


class DraftModel:
    """One loaded draft model and its context (module docstring). ``path`` the GGUF, ``target``
    the engine's model (whose vocabulary it must share; ``target_vocab`` its ``vocab_digest``),
    ``lanes`` sequences of up to ``context_length`` tokens. Raises
    EngineError(ERR_REGISTRATION_REFUSED) with nothing left loaded when the file does not load, the
    vocabularies differ or llama.cpp cannot create the context."""

    def __init__(
        self,
        path: str,
        target: LlamaModel,
        target_vocab: str,
        *,
        lanes: int,
        context_length: int,
        n_threads: int,
        n_threads_batch: int,
        n_gpu_layers: int = 0,
    ) -> None:
        try:
            self.model = model = LlamaModel(path, n_gpu_layers=n_gpu_layers)
        except (EngineError, OSError) as exc:  # OSError: a file that cannot be read
            raise _refused(f"draft model {path}: {exc}") from None
        self.ctx = None
        try:
            if model.n_vocab != target.n_vocab:
                raise _refused(f"draft model {path}: {model.n_vocab} tokens, the target has {target.n_vocab}")
            if vocab_digest(model) != target_vocab:
                raise _refused(f"draft model {path}: its vocabulary differs from the target's (token texts)")
            n_batch = max(_N_BATCH, lanes)
            cp = L.llama_context_default_params()
            cp.n_ctx = max(-(-(lanes * context_length) // 256) * 256, 256)
            cp.n_batch = n_batch
            cp.n_ubatch = n_batch
            cp.n_seq_max = lanes
            cp.n_threads = n_threads
            cp.n_threads_batch = n_threads_batch
            cp.kv_unified = True
            cp.swa_full = True
            cp.no_perf = True
            self.ctx = L.llama_init_from_model(model.ptr, cp)
            if not self.ctx:
                raise _refused(f"draft model {path}: llama.cpp cannot create its context")
        except BaseException:
            self.close()
            raise
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = model.n_vocab
        self.context_length = context_length
        self.n_batch = int(L.llama_n_batch(self.ctx))
        self.nbytes = model.path.stat().st_size + int(L.llama_n_ctx(self.ctx)) * model.kv_bytes_per_token
        self.free_seqs = list(range(lanes))
        self.lanes: dict[int, _LaneDraft] = {}  # lane tag -> its draft sequence
        self.batch = TokenBatch(max(64, lanes), self.n_batch)
        self.failures = 0  # llama_decode calls that failed (their rounds drafted nothing)
        self._step_ns: dict[int, deque[float]] = {}  # drafting lanes -> ns per llama_decode
        self._last_lanes = 0  # drafting lanes of the last timed call
        self.last_ratio = 0.0  # the last ``step_ratio``, for stats

    # ------------------------------------------------------------------ sequences

    def _seat(self, lane: Lane) -> _LaneDraft | None:
        """``lane``'s draft sequence, taken on its first use; None when every sequence is held
        (more drafting lanes than ``lanes``: that lane drafts nothing)."""
        st = self.lanes.get(lane.tag)
        if st is not None and st.lane is lane:
            return st
        if st is not None:
            self._release(st)
        if not self.free_seqs:
            return None
        st = _LaneDraft(lane, heapq.heappop(self.free_seqs), np.zeros(self.context_length, np.int32))
        self.lanes[lane.tag] = st
        return st

    def _release(self, st: _LaneDraft) -> None:
        L.llama_memory_seq_rm(self.mem, st.seq, -1, -1)
        heapq.heappush(self.free_seqs, st.seq)
        del self.lanes[st.lane.tag]

    def forget_gone(self, live: Mapping[int, Lane]) -> None:
        """Release the draft sequence of every lane no longer in ``live`` (the engine's lanes by
        tag) or replaced there by another lane object."""
        for tag, st in list(self.lanes.items()):
            if live.get(tag) is not st.lane:
                self._release(st)

    # ------------------------------------------------------------------ drafting

    def draft(self, want: list[tuple[Lane, int]], live: Mapping[int, Lane]) -> dict[int, np.ndarray]:
        """Greedy drafts for ``want`` (lane, m >= 1 tokens; each lane's ``n_tokens`` committed
        tokens, its last one not yet forwarded by the target): by lane tag, ``m`` int32 token ids
        each (module docstring). ``live`` is the engine's lanes (gone lanes are released first).
        Lanes without a draft sequence, and every lane when a llama_decode fails, are absent."""
        self.forget_gone(live)
        runs: list[tuple[_LaneDraft, Lane, int, int]] = []  # state, lane, m, batch row of its logits
        rows = 0
        seated = []
        for lane, m in want:
            st = self._seat(lane)
            if st is None or m <= 0:
                continue
            n = lane.n_tokens
            keep = min(_common(st.toks[: st.n], lane.tokens[:n]), n - 1)
            if st.n > keep:
                L.llama_memory_seq_rm(self.mem, st.seq, keep, -1)
                st.n = keep
            seated.append((st, lane, m, keep))
            rows += n - keep
        if not seated:
            return {}
        t0 = time.perf_counter_ns()
        steps = max(m for _, _, m, _ in seated)  # llama_decode calls a full draft makes
        b = self.batch
        if rows > b.capacity:
            self.batch = b = TokenBatch(max(rows, 2 * b.capacity), self.n_batch)
        b.clear()
        for st, lane, m, keep in seated:
            runs.append((st, lane, m, b.add(lane.tokens[keep : lane.n_tokens], keep, st.seq, True)))
        out = {lane.tag: np.empty(m, np.int32) for _, lane, m, _ in runs}
        if not self._decode(runs, out, 0):
            return {}
        for st, lane, _, _ in runs:
            n = lane.n_tokens
            st.toks[st.n : n] = lane.tokens[st.n : n]
            st.n = n
        for j in range(1, max(m for _, _, m, _ in runs)):
            step = [r for r in runs if r[2] > j]
            b.clear()
            step = [
                (st, lane, m, b.add(out[lane.tag][j - 1 : j], st.n, st.seq, True)) for st, lane, m, _ in step
            ]
            if not self._decode(step, out, j):
                return {}
            for st, lane, _, _ in step:
                st.toks[st.n] = out[lane.tag][j - 1]
                st.n += 1
        window = self._step_ns.get(len(seated))
        if window is None:
            window = self._step_ns[len(seated)] = deque(maxlen=STEP_WINDOW)
        window.append((time.perf_counter_ns() - t0) / steps)
        self._last_lanes = len(seated)
        return out

    def step_ratio(self, plain_ns: Callable[[int], float | None]) -> float:
        """One drafted token's cost in the target's plain decode steps (module docstring): the
        median draft step of the last call's lane count over ``plain_ns`` of that count; 0.0
        until both are known (``MIN_STEPS`` timed calls)."""
        window = self._step_ns.get(self._last_lanes)
        plain = plain_ns(self._last_lanes) if window is not None and len(window) >= MIN_STEPS else None
        if window is None or plain is None or plain <= 0:
            return 0.0
        self.last_ratio = float(statistics.median(window)) / plain
        return self.last_ratio

    def _decode(
        self, runs: list[tuple[_LaneDraft, Lane, int, int]], out: dict[int, np.ndarray], j: int
    ) -> bool:
        """Decode the batch; ``out[tag][j]`` = the argmax of each run's logits row. False (every
        run's sequence emptied) when llama.cpp fails."""
        n_vocab = self.n_vocab
        ctx = self.ctx

        def on_part(start: int, end: int) -> None:
            for _, lane, _, row in runs:
                if start <= row < end:
                    ptr = L.llama_get_logits_ith(ctx, row - start)
                    out[lane.tag][j] = int(np.argmax(np.ctypeslib.as_array(ptr, (n_vocab,))))

        try:
            self.batch.decode(ctx, on_part)
        except BatchDecodeError:
            self.failures += 1
            for st, _, _, _ in runs:
                L.llama_memory_seq_rm(self.mem, st.seq, -1, -1)
                st.n = 0
            return False
        return True

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Free the context and the weights; idempotent."""
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        self.model.close()


class DraftHost:
    """The draft models of one engine: ``open`` loads one for a registration, ``bind`` makes it the
    drafter of a certificate (``sources``: cert id -> drafter, what ``speculation.Speculator``
    reads; a slot's certificates, greedy and sampled, all map to its one drafter, so every reader
    goes over the distinct drafters, ``set(sources.values())``), ``close`` frees each once.
    ``target`` is the engine's model; ``lanes``, ``context_length`` and threads size each draft
    context as the engine's."""

    def __init__(
        self,
        target: LlamaModel,
        *,
        lanes: int,
        context_length: int,
        n_threads: int,
        n_threads_batch: int,
        n_gpu_layers: int = 0,
    ) -> None:
        self.target = target
        self.kw = dict(
            lanes=lanes,
            context_length=context_length,
            n_threads=n_threads,
            n_threads_batch=n_threads_batch,
            n_gpu_layers=n_gpu_layers,
        )
        self.sources: dict[int, DraftModel] = {}
        self._target_vocab: str | None = None

    def open(self, reg: StrategyRegistration, raw_config: bytes) -> tuple[DraftConfig, DraftModel]:
        """The config (``raw_config``, the PROPOSAL_LINEAR record) and the loaded draft model of a
        "draft-model" registration. Raises EngineError(ERR_REGISTRATION_REFUSED), nothing loaded,
        for anything but one DRAFT_WEIGHTS artifact, a config that does not decode, or a draft that
        ``DraftModel`` refuses."""
        if len(reg.artifacts) != 1 or reg.artifacts[0].role != ArtifactRole.DRAFT_WEIGHTS:
            raise _refused("draft-model takes exactly one DRAFT_WEIGHTS artifact")
        try:
            cfg = DraftConfig.from_params(raw_config)
        except ValueError as exc:
            raise _refused(f"draft-model config: {exc}") from None
        if self._target_vocab is None:
            self._target_vocab = vocab_digest(self.target)
        path = str(reg.artifacts[0].load_path)
        return cfg, DraftModel(path, self.target, self._target_vocab, **self.kw)

    def bind(self, cert_id: int, drafter: DraftModel) -> None:
        """``drafter`` drafts for lanes admitted under certificate ``cert_id`` (one drafter may be
        bound to several certificates: the lanes of all of them share its sequences)."""
        self.sources[cert_id] = drafter

    def stats(self) -> dict[str, int]:
        """Over every bound drafter: ``draft_models``, ``draft_bytes`` (weights files + KV caches,
        bytes), ``draft_sequences`` (lanes holding a draft sequence), ``draft_failures_total``
        (draft llama_decode calls that failed) and ``draft_step_permille`` (the largest last
        ``step_ratio``: a drafted token's cost in thousandths of a target step)."""
        ds = set(self.sources.values())
        return {
            "draft_models": len(ds),
            "draft_bytes": sum(d.nbytes for d in ds),
            "draft_sequences": sum(len(d.lanes) for d in ds),
            "draft_failures_total": sum(d.failures for d in ds),
            "draft_step_permille": max((round(d.last_ratio * 1000) for d in ds), default=0),
        }

    def close(self) -> None:
        """Free every draft model; idempotent."""
        for d in set(self.sources.values()):
            d.close()
        self.sources.clear()
