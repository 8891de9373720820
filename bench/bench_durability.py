"""Durable acceptance's cost and recovery time (DESIGN.md "Crash = preemption; acceptance is
durable"), printed beside their targets.

Two real ``basertd serve`` daemons run side by side in the same minute, identical but for
``[durability] mode``: "tick" (one group commit, one fsync, per tick before delivery) and "off".
Engine: the reference engine (``--engine ref``: ``--lanes`` lanes, ``--tick-us`` microseconds per
tick: isolates the coordinator's own cost) or the default model (``--engine llamacpp``,
``--threads`` threads). Rounds alternate between the two daemons; medians are printed.

1. **throughput**: aggregate tokens/s of 8 concurrent streams (``--tokens`` each, greedy, ignore
   EOS), tick / off. Target >= 0.95.
2. **inter-token latency**: the median gap between consecutive Tokens replies as the client sees
   them, tick beside off (ratio off / tick; target >= 0.95).
3. **worker SIGKILL to the next token**: one stream on the "tick" daemon; its worker is
   SIGKILLed after a few tokens; the seconds from the kill to the stream's next token (the
   worker's respawn plus the resumed lane's re-prefill). It needs the scheduler to treat a worker
   crash as a preemption; until then the stream ends with WORKER_FAILED and the row says so.

    .venv/bin/python bench/bench_durability.py [--rounds 3] [--tokens 64] [--engine ref|llamacpp]

Exit status 1 when a target is missed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from _daemon import BenchDaemon, workers_toml

from basertd.client import AsyncClient, Client, ClientError


class Served(BenchDaemon):
    """One ``basertd serve`` with ``[durability] mode = mode``."""

    def __init__(self, workers: str, mode: str) -> None:
        super().__init__(workers, prefix=f"brt-bd-{mode}-", extra=f'[durability]\nmode = "{mode}"\n')


async def burst(sock: Path, n: int, tokens: int) -> tuple[float, list[float]]:
    """``n`` concurrent streams: (aggregate tokens/s, every inter-token gap in seconds)."""
    async with await AsyncClient.connect(sock) as c:
        gaps: list[float] = []

        async def one(k: int) -> int:
            s = await c.stream(
                prompt_tokens=[1, 5 + k, 9, 13], max_tokens=tokens, temperature=0.0, ignore_eos=True
            )
            got, last = 0, None
            async for t in s:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                got += len(t.ids)
            return got

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*(one(k) for k in range(n))))
        return total / (time.perf_counter() - t0), gaps


def kill_to_next_token(served: Served, tokens: int) -> float | str:
    """Seconds from a worker SIGKILL to the next token of the stream it was serving."""
    with Client(served.sock, timeout=300) as c:
        s = c.stream(prompt_tokens=[1, 7, 11, 13], max_tokens=tokens, temperature=0.0, ignore_eos=True)
        it = iter(s)
        for _ in range(3):
            next(it)
        os.kill(served.worker_pid(), signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            # tokens the dead worker sent before the kill are already buffered and arrive at once:
            # the resumed stream's first token is the first one after a pause
            last = t0
            dt = None
            for _ in it:
                now = time.perf_counter()
                if dt is None and now - last > 0.05:
                    dt = now - t0
                last = now
            if dt is None:
                dt = last - t0
        except (ClientError, StopIteration) as exc:
            return f"stream ended: {exc!r}"
        return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--engine", choices=["ref", "llamacpp"], default="ref")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--tick-us", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.engine == "ref":
        workers = (
            workers_toml("basert", lanes=args.lanes, context_length=512)
            + f"[workers.ref_config]\nvocab_size = 259\neos_period = 0\ntick_delay_us = {args.tick_us}\n"
        )
    else:
        workers = workers_toml("llamacpp", lanes=8, context_length=1024, threads=args.threads)
    daemons = {mode: Served(workers, mode) for mode in ("tick", "off")}
    try:
        rates: dict[str, list[float]] = {"tick": [], "off": []}
        itl: dict[str, list[float]] = {"tick": [], "off": []}
        for _ in range(args.rounds):
            for mode, d in daemons.items():
                rate, gaps = asyncio.run(burst(d.sock, args.streams, args.tokens))
                rates[mode].append(rate)
                itl[mode].extend(gaps)
        kill = kill_to_next_token(daemons["tick"], args.tokens)
    finally:
        for d in daemons.values():
            d.close()
    tps = {m: statistics.median(v) for m, v in rates.items()}
    gap = {m: statistics.median(v) for m, v in itl.items()}
    ratio_tps = tps["tick"] / tps["off"]
    ratio_itl = gap["off"] / gap["tick"]
    ok = ratio_tps >= 0.95 and ratio_itl >= 0.95
    print(f"engine {args.engine}, {args.streams} streams x {args.tokens} tokens, {args.rounds} rounds")
    print(f"{'':32}{'tick':>12}{'off':>12}{'ratio':>10}  target")
    print(f"{'tokens/s (aggregate)':32}{tps['tick']:12.1f}{tps['off']:12.1f}{ratio_tps:10.3f}  >= 0.95")
    print(
        f"{'inter-token latency (ms, p50)':32}{gap['tick'] * 1e3:12.2f}{gap['off'] * 1e3:12.2f}"
        f"{ratio_itl:10.3f}  >= 0.95 (off/tick)"
    )
    if isinstance(kill, float):
        print(f"{'worker SIGKILL -> next token':32}{kill:12.3f} s")
    else:
        print(f"{'worker SIGKILL -> next token':32} n/a: {kill}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
