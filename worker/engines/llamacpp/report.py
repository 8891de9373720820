"""``Report``: what the llama.cpp engine says about itself: its static facts (``info``), its one
state space (``state_spaces``), its counters and gauges (``stats``) and each tick's memory
counters (``mem_counters``, ``TickEvents.mem``).

Sizes are in tokens unless named ``_bytes``; bytes of KV are cells times the model's K+V bytes per
token at F16 (``LlamaModel.kv_bytes_per_token``). Nothing here changes the engine or raises.
``new_stats`` makes the counters the engine's parts increment, named where ``Report.stats``
documents them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import llama_cpp as L

from basertd.grammar_compile import GRAMMAR_KINDS
from basertd.schema.abi import SpaceKind
from basertd.schema.tick import MemCounters, StateSpaceDesc
from basertd.worker.engines.base import EngineInfo, TokenizerSpec
from basertd.worker.engines.llamacpp.seeds import KV_SPACE_ID

if TYPE_CHECKING:
    from basertd.worker.engines.llamacpp.engine import LlamaCppEngine


def new_stats() -> dict[str, int]:
    """The engine's counters, all 0 (named in ``Report.stats``)."""
    names = (
        "ticks prefill_tokens_total cached_tokens_total decode_tokens_total replay_tokens_total"
        " evictions_total faults_total rejected_plans cold_fallbacks_total yields_total"
        " yield_aborts_total yield_abort_rows_total spec_rounds_total spec_drafted_total"
        " spec_accepted_total spec_faults_total"
    )
    return dict.fromkeys(names.split(), 0)


class Report:
    """The reports of ``engine`` (module docstring), read from its parts when asked; served to
    the Engine surface by ``base.ServedBy``."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine

    def info(self) -> EngineInfo:
        """Sizes, vocabulary and tokenizer of the loaded model (``LlamaCppEngine``'s docstring)."""
        e = self.engine
        m = e.model
        return EngineInfo(
            engine="llamacpp",
            engine_version=f"llama-cpp-python {L.__version__}",
            model=str(m.path),
            model_id=m.model_id,
            vocab_size=m.n_vocab,
            context_length=e.context_length,
            max_lanes=e.max_lanes,
            max_batch_size=e.max_lanes,
            page_size_tokens=e.page,
            pool_bytes=e.n_cells * e.bytes_per_token,
            seed_lease_ticks=e.seed_ttl,
            eos_token_ids=m.eog_ids,
            bos_token_id=m.bos_id,
            add_bos=m.add_bos,
            tokenizer=TokenizerSpec(kind="gguf", path=str(m.path)),
            extra={
                "arch": m.arch,
                "n_swa": str(e.n_swa),
                "embedding_dim": str(m.n_embd),
                "kv_cells": str(e.n_cells),
                "kv_layout": e.kv_layout,
                "n_batch": str(e.n_batch),
                "step_tokens": str(e.step_rows),
                "prefill_rounds": "spread",
                "grammar_kinds": ",".join(GRAMMAR_KINDS),
                "host_bytes": str(e.host.capacity),
                "description": m.description,
                "n_params": str(m.n_params),
                "file_bytes": str(m.file_bytes),
                "quantization": m.quantization,
                **({"yield": "step"} if e.rounds.control is not None else {}),
            },
        )

    def state_spaces(self) -> list[StateSpaceDesc]:
        """One PAGED_TOKEN_KV space (id 0): ``bytes_per_token`` is K+V over all layers at F16;
        forks share pages by reference in the unified cache (fork cost class 1, refcount) and copy
        the stream per lane (class 2, copy). Sliding-window models keep the same descriptor; their
        window limits which cached prefixes are servable (``prefix_cache``)."""
        e = self.engine
        return [
            StateSpaceDesc(
                space_id=KV_SPACE_ID,
                kind=SpaceKind.PAGED_TOKEN_KV,
                version_tag=e.ops.version_tag,
                bytes_per_token=e.bytes_per_token,
                page_size_tokens=e.page,
                fork_cost_class=1 if e.kv_layout == "unified" else 2,
                name=f"kv-swa{e.n_swa}" if e.n_swa else "kv",
            )
        ]

    def stats(self) -> dict[str, int]:
        """Counters and gauges (the reference engine's names where it has them): ticks,
        last_plan_seq, prefill_tokens_total (seeded and replayed tokens excluded),
        cached_tokens_total (served by seeds), decode_tokens_total (sampled and HOST-committed),
        replay_tokens_total, live_lanes, live_seed_leases, grammar_handles (live grammar handles),
        live_logit_biases, cache_entries, bare_sequences,
        pool_bytes_used / _total, evictions_total, faults_total, rejected_plans,
        cold_fallbacks_total (seeds whose sliding window was lost), yields_total (ticks ended early
        by the yield word), spec_rounds_total / spec_drafted_total / spec_accepted_total
        (speculative rounds verified, tokens drafted and accepted), spec_faults_total (drafts
        refused as strategy faults, ``speculation.StrategyFault``), the verify cost the ``auto``
        policy judges drafts by (``verify_cost.VerifyCost.stats``: ``spec_verify_base_permille`` /
        ``spec_verify_per_draft_permille`` in thousandths of a plain decode step,
        ``spec_verify_measured`` 0 while the defaults, ``spec_verify_samples``), the host tier's ``host_*``
        gauges and counters (``HostTier.stats``: entries, bytes, capacity, demotions, drops,
        restores, restored tokens, restore ns, refused snapshots), the draft models'
        ``draft_models`` / ``draft_bytes`` / ``draft_sequences`` (``DraftHost.stats``), and the
        measured rate curve (``rates.RateCurve.stats``: ``rate_tok_s_b<rows>`` per power-of-two
        llama_decode size), and ``kv_stream_flushes_total`` (one-token ``llama_decode`` calls run
        to perform queued copies between per-lane streams before a state read or load,
        ``cells.Cells.flush``) and ``kv_stream_moves_total`` (streams moved or swapped so the
        decoding lanes stay consecutive or an admit gets a lane stream a cache entry held,
        ``cells.Cells.move_stream`` / ``swap_streams``)."""
        e = self.engine
        out = dict(e.counters)
        out.update(e.rates.stats())
        out.update(e.host.stats())
        out.update(e.drafts.stats())
        out.update(e.rounds.speculator.cost.stats())
        out.update(
            last_plan_seq=e.last_plan_seq or 0,
            bare_sequences=len(e.sequences.bare) + len(e.seeds.adopted),
            live_lanes=len(e.lanes),
            live_seed_leases=len(e.cache.leases),
            grammar_handles=len(e.grammars),
            live_logit_biases=len(e.logit_biases),
            cache_entries=len(e.cache.entries),
            cache_bytes=e.seeds.cached_cells() * e.bytes_per_token,
            pool_bytes_used=e.ledger.used * e.bytes_per_token,
            pool_bytes_total=e.n_cells * e.bytes_per_token,
            kv_stream_flushes_total=e.cells.flushes,
            kv_stream_moves_total=e.cells.moves,
        )
        return out

    def mem_counters(self) -> MemCounters:
        """The pool's and the host's memory after a tick (``TickEvents.mem``): KV bytes allocated,
        host bytes retained (held logits rows, finished exports, the host tier), pool pages in all
        and in use, evictable bytes."""
        e = self.engine
        held = sum(ln.held_row.nbytes for ln in e.lanes.values() if ln.held_row is not None)
        used = e.ledger.used
        return MemCounters(
            allocated_bytes=used * e.bytes_per_token,
            host_retained_bytes=held + e.ops.retained_bytes() + e.host.bytes,
            pool_blocks_total=e.n_cells // e.page,
            pool_blocks_used=-(-used // e.page),
            pool_bytes_evictable=e.seeds.evictable_bytes(),
        )
