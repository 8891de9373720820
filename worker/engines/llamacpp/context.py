"""The llama.cpp context of one engine: its sizes, resolved from the engine's arguments
(``Sizes.resolve``), and the ``llama_context`` made with them (``open_context``): ``n_seq_max``
sequences (lanes + cache sequences + spare sequences + the scratch sequence of ``cells.Cells``) in
one of the ``KV_LAYOUTS``. Sizes are tokens (one token = one KV cell)."""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp as L

from basertd.schema.abi import Status
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.model import LlamaModel

KV_LAYOUTS = ("unified", "per-lane")
"""``unified``: one KV cache every sequence's cells share (``kv_unified``; a prefix is shared by
reference, and the pool is ``pool_tokens`` cells). ``per-lane``: one stream of
``pad256(context_length)`` cells per sequence id (llama-server's layout); a query attends to its
own stream only, so decode steps over many lanes are cheaper, and a prefix is copied between
streams (``cells``). Measured by ``bench/bench_prefill_layout.py layout``."""


def stream_cells(context_length: int) -> int:
    """Cells of one per-lane stream: ``context_length`` padded to 256, as llama.cpp pads it."""
    return -(-context_length // 256) * 256


@dataclass(frozen=True)
class Sizes:
    """What an engine's arguments come to: ``cache_sequences`` and ``spare_sequences`` (default
    max(4, lanes) and 4 in the unified cache, where a sequence's cells only count when used;
    max(2, lanes // 4) and 1 per-lane, where each is a whole stream, the idle lanes' streams keep
    prefixes too and the host tier keeps the evicted ones by their tokens), ``n_seq_max``,
    ``pool_tokens`` (default lanes * context_length) and ``n_batch`` (at least lanes and
    n_seq_max)."""

    cache_sequences: int
    spare_sequences: int
    n_seq_max: int
    pool_tokens: int
    n_batch: int

    @classmethod
    def resolve(
        cls,
        *,
        lanes: int,
        context_length: int,
        page_size_tokens: int,
        seed_lease_ticks: int,
        cache_sequences: int | None,
        spare_sequences: int | None,
        pool_tokens: int | None,
        n_batch: int,
        kv_layout: str = "unified",
    ) -> Sizes:
        """ValueError for sizes llama.cpp cannot serve (``LlamaCppEngine``'s docstring)."""
        if lanes < 1 or context_length < 2 or page_size_tokens < 1 or seed_lease_ticks < 0:
            raise ValueError("lanes >= 1, context_length >= 2, page_size_tokens >= 1 required")
        per_lane = kv_layout == "per-lane"
        if cache_sequences is None:
            cache_sequences = max(2, lanes // 4) if per_lane else max(4, lanes)
        if spare_sequences is None:
            spare_sequences = 1 if per_lane else 4
        n_seq_max = lanes + cache_sequences + spare_sequences + 1  # + 1 scratch sequence
        if n_seq_max > L.llama_max_parallel_sequences():
            raise ValueError(f"{n_seq_max} sequences exceed llama.cpp's {L.llama_max_parallel_sequences()}")
        pool_tokens = lanes * context_length if pool_tokens is None else pool_tokens
        if pool_tokens < 1:
            raise ValueError("pool_tokens must be >= 1")
        # llama.cpp reserves graphs with one output per sequence: n_batch (clamped to n_ctx) must
        # cover n_seq_max, or context creation hits a GGML_ASSERT. Cells are padded to 256 anyway.
        return cls(cache_sequences, spare_sequences, n_seq_max, pool_tokens, max(n_batch, lanes, n_seq_max))


@dataclass(frozen=True)
class Context:
    """A created ``llama_context``: ``params`` the llama_context_params it was made with,
    ``n_cells`` the KV cells the ledger enforces, ``n_batch`` / ``n_ubatch`` llama.cpp's, and
    ``step_rows`` the rows of one ``llama_decode`` (where a tick may yield)."""

    ctx: L.llama_context_p
    params: dict[str, int | bool]
    n_cells: int
    n_batch: int
    n_ubatch: int
    step_rows: int


def open_context(
    model: LlamaModel,
    sizes: Sizes,
    *,
    lanes: int,
    n_ubatch: int,
    n_threads: int,
    n_threads_batch: int,
    swa_full: bool,
    yield_step_tokens: int | None,
    kv_layout: str = "unified",
    context_length: int = 0,
) -> Context:
    """The context of ``model``: with the ``unified`` layout one KV cache of at least
    ``sizes.pool_tokens`` cells (n_ctx padded to a multiple of 256, as llama.cpp pads it anyway),
    with ``per-lane`` one stream of ``stream_cells(context_length)`` cells per sequence id (the
    ledger's pool is every stream but the scratch sequence's). EngineError(ERR_FATAL) when
    llama.cpp cannot create it, ValueError for ``yield_step_tokens`` < 1 or an unknown layout; the
    model stays open either way (the caller closes it)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    unified = kv_layout == "unified"
    n_batch = sizes.n_batch
    cp = L.llama_context_default_params()
    if unified:
        cp.n_ctx = max(-(-sizes.pool_tokens // 256) * 256, -(-n_batch // 256) * 256)
    else:
        cp.n_ctx = sizes.n_seq_max * stream_cells(context_length)
    cp.n_batch = n_batch
    cp.n_ubatch = min(n_ubatch, n_batch)
    cp.n_seq_max = sizes.n_seq_max
    cp.n_threads = n_threads
    cp.n_threads_batch = n_threads_batch
    cp.kv_unified = unified
    cp.swa_full = swa_full
    cp.no_perf = True
    ctx = L.llama_init_from_model(model.ptr, cp)
    if not ctx:
        raise EngineError(Status.ERR_FATAL, "llama.cpp cannot create the context")
    params: dict[str, int | bool] = {
        "n_ctx": cp.n_ctx,
        "n_batch": n_batch,
        "n_ubatch": cp.n_ubatch,
        "n_seq_max": sizes.n_seq_max,
        "n_threads": cp.n_threads,
        "n_threads_batch": cp.n_threads_batch,
        "kv_unified": unified,
        "swa_full": swa_full,
    }
    # llama.cpp pads n_ctx up to a multiple of 256; the pool is what was asked for, which the
    # ledger then enforces (never more than llama.cpp actually has).
    if unified:
        n_cells = min(sizes.pool_tokens, int(L.llama_n_ctx(ctx)))
    else:
        n_cells = (sizes.n_seq_max - 1) * (int(L.llama_n_ctx(ctx)) // sizes.n_seq_max)
    real_batch = int(L.llama_n_batch(ctx))
    real_ubatch = int(L.llama_n_ubatch(ctx))
    step = real_ubatch if yield_step_tokens is None else yield_step_tokens
    if step < 1:
        raise ValueError("yield_step_tokens must be >= 1")
    step_rows = max(lanes, min(real_batch, step))  # a round's decode rows: one step
    return Context(ctx, params, n_cells, real_batch, real_ubatch, step_rows)
