"""What a speculative round's verification costs on the llama.cpp engine, with a bare loop: one
``llama_decode`` of ``1 + m`` tokens of one sequence at position ``--position`` (every row with
logits, as a verification batch has; and, for comparison, only the last row), against a one-token
step, for m in ``--drafts``. Prints milliseconds and the ratio to the one-token step, ``--reps``
times (median of 6 decodes each; the drafted KV is removed after each). The constants
``VERIFY_BASE`` / ``VERIFY_PER_DRAFT`` of ``basertd.worker.engines.llamacpp.verify_cost`` are a
line fitted to the all-rows ratios for m >= 3 on the default model with 2 threads: the cost the
engine assumes until it has measured its own (``VerifyCost``).

``--device cuda`` offloads every layer (a CUDA build of llama.cpp), where draft rows cost far less.

    .venv/bin/python bench/bench_verify_cost.py [--model PATH] [--threads 2] [--position 1000]
        [--drafts 1,3,7,11,15,23,31,47] [--reps 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import llama_cpp as L
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefill_layout import Ctx, prompts

from basertd.models import default_model_path
from basertd.worker.engines.llamacpp.model import LlamaModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--position", type=int, default=1000)
    ap.add_argument("--drafts", default="1,3,7,11,15,23,31,47")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    drafts = [int(x) for x in a.drafts.split(",")]
    L.llama_backend_init()
    model = LlamaModel(a.model or str(default_model_path()), n_gpu_layers=-1 if a.device == "cuda" else 0)
    (toks,) = prompts(model, 1, a.position + max(drafts) + 1)
    c = Ctx(
        model,
        n_ctx=-(-(a.position + 256) // 256) * 256 + 256,
        n_seq=1,
        n_batch=1024,
        threads=a.threads,
        unified=True,
        swa_full=True,
    )
    mem = L.llama_get_memory(c.ctx)
    p0 = a.position
    try:
        c.run([(toks[:p0], 0, 0, True)])

        def step(n: int, every: bool) -> float:
            times = []
            for _ in range(6):
                b = c.batch
                b.clear()
                for i in range(n):
                    b.add(toks[p0 + i : p0 + i + 1], p0 + i, 0, every or i == n - 1)
                t = time.perf_counter()
                b.decode(c.ctx, lambda s, e: None)
                times.append(time.perf_counter() - t)
                L.llama_memory_seq_rm(mem, 0, p0, -1)
            return 1000 * float(np.median(times))

        print(f"position {p0}, {a.threads} threads: ms per llama_decode (ratio to a 1-token step)")
        for _ in range(a.reps):
            one = step(1, True)
            cells = [f"m=0 {one:.1f}"]
            for m in drafts:
                every, last = step(1 + m, True), step(1 + m, False)
                cells.append(f"m={m} all {every:.1f} ({every / one:.2f}) last {last:.1f} ({last / one:.2f})")
            print("  ".join(cells), flush=True)
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
