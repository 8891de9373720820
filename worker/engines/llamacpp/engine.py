"""``LlamaCppEngine``: the Engine protocol over one llama.cpp context (DESIGN.md "Engines").

One ``llama_context`` with ``n_seq_max`` = lanes + cache sequences + spare sequences + a scratch
sequence, in one KV cache of ``pool_tokens`` cells or in per-lane streams (``context.KV_LAYOUTS``).
Each lane owns one sequence id; a tick runs retires, commits, admits, prefills, decodes (ABI rule
53) and puts every decoding lane of a round in one ``llama_decode``, with the tick's prefill chunks
behind them in the same batch (a chunk of 8 rows or more in a ``llama_decode`` of its own:
``rounds.SPLIT_MIN_PREFILL_ROWS``). A grant of
k tokens runs k rounds; the tick's prefill is spread evenly over them (``rounds``), so a lane
decoding beside a long prefill gets a token every round instead of waiting for all of it. Tokens
are chosen on the host from each lane's logits row (``sampling``); HOST lanes get the row in the
logits ring instead.

This module is the Engine surface; the work is in its parts: ``cells.Cells`` (llama.cpp memory,
the cell ledger and sequence ids, changed together), ``tick.Tick`` (one tick's state and lane
work; the admits in ``admit``), ``rounds.Rounds`` (decode rounds, batches, yield and abort),
``validate`` and ``report.Report`` (``info``, ``state_spaces``, ``stats``). Each optional
capability is served by one part (``base.ServedBy``: the call goes to the part's method of the same
name): the prefix cache by ``seeds.Seeds`` (matches, leases, publish, evict), state ops by
``sequences.Sequences`` (bare sequences, adoption) and ``ops.StateOps`` (exports, snapshots,
restores), grammars by ``grammar.GrammarSet``, logit biases by ``sampling.LogitBiases``, the
yield by ``rounds``, embeddings by ``embed.Embedder``, prompt scores by ``score.Scorer``,
speculation-strategy registration by ``strategies.Strategies`` (the prompt-lookup drafts and their
verification inside the rounds: ``speculation``). Evicted prefixes go to the engine's own host tier
(``host_tier.HostTier``, ``host_bytes``) and come back through ``seed_acquire``; the ABI's
HOST_TIER ops on a sequence's ranges (demote, promote) are not served and answer
ERR_OP_UNSUPPORTED after the checks every op makes.

Where the ABI leaves a choice, this engine's semantics are documented where they are made: lane
stops, HOST commits and the pending last token in ``tick``; budgets and internal work in
``validate``, KV feasibility in ``feasibility``; publishing into a full cache in ``seeds``;
state-op timing in ``ops``; the yield inside a tick in ``rounds``.

Output depends on batch composition and, through the order of llama.cpp's sums over KV cells, on
where cells sit in the cache; two runs are bit-identical when both match (tests compare with a bare
loop from an empty cache, and elsewhere allow divergence only at a near-tie of the reference).

Test hooks live outside this module: ``hooks`` is None in production; tests install a
``basertd.worker.engines.llamacpp.hooks.LaneTestHooks`` (fault injection, forced finishes, as the
reference engine's ``baseRT_ref_*`` calls), applied at one point of ``tick`` after the retires.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import llama_cpp as L

from basertd.schema.abi import Status
from basertd.schema.tick import TickEvents, TickPlan, TickTimings
from basertd.worker.engines.base import (
    Engine,
    EngineError,
    EngineFatal,
    PartialEmit,
    PlanRejected,
    RingMapping,
    ServedBy,
)
from basertd.worker.engines.llamacpp.admit import admit
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.context import Sizes, open_context
from basertd.worker.engines.llamacpp.draft_model import DraftHost
from basertd.worker.engines.llamacpp.embed import EMBED_INPUTS, Embedder
from basertd.worker.engines.llamacpp.grammar import GrammarSet
from basertd.worker.engines.llamacpp.host_tier import HostTier
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.model import LlamaModel
from basertd.worker.engines.llamacpp.ops import StateOps
from basertd.worker.engines.llamacpp.prefix_cache import CacheEntry, PrefixCache
from basertd.worker.engines.llamacpp.rates import RateCurve
from basertd.worker.engines.llamacpp.report import Report, new_stats
from basertd.worker.engines.llamacpp.rings import EngineRings
from basertd.worker.engines.llamacpp.rounds import Rounds
from basertd.worker.engines.llamacpp.sampling import LogitBiases
from basertd.worker.engines.llamacpp.score import Scorer
from basertd.worker.engines.llamacpp.seeds import Seeds
from basertd.worker.engines.llamacpp.sequences import Sequences
from basertd.worker.engines.llamacpp.speculation import Speculator
from basertd.worker.engines.llamacpp.state import compat_identity
from basertd.worker.engines.llamacpp.strategies import Strategies
from basertd.worker.engines.llamacpp.tick import Tick, TickParts
from basertd.worker.engines.llamacpp.validate import validate_plan
from basertd.worker.engines.llamacpp.work import SHED_REASON_POOL, TickWork

if TYPE_CHECKING:
    from basertd.worker.engines.llamacpp.hooks import LaneTestHooks


class LlamaCppEngine(Engine):
    """The llama.cpp engine adapter (``basertd.worker.engines.base.Engine``).

    Sizes are tokens unless named ``_bytes``: ``lanes`` concurrent lanes (also the most decodes per
    tick), ``context_length`` tokens per lane (prompt + generated), ``pool_tokens`` KV cells in all
    (default ``lanes * context_length``; published prefixes live in what lanes leave free),
    ``page_size_tokens`` the paging unit of matches and seeds (ABI rule 88), ``cache_sequences``
    the most published prefixes kept (per-lane, besides those the idle lanes' streams keep),
    ``spare_sequences`` bare sequences for restores and forks
    (both defaulted by layout: ``context.Sizes``),
    ``seed_lease_ticks`` the lease TTL (rule 84). ``n_threads`` / ``n_threads_batch`` go to
    llama.cpp (single-token / multi-token batches). ``n_batch`` caps one ``llama_decode``.
    ``swa_full`` keeps a full-size sliding-window cache (the C default; see the reference notes).
    ``kv_layout`` is ``unified`` (one shared cache) or ``per-lane`` (a stream per sequence id;
    ``pool_tokens`` then does not apply: ``context.KV_LAYOUTS``).
    ``yield_step_tokens`` rows per llama_decode (the yield granularity; default n_ubatch).
    ``repack`` False loads the weights without llama.cpp's CPU repacking (``LlamaModel``).
    ``host_bytes`` bounds the host tier of evicted prefixes (``host_tier``; 0: off).

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
        spare_sequences: int | None = None,
        pool_tokens: int | None = None,
        seed_lease_ticks: int = 8,
        n_batch: int = 512,
        n_ubatch: int = 512,
        swa_full: bool = True,
        n_gpu_layers: int = 0,
        yield_step_tokens: int | None = None,
        repack: bool = True,
        host_bytes: int = 0,
        kv_layout: str = "unified",
    ) -> None:
        if host_bytes < 0:
            raise ValueError(f"host_bytes must be >= 0, got {host_bytes}")
        sizes = Sizes.resolve(
            lanes=lanes,
            context_length=context_length,
            page_size_tokens=page_size_tokens,
            seed_lease_ticks=seed_lease_ticks,
            cache_sequences=cache_sequences,
            spare_sequences=spare_sequences,
            kv_layout=kv_layout,
            pool_tokens=pool_tokens,
            n_batch=n_batch,
        )
        self.model = LlamaModel(model_path, n_gpu_layers=n_gpu_layers, repack=repack)
        try:
            c = open_context(
                self.model,
                sizes,
                lanes=lanes,
                n_ubatch=n_ubatch,
                n_threads=n_threads,
                n_threads_batch=n_threads if n_threads_batch is None else n_threads_batch,
                swa_full=swa_full,
                yield_step_tokens=yield_step_tokens,
                kv_layout=kv_layout,
                context_length=context_length,
            )
        except (EngineError, ValueError):
            self.model.close()
            raise
        self.ctx, self._ctx_params = c.ctx, c.params
        self.n_cells, self.n_batch, self.step_rows = c.n_cells, c.n_batch, c.step_rows
        self.max_lanes = lanes
        self.context_length = context_length
        self.page = page_size_tokens
        self.n_vocab = self.model.n_vocab
        self.n_swa = self.model.n_swa
        self.bytes_per_token = self.model.kv_bytes_per_token
        self.seed_ttl = seed_lease_ticks
        self.spare_sequences = sizes.spare_sequences
        self.kv_layout = kv_layout
        # What decides whether a sequence blob loads: the weights, KV types, the stream layout,
        # the sliding-window cache layout and llama.cpp's state format (its version). Not the pool
        # size, so a respawned worker with another pool still restores.
        self.identity = compat_identity(self.model.model_id, "kv-f16", kv_layout, swa_full, L.__version__)
        self.counters = stats = new_stats()
        threads_batch = n_threads if n_threads_batch is None else n_threads_batch
        self.scorer = Scorer(self.model, max_tokens=context_length, n_threads=threads_batch)
        self.embedder = Embedder(
            self.model, max_tokens=context_length, max_inputs=EMBED_INPUTS, n_threads=threads_batch
        )
        per_lane = kv_layout == "per-lane"
        self.cells = cells = Cells(self.ctx, self.n_cells, sizes.n_seq_max, lanes if per_lane else None)
        self.ledger = cells.ledger  # read by validation (``validate.EngineState``)
        # per-lane, the idle lane streams hold entries too (``seeds``)
        self.cache = PrefixCache(page_size_tokens, sizes.cache_sequences + (lanes if per_lane else 0))
        self.rings = EngineRings()
        ident = self.identity
        self.host = HostTier(host_bytes)
        self.seeds = seeds = Seeds(
            cells, self.cache, self.model, seed_lease_ticks, stats, self.rings, ident, self.host
        )
        self.lanes: dict[int, Lane] = {}
        self.faulted: set[int] = set()
        self.locked: set[int] = set()
        self.logit_biases = LogitBiases(self.n_vocab)
        self.grammars = grammars = GrammarSet(self.model, self.n_vocab, n_threads)
        handle = itertools.count(1).__next__  # sequence handles of lanes and bare sequences
        self.last_plan_seq: int | None = None
        live = self.lanes
        self.sequences = Sequences(
            cells, seeds, self.rings, live, self.locked, handle, self.model, sizes.spare_sequences
        )
        self.ops = StateOps(self.sequences, self.identity)
        self.rates = RateCurve()
        batch_rows = sizes.n_batch + lanes
        self.drafts = DraftHost(
            self.model,
            lanes=lanes,
            context_length=context_length,
            n_threads=n_threads,
            n_threads_batch=threads_batch,
            n_gpu_layers=n_gpu_layers,
        )
        self.strategies = Strategies(self.model.arch, self.model.n_layer, self.drafts)
        # Drafts write KV past the lane's end and are removed again: not on a window cache that
        # prunes (``speculation``).
        self.speculates = swa_full or not self.n_swa
        speculator = Speculator(cells, context_length, self.n_vocab, self.drafts.sources)
        self.rounds = Rounds(
            cells, live, grammars, self.rates, stats, self.n_vocab, self.step_rows, batch_rows, speculator
        )
        self._parts = TickParts(
            live,
            self.faulted,
            cells,
            seeds,
            self.rings,
            grammars,
            self.logit_biases,
            stats,
            self.model.eog_mask,
            context_length,
            handle,
        )
        self.report = Report(self)
        self.hooks: LaneTestHooks | None = None  # tests only (module docstring)
        self._closed = False

    @property
    def tick_index(self) -> int:
        """Accepted ticks so far (the seed-lease clock, ``seeds.Seeds``)."""
        return self.seeds.tick_index

    # ------------------------------------------------------------------ static facts, counters

    # What the engine says about itself, read from its parts (``report.Report``).
    info = ServedBy("report")
    state_spaces = ServedBy("report")
    stats = ServedBy("report")

    def prefill_curve(self) -> list[tuple[int, float]]:
        """Measured tokens per second of a llama_decode by row count, ``[(rows_bucket, tok_s)]``
        (``rates.RateCurve``); empty until the engine has run."""
        return self.rates.curve()

    def context_params(self) -> dict[str, int | bool]:
        """The llama_context_params this engine created its context with (for reference runs)."""
        return dict(self._ctx_params)

    # ------------------------------------------------------------------ rings

    def attach_rings(self, rings: Sequence[RingMapping]) -> None:
        """Attach (or re-attach) the prompt, emit and optional logits rings; all or nothing
        (EngineError(ERR_RING_LAYOUT), ABI rule 125); writer cursors restart (rule 130)."""
        self.rings.attach(rings)

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
            self.counters["rejected_plans"] += 1
            raise
        self.last_plan_seq = plan.plan_seq
        ev = TickEvents(plan_seq=plan.plan_seq)
        tick = Tick(self._parts, ev, on_partial_emit)
        self.rounds.start(tick)
        self.ops.run_pending()
        tick.retire(work)
        if self.hooks is not None:
            self.hooks.apply(tick)
        for e in work.evict:
            self.seeds.evict(e, ev.shed, SHED_REASON_POOL)
        tick.commit(work)
        if self.cells.streams:
            self.seeds.vacate_lane_streams(sum(1 for w in work.admits if not w.cert_reject))
        admit(tick, work)
        if self.cells.streams:
            self._compact_lanes(work)
        self.rounds.run(work, tick)
        tick.finish_events(work)
        ev.op_completions = self.ops.take_completions()
        self.counters["ticks"] += 1
        self.seeds.end_tick()
        ev.timings = TickTimings(
            wall_ns=time.perf_counter_ns() - t0, prefill_ns=tick.prefill_ns, decode_ns=tick.decode_ns
        )
        ev.mem = self.report.mem_counters()
        return ev

    def _compact_lanes(self, work: TickWork) -> None:
        """Per-lane streams: move the highest lanes down into free lane streams below them
        (``Cells.move_stream``), then let each lane that decodes this tick with its prompt
        prefilled trade streams with what sits below it and does not decode: a lane, or a cache
        entry kept in a lane stream (``Cells.swap_streams``), so the round's decode rows are
        consecutive streams, one ubatch (``cells``). Lanes with a state op in flight stay where
        they are."""
        cells = self.cells
        for lane in sorted(self.lanes.values(), key=lambda ln: -ln.seq):
            if not cells.lane_gap(lane.seq):
                break
            if lane.handle in self.locked:
                continue
            dst = cells.take_lane_seq()
            cells.move_stream(lane.seq, dst)
            lane.seq = dst
        tags = {tag for tag, _ in work.decodes}
        movable = [ln for ln in self.lanes.values() if ln.handle not in self.locked]
        decodes = [ln.tag in tags and ln.prefilled >= ln.prefill_end for ln in movable]
        high = sorted((ln for ln, d in zip(movable, decodes, strict=True) if d), key=lambda ln: -ln.seq)
        if not high:
            return
        idle: list[Lane | CacheEntry] = [ln for ln, d in zip(movable, decodes, strict=True) if not d]
        idle += self.seeds.lane_stream_entries()
        low = sorted(idle, key=lambda x: x.seq)
        for hi, lo in zip(high, low, strict=False):
            if hi.seq < lo.seq:
                break
            cells.swap_streams(hi.seq, lo.seq)
            hi.seq, lo.seq = lo.seq, hi.seq

    # ------------------------------------------------------------------ capabilities, by part

    # Capability.PREFIX_CACHE: matches, leases and eviction in ``seeds``; adoption in ``sequences``.
    space_match = ServedBy("seeds")
    seed_acquire = ServedBy("seeds")
    seed_release = ServedBy("seeds")
    seed_lease_ticks = ServedBy("seeds")
    seed_adopt = ServedBy("sequences")
    cache_evict = ServedBy("seeds")
    cache_evict_entries = ServedBy("seeds")

    # Capability.STATE_OPS: sequence handles in ``sequences``, asynchronous ops in ``ops``. No
    # HOST_TIER: demote and promote answer ERR_OP_UNSUPPORTED after ``check_op_target``.
    check_op_target = ServedBy("sequences")
    lane_sequence = ServedBy("sequences")
    sequence_create = ServedBy("sequences")
    sequence_free = ServedBy("sequences")
    sequence_publish = ServedBy("sequences")
    seq_fork = ServedBy("sequences")
    snapshot_boundary = ServedBy("sequences")
    trim = ServedBy("sequences")
    export_size = ServedBy("ops")
    snapshot = ServedBy("ops")
    restore = ServedBy("ops")
    op_poll = ServedBy("ops")
    op_cancel = ServedBy("ops")
    op_output = ServedBy("ops")

    # Capability.GRAMMAR and Capability.LOGIT_BIAS
    grammar_create = ServedBy("grammars")
    grammar_free = ServedBy("grammars")
    logit_bias_create = ServedBy("logit_biases")
    logit_bias_free = ServedBy("logit_biases")

    # Capability.TICK_YIELD: the yield word is read between the steps of ``rounds``.
    attach_control = ServedBy("rounds")

    # Capability.EMBEDDINGS and Capability.SCORING: between ticks, each in a context of its own
    # made on first use (``embed.Embedder``, ``score.Scorer``).
    embed = ServedBy("embedder")
    embed_chunk = ServedBy("embedder")
    embed_cancel = ServedBy("embedder")
    score = ServedBy("scorer")

    # Capability.SPECULATION: registration and certificates in ``strategies``; drafting and
    # verification in ``speculation`` (prompt-lookup only).
    strategy_register = ServedBy("strategies")

    # ------------------------------------------------------------------ vocabulary

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
        self.host.clear()
        self.embedder.close()
        self.scorer.close()
        self.drafts.close()
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        self.model.close()

    def __enter__(self) -> LlamaCppEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
