"""``LlamaCppEngine``: the Engine protocol over one llama.cpp context (DESIGN.md "Engines").

One ``llama_context`` with a unified KV cache of ``pool_tokens`` cells and ``n_seq_max`` = lanes +
cache sequences + spare sequences. Each lane owns one sequence id; a tick runs retires, commits,
admits, prefills, decodes (ABI rule 53) and puts every decoding lane of a round in one
``llama_decode``, with the tick's prefill chunks packed behind them in the same batch. A grant of
k tokens runs k rounds; the tick's prefill is spread evenly over them (``_feed_room``), so a lane
decoding beside a long prefill gets a token every round instead of waiting for all of it. Tokens
are chosen on the host from each lane's logits row (``sampling``); HOST lanes get the row in the
logits ring instead.

Semantics this engine fixes where the ABI leaves a choice:

- ``prefill_token_budget`` and ``max_decode_lanes`` are literal: 0 means none.
- A lane stops with EOS on any end-of-generation token unless IGNORE_EOS (rule 68), with LENGTH when
  it holds ``context_length`` tokens; retiring a lane that has not stopped emits CANCELLED; a lane
  fault emits ERROR with a fault record (rules 60-62).
- HOST commits are not echoed in emits: a HOST lane's emits carry n_tokens 0 and the logits row
  (rule 65); a committed end-of-generation token finishes the lane with an EOS emit.
- Internal work the coordinator did not plan (the cold prefill after a lost sliding window, the
  re-decode of a fully cached prompt's last token) is not charged to the prefill budget.
- KV feasibility is checked against a cell ledger (``pool``) that mirrors llama.cpp's cells and
  sharing exactly; every committed token is charged a cell when committed (its KV follows at the
  next decode unit). NEEDS_REPLAN when retires and the shed envelope's evictions cannot make room
  (rules 50-52). Lanes are never shed; a decode grant of 0 is ILLEGAL_COMBINATION and grants that
  could overflow the emit ring are BOUNDS, as in the reference engine.
- A lane's sequence holds the KV of every committed token but the last sampled one (computed by the
  next decode); forks of a lane carry that token as pending, so lengths agree with the reference
  engine's committed count.
- Publishing when ``cache_sequences`` entries exist first evicts the least recently used unpinned
  entry the plan's shed envelope allows; if none, the retire publishes nothing.
- State ops complete at the start of the next accepted tick and are reported in its
  op_completions, as in the reference engine.

Output depends on batch composition and, through the order of llama.cpp's sums over KV cells, on
where cells sit in the cache; two runs are bit-identical when both match (tests compare with a bare
loop from an empty cache, and elsewhere allow divergence only at a near-tie of the reference).

Yield inside a tick (``basertd.shm.control``): a tick's work is split into steps, one
``llama_decode`` of at most ``yield_step_tokens`` rows each (default n_ubatch). With a control
segment attached, the yield word is read before every step but the tick's first (and before every
decode round after the first, unless a decoding lane is in its replay tail, whose units emit
nothing and so must all run); once it is set the tick ends with what it has done: the planned
prefill that did not run is reported exactly as a budget-shed chunk (one PREFILL_CHUNK entry per
lane, tokens = planned - done; ABI rules 56, 57) and the lane resumes at the offset reached; lanes
whose prefill was cut do not decode; decode lanes keep the tokens they have (finish NONE). KV the
coordinator already counts as prefilled (cold fallback, a cached prompt's last token) is never cut.
An urgent yield (an arrival that outranks the tick, a cancel, a drain) does not wait for the step
boundary: llama.cpp's abort callback (``abort.AbortWatch``) ends the step in flight, whose KV
llama.cpp drops, and the tick ends as above (``_arm_abort`` says which steps may be cut so that
every two ticks make progress); the inter-token bound's yield waits for the boundary.

Capabilities (``base.Capability``): everything but HOST_TIER (no host tier for llama.cpp KV:
demote and promote answer ERR_OP_UNSUPPORTED after the checks every op makes).

Test hooks live outside this module: ``hooks`` is None in production; tests install a
``basertd.worker.engines.llamacpp.hooks.LaneTestHooks`` (fault injection, forced finishes, as the
reference engine's ``baseRT_ref_*`` calls), applied at one point of ``tick`` after the retires.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import llama_cpp as L
import numpy as np

from basertd.schema.abi import (
    ALL_SPACES,
    AdmitStatus,
    DeterminismClass,
    FaultCode,
    Finish,
    Sampling,
    ShedKind,
    SpaceKind,
    Status,
    TickStatus,
    Tier,
)
from basertd.schema.tick import (
    AdmitResult,
    CacheKey,
    LaneEmit,
    LaneFault,
    LaneLogprob,
    MatchCandidate,
    MatchResult,
    MemCounters,
    OpStatus,
    RingRef,
    ShedEntry,
    ShedPolicy,
    SpaceMatch,
    StateSpaceDesc,
    TickEvents,
    TickPlan,
    TickTimings,
    TokenRange,
    TokenRef,
)
from basertd.shm import RingError
from basertd.worker.engines.base import (
    Engine,
    EngineError,
    EngineFatal,
    EngineInfo,
    PartialEmit,
    PlanRejected,
    RingMapping,
    TokenizerSpec,
)
from basertd.worker.engines.llamacpp import sampling
from basertd.worker.engines.llamacpp.abort import AbortWatch
from basertd.worker.engines.llamacpp.batch import BatchDecodeError, TokenBatch
from basertd.worker.engines.llamacpp.grammar import GrammarSet
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.model import LlamaModel
from basertd.worker.engines.llamacpp.ops import StateOps
from basertd.worker.engines.llamacpp.pool import CellLedger
from basertd.worker.engines.llamacpp.prefix_cache import (
    CacheEntry,
    Lease,
    PrefixCache,
    common_prefix,
    prefix_digest,
    prefix_servable,
    window_intact,
)
from basertd.worker.engines.llamacpp.rates import RateCurve
from basertd.worker.engines.llamacpp.rings import EngineRings
from basertd.worker.engines.llamacpp.state import compat_identity
from basertd.worker.engines.llamacpp.validate import (
    SHED_REASON_BUDGET,
    SHED_REASON_POOL,
    SHED_REASON_PUBLISH,
    AdmitWork,
    TickWork,
    validate_plan,
)

if TYPE_CHECKING:
    from basertd.worker.engines.llamacpp.hooks import LaneTestHooks

KV_SPACE_ID = 0
"""space_id of the engine's one state space (PAGED_TOKEN_KV)."""

_U32 = (1 << 32) - 1


def _u32_status(status: Status) -> int:
    return int(status) & _U32  # ABI rule 15: two's-complement bits


MIN_ROUND_FEED = 64
"""A tick's prefill of at most this many rows is not spread over its decode rounds: it goes whole
in the first (a short prompt's first token is not delayed by rounds of a few rows each). A longer
one is spread evenly, so the rounds the grants allow are all used and none is decode-only."""


class _TickScratch:
    """Per-tick working state: grants left, tokens and logprobs per lane, rows, faults."""

    def __init__(self, ev: TickEvents, on_partial_emit: PartialEmit | None) -> None:
        self.ev = ev
        self.on_partial = on_partial_emit
        self.grant: dict[int, int] = {}
        self.start_tokens: dict[int, int] = {}
        self.rows: dict[int, RingRef] = {}
        self.finish: dict[int, int] = {}
        self.emit_order: list[int] = []
        self.fresh: dict[int, list[int]] = {}
        self.fault_lanes: dict[int, Lane] = {}
        self.prefill_ns = 0
        self.decode_ns = 0
        self.floor: dict[int, int] = {}  # lane tag -> prefilled before this tick's chunk
        self.min_rows = 0  # rows of the batch in flight that a yield may not cut
        self.steps = 0  # llama_decode calls so far
        self.yielded = False
        self.replaying = False  # a decoding lane of the round in flight is in its replay tail
        self.clear_at_start = True  # the yield word was clear when the tick began
        self._noted: set[int] = set()

    def note(self, tag: int) -> None:
        """Give ``tag`` an emit record this tick (once, in first-noted order)."""
        if tag not in self._noted:
            self._noted.add(tag)
            self.emit_order.append(tag)


class LlamaCppEngine(Engine):
    """The llama.cpp engine adapter (``basertd.worker.engines.base.Engine``).

    Sizes are tokens unless named ``_bytes``: ``lanes`` concurrent lanes (also the most decodes per
    tick), ``context_length`` tokens per lane (prompt + generated), ``pool_tokens`` KV cells in all
    (default ``lanes * context_length``; published prefixes live in what lanes leave free),
    ``page_size_tokens`` the paging unit of matches and seeds (ABI rule 88), ``cache_sequences``
    the most published prefixes kept, ``spare_sequences`` bare sequences for restores and forks,
    ``seed_lease_ticks`` the lease TTL (rule 84). ``n_threads`` / ``n_threads_batch`` go to
    llama.cpp (single-token / multi-token batches). ``n_batch`` caps one ``llama_decode``.
    ``swa_full`` keeps a full-size sliding-window cache (the C default; see the reference notes).
    ``yield_step_tokens`` rows per llama_decode (the yield granularity; default n_ubatch).
    ``repack`` False loads the weights without llama.cpp's CPU repacking (``LlamaModel``).

    Raises EngineError(ERR_FATAL) when the model or context cannot be created, ValueError for
    sizes llama.cpp cannot serve (more than 256 sequences, an empty pool). A pool smaller than
    ``lanes * context_length`` is fine: plans that would overfill it get NEEDS_REPLAN."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        lanes: int = 8,
        context_length: int = 2048,
        n_threads: int = 1,
        n_threads_batch: int | None = None,
        page_size_tokens: int = 16,
        cache_sequences: int | None = None,
        spare_sequences: int = 4,
        pool_tokens: int | None = None,
        seed_lease_ticks: int = 8,
        n_batch: int = 512,
        n_ubatch: int = 512,
        swa_full: bool = True,
        n_gpu_layers: int = 0,
        yield_step_tokens: int | None = None,
        repack: bool = True,
    ) -> None:
        if lanes < 1 or context_length < 2 or page_size_tokens < 1 or seed_lease_ticks < 0:
            raise ValueError("lanes >= 1, context_length >= 2, page_size_tokens >= 1 required")
        cache_sequences = max(4, lanes) if cache_sequences is None else cache_sequences
        n_seq_max = lanes + cache_sequences + spare_sequences + 1  # + 1 scratch sequence
        if n_seq_max > L.llama_max_parallel_sequences():
            raise ValueError(f"{n_seq_max} sequences exceed llama.cpp's {L.llama_max_parallel_sequences()}")
        pool_tokens = lanes * context_length if pool_tokens is None else pool_tokens
        if pool_tokens < 1:
            raise ValueError("pool_tokens must be >= 1")
        # llama.cpp reserves graphs with one output per sequence: n_batch (clamped to n_ctx) must
        # cover n_seq_max, or context creation hits a GGML_ASSERT. Cells are padded to 256 anyway.
        n_batch = max(n_batch, lanes, n_seq_max)
        self.model = LlamaModel(model_path, n_gpu_layers=n_gpu_layers, repack=repack)
        cp = L.llama_context_default_params()
        cp.n_ctx = max(-(-pool_tokens // 256) * 256, -(-n_batch // 256) * 256)
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_ubatch, n_batch)
        cp.n_seq_max = n_seq_max
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads if n_threads_batch is None else n_threads_batch
        cp.kv_unified = True
        cp.swa_full = swa_full
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model.ptr, cp)
        if not self.ctx:
            self.model.close()
            raise EngineError(Status.ERR_FATAL, "llama.cpp cannot create the context")
        self._ctx_params = {
            "n_ctx": cp.n_ctx,
            "n_batch": n_batch,
            "n_ubatch": cp.n_ubatch,
            "n_seq_max": n_seq_max,
            "n_threads": cp.n_threads,
            "n_threads_batch": cp.n_threads_batch,
            "kv_unified": True,
            "swa_full": swa_full,
        }
        self.mem = L.llama_get_memory(self.ctx)
        # llama.cpp pads n_ctx up to a multiple of 256; the pool is what was asked for, which the
        # ledger then enforces (never more than llama.cpp actually has).
        self.n_cells = min(pool_tokens, int(L.llama_n_ctx(self.ctx)))
        self.n_batch = int(L.llama_n_batch(self.ctx))
        # One step = one llama_decode of at most step_rows rows: where a tick may yield.
        step = int(L.llama_n_ubatch(self.ctx)) if yield_step_tokens is None else yield_step_tokens
        if step < 1:
            raise ValueError("yield_step_tokens must be >= 1")
        self.step_rows = max(lanes, min(self.n_batch, step))  # a round's decode rows: one step
        self._control = None
        self._abort: AbortWatch | None = None
        self._first_step_aborted = False  # the last tick's first step was aborted
        self.n_ubatch = int(L.llama_n_ubatch(self.ctx))
        self.rates = RateCurve()
        self.max_lanes = lanes
        self.context_length = context_length
        self.page = page_size_tokens
        self.n_vocab = self.model.n_vocab
        self.n_swa = self.model.n_swa
        self.bytes_per_token = self.model.kv_bytes_per_token
        self.seed_ttl = seed_lease_ticks
        self.cache_sequences = cache_sequences
        self.spare_sequences = spare_sequences
        # What decides whether a sequence blob loads: the weights, KV types, one unified stream,
        # the sliding-window cache layout and llama.cpp's state format (its version). Not the pool
        # size, so a respawned worker with another pool still restores.
        self.identity = compat_identity(self.model.model_id, "kv-f16", "unified", swa_full, L.__version__)
        # llama.cpp sequence ids: the highest is the scratch sequence (prefix exports).
        self.scratch_seq = n_seq_max - 1
        self._free_seqs = list(range(n_seq_max - 1))
        heapq.heapify(self._free_seqs)
        self.ledger = CellLedger(self.n_cells)
        self.cache = PrefixCache(page_size_tokens, cache_sequences)
        self.rings = EngineRings()
        self.batch = TokenBatch(n_batch + lanes, self.step_rows)
        self.lanes: dict[int, Lane] = {}
        self.faulted: set[int] = set()
        self.locked: set[int] = set()
        self.logit_biases: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.grammars = GrammarSet(self.model, self.n_vocab, n_threads)
        self._next_bias = 1
        self._next_handle = 1
        self.last_plan_seq: int | None = None
        self.tick_index = 0
        self.ops = StateOps(self)
        self.hooks: LaneTestHooks | None = None  # tests only (module docstring)
        self._evictable_bytes = 0
        self._evictable_dirty = True
        self._stats = {
            "ticks": 0,
            "prefill_tokens_total": 0,
            "cached_tokens_total": 0,
            "decode_tokens_total": 0,
            "replay_tokens_total": 0,
            "evictions_total": 0,
            "faults_total": 0,
            "rejected_plans": 0,
            "cold_fallbacks_total": 0,
            "yields_total": 0,
            "yield_aborts_total": 0,
            "yield_abort_rows_total": 0,
        }
        self._closed = False

    # ------------------------------------------------------------------ static facts

    def info(self) -> EngineInfo:
        """Sizes, vocabulary and tokenizer of the loaded model (see the class docstring)."""
        m = self.model
        return EngineInfo(
            engine="llamacpp",
            engine_version=f"llama-cpp-python {L.__version__}",
            model=str(m.path),
            model_id=m.model_id,
            vocab_size=m.n_vocab,
            context_length=self.context_length,
            max_lanes=self.max_lanes,
            max_batch_size=self.max_lanes,
            page_size_tokens=self.page,
            pool_bytes=self.n_cells * self.bytes_per_token,
            seed_lease_ticks=self.seed_ttl,
            eos_token_ids=m.eog_ids,
            bos_token_id=m.bos_id,
            add_bos=m.add_bos,
            tokenizer=TokenizerSpec(kind="gguf", path=str(m.path)),
            extra={
                "arch": m.arch,
                "n_swa": str(self.n_swa),
                "kv_cells": str(self.n_cells),
                "n_batch": str(self.n_batch),
                "step_tokens": str(self.step_rows),
                "prefill_rounds": "spread",
                "description": m.description,
                **({"yield": "step"} if self._control is not None else {}),
            },
        )

    def prefill_curve(self) -> list[tuple[int, float]]:
        """Measured tokens per second of a llama_decode by row count, ``[(rows_bucket, tok_s)]``
        (``rates.RateCurve``); empty until the engine has run."""
        return self.rates.curve()

    def context_params(self) -> dict[str, int | bool]:
        """The llama_context_params this engine created its context with (for reference runs)."""
        return dict(self._ctx_params)

    def state_spaces(self) -> list[StateSpaceDesc]:
        """One PAGED_TOKEN_KV space (id 0): ``bytes_per_token`` is K+V over all layers at F16;
        forks share pages by reference. Sliding-window models keep the same descriptor; their
        window limits which cached prefixes are servable (``prefix_cache``)."""
        return [
            StateSpaceDesc(
                space_id=KV_SPACE_ID,
                kind=SpaceKind.PAGED_TOKEN_KV,
                version_tag=self.ops.version_tag,
                bytes_per_token=self.bytes_per_token,
                page_size_tokens=self.page,
                fork_cost_class=1,
                name=f"kv-swa{self.n_swa}" if self.n_swa else "kv",
            )
        ]

    def seed_lease_ticks(self) -> int:
        """The declared seed-lease TTL in ticks (ABI rule 84)."""
        return self.seed_ttl

    def stats(self) -> dict[str, int]:
        """Counters and gauges (the reference engine's names where it has them): ticks,
        last_plan_seq, prefill_tokens_total (seeded and replayed tokens excluded),
        cached_tokens_total (served by seeds), decode_tokens_total (sampled and HOST-committed),
        replay_tokens_total, live_lanes, live_seed_leases, grammar_handles (live grammar handles),
        live_logit_biases, cache_entries, bare_sequences,
        pool_bytes_used / _total, evictions_total, faults_total, rejected_plans,
        cold_fallbacks_total (seeds whose sliding window was lost), yields_total (ticks ended early
        by the yield word), and the measured rate curve (``rates.RateCurve.stats``:
        ``rate_tok_s_b<rows>`` per power-of-two llama_decode size)."""
        out = dict(self._stats)
        out.update(self.rates.stats())
        out.update(
            last_plan_seq=self.last_plan_seq or 0,
            bare_sequences=len(self.ops.bare) + len(self.ops.leased),
            live_lanes=len(self.lanes),
            live_seed_leases=len(self.cache.leases),
            grammar_handles=len(self.grammars),
            live_logit_biases=len(self.logit_biases),
            cache_entries=len(self.cache.entries),
            pool_bytes_used=self.ledger.used * self.bytes_per_token,
            pool_bytes_total=self.n_cells * self.bytes_per_token,
        )
        return out

    # ------------------------------------------------------------------ rings

    def attach_rings(self, rings: Sequence[RingMapping]) -> None:
        """Attach (or re-attach) the prompt, emit and optional logits rings; all or nothing
        (EngineError(ERR_RING_LAYOUT), ABI rule 125); writer cursors restart (rule 130)."""
        self.rings.attach(rings)

    def attach_control(self, control: object) -> bool:
        """Read ``control``'s yield word (a ``basertd.shm.ControlBlock``) between llama_decode
        calls: once it is set, the tick in flight ends after its current step (module docstring).
        Returns True (this engine can yield; its capability record then says ``yield = step``)."""
        self._control = control
        self._abort = AbortWatch.attach(self.ctx, control)
        return True

    # ------------------------------------------------------------------ sequence ids

    def _take_seq(self) -> int:
        if not self._free_seqs:
            raise EngineError(Status.EBUSY, "no free llama.cpp sequence id")
        return heapq.heappop(self._free_seqs)

    def _release_seq(self, seq: int) -> None:
        """Remove every cell of ``seq`` from llama.cpp and the ledger; the id becomes free."""
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.ledger.drop(seq)
        heapq.heappush(self._free_seqs, seq)
        self._evictable_dirty = True

    def _new_handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h

    def pos_range(self, seq: int) -> tuple[int, int]:
        """(pos_min, pos_max) llama.cpp reports for ``seq`` (the sliding-window cache on SWA
        models); (-1, -1) when empty."""
        return (
            int(L.llama_memory_seq_pos_min(self.mem, seq)),
            int(L.llama_memory_seq_pos_max(self.mem, seq)),
        )

    # ------------------------------------------------------------------ validation hooks

    def seed_source(self, lease: Lease) -> tuple[int, int, int, int]:
        """(seq id, length, pos_min, pos_max) of the sequence a lease serves from."""
        if lease.adopted:
            seq = self.ops.bare_seq(lease.adopted, leased=True)
        else:
            seq = self.cache.entries[lease.entry_id].seq
        pmin, pmax = self.pos_range(seq)
        return seq, self.ledger.length(seq), pmin, pmax

    def window_ok(self, pos_min: int, share_len: int) -> bool:
        """Whether a sequence holding ``[pos_min, ..]`` can be cut to ``share_len`` tokens and
        continue exactly (``prefix_cache.window_intact``)."""
        if share_len == 0:
            return True
        if pos_min > share_len - 1:
            return False
        return window_intact(pos_min, share_len - 1, share_len, self.n_swa)

    # ------------------------------------------------------------------ tick

    def tick(self, plan: TickPlan, on_partial_emit: PartialEmit | None = None) -> TickEvents:
        """Run one plan (ABI section E). Raises PlanRejected with no state change (sections C, D)
        or EngineFatal when llama.cpp reports an unrecoverable error. ``on_partial_emit`` is
        called on this thread with each lane's fresh tokens after every decode round (rule 64)."""
        if self._closed:
            raise EngineFatal(Status.ERR_FATAL, "engine is closed")
        t0 = time.perf_counter_ns()
        try:
            work = validate_plan(self, plan)
        except PlanRejected:
            self._stats["rejected_plans"] += 1
            raise
        self.last_plan_seq = plan.plan_seq
        ev = TickEvents(plan_seq=plan.plan_seq)
        sc = _TickScratch(ev, on_partial_emit)
        if self._abort is not None:  # only the abort callback's first-step rule needs this read
            sc.clear_at_start = not self._yield_requested()
        self.ops.run_pending()
        self._retire(work, sc)
        if self.hooks is not None:
            self.hooks.apply(sc)
        for e in work.evict:
            self._evict(e, sc, SHED_REASON_POOL)
        self._commit(work, sc)
        self._admit(work, sc)
        self._run_rounds(work, sc)
        if self._abort is not None:
            self._abort.disarm()
        self._finish_events(work, sc)
        self.tick_index += 1
        self._stats["ticks"] += 1
        self._expire_leases()
        ev.timings = TickTimings(
            wall_ns=time.perf_counter_ns() - t0, prefill_ns=sc.prefill_ns, decode_ns=sc.decode_ns
        )
        ev.mem = self._mem_counters()
        return ev

    # -- retires, commits, admits

    def _retire(self, work: TickWork, sc: _TickScratch) -> None:
        for tag, publish in work.retires:
            if tag in self.faulted:
                self.faulted.discard(tag)
                continue
            lane = self.lanes.pop(tag)
            if not lane.finished:
                sc.note(tag)
                sc.finish[tag] = Finish.CANCELLED
            lane.held_row = None
            if publish:
                self._publish(lane.seq, lane.tokens, lane.kv_len, lane.taint, work.plan.shed_policy, sc)
            else:
                self._release_seq(lane.seq)

    def _publish(
        self,
        seq: int,
        tokens: np.ndarray,
        kv_len: int,
        taint: int,
        policy: ShedPolicy | None,
        sc: _TickScratch | None,
    ) -> bool:
        """Hand ``seq`` to the prefix cache under ``tokens[:whole pages of kv_len]``; the sequence
        is consumed either way (kept as the entry, or freed when nothing is published). Returns
        True when an entry now serves those tokens (ABI rules 90, 91)."""
        n = (kv_len // self.page) * self.page
        if n == 0:
            self._release_seq(seq)
            return False
        toks = np.array(tokens[:n], dtype=np.int32)
        digest = prefix_digest(self.model.model_id, toks)
        same = self.cache.find_identical(digest, taint)
        if same is not None:
            self.cache.touch(same)
            self._release_seq(seq)
            return True
        L.llama_memory_seq_rm(self.mem, seq, n, -1)
        self.ledger.truncate(seq, n)
        pmin, pmax = self.pos_range(seq)
        if not prefix_servable(pmin, pmax, n, self.n_swa):
            self._release_seq(seq)  # its window is already gone: it could never seed a lane
            return False
        if len(self.cache.entries) >= self.cache.max_entries:
            victim = self._publish_victim(policy)
            if victim is None:
                self._release_seq(seq)
                return False
            self._evict(victim, sc, SHED_REASON_PUBLISH)
        self.cache.add(seq, toks, digest, taint)
        self._evictable_dirty = True
        return True

    def _publish_victim(self, policy: ShedPolicy | None) -> CacheEntry | None:
        if policy is None:
            return None
        cands = self.cache.eviction_order(policy.evictable_cache_classes)
        if not cands:
            return None
        total = self.ledger.freed_by([(e.seq, 0) for e in self.cache.entries.values()])
        cap = min(policy.max_evict_bytes, max(0, total * self.bytes_per_token - policy.protected_quota_bytes))
        for e in cands:
            if self.ledger.exclusive(e.seq) * self.bytes_per_token <= cap:
                return e
        return None

    def _evict(self, entry: CacheEntry, sc: _TickScratch | None, reason: int) -> int:
        """Drop a cache entry; returns the bytes freed and reports a CACHE_EVICTION shed entry
        when inside a tick (ABI rule 58)."""
        freed = self.ledger.exclusive(entry.seq) * self.bytes_per_token
        self.cache.remove(entry)
        self._release_seq(entry.seq)
        self._stats["evictions_total"] += 1
        if sc is not None:
            sc.ev.shed.entries.append(
                ShedEntry(
                    lane_tag=0, kind=ShedKind.CACHE_EVICTION, reason=reason, bytes=freed, tokens=entry.length
                )
            )
            sc.ev.shed.evictions_performed += 1
            sc.ev.shed.bytes_evicted += freed
        return freed

    def _commit(self, work: TickWork, sc: _TickScratch) -> None:
        for tag, token in work.commits:
            lane = self.lanes.get(tag)
            if lane is None:
                continue  # faulted by a test hook this tick
            lane.pending_nonce = 0
            lane.append(token)
            self._stats["decode_tokens_total"] += 1
            g_finish = self._grammar_consume(lane, token, sc)
            if g_finish < 0:
                continue
            if self.model.eog_mask[token] and not lane.cfg.ignore_eos:
                lane.finish = Finish.EOS
            elif g_finish == Finish.GRAMMAR:
                lane.finish = Finish.GRAMMAR
            elif lane.n_tokens >= self.context_length:
                lane.finish = Finish.LENGTH
            if lane.finished:
                sc.note(tag)
                sc.finish[tag] = lane.finish

    def _admit(self, work: TickWork, sc: _TickScratch) -> None:
        for w in work.admits:
            tag = w.rec.lane_tag
            if w.cert_reject:
                sc.ev.admit_results.append(
                    AdmitResult(
                        lane_tag=tag,
                        status=AdmitStatus.REJECTED,
                        reject_code=_u32_status(Status.REJECT_CERT_UNMATCHED),
                    )
                )
                continue
            self.lanes[tag] = self._make_lane(w)
            sc.ev.admit_results.append(
                AdmitResult(lane_tag=tag, status=AdmitStatus.ADMITTED, granted_class=w.granted)
            )

    def _make_lane(self, w: AdmitWork) -> Lane:
        a = w.rec
        n = w.prompt.shape[0]
        tokens = np.zeros(self.context_length, np.int32)
        tokens[:n] = w.prompt
        bias = self.logit_biases.get(a.logit_bias_handle) if a.logit_bias_handle else None
        cfg = sampling.SamplerConfig.from_admit(a.sampling, a.params, a.want_logprobs, bias)
        lease = w.lease
        taint = 0
        kv_len, prefilled, produced = w.kv_len, w.prefilled, w.produced
        cold = w.cold_fallback
        seq = self.ops.take_adopted(lease) if lease is not None and lease.adopted else self._take_seq()
        if lease is not None:
            self.cache.leases.pop(lease.handle, None)
            taint = lease.taint
            if lease.adopted:
                if not cold:
                    L.llama_memory_seq_rm(self.mem, seq, w.share_len, -1)
                    self.ledger.truncate(seq, w.share_len)
            else:
                entry = self.cache.entries[lease.entry_id]
                entry.pins -= 1
                self.cache.touch(entry)
                if not cold and w.share_len:
                    L.llama_memory_seq_cp(self.mem, entry.seq, seq, 0, w.share_len)
                    self.ledger.share(entry.seq, seq, w.share_len)
            if not cold and w.share_len and not window_intact(*self.pos_range(seq), w.share_len, self.n_swa):
                cold = True  # the shared window is not what it should be: never trust it
            if cold:
                L.llama_memory_seq_rm(self.mem, seq, -1, -1)
                if self.ledger.length(seq):
                    self.ledger.truncate(seq, 0)
                kv_len, produced = 0, w.prefill_end
                self._stats["cold_fallbacks_total"] += 1
            else:
                self._stats["cached_tokens_total"] += w.share_len
            self._evictable_dirty = True
        return Lane(
            tag=a.lane_tag,
            seq=seq,
            handle=self._new_handle(),
            tokens=tokens,
            n_tokens=n,
            prompt_len=n,
            prefill_end=w.prefill_end,
            prefilled=prefilled,
            kv_len=kv_len,
            produced=produced,
            sampling=Sampling(a.sampling),
            cfg=cfg,
            rng_base=a.rng_counter_base,
            determinism_class=a.determinism_class,
            taint=taint,
            seeded_tokens=0 if cold else w.share_len,
            grammar=self.grammars.lane_grammar(a.grammar_handle, w.prompt[n - a.grammar_replay :]),
        )

    # -- prefill and decode rounds

    def _run_rounds(self, work: TickWork, sc: _TickScratch) -> None:
        for tag, eff in work.prefills:
            lane = self.lanes.get(tag)
            if lane is not None:
                sc.floor.setdefault(tag, lane.prefilled)
                lane.prefilled += eff
        for tag, max_new in work.decodes:
            if tag in self.lanes:
                sc.grant[tag] = max_new
                sc.note(tag)
                sc.start_tokens[tag] = self.lanes[tag].n_tokens
        # Lanes with KV to catch up on before decoding: the plan's prefills in plan order, then
        # lanes whose admit needs internal feeding (cold fallback, re-decode of a cached prompt end).
        feed: list[Lane] = []
        seen: set[int] = set()
        for tag, _ in work.prefills:
            lane = self.lanes.get(tag)
            if lane is not None and tag not in seen and lane.kv_len < lane.prefilled:
                feed.append(lane)
                seen.add(tag)
        for w in work.admits:
            lane = self.lanes.get(w.rec.lane_tag)
            if lane is not None and lane.tag not in seen and lane.kv_len < lane.prefilled:
                feed.append(lane)
                seen.add(lane.tag)
        decode_order = [tag for tag, _ in work.decodes if tag in self.lanes]
        while True:
            active = [t for t in decode_order if sc.grant.get(t, 0) > 0 and t in self.lanes]
            if not active and not feed:
                break
            sc.replaying = self._replaying(active)
            if sc.steps and not sc.replaying and self._yield_requested():
                sc.yielded = True  # decode lanes keep the tokens they have (finish NONE)
                break
            self._grammar_fill(active)
            self._round(active, feed, sc)
            feed = [ln for ln in feed if ln.tag in self.lanes and ln.kv_len < ln.prefilled]
            if sc.on_partial is not None:
                for tag, toks in sc.fresh.items():
                    if toks:
                        sc.on_partial(tag, np.array(toks, dtype=np.uint32))
            sc.fresh.clear()
            if sc.yielded:
                break
        if sc.yielded:
            self._shed_cut_prefills(work, sc)

    def _replaying(self, tags: list[int]) -> bool:
        """Whether any of these lanes is still in its replay tail: replay units emit nothing (ABI
        rule 72), so the coordinator counts them from the grant, and the rounds must not be cut."""
        return any((ln := self.lanes.get(t)) is not None and ln.produced < ln.n_tokens for t in tags)

    def _arm_abort(self, start: int, sc: _TickScratch) -> None:
        """Before the batch part starting at row ``start``: let an urgent yield (an arrival that
        outranks the tick, a cancel, a drain; not the inter-token bound, which waits for the step
        boundary) abort that part mid-way, or not. A part is abortable when it is one ubatch, holds
        no rows a yield may not cut, no decoding lane of the round is in its replay tail, and the
        tick has made progress: a step already done, or, for the tick's first step, the yield word
        was clear when the tick began (the arrival is newer than the plan) and the previous tick
        did not lose its own first step the same way (so two ticks in a row always progress)."""
        w = self._abort
        if w is None:
            return
        end = min(self.batch.n, start + self.batch.n_batch)
        ok = (
            end - start <= self.n_ubatch
            and start >= sc.min_rows
            and not sc.replaying
            and (sc.steps > 0 or (sc.clear_at_start and not self._first_step_aborted))
        )
        if ok:
            w.arm()
        else:
            w.disarm()

    def _yield_requested(self) -> bool:
        """The control segment's yield word is set (``basertd.shm.control``)."""
        c = self._control
        return c is not None and c.yield_reason() != 0

    def _shed_cut_prefills(self, work: TickWork, sc: _TickScratch) -> None:
        """After a yield: each lane whose planned prefill did not all run is reported exactly as a
        budget-shed chunk (one PREFILL_CHUNK entry per lane, tokens = planned - done; ABI rules 56,
        57), its cursor set back to what its KV holds."""
        self._stats["yields_total"] += 1
        if self._control is not None:
            self._control.note_yield_taken()
        by_tag = {e.lane_tag: e for e in work.shed if e.kind == ShedKind.PREFILL_CHUNK}
        for tag, _ in work.prefills:
            lane = self.lanes.get(tag)
            if lane is None or lane.kv_len >= lane.prefilled:
                continue
            cut = lane.prefilled - max(lane.kv_len, sc.floor.get(tag, 0))
            lane.prefilled -= cut
            entry = by_tag.get(tag)
            if entry is not None:
                entry.tokens += cut
            else:
                entry = ShedEntry(
                    lane_tag=tag, kind=ShedKind.PREFILL_CHUNK, reason=SHED_REASON_BUDGET, tokens=cut
                )
                by_tag[tag] = entry
                work.shed.append(entry)
                work.chunks_dropped += 1
            sc.grant[tag] = 0  # its decode waits for the prefill to resume (ABI rule 47)

    def _round(self, active: list[int], feed: list[Lane], sc: _TickScratch) -> None:
        """One ``llama_decode`` (more if it exceeds n_batch): a token for every decoding lane that
        needs one, then the prefill runs; then every active lane takes one decode unit."""
        feeding = {ln.tag for ln in feed}
        forward: list[Lane] = []
        ready: list[Lane] = []
        for tag in active:
            lane = self.lanes[tag]
            if tag in feeding:
                continue  # its unit takes the logits of its last prefill row
            if lane.kv_len == lane.produced - 1:
                forward.append(lane)
            elif lane.kv_len == lane.produced and (
                lane.held_row is not None or lane.produced < lane.n_tokens
            ):
                ready.append(lane)  # a held row, or a replayed token that needs no logits
            else:
                self._fault(lane, FaultCode.INTERNAL, 1, sc)
        # Never hand llama.cpp more tokens than the ledger has cells for (the plan was checked;
        # this only trips if a seeded admit fell back to a cold prefill after validation).
        while feed and len(forward) + sum(ln.prefilled - ln.kv_len for ln in feed) > self.ledger.free:
            self._fault(feed.pop(), FaultCode.OOM_TENTATIVE, 0, sc)
        need_rows = len(forward) + sum(ln.prefilled - ln.kv_len for ln in feed)
        room = self._feed_room(forward, ready, feed, sc)
        b = self.batch
        if need_rows > b.capacity:
            self.batch = b = TokenBatch(need_rows, self.step_rows)
        b.clear()
        runs: list[tuple[Lane, int, int, bool]] = []  # lane, first row, rows, wants logits
        for lane in forward:
            k = lane.kv_len
            row = b.add(lane.tokens[k : k + 1], k, lane.seq, True)
            runs.append((lane, row, 1, True))
        n_decode_rows = b.n
        # Rows a yield may not cut come first: KV the coordinator already counts as prefilled (a
        # cold fallback, a cached prompt's last token); then this tick's planned chunks.
        for mandatory in (True, False):
            for lane in feed:
                floor = min(max(sc.floor.get(lane.tag, lane.prefilled), lane.kv_len), lane.prefilled)
                k, end = (lane.kv_len, floor) if mandatory else (max(floor, lane.kv_len), lane.prefilled)
                if not mandatory:
                    end = min(end, k + room)
                if end <= k:
                    continue
                if not mandatory:
                    room -= end - k
                want = end == lane.prefilled and end == lane.prefill_end and lane.produced == end
                row = b.add(lane.tokens[k:end], k, lane.seq, want)
                runs.append((lane, row - (end - k) + 1, end - k, want))
            if mandatory:
                sc.min_rows = b.n
        if b.n:
            self._decode_batch(runs, n_decode_rows, sc)
        ready = [ln for ln in ready if ln.tag in self.lanes and sc.grant.get(ln.tag, 0) > 0]
        for lane in [ln for ln in ready if ln.held_row is None]:
            self._units([lane], None, sc)  # a replayed token: no logits
        held = [ln for ln in ready if ln.held_row is not None]
        if held:
            rows = np.stack([ln.held_row for ln in held])
            for lane in held:
                lane.held_row = None
            self._units(held, rows, sc)

    def _feed_room(self, forward: list[Lane], ready: list[Lane], feed: list[Lane], sc: _TickScratch) -> int:
        """Planned prefill rows this round may carry (rows a yield may not cut are always fed).
        With lanes decoding beside the prefill, the tick's prefill is spread evenly over the rounds
        their grants leave, so each decoding lane gets a token every round rather than once the
        whole prefill has run (a round is then about prefill / grant rows, and the tick as long as
        before); with none decoding, all of it (split into steps by ``TokenBatch``)."""
        left = sum(ln.prefilled - max(sc.floor.get(ln.tag, ln.prefilled), ln.kv_len) for ln in feed)
        rounds = max((sc.grant.get(ln.tag, 0) for ln in (*forward, *ready)), default=0)
        if left <= 0 or rounds <= 1:
            return max(left, 0)
        if left <= MIN_ROUND_FEED:  # a short prefill (an interactive prompt) goes whole
            return left
        return -(-left // rounds)

    def _decode_batch(
        self, runs: list[tuple[Lane, int, int, bool]], n_decode_rows: int, sc: _TickScratch
    ) -> None:
        n_vocab = self.n_vocab
        ctx = self.ctx

        def on_part(start: int, end: int) -> None:
            units: list[tuple[Lane, int]] = []  # lane, output row of this part
            out_of_row: np.ndarray | None = None
            for lane, first, n, want in runs:
                lo, hi = max(first, start), min(first + n, end)
                if lo >= hi or lane.tag not in self.lanes:
                    continue
                k = hi - lo
                self.ledger.append(lane.seq, k)
                lane.kv_len += k
                lane.content_gen += 1
                if first >= n_decode_rows:
                    self._stats["prefill_tokens_total"] += k
                if want and lane.kv_len == lane.produced:
                    if out_of_row is None:  # llama_get_logits keeps the batch's output order
                        out_of_row = np.cumsum(self.batch.logits[start:end], dtype=np.int64) - 1
                    units.append((lane, int(out_of_row[first + n - 1 - start])))
            if not units:
                return
            n_out = int(out_of_row[-1]) + 1
            logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), (n_out, n_vocab))
            go = [(ln, o) for ln, o in units if sc.grant.get(ln.tag, 0) > 0]
            for lane, o in units:
                if sc.grant.get(lane.tag, 0) <= 0:
                    lane.held_row = logits[o].copy()
            if go:
                idx = [o for _, o in go]
                contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
                rows = logits[idx[0] : idx[0] + len(idx)] if contiguous else logits[idx]
                self._units([ln for ln, _ in go], rows, sc)

        def stop(rows_done: int) -> bool:
            if rows_done < sc.min_rows or not self._yield_requested():
                return False
            sc.yielded = True
            return True

        def on_step(start: int, end: int) -> None:
            sc.steps += 1
            on_part(start, end)

        def arm(start: int) -> None:
            self._arm_abort(start, sc)

        t = time.perf_counter_ns()
        try:
            done = self.batch.decode(ctx, on_step, stop, arm if self._abort is not None else None)
        except BatchDecodeError as exc:
            if exc.rc < -1:
                raise EngineFatal(Status.ERR_FATAL, str(exc)) from exc
            for lane, first, n, _ in runs:
                if first + n > exc.start and lane.tag in self.lanes:
                    self._fault(lane, FaultCode.INTERNAL, exc.rc & _U32, sc)
        dt = time.perf_counter_ns() - t
        if self.batch.aborted:
            sc.yielded = True
            self._first_step_aborted = sc.steps == 0
            self._stats["yield_aborts_total"] += 1
            self._stats["yield_abort_rows_total"] += min(self.batch.n, done + self.batch.n_batch) - done
        elif sc.steps:
            self._first_step_aborted = False
        for rows, ns in self.batch.parts:
            self.rates.note(rows, ns)
        if self.batch.n > n_decode_rows:
            sc.prefill_ns += dt
        else:
            sc.decode_ns += dt

    def _units(self, lanes: list[Lane], rows: np.ndarray | None, sc: _TickScratch) -> None:
        """One decode unit for each of ``lanes`` (ABI rules 67, 72), lane i taking logits row
        ``rows[i]`` of the 2-D float32 array ``rows`` (n_lanes, vocab), or no row (None: replayed
        tokens). Token selection is one ``sampling.select_batch`` call over every sampling lane."""
        pend: list[int] = []
        heads: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # lane index -> (its row, masked row)
        for i, lane in enumerate(lanes):
            own = None if rows is None else rows[i]
            head = self._unit_head(lane, own, sc)
            if head is not None:
                pend.append(i)
                heads[i] = (own, head)
        if not pend:
            return
        assert rows is not None
        adjusted: dict[int, np.ndarray] = {}
        for j, i in enumerate(pend):
            lane = lanes[i]
            own, row = heads[i]  # the logits row, and the same masked by the lane's grammar
            r = sampling.adjusted_row(row, lane.cfg, lane.tokens[: lane.n_tokens], lane.prefill_end)
            if r is not own:
                adjusted[j] = r
        if not adjusted and pend == list(range(rows.shape[0])):
            mat = rows  # every row as llama.cpp wrote it: no copy
        else:
            mat = rows[pend]
            for j, r in adjusted.items():
                mat[j] = r
        cfgs = [lanes[i].cfg for i in pend]
        samplers = [lanes[i] for i in pend]
        us = [sampling.draw(ln.rng_base + ln.generated) if ln.cfg.sampled else 0.0 for ln in samplers]
        toks = sampling.select_batch(mat, cfgs, us)
        for j, i in enumerate(pend):
            self._unit_tail(lanes[i], mat[j], int(toks[j]), sc)

    def _unit_head(self, lane: Lane, row: np.ndarray | None, sc: _TickScratch) -> np.ndarray | None:
        """The part of a decode unit before sampling: a replayed token, a full context, the
        lane's grammar mask, or a HOST lane's row to the logits ring. Returns the row the lane
        samples its token from (masked by its grammar), or None when it samples nothing."""
        tag = lane.tag
        sc.grant[tag] -= 1
        if lane.produced < lane.n_tokens:  # a replayed token: its forward is done, no emit
            lane.produced += 1
            self._stats["replay_tokens_total"] += 1
            return None
        if lane.n_tokens >= self.context_length:  # a prompt of the full context: nothing fits
            lane.finish = Finish.LENGTH
            sc.grant[tag] = 0
            sc.finish[tag] = lane.finish
            return None
        cfg = lane.cfg
        if lane.grammar is not None:
            row = self.grammars.mask_row(lane.grammar, row)
            if row is None:  # the grammar allows no token
                self._fault(lane, FaultCode.GRAMMAR_OVERFLOW, 0, sc)
                return None
        if lane.is_host:
            try:
                ref = self.rings.write_row(sampling.adjusted_row(row, cfg, lane.tokens[:0], 0))
            except RingError:
                self._fault(lane, FaultCode.REF_SPAN_OOB, 0, sc)
                return None
            lane.pending_nonce = ref.generation
            sc.rows[tag] = ref
            return None
        return row

    def _unit_tail(self, lane: Lane, r: np.ndarray, tok: int, sc: _TickScratch) -> None:
        """The part of a decode unit after sampling ``tok`` from the adjusted row ``r``: logprobs,
        commit, partial-emit bookkeeping, finish."""
        tag = lane.tag
        cfg = lane.cfg
        if cfg.n_logprobs >= 0:
            lp, ids, lps = sampling.logprobs(r, tok, cfg.n_logprobs)
            sc.ev.logprobs.append(
                LaneLogprob(
                    lane_tag=tag, logprob=lp, n_top=len(ids), top_ids=ids.tolist(), top_logprobs=lps.tolist()
                )
            )
        lane.append(tok)
        self._stats["decode_tokens_total"] += 1
        fresh = sc.fresh.get(tag)
        if fresh is None:
            sc.fresh[tag] = [tok]
        else:
            fresh.append(tok)
        g_finish = self._grammar_consume(lane, tok, sc)
        if g_finish < 0:
            return
        if self.model.eog_mask[tok] and not cfg.ignore_eos:
            lane.finish = Finish.EOS
        elif g_finish == Finish.GRAMMAR:
            lane.finish = Finish.GRAMMAR
        elif lane.n_tokens >= self.context_length:
            lane.finish = Finish.LENGTH
        if lane.finished:
            sc.grant[tag] = 0
            sc.finish[tag] = lane.finish

    # -- grammar hooks (``grammar``): masks for a round, committed tokens

    def _grammar_fill(self, active: list[int]) -> None:
        """Fill the bitmasks of the round's constrained lanes that sample (not replaying) in one
        llguidance call, before their rows exist."""
        gs = []
        for tag in active:
            lane = self.lanes[tag]
            if lane.grammar is not None and lane.produced >= lane.n_tokens:
                gs.append(lane.grammar)
        self.grammars.fill(gs)

    def _grammar_consume(self, lane: Lane, token: int, sc: _TickScratch) -> int:
        """Feed a committed token to the lane's matcher: Finish.NONE, Finish.GRAMMAR (complete),
        or -1 after faulting the lane with GRAMMAR_OVERFLOW (the grammar refused the token)."""
        if lane.grammar is None:
            return Finish.NONE
        res = self.grammars.consume(lane.grammar, token)
        if res < 0:
            self._fault(lane, FaultCode.GRAMMAR_OVERFLOW, token, sc)
        return res

    def _fault(self, lane: Lane, code: int, detail: int, sc: _TickScratch) -> None:
        """Stop one lane with a typed fault; the tick goes on (ABI rules 60-62)."""
        self.lanes.pop(lane.tag, None)
        self.faulted.add(lane.tag)
        self._release_seq(lane.seq)
        sc.grant[lane.tag] = 0
        sc.note(lane.tag)
        sc.finish[lane.tag] = Finish.ERROR
        sc.ev.faults.append(LaneFault(lane_tag=lane.tag, code=code, detail=detail))
        self._stats["faults_total"] += 1
        sc.start_tokens.setdefault(lane.tag, lane.n_tokens)
        sc.fault_lanes[lane.tag] = lane

    def _finish_events(self, work: TickWork, sc: _TickScratch) -> None:
        ev = sc.ev
        for tag in sc.emit_order:
            lane = self.lanes.get(tag) or sc.fault_lanes.get(tag)
            start = sc.start_tokens.get(tag)
            ref = TokenRef()
            n = 0
            if lane is not None and start is not None and lane.n_tokens > start:
                toks = lane.tokens[start : lane.n_tokens].astype(np.uint32)
                try:
                    ref = self.rings.write_tokens(toks)
                    n = int(toks.shape[0])
                except RingError:
                    if tag in self.lanes:
                        self._fault(lane, FaultCode.REF_SPAN_OOB, int(toks.shape[0]), sc)
                    else:
                        ev.faults.append(LaneFault(lane_tag=tag, code=FaultCode.REF_SPAN_OOB))
                    sc.finish[tag] = Finish.ERROR
            ev.emits.append(
                LaneEmit(
                    lane_tag=tag,
                    token_ref=ref,
                    n_tokens=n,
                    finish=sc.finish.get(tag, Finish.NONE),
                    logits_row=sc.rows.get(tag, RingRef()),
                )
            )
        ev.shed.prefill_chunks_dropped += work.chunks_dropped
        ev.shed.entries[:0] = work.shed
        if ev.faults:
            ev.tick_status = TickStatus.LANE_ERRORS
        elif ev.shed.entries:
            ev.tick_status = TickStatus.SHED
        ev.op_completions = self.ops.take_completions()

    def _expire_leases(self) -> None:
        for lease in self.cache.expired(self.tick_index):
            self._drop_lease(lease)

    def _drop_lease(self, lease: Lease) -> None:
        self.cache.leases.pop(lease.handle, None)
        if lease.adopted:
            self.ops.free_adopted(lease)
        else:
            e = self.cache.entries.get(lease.entry_id)
            if e is not None:
                e.pins -= 1
        self._evictable_dirty = True

    def _mem_counters(self) -> MemCounters:
        if self._evictable_dirty:
            unpinned = [(e.seq, 0) for e in self.cache.entries.values() if e.pins == 0]
            self._evictable_bytes = self.ledger.freed_by(unpinned) * self.bytes_per_token
            self._evictable_dirty = False
        held = sum(ln.held_row.nbytes for ln in self.lanes.values() if ln.held_row is not None)
        used = self.ledger.used
        return MemCounters(
            allocated_bytes=used * self.bytes_per_token,
            host_retained_bytes=held + self.ops.retained_bytes(),
            pool_blocks_total=self.n_cells // self.page,
            pool_blocks_used=-(-used // self.page),
            pool_bytes_evictable=self._evictable_bytes,
        )

    # ------------------------------------------------------------------ prefix cache and seeds

    def _space_ok(self, space_id: int) -> None:
        if space_id not in (KV_SPACE_ID, ALL_SPACES):
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no state space {space_id}")

    def _servable_len(self, entry: CacheEntry, limit: int) -> int:
        """Longest page multiple <= ``limit`` of ``entry`` that can seed a lane (0 if none)."""
        q = (min(limit, entry.length) // self.page) * self.page
        if q == 0:
            return 0
        pmin, pmax = self.pos_range(entry.seq)
        return q if prefix_servable(pmin, pmax, q, self.n_swa) else 0

    def space_match(self, space_id: int, span: TokenRef) -> MatchResult:
        """Cached prefixes of ``span`` (tokens in the prompt ring) that can seed a lane, longest
        first, each a multiple of page_size_tokens (ABI rule 88). Pins nothing (rule 87). Raises
        EngineError(ERR_UNKNOWN_HANDLE) for another space id, (REJECT_BAD_REF_GENERATION) for a
        stale span."""
        self._space_ok(space_id)
        toks = self.rings.read_prompt(span).astype(np.int32)
        seen: set[tuple[int, int]] = set()
        cands: list[MatchCandidate] = []
        for e in self.cache.entries.values():
            q = self._servable_len(e, common_prefix(e.tokens, toks))
            if q and (q, e.taint) not in seen:
                seen.add((q, e.taint))
                cands.append(
                    MatchCandidate(
                        prefix_len=q,
                        provenance_digest=prefix_digest(self.model.model_id, toks[:q]),
                        taint_bits=e.taint,
                        resident_tier=Tier.GPU,
                    )
                )
        cands.sort(key=lambda c: -c.prefix_len)
        return MatchResult(spaces=[SpaceMatch(space_id=KV_SPACE_ID, candidates=cands)])

    def seed_acquire(self, span: TokenRef, prefix_len: int, determinism_class: int) -> int:
        """Pin a cached entry serving ``span[:prefix_len]`` and return a seed handle for one admit,
        valid for this tick and the next ``seed_lease_ticks`` (ABI rules 75-83). Raises
        EngineError: REJECT_BOUNDS for prefix_len 0 or past the span, ERR_SEED_UNSERVABLE when no
        entry serves it (not a page multiple, not cached, window lost, or only tainted variants for
        a DETERMINISTIC seed), REJECT_BAD_REF_GENERATION for a stale span."""
        toks = self.rings.read_prompt(span).astype(np.int32)
        if prefix_len <= 0 or prefix_len > toks.shape[0]:
            raise EngineError(Status.REJECT_BOUNDS, f"prefix_len {prefix_len} outside 1..{toks.shape[0]}")
        if prefix_len % self.page:
            raise EngineError(Status.ERR_SEED_UNSERVABLE, f"{prefix_len} is not a multiple of {self.page}")
        prefix = toks[:prefix_len].copy()
        best: CacheEntry | None = None
        for e in self.cache.entries.values():
            if determinism_class == DeterminismClass.DETERMINISTIC and e.taint:
                continue
            if e.length < prefix_len or common_prefix(e.tokens, prefix) < prefix_len:
                continue
            if self._servable_len(e, prefix_len) != prefix_len:
                continue
            if best is None or (e.taint, -e.lru) < (best.taint, -best.lru):
                best = e
        if best is None:
            raise EngineError(Status.ERR_SEED_UNSERVABLE, "no cached prefix serves this seed")
        best.pins += 1
        self.cache.touch(best)
        self._evictable_dirty = True
        lease = self.cache.new_lease(
            prefix,
            determinism_class,
            self.tick_index + self.seed_ttl,
            entry_id=best.entry_id,
            taint=best.taint,
        )
        return lease.handle

    def seed_release(self, seed_handle: int) -> None:
        """Release an unconsumed lease (an adopted sequence is freed with it). Raises
        EngineError(ERR_UNKNOWN_HANDLE) for an unknown, consumed or expired handle (ABI rule 81)."""
        lease = self.cache.leases.get(seed_handle)
        if lease is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no seed {seed_handle}")
        self._drop_lease(lease)

    def seed_adopt(self, seq: int, span: TokenRef) -> int:
        """Lease the bare sequence ``seq`` (a restore target) as the seed of one admit whose prompt
        starts with ``span`` (its length must equal the sequence's; ABI rule 86)."""
        toks = self.rings.read_prompt(span).astype(np.int32)
        return self.ops.adopt(seq, toks)

    def cache_evict(self, policy: ShedPolicy, bytes_target: int) -> int:
        """Evict unpinned entries of the policy's classes, least recently used first, freeing at
        most min(bytes_target, max_evict_bytes, cached bytes - protected_quota_bytes); returns the
        bytes freed (ABI rule 89)."""
        total = self.ledger.freed_by([(e.seq, 0) for e in self.cache.entries.values()]) * self.bytes_per_token
        cap = min(bytes_target, policy.max_evict_bytes, max(0, total - policy.protected_quota_bytes))
        freed = 0
        for e in self.cache.eviction_order(policy.evictable_cache_classes):
            gain = self.ledger.exclusive(e.seq) * self.bytes_per_token
            if freed + gain > cap:
                continue
            freed += self._evict(e, None, SHED_REASON_POOL)
        return freed

    def cache_evict_entries(self, keys: Sequence[CacheKey]) -> None:
        """Drop the unpinned entries named by (compat identity, provenance digest of the entry's
        tokens); keys naming nothing, or pinned entries, are left alone."""
        for k in keys:
            if k.compat_key != self.identity:
                continue
            for e in list(self.cache.entries.values()):
                if e.digest == k.provenance_digest and e.pins == 0:
                    self._evict(e, None, SHED_REASON_POOL)

    # ------------------------------------------------------------------ sequences and state ops

    def lane_sequence(self, lane_tag: int) -> int | None:
        """The sequence handle a live lane owns, or None."""
        lane = self.lanes.get(lane_tag)
        return None if lane is None else lane.handle

    def sequence_create(self) -> int:
        """A bare, empty sequence (a restore target). EngineError(EBUSY) when all spare sequences
        are in use."""
        return self.ops.create()

    def sequence_free(self, seq: int) -> None:
        """Free a bare sequence; EngineError(ERR_UNKNOWN_HANDLE) otherwise (ABI rule 112)."""
        self.ops.free(seq)

    def sequence_publish(self, seq: int, tokens: np.ndarray) -> None:
        """Publish a bare sequence's whole-page prefix under ``tokens``; consumes it (rule 91)."""
        self.ops.publish(seq, np.asarray(tokens, dtype=np.int64))

    def seq_fork(self, parent: int, flags: int = 0) -> int:
        """A bare sequence sharing every cell of ``parent`` (refcounted, zero-copy)."""
        return self.ops.fork(parent)

    def export_size(self, seq: int, space_id: int, rng: TokenRange, encoding: int) -> tuple[int, int]:
        """``(required_bytes, sizing_gen)`` of a lossless export of ``[0, rng.end)``."""
        return self.ops.export_size(seq, space_id, rng, encoding)

    def snapshot(self, seq: int, space_id: int, boundary_pos: int, sizing_gen: int, dst_bytes: int) -> int:
        """Start a snapshot of ``[0, boundary_pos)``; returns an op handle (ABI rules 95-98)."""
        return self.ops.snapshot(seq, space_id, boundary_pos, sizing_gen, dst_bytes)

    def restore(self, seq: int, space_id: int, data: bytes) -> int:
        """Start restoring a sealed export into a bare sequence; returns an op handle (101-104)."""
        return self.ops.restore(seq, space_id, data)

    def snapshot_boundary(self, seq: int, space_id: int, cap: int) -> int:
        """Newest page-multiple length <= ``cap`` a seed could serve (rule 111)."""
        return self.ops.snapshot_boundary(seq, space_id, cap)

    def trim(self, seq: int, space_id: int, new_len: int) -> None:
        """Trim a bare sequence to ``new_len`` tokens (rule 109)."""
        self.ops.trim(seq, space_id, new_len)

    def check_op_target(self, seq: int, space_id: int) -> None:
        """ERR_UNKNOWN_HANDLE (space or sequence), EBUSY during another op (rule 98): what demote
        and promote (not served: ``base.Capability.HOST_TIER``) check before ERR_OP_UNSUPPORTED."""
        self.ops.check_target(seq, space_id)

    def op_poll(self, op: int) -> OpStatus:
        """State of an op; it completes at the next accepted tick (ABI rules 69, 99)."""
        return self.ops.poll(op)

    def op_cancel(self, op: int) -> None:
        """Cancel a running op (ABI rule 100)."""
        self.ops.cancel(op)

    def op_output(self, op: int) -> bytes:
        """The sealed bytes of a DONE snapshot, handed over once (EBUSY while it runs)."""
        return self.ops.output(op)

    # ------------------------------------------------------------------ grammar, bias, vocabulary

    def grammar_create(self, json_schema: str, kind: str = "json_schema") -> int:
        """A grammar handle for a spec of ``kind`` ("json_schema", "lark" or "regex"; ``grammar``),
        or 0 when it does not compile. Lanes admitted with it sample only what it allows and
        finish with Finish.GRAMMAR when it is complete."""
        return self.grammars.create(json_schema, kind)

    def grammar_free(self, handle: int) -> None:
        """Free a grammar handle (live lanes keep their matchers); EngineError(ERR_UNKNOWN_HANDLE)
        when absent (ABI rule 113)."""
        self.grammars.free(handle)

    def logit_bias_create(self, tokens: Sequence[int], values: Sequence[float]) -> int:
        """Register an additive logit bias; 0 when empty, mismatched or out of the vocabulary."""
        ids = np.asarray(list(tokens), dtype=np.int64)
        vals = np.asarray(list(values), dtype=np.float32)
        if ids.size == 0 or ids.shape != vals.shape or ids.min() < 0 or ids.max() >= self.n_vocab:
            return 0
        if not np.all(np.isfinite(vals)):
            return 0
        h = self._next_bias
        self._next_bias += 1
        self.logit_biases[h] = (ids.astype(np.int32), vals)
        return h

    def logit_bias_free(self, handle: int) -> None:
        """Free a bias handle (lanes keep their copy); ERR_UNKNOWN_HANDLE if absent."""
        if self.logit_biases.pop(handle, None) is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no logit bias {handle}")

    def tokenize(self, text: bytes, add_special: bool) -> list[int]:
        """Token ids of ``text`` with the model's vocabulary."""
        return self.model.tokenize(text, add_special)

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of ``tokens`` (may end inside a UTF-8 character)."""
        return self.model.detokenize(list(tokens))

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Free the context and the model; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.rings.close()
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        self.model.close()

    def __enter__(self) -> LlamaCppEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
