"""Single-stream decode of ``basertd serve`` with the workers' OpenMP threads passive (the
coordinator's default, ``basertd.server.workers.process.compute_env``) against the same daemon with
them spinning (``OMP_WAIT_POLICY=ACTIVE``, libgomp's own default), in one run.

Two daemons on the default model (8 lanes x 2048 tokens, ``--threads`` llama.cpp threads, no HTTP)
serve ``--rounds`` rounds of one greedy ``--tokens``-token streamed request each, alternating which
goes first; only one decodes at a time. Printed: each request's tokens/s, the medians, the ratio
passive / spinning, and the load average before and after (on a shared 2-core box the spinning
daemon degrades with the load; on an idle one the two should be within noise).

    .venv/bin/python bench/bench_openmp_wait.py [--rounds 8] [--tokens 128] [--threads 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import BenchDaemon, workers_toml

from basertd.client import AsyncClient
from basertd.models import default_model_path


def start(model: str, threads: int, policy: str | None) -> BenchDaemon:
    """A daemon whose environment sets ``OMP_WAIT_POLICY`` to ``policy`` (None: unset, so the
    coordinator gives its workers its default)."""
    saved = os.environ.pop("OMP_WAIT_POLICY", None)
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
    try:
        return BenchDaemon(
            workers_toml(model=model, lanes=8, context_length=2048, threads=threads), prefix="brt-omp-"
        )
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved


async def rate(sock: Path, prompt: str, tokens: int) -> float:
    """Tokens/s of one streamed greedy request (send to last token)."""
    async with await AsyncClient.connect(sock) as c:
        t0 = time.perf_counter()
        s = await c.stream(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
        n = 0
        async for t in s:
            n += len(t.ids)
        return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    l0 = os.getloadavg()[0]
    passive = start(model, args.threads, None)
    spinning = start(model, args.threads, "ACTIVE")
    rows: dict[str, list[float]] = {"passive": [], "spinning": []}
    try:
        for d in (passive, spinning):
            asyncio.run(rate(d.sock, "warm up", 8))
        for r in range(args.rounds):
            order = [("passive", passive), ("spinning", spinning)]
            for name, d in order if r % 2 == 0 else order[::-1]:
                prompt = f"Run {r}, story: once upon a time, in a land far away,"
                rows[name].append(asyncio.run(rate(d.sock, prompt, args.tokens)))
    finally:
        passive.close()
        spinning.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"model {Path(model).name}, {args.threads} threads, 1 stream x {args.tokens} tokens")
    for k, v in rows.items():
        runs = " ".join(f"{x:.1f}" for x in v)
        print(f"{k:9} median {med[k]:6.1f} tok/s  min {min(v):5.1f}  max {max(v):5.1f}  runs {runs}")
    ratio = med["passive"] / med["spinning"]
    print(f"ratio passive / spinning {ratio:.2f}; load {l0:.2f}->{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
