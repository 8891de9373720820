"""basertd against llama-server on llama-server's own ground, both over the OpenAI HTTP API, in one
run: every figure is printed beside llama-server's from the same minutes, in alternating rounds.

llama-server is built from the llama.cpp sources the installed llama-cpp-python vendors
(``llama_server.py``) and runs ``-c lanes*context -np lanes -t threads``; basertd runs one
llama.cpp worker with ``lanes`` lanes of ``context`` tokens and ``threads`` threads. Both serve the
default model (or ``--model``). Each round runs every scenario on one server, then on the other
(the order swaps each round); prompts carry a per-round nonce so no cache carries over.

1. **1 stream / 8 streams**: aggregate completion tokens/s of 1 and 8 concurrent greedy requests
   (``--tokens`` each, ``ignore_eos``), streamed.
2. **burst**: ``--agents`` streaming requests with distinct ``--prompt-tokens`` prompts
   (``--agent-tokens`` each), then ``--delay`` s later one short interactive request (basertd: the
   ``X-Basertd-QoS: interactive`` header, the agents ``batch``; llama-server has no classes).
   Wall (first send to last token), the longest stall of any agent (gap between two content
   chunks), the interactive TTFT.
3. **shared prefix**: 16 concurrent requests sharing a ``--prefix-tokens`` prefix (32 tokens
   each). Wall and prefills = prompt tokens evaluated / prefix length (basertd: prompt - cached
   tokens from ``usage``; llama-server: ``timings.prompt_n``).
4. **returning prompt**: agent 0's prompt of the burst sent again after the shared-prefix burst
   pushed other traffic through the KV pool; its TTFT.
5. **footprint**: the servers' RSS (every process of the server: basertd's coordinator and worker)
   after the rounds, and start-to-ready seconds (spawn to /health 200): the median of ``--starts``
   starts of each, alternating, the first being the one the rounds ran on (the others follow the
   rounds, one server at a time).

Targets (ratios to llama-server in the same run): agents' wall <= 0.9x, 1 stream >= 1.0x,
8 streams >= 1.05x, returning TTFT <= 1.0x, RSS <= 1.0x, start <= 1.5x; absolute: interactive TTFT
<= 0.3 s, no stall over 1 s, shared-prefix prefills <= 1.1. Exit status 1 when a target is missed.

``--device cuda`` puts every layer on the GPU for both (basertd ``device = "cuda:0"``, llama-server
``-ngl 99``; a CUDA build of each).

    .venv/bin/python bench/bench_vs_llama_server.py [--rounds 3] [--threads 2] [--only 1,8,burst,prefix]
        [--starts 1] [--device cpu|cuda] [--model PATH] [--config '[scheduler]\\nmax_itl_s = 2.0']
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import BenchDaemon, workers_toml
from llama_server import LlamaServer

from basertd.models import default_model_path

QOS = "X-Basertd-QoS"
WORDS = [
    a + b for a in ("riv", "sto", "lan", "har", "mea", "cop", "win", "gar") for b in ("er", "on", "ite", "ow")
]


def prose(seed: int, n_words: int) -> str:
    """Deterministic filler text of ``n_words`` words (``tokens_per_word`` gives the model's rate)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + ("." if i % 12 == 11 else "") for i in range(n_words))


def tokens_per_word(model: str) -> float:
    """Tokens per word of ``prose`` on ``model``'s vocabulary (about 2 on Gemma 3), so prompts are
    sized in tokens: a guess of 1.3 made the agents' prompts 2,700 tokens, past a 2,048-token lane."""
    from basertd.server.request.tokenizer import GgufTokenizer

    tok = GgufTokenizer(model)
    try:
        return len(tok.encode(prose(0, 2000), add_bos=False)) / 2000
    finally:
        tok.close()


def rss_mib(pids: list[int]) -> float:
    """Resident memory of ``pids`` and all their descendants, MiB (from /proc)."""
    seen, todo, total = set(), list(pids), 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for tid in os.listdir(f"/proc/{pid}/task"):
                kids = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                todo.extend(int(k) for k in kids)
        except OSError:
            continue
    return total / 1024


class Server:
    """One server under test: ``name``, ``url``, the headers of a batch / interactive request,
    its pids, how to read prompt tokens evaluated from a finished response."""

    def __init__(self, name: str, url: str, pids: Callable[[], list[int]], qos: bool, ready_s: float) -> None:
        self.name, self.url, self.pids, self.qos, self.ready_s = name, url, pids, qos, ready_s

    def headers(self, qos: str) -> dict[str, str]:
        return {QOS: qos} if self.qos else {}


async def stream(
    http: aiohttp.ClientSession,
    srv: Server,
    prompt: str,
    max_tokens: int,
    qos: str = "batch",
    ignore_eos: bool = True,
) -> dict[str, Any]:
    """One streamed greedy /v1/completions: send time, content-chunk times, completion tokens,
    prompt tokens evaluated (None when the server does not say)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    async with http.post(srv.url + "/v1/completions", json=body, headers=srv.headers(qos)) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if any(c.get("text") for c in obj.get("choices") or []):
                times.append(time.perf_counter())
            usage = obj.get("usage") or usage
            timings = obj.get("timings") or timings
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) if usage else None
    evaluated = timings.get("prompt_n")
    if evaluated is None and usage.get("prompt_tokens") is not None:
        evaluated = usage["prompt_tokens"] - (cached or 0)
    tokens = usage.get("completion_tokens", len(times))
    return {
        "t0": t0,
        "times": times,
        "tokens": tokens,
        "evaluated": evaluated,
        "prompt": usage.get("prompt_tokens"),
    }


def ttft(r: dict[str, Any]) -> float:
    return r["times"][0] - r["t0"] if r["times"] else float("nan")


def stall(r: dict[str, Any]) -> float:
    return max((b - a for a, b in itertools.pairwise(r["times"])), default=0.0)


async def rate(http: aiohttp.ClientSession, srv: Server, n: int, tokens: int, nonce: str) -> float:
    prompts = [f"{nonce} story {i}: once upon a time, in a land far away," for i in range(n)]
    t0 = time.perf_counter()
    out = await asyncio.gather(*(stream(http, srv, p, tokens) for p in prompts))
    return sum(r["tokens"] for r in out) / (time.perf_counter() - t0)


async def burst(
    http: aiohttp.ClientSession, srv: Server, a: argparse.Namespace, nonce: str, r: int
) -> dict[str, Any]:
    words = int(a.prompt_tokens / a.tokens_per_word)
    prompts = [f"{nonce} agent {i}: " + prose(1000 * r + i, words) for i in range(a.agents)]
    t0 = time.perf_counter()
    agents = [asyncio.create_task(stream(http, srv, p, a.agent_tokens)) for p in prompts]
    await asyncio.sleep(a.delay)
    inter = await stream(http, srv, f"{nonce} Hi! What is 2+2?", 8, qos="interactive", ignore_eos=False)
    done = await asyncio.gather(*agents)
    wall = max(r["times"][-1] for r in done if r["times"]) - t0
    return {
        "wall": wall,
        "stall": max(stall(r) for r in done),
        "ttft_inter": ttft(inter),
        "_prompt0": prompts[0],
    }


async def prefix(
    http: aiohttp.ClientSession, srv: Server, a: argparse.Namespace, nonce: str, r: int
) -> dict[str, float]:
    shared = f"{nonce} shared context: " + prose(r, int(a.prefix_tokens / a.tokens_per_word))
    t0 = time.perf_counter()
    out = await asyncio.gather(
        *(stream(http, srv, f"{shared}\nQuestion {i}: why {WORDS[i]}?", 32) for i in range(16))
    )
    wall = time.perf_counter() - t0
    plen = min(r["prompt"] or 0 for r in out) - 8  # the distinct questions are a few tokens each
    evaluated = [r["evaluated"] for r in out]
    prefills = (sum(evaluated) - 16 * 8) / plen if None not in evaluated and plen > 0 else float("nan")
    return {"prefix_wall": wall, "prefills": prefills}


async def one_round(srv: Server, a: argparse.Namespace, r: int) -> dict[str, float]:
    nonce = f"[{srv.name} round {r} {time.time_ns() % 10**9}]"
    out: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=1800)
    # A new connection per request: llama-server drops idle keep-alive connections, which a
    # pooled client then reuses ("Server disconnected" on the next request).
    conn = aiohttp.TCPConnector(limit=64, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
        if "1" in a.only:
            out["tps1"] = await rate(http, srv, 1, a.tokens, nonce)
        if "8" in a.only:
            out["tps8"] = await rate(http, srv, 8, a.tokens, nonce)
        prompt0 = None
        if "burst" in a.only:
            b = await burst(http, srv, a, nonce, r)
            prompt0 = b.pop("_prompt0")
            out.update(b)
        if "prefix" in a.only:
            out.update(await prefix(http, srv, a, nonce, r))
            if prompt0 is not None:
                again = await stream(http, srv, prompt0, 4, qos="interactive", ignore_eos=False)
                out["ttft_return"] = ttft(again)
    return out


def load() -> str:
    return "load {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


ROWS = [  # key, label, unit, target kind ("ge"/"le" ratio to llama-server, or "abs" bound), target
    ("tps1", "decode tok/s, 1 stream", "tok/s", "ge", 1.0),
    ("tps8", "decode tok/s, 8 streams", "tok/s", "ge", 1.05),
    ("wall", "agents' burst: wall", "s", "le", 0.9),
    ("stall", "agents' burst: longest stall", "s", "abs", 1.0),
    ("ttft_inter", "interactive TTFT behind the agents", "s", "abs", 0.3),
    ("prefills", "shared prefix: prefills", "", "abs", 1.1),
    ("prefix_wall", "shared prefix: wall", "s", "none", 0.0),
    ("ttft_return", "returning prompt: TTFT", "s", "le", 1.0),
    ("rss", "RSS of the server's processes", "MiB", "le", 1.0),
    ("ready", "start to ready", "s", "le", 1.5),
]


def table(ours: dict[str, float], theirs: dict[str, float]) -> bool:
    ok = True
    print(f"\n{'figure':40} {'basertd':>10} {'llama-server':>13} {'ratio':>7}  target")
    for key, label, unit, kind, target in ROWS:
        if key not in ours:
            continue
        b, ls = ours[key], theirs.get(key, float("nan"))
        ratio = b / ls if ls else float("nan")
        if kind == "ge":
            met, want = ratio >= target, f">= {target}x"
        elif kind == "le":
            met, want = ratio <= target, f"<= {target}x"
        elif kind == "abs":
            met, want = b <= target, f"<= {target:g} {unit}".strip()
        else:
            met, want = True, ""
        ok &= met
        mark = "" if kind == "none" else ("ok" if met else "MISSED")
        print(f"{label:40} {b:10.3f} {ls:13.3f} {ratio:7.2f}  {want} {mark}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--agent-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=1740)
    p.add_argument("--prefix-tokens", type=int, default=1798)
    p.add_argument("--delay", type=float, default=2.0)
    p.add_argument("--only", default="1,8,burst,prefix")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--starts", type=int, default=1, help="starts of each server whose median is 'ready'")
    p.add_argument("--config", default="", help="TOML added to basertd's configuration ([scheduler] ...)")
    p.add_argument("--kv-layout", default=None, choices=["unified", "per-lane"],
                   help="basertd's KV layout ([[workers]] kv_layout; default: the daemon's)")  # fmt: skip
    a = p.parse_args()
    gpu = a.device == "cuda"
    a.only = set(a.only.split(","))
    model = a.model or str(default_model_path())
    a.tokens_per_word = tokens_per_word(model)
    workers = workers_toml(model=model, lanes=a.lanes, context_length=a.context, threads=a.threads,
                           device="cuda:0" if gpu else None, kv_layout=a.kv_layout)  # fmt: skip

    def start_ours() -> tuple[BenchDaemon, float]:
        t0 = time.monotonic()
        d = BenchDaemon(workers, prefix="brt-vs-", http=True, extra=a.config.replace("\\n", "\n") + "\n")
        return d, time.monotonic() - t0

    def start_theirs() -> LlamaServer:
        return LlamaServer(model, ctx=a.lanes * a.context, parallel=a.lanes, threads=a.threads,
                           extra=("-ngl", "99" if gpu else "0"))  # fmt: skip

    ours_d, ours_ready = start_ours()
    theirs_s = start_theirs()
    readies = {"basertd": [ours_ready], "llama-server": [theirs_s.ready_s]}
    try:
        ours = Server("basertd", ours_d.url or "", lambda: [ours_d.proc.pid], True, ours_ready)
        theirs = Server("llama-server", theirs_s.url, lambda: theirs_s.pids, False, theirs_s.ready_s)
        rows: dict[str, list[dict[str, float]]] = {"basertd": [], "llama-server": []}
        for r in range(a.rounds):
            order = (ours, theirs) if r % 2 == 0 else (theirs, ours)
            for srv in order:
                print(f"round {r + 1}/{a.rounds}: {srv.name} ({load()})", flush=True)
                got = asyncio.run(one_round(srv, a, r))
                print("  " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
                rows[srv.name].append(got)
        med = {
            name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in rows.items() if rs
        }
        for srv in (ours, theirs):
            med[srv.name]["rss"] = rss_mib(srv.pids())
    finally:
        ours_d.close()
        theirs_s.close()
    for i in range(1, a.starts):
        for name in ("basertd", "llama-server") if i % 2 else ("llama-server", "basertd"):
            if name == "basertd":
                d, ready = start_ours()
                d.close()
            else:
                srv_l = start_theirs()
                ready = srv_l.ready_s
                srv_l.close()
            readies[name].append(ready)
            print(f"start {i + 1}/{a.starts}: {name} ready in {ready:.2f} s ({load()})", flush=True)
    for name, rs in readies.items():
        med[name]["ready"] = statistics.median(rs)
    print(f"\nmedians of {a.rounds} rounds; model {Path(model).name}, {a.lanes} lanes x {a.context}, "
          f"{a.threads} threads, {a.device}; {load()}")  # fmt: skip
    return 0 if table(med["basertd"], med["llama-server"]) else 1


if __name__ == "__main__":
    sys.exit(main())
