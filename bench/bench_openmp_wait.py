"""Single-stream decode of ``basertd serve`` under several OpenMP wait settings of its workers, in
one run: the coordinator's default (``basertd.server.workers.environment.compute_env``) and each
``--variant`` (``KEY=VALUE[,KEY=VALUE]`` set in the daemon's environment, e.g.
``OMP_WAIT_POLICY=PASSIVE`` or ``GOMP_SPINCOUNT=300000``, libgomp's own default).

Each round starts, for every setting in turn (the order rotating every round), one daemon on the
default model (8 lanes x 2048 tokens, ``--threads`` llama.cpp threads, no HTTP), runs ``--per``
greedy ``--tokens``-token streamed requests one after the other, and stops it: one daemon at a
time, since an idle worker whose threads spin (``OMP_WAIT_POLICY=ACTIVE`` spins for good) would
take a core from the one measured. Printed: each request's
tokens/s, the medians, each setting's ratio to the default's, and the load average before and
after (on a shared 2-core box spinning threads degrade with the load; passive ones pay a futex
wake at every barrier inside a step).

    .venv/bin/python bench/bench_openmp_wait.py [--rounds 3] [--per 3] [--tokens 128] [--threads 2]
        [--variant OMP_WAIT_POLICY=PASSIVE --variant GOMP_SPINCOUNT=300000 ...] [--model PATH]
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

WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def start(model: str, threads: int, env: dict[str, str]) -> BenchDaemon:
    """A daemon whose environment has ``env`` and no other OpenMP wait setting of ours."""
    saved = {k: os.environ.pop(k) for k in WAIT_KEYS if k in os.environ}
    os.environ.update(env)
    try:
        return BenchDaemon(
            workers_toml(model=model, lanes=8, context_length=2048, threads=threads), prefix="brt-omp-"
        )
    finally:
        for k in (*WAIT_KEYS, *env):
            os.environ.pop(k, None)
        os.environ.update(saved)


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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per", type=int, default=3, help="requests per daemon start")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], help="KEY=VALUE[,KEY=VALUE]")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    settings = {"default": {}} | {v: dict(kv.split("=", 1) for kv in v.split(",")) for v in args.variant}
    l0 = os.getloadavg()[0]
    rows: dict[str, list[float]] = {name: [] for name in settings}
    names = list(settings)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            d = start(model, args.threads, settings[name])
            try:
                asyncio.run(rate(d.sock, "warm up", 8))
                for i in range(args.per):
                    prompt = f"Run {r}.{i}, story: once upon a time, in a land far away,"
                    rows[name].append(asyncio.run(rate(d.sock, prompt, args.tokens)))
            finally:
                d.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"model {Path(model).name}, {args.threads} threads, 1 stream x {args.tokens} tokens")
    for k, v in rows.items():
        runs = " ".join(f"{x:.1f}" for x in v)
        print(
            f"{k:32} median {med[k]:6.1f} tok/s (x{med[k] / med['default']:.2f})"
            f"  min {min(v):5.1f}  max {max(v):5.1f}  runs {runs}"
        )
    print(f"load {l0:.2f}->{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
