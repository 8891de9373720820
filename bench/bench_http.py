"""Tokens/s and TTFT through the OpenAI-compatible HTTP API beside the native socket, same daemon,
same run.

One real ``basertd serve`` (the model's llamacpp worker, default configuration but the runtime
directory, HTTP on 127.0.0.1 port 0) serves ``n`` concurrent greedy streamed requests with
``ignore_eos`` (exactly ``--tokens`` tokens each) at n = 1 and 8, alternately through the native
socket (``basertd.client.AsyncClient``) and through ``POST /v1/completions`` with
``stream: true`` (aiohttp client, SSE). TTFT: from sending to the first token's text arriving.
Prints medians over ``--rounds`` rounds and the ratios HTTP/native.

    .venv/bin/python bench/bench_http.py [--tokens 64] [--rounds 3] [--model PATH] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import aiohttp
from _daemon import BenchDaemon, workers_toml

from basertd.client import AsyncClient

PROMPTS = [f"Story number {i}: once upon a time, in a land far away," for i in range(8)]


async def native_one(c: AsyncClient, prompt: str, tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    ttft = 0.0
    n = 0
    stream = await c.stream(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async for t in stream:
        if not ttft and t.ids:
            ttft = time.perf_counter() - t0
        n += len(t.ids)
    return n, ttft


async def http_one(s: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> tuple[int, float]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    ttft = 0.0
    n = 0
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if not ttft:
                ttft = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return n, ttft


async def measure(kind: str, sock: Path, url: str, n: int, tokens: int) -> tuple[float, float]:
    """(aggregate tokens/s, median TTFT seconds) of ``n`` concurrent requests."""
    if kind == "native":
        async with await AsyncClient.connect(sock) as c:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(native_one(c, PROMPTS[i], tokens) for i in range(n)))
    else:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(http_one(s, url, PROMPTS[i], tokens) for i in range(n)))
    wall = time.perf_counter() - t0
    return sum(o[0] for o in outs) / wall, statistics.median(o[1] for o in outs)


class DaemonUnderTest(BenchDaemon):
    """A real ``basertd serve`` on the model, listening for HTTP on an ephemeral loopback port."""

    def __init__(self, model: str, threads: int) -> None:
        super().__init__(workers_toml(model=model, threads=threads), http=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.model is None:
        from basertd.models import default_model_path

        args.model = str(default_model_path())
    d = DaemonUnderTest(args.model, args.threads)
    try:
        asyncio.run(measure("native", d.sock, d.url, 1, 8))  # warm-up
        asyncio.run(measure("http", d.sock, d.url, 1, 8))
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for n in (1, 8):
                for kind in ("native", "http"):
                    results.setdefault((kind, n), []).append(
                        asyncio.run(measure(kind, d.sock, d.url, n, args.tokens))
                    )
    finally:
        d.close()
    print(
        f"model {Path(args.model).name}, {args.threads} threads, {args.tokens} tokens per request (greedy), "
        f"median of {args.rounds} alternating rounds; load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'streams':>7} {'native tok/s':>13} {'http tok/s':>11} {'ratio':>6} "
        f"{'native TTFT':>12} {'http TTFT':>10}"
    )
    for n in (1, 8):
        nat, web = results[("native", n)], results[("http", n)]
        rn, rh = statistics.median(r[0] for r in nat), statistics.median(r[0] for r in web)
        tn, th = statistics.median(r[1] for r in nat), statistics.median(r[1] for r in web)
        print(f"{n:>7} {rn:>13.1f} {rh:>11.1f} {rh / rn:>6.3f} {tn * 1e3:>9.1f} ms {th * 1e3:>7.1f} ms")


if __name__ == "__main__":
    main()
