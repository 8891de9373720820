"""Aggregate generation throughput of ``basertd serve`` at 1 and 8 concurrent requests.

Baseline, in the same process and minute: the same engine worker driven directly over Link W (no
coordinator: one lane, whole prompt prefilled in the admit tick, decode grants of 8), on the same
model, threads and prompt. A real daemon (default configuration apart from the runtime directory)
serves 1 request, then 8 concurrent ones, all greedy with ``ignore_eos`` so every request generates
exactly ``--tokens`` tokens. The three measurements alternate for ``--rounds`` rounds, so a noisy
neighbour on a shared box hits each alike; prints medians of tokens/s and of the ratios
daemon/direct.

    .venv/bin/python bench/bench_generate.py [--tokens 64] [--rounds 3] [--model PATH] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _daemon import BenchDaemon, workers_toml

from basertd.client import AsyncClient
from basertd.schema.abi import Finish, Sampling, SamplingFlag
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, SamplingParams, TickPlan
from basertd.server.request.tokenizer import GgufTokenizer
from basertd.server.workers.process import WorkerSpec
from basertd.server.workers.sync_worker import SyncWorker

PROMPTS = [f"Story number {i}: once upon a time, in a land far away," for i in range(8)]


class DirectLane:
    """The baseline: one lane driven directly over Link W (whole prompt prefilled in the admit
    tick, decode grants of 8), on its own worker."""

    def __init__(self, model: str, threads: int) -> None:
        self.rundir = tempfile.mkdtemp(prefix="brt-bench-", dir="/tmp")
        self.tok = GgufTokenizer(model)
        self.prompt = np.asarray(self.tok.encode(PROMPTS[0], add_bos=self.tok.add_bos), dtype=np.uint32)
        self.worker = SyncWorker(
            WorkerSpec(
                engine="llamacpp",
                model=model,
                lanes=8,
                context_length=2048,
                threads=threads,
                runtime_dir=self.rundir,
            )
        )
        self.seq = 0
        self.tag = 0

    def rate(self, tokens: int) -> float:
        """Tokens/s of one greedy generation of ``tokens`` tokens."""
        self.tag += 1
        tag, prompt = self.tag, self.prompt
        ref = self.worker.proc.prompt_ring.write(prompt)
        greedy = SamplingParams(flags=int(SamplingFlag.IGNORE_EOS))
        admit = LaneAdmit(lane_tag=tag, prompt=ref, sampling=int(Sampling.GPU_GREEDY), params=greedy)
        n, first, t0 = 0, True, time.perf_counter()
        while n < tokens:
            self.seq += 1
            ev = self.worker.tick(
                TickPlan(
                    plan_seq=self.seq,
                    prefill_token_budget=len(prompt) if first else 0,
                    max_decode_lanes=1,
                    admits=[admit] if first else [],
                    prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))]
                    if first
                    else [],
                    decodes=[LaneDecode(lane_tag=tag, max_new_tokens=min(8, tokens - n))],
                )
            )
            first = False
            n += ev.emits[0].n_tokens
            if ev.emits[0].finish != Finish.NONE:
                break
        rate = n / (time.perf_counter() - t0)
        self.seq += 1
        self.worker.tick(TickPlan(plan_seq=self.seq, retires=[LaneRetire(lane_tag=tag)]))
        return rate

    def close(self) -> None:
        self.worker.close()
        self.tok.close()
        shutil.rmtree(self.rundir, ignore_errors=True)


async def _concurrent(sock: Path, n: int, tokens: int) -> float:
    async with await AsyncClient.connect(sock) as c:
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(c.generate(PROMPTS[i], max_tokens=tokens, temperature=0.0, ignore_eos=True) for i in range(n))
        )
        wall = time.perf_counter() - t0
    return sum(o.usage.completion_tokens for o in outs) / wall


class DaemonUnderTest(BenchDaemon):
    """A real ``basertd serve`` on the model (default configuration but the runtime directory)."""

    def __init__(self, model: str, threads: int) -> None:
        super().__init__(workers_toml(model=model, threads=threads))
        asyncio.run(_concurrent(self.sock, 1, 8))  # warm-up

    def rate(self, n: int, tokens: int) -> float:
        """Aggregate tokens/s of ``n`` concurrent greedy requests of ``tokens`` tokens."""
        return asyncio.run(_concurrent(self.sock, n, tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians are printed)")
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.model is None:
        from basertd.models import default_model_path

        args.model = str(default_model_path())
    direct = DirectLane(args.model, args.threads)
    try:
        direct.rate(8)  # warm-up
        daemon = DaemonUnderTest(args.model, args.threads)
        try:
            rows = []
            for _ in range(args.rounds):  # alternate, so a noisy neighbour hits every column alike
                rows.append(
                    (direct.rate(args.tokens), daemon.rate(1, args.tokens), daemon.rate(8, args.tokens))
                )
        finally:
            daemon.close()
    finally:
        direct.close()
    base, one, eight = (statistics.median(col) for col in zip(*rows, strict=True))
    r1 = statistics.median(r[1] / r[0] for r in rows)
    r8 = statistics.median(r[2] / r[0] for r in rows)
    print(
        f"model {Path(args.model).name}, {args.threads} threads, {args.tokens} tokens per request (greedy), ",
        end="",
    )
    print(f"median of {args.rounds} alternating rounds; load average {os.getloadavg()[0]:.2f}")
    print(f"direct engine, 1 lane      : {base:7.1f} tok/s   (baseline)")
    print(f"basertd, 1 request         : {one:7.1f} tok/s   ratio {r1:5.2f}")
    print(f"basertd, 8 concurrent      : {eight:7.1f} tok/s   ratio {r8:5.2f} (aggregate)")


if __name__ == "__main__":
    main()
