"""The llama.cpp engine's prefill-rate curve and its KV layouts, measured with a bare loop.

Two parts, each a plain low-level llama.cpp loop (``TokenBatch`` of the engine, no coordinator):

``curve``: prefill tok/s of one ``--prompt``-token prompt fed in chunks of B tokens, one
``llama_decode`` per chunk (what a tick with a B-token prefill budget does), for B in
``--sizes``; the context has n_batch = max(B), n_ubatch ``--ubatch`` (512, the engine's).
Prints B, tok/s and the ratio to the best B. The scheduler should pick chunk sizes from this
curve (``prefill_curve`` returns it).

``layout``: for each of ``--layouts`` (``kv_unified`` true: one cache all lanes share, the engine's;
false: one KV stream per lane, llama-server's; ``swa_full`` true: a full-size sliding-window cache,
the engine's default; false: a window-sized one, llama-server's), 8 lanes each get a
``--layout-prompt``-token prompt prefilled one after another in 2,048-token batches (seconds per prompt), then
``--new`` greedy tokens are decoded for the 8 lanes together (ms per 8-lane step). Then batch
invariance: each lane's greedy output decoded alone (a fresh context holding only that lane) against
the output among the 7 others; prints how many of the 8 part and at which token.

    .venv/bin/python bench/bench_prefill_layout.py [--model PATH] [--threads 2] [curve|layout|all]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import llama_cpp as L
import numpy as np

from basertd.worker.engines.llamacpp.batch import TokenBatch
from basertd.worker.engines.llamacpp.model import LlamaModel

LAYOUTS = {
    "unified+swa_full": (True, True),
    "unified+swa_window": (True, False),
    "per-lane+swa_full": (False, True),
    "per-lane+swa_window": (False, False),
}


class Ctx:
    """One bare llama.cpp context over a loaded model; ``feed`` runs tokens of one sequence."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_ctx: int,
        n_seq: int,
        n_batch: int,
        threads: int,
        unified: bool,
        swa_full: bool,
        ubatch: int = 512,
    ) -> None:
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_batch, ubatch)
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = unified
        cp.swa_full = swa_full
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(model.ptr, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp cannot create the context")
        self.n_vocab = model.n_vocab
        self.batch = TokenBatch(max(n_batch, n_seq), n_batch)

    def run(self, parts: list[tuple[np.ndarray, int, int, bool]]) -> list[np.ndarray]:
        """Decode ``(tokens, pos0, seq, want_last)`` runs in one batch; the logits rows wanted."""
        b = self.batch
        b.clear()
        rows = [b.add(t, p, s, w) for t, p, s, w in parts]
        out: dict[int, np.ndarray] = {}

        def on_part(start: int, end: int) -> None:
            for (_, _, _, want), r in zip(parts, rows, strict=True):
                if want and start <= r < end:
                    ptr = L.llama_get_logits_ith(self.ctx, r - start)
                    out[r] = np.ctypeslib.as_array(ptr, (self.n_vocab,)).copy()

        b.decode(self.ctx, on_part)
        return [out[r] for (_, _, _, w), r in zip(parts, rows, strict=True) if w]

    def close(self) -> None:
        L.llama_free(self.ctx)


def prompts(model: LlamaModel, n: int, length: int) -> list[np.ndarray]:
    """``n`` distinct natural-language prompts of ``length`` tokens (BOS first where the model
    wants it): numbered sentences, so the text is ordinary and no two prompts share a prefix."""
    out = []
    for i in range(n):
        text = " ".join(
            f"Note {i}.{k}: the {['red', 'blue', 'green', 'old', 'quick'][(i + k) % 5]} agent {i} read file "
            f"{k * 7 + i} and reported {k * 13 % 97} warnings about module {chr(97 + (k + i) % 26)}."
            for k in range(length // 8 + 8)
        )
        toks = model.tokenize(text.encode(), True)[:length]
        out.append(np.asarray(toks, np.int32))
    return out


def prefill_curve(
    model: LlamaModel, sizes: list[int], prompt_len: int, threads: int, ubatch: int = 512
) -> list[tuple[int, float]]:
    """Prefill tok/s of one ``prompt_len``-token prompt fed in chunks of each size (one
    llama_decode per chunk), as ``[(chunk_tokens, tok_per_s)]``."""
    (toks,) = prompts(model, 1, prompt_len)
    top = max(sizes)
    c = Ctx(
        model,
        n_ctx=-(-prompt_len // 256) * 256 + 256,
        n_seq=1,
        n_batch=top,
        threads=threads,
        unified=True,
        swa_full=False,
        ubatch=ubatch,
    )
    out = []
    try:
        c.run([(toks[:8], 0, 0, True)])  # warm up
        for b in sizes:
            L.llama_memory_clear(L.llama_get_memory(c.ctx), True)
            t = time.perf_counter()
            for p in range(0, prompt_len, b):
                c.run([(toks[p : p + b], p, 0, p + b >= prompt_len)])
            out.append((b, prompt_len / (time.perf_counter() - t)))
    finally:
        c.close()
    return out


def greedy(
    c: Ctx, lanes: list[int], toks: list[np.ndarray], n_new: int, chunk: int = 2048
) -> tuple[dict[int, list[int]], list[float], list[float]]:
    """Prefill each lane's prompt (one after another, ``chunk`` tokens per llama_decode), then
    decode ``n_new`` greedy tokens for all lanes together. Returns tokens per lane, seconds per
    prompt, seconds per decode step."""
    out: dict[int, list[int]] = {}
    pre: list[float] = []
    nxt: dict[int, int] = {}
    for s in lanes:
        t = time.perf_counter()
        p = toks[s]
        row = None
        for o in range(0, len(p), chunk):
            rows = c.run([(p[o : o + chunk], o, s, o + chunk >= len(p))])
            row = rows[-1] if rows else row
        pre.append(time.perf_counter() - t)
        nxt[s] = int(np.argmax(row))
        out[s] = [nxt[s]]
    steps = []
    for k in range(n_new - 1):
        t = time.perf_counter()
        rows = c.run([(np.array([nxt[s]], np.int32), len(toks[s]) + k, s, True) for s in lanes])
        steps.append(time.perf_counter() - t)
        for s, r in zip(lanes, rows, strict=True):
            nxt[s] = int(np.argmax(r))
            out[s].append(nxt[s])
    return out, pre, steps


def parting(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def layout_bench(
    model: LlamaModel, threads: int, plen: int, n_new: int, names: list[str], invariance: bool
) -> None:
    toks = prompts(model, 8, plen)
    per_lane = -(-(plen + n_new) // 256) * 256
    for name in names:
        unified, swa_full = LAYOUTS[name]
        kw = dict(n_ctx=8 * per_lane, n_batch=2048, threads=threads, unified=unified, swa_full=swa_full)
        c = Ctx(model, n_seq=8, **kw)
        try:
            together, pre, steps = greedy(c, list(range(8)), toks, n_new)
        finally:
            c.close()
        parts = []
        for s in range(8 if invariance else 0):
            c = Ctx(model, n_seq=8, **kw)  # same context shape, only this lane in it
            try:
                alone, _, _ = greedy(c, [s], toks, n_new)
            finally:
                c.close()
            parts.append(parting(alone[s], together[s]))
        parted = [p for p in parts if p is not None]
        print(
            f"{name:22s} prefill/prompt {np.mean(pre):6.2f} s (first {pre[0]:.2f}, last {pre[-1]:.2f})  "
            f"8-lane step {1000 * np.median(steps):6.1f} ms"
            + (f"  parted alone vs among 7: {len(parted)}/8" if invariance else "")
            + (f" at tokens {sorted(parted)}" if parted else "")
        )
        sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", nargs="?", default="all", choices=["curve", "layout", "all"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=2048, help="curve: prompt tokens")
    ap.add_argument("--sizes", default="64,128,256,512,1024,2048")
    ap.add_argument("--ubatch", type=int, default=512, help="n_ubatch (the engine's default: 512)")
    ap.add_argument("--layout-prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"layout: which of {', '.join(LAYOUTS)}")
    ap.add_argument("--no-invariance", action="store_true", help="layout: skip the alone-vs-among runs")
    ap.add_argument("--no-repack", action="store_true", help="load without CPU weight repacking")
    args = ap.parse_args()
    logging.getLogger("basertd.llamacpp").setLevel(logging.ERROR)
    if args.model is None:
        from basertd.models import default_model_path

        args.model = default_model_path()
    model = LlamaModel(Path(args.model), repack=not args.no_repack)
    try:
        print(
            f"model {model.description} ({Path(args.model).name}), n_swa {model.n_swa}, "
            f"threads {args.threads}, repack {not args.no_repack}"
        )
        if args.part in ("curve", "all"):
            curve = prefill_curve(
                model, [int(x) for x in args.sizes.split(",")], args.prompt, args.threads, args.ubatch
            )
            best = max(r for _, r in curve)
            print(
                f"prefill curve ({args.prompt}-token prompt, one llama_decode per chunk, "
                f"n_ubatch {args.ubatch})"
            )
            for b, r in curve:
                print(f"  chunk {b:5d}  {r:8.1f} tok/s  {r / best:5.2f} of best")
            sys.stdout.flush()
        if args.part in ("layout", "all"):
            names = args.layouts.split(",")
            if unknown := set(names) - set(LAYOUTS):
                ap.error(f"unknown layouts {sorted(unknown)}; known: {', '.join(LAYOUTS)}")
            layout_bench(model, args.threads, args.layout_prompt, args.new, names, not args.no_invariance)
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
