"""Embeddings on the default model over ``/v1/embeddings``: inputs per second at batch 1 and batch
32, and what embedding costs the generation lanes of the same worker (one stream's tokens/s alone,
then while a client embeds batches of 32 without pause; the ratio of the two).

Inputs are ~``--input-tokens`` tokens of filler prose each, distinct per request. One worker of
8 lanes x 2048 tokens, ``--threads`` llama.cpp threads.

    .venv/bin/python bench/bench_embeddings.py [--seconds 10] [--threads 2] [--input-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import BenchDaemon, workers_toml
from bench_vs_llama_server import prose

from basertd.models import default_model_path


async def embed_rate(
    url: str, batch: int, seconds: float, words: int, stop: asyncio.Event | None = None
) -> float:
    """Inputs embedded per second by one client sending ``batch`` inputs a request."""
    n, k = 0, 0
    async with aiohttp.ClientSession() as http:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds and not (stop and stop.is_set()):
            inputs = [f"{k}.{i} " + prose(k * 100 + i, words) for i in range(batch)]
            async with http.post(
                url + "/v1/embeddings", json={"input": inputs, "encoding_format": "base64"}
            ) as r:
                r.raise_for_status()
                await r.read()
            n += batch
            k += 1
        return n / (time.perf_counter() - t0)


async def stream_rate(url: str, tokens: int) -> float:
    """Tokens/s of one streamed greedy completion of ``tokens`` tokens."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as http:
        t0 = time.perf_counter()
        async with http.post(url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for _ in r.content:
                pass
        return tokens / (time.perf_counter() - t0)


async def contended(url: str, tokens: int, words: int) -> tuple[float, float]:
    stop = asyncio.Event()
    emb = asyncio.create_task(embed_rate(url, 32, 3600, words, stop))
    await asyncio.sleep(0.5)
    tps = await stream_rate(url, tokens)
    stop.set()
    return tps, await emb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    words = int(a.input_tokens / 1.3)
    model = str(default_model_path())
    with BenchDaemon(
        workers_toml(model=model, lanes=8, context_length=2048, threads=a.threads),
        prefix="brt-emb-",
        http=True,
    ) as d:
        url = d.url or ""
        asyncio.run(embed_rate(url, 1, 1.0, words))  # warm: the embeddings context is made on first use
        one = asyncio.run(embed_rate(url, 1, a.seconds, words))
        many = asyncio.run(embed_rate(url, 32, a.seconds, words))
        alone = asyncio.run(stream_rate(url, a.tokens))
        beside, emb_beside = asyncio.run(contended(url, a.tokens, words))
    print(f"load {os.getloadavg()[0]:.1f}; {a.input_tokens}-token inputs, {a.threads} threads")
    print(f"embeddings/s, batch 1:  {one:8.1f}")
    print(f"embeddings/s, batch 32: {many:8.1f}  ({many / one:.1f}x batch 1)")
    print(f"one stream alone:            {alone:6.1f} tok/s")
    ratio = beside / alone
    print(f"one stream beside embedding: {beside:6.1f} tok/s  ({ratio:.2f}x alone)")
    print(f"embeddings/s meanwhile:     {emb_beside:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
