"""Aggregate generation throughput of ``basertd serve`` at 1 and 8 concurrent requests (issue 7).

Baseline, in the same process and minute: the same engine worker driven directly over Link W (no
coordinator: one lane, whole prompt prefilled in the admit tick, decode grants of 8), on the same
model, threads and prompt. Then a real daemon (default configuration apart from the runtime
directory) serves 1 request, then 8 concurrent ones, all greedy with ``ignore_eos`` so every
request generates exactly ``--tokens`` tokens. Prints tokens/s and the ratios daemon/direct.

    .venv/bin/python bench/bench_generate.py [--tokens 64] [--model PATH] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from basertd.client import AsyncClient, Client
from basertd.schema.abi import Finish, Sampling, SamplingFlag
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, SamplingParams, TickPlan
from basertd.server.tokenizer import GgufTokenizer
from basertd.server.worker_proc import SyncWorker, WorkerSpec

PROMPTS = [f"Story number {i}: once upon a time, in a land far away," for i in range(8)]


def direct_rate(model: str, threads: int, tokens: int) -> float:
    """Tokens/s of one lane driven directly (grant 8 per tick), after a warm-up run."""
    rundir = tempfile.mkdtemp(prefix="brt-bench-", dir="/tmp")
    tok = GgufTokenizer(model)
    prompt = np.asarray(tok.encode(PROMPTS[0], add_bos=tok.add_bos), dtype=np.uint32)
    worker = SyncWorker(
        WorkerSpec(
            engine="llamacpp", model=model, lanes=8, context_length=2048, threads=threads, runtime_dir=rundir
        )
    )
    seq = 0
    try:
        rate = 0.0
        for tag in (1, 2):  # the first run warms up
            ref = worker.proc.prompt_ring.write(prompt)
            greedy = SamplingParams(flags=int(SamplingFlag.IGNORE_EOS))
            admit = LaneAdmit(lane_tag=tag, prompt=ref, sampling=int(Sampling.GPU_GREEDY), params=greedy)
            n, first, t0 = 0, True, time.perf_counter()
            while n < tokens:
                seq += 1
                ev = worker.tick(
                    TickPlan(
                        plan_seq=seq,
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
            seq += 1
            worker.tick(TickPlan(plan_seq=seq, retires=[LaneRetire(lane_tag=tag)]))
        return rate
    finally:
        worker.close()
        tok.close()
        shutil.rmtree(rundir, ignore_errors=True)


async def _concurrent(sock: Path, n: int, tokens: int) -> float:
    async with await AsyncClient.connect(sock) as c:
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(c.generate(PROMPTS[i], max_tokens=tokens, temperature=0.0, ignore_eos=True) for i in range(n))
        )
        wall = time.perf_counter() - t0
    return sum(o.usage.completion_tokens for o in outs) / wall


def daemon_rates(model: str, threads: int, tokens: int) -> tuple[float, float]:
    """(tokens/s at 1 request, aggregate tokens/s at 8 concurrent) through a real daemon."""
    base = Path(tempfile.mkdtemp(prefix="brt-bench-", dir="/tmp"))
    cfg = base / "basertd.toml"
    worker = f'[[workers]]\nengine = "llamacpp"\nmodel = "{model}"\nthreads = {threads}\n'
    cfg.write_text(f'runtime_dir = "{base / "rt"}"\n' + worker)
    sock = base / "rt" / "basertd.sock"
    with open(base / "daemon.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "basertd.cli", "serve", "--config", str(cfg)], stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((base / "daemon.log").read_text()[-3000:])
            try:
                with Client(sock, timeout=5) as c:
                    if c.health().status == "ok":
                        break
            except OSError:
                pass
            time.sleep(0.1)
        asyncio.run(_concurrent(sock, 1, 8))  # warm-up
        one = asyncio.run(_concurrent(sock, 1, tokens))
        eight = asyncio.run(_concurrent(sock, 8, tokens))
        return one, eight
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.model is None:
        from basertd.models import default_model_path

        args.model = str(default_model_path())
    base = direct_rate(args.model, args.threads, args.tokens)
    one, eight = daemon_rates(args.model, args.threads, args.tokens)
    print(f"model {Path(args.model).name}, {args.threads} threads, {args.tokens} tokens per request (greedy)")
    print(f"direct engine, 1 lane      : {base:7.1f} tok/s   (baseline)")
    print(f"basertd, 1 request         : {one:7.1f} tok/s   ratio {one / base:5.2f}")
    print(f"basertd, 8 concurrent      : {eight:7.1f} tok/s   ratio {eight / base:5.2f} (aggregate)")


if __name__ == "__main__":
    main()
