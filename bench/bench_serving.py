"""Serving under contention (issue 8): throughput, interactive TTFT under batch load, and prefix
sharing of ``basertd serve`` on the default model, each printed beside its target.

A real daemon runs as a subprocess (8 lanes of 2048 tokens, ``--threads`` llama.cpp threads,
every other key at its default). Three scenarios, all against it:

1. **throughput**: aggregate tokens/s of 1 and of 8 concurrent requests (distinct prompts,
   ``--tokens`` tokens each, greedy, ignore EOS). Baseline in the same minute: the same engine
   driven directly over Link W, one lane (as bench_generate.py). ``--rounds`` alternating rounds;
   medians. Targets: llama-server's figures on this machine, 70 and 134 tokens/s.
2. **interactive TTFT**: 8 batch requests with distinct ~1,500-token prompts (max 128 tokens
   each), then, 2 s later, one short interactive request; its TTFT as the client sees it (send to
   first token) and in ticks (the daemon's access line). Baseline: the same kind of request on the
   idle daemon. Target: under 1 s.
3. **shared prefix**: 16 concurrent requests sharing a ~1,500-token prefix (distinct questions
   after it, 32 tokens each). prefills = n - sum(cached_tokens) / prefix length (the issue's
   formula; the prefix length is the tokens all 16 prompts share), cross-checked with the
   engine's own prefill counter: (prefilled tokens - the tokens after the shared pages) / prefix
   length. Wall time. Target: at most 1.2 prefills.

Prompts carry a per-run nonce at their start, so nothing is served from a previous scenario's
cache. The load average before and after each scenario is printed: on a shared 2-core box,
llama.cpp with 2 threads slows down several times while other jobs run. Exit status 1 when a
target is missed (the table says which), 0 otherwise.

    .venv/bin/python bench/bench_serving.py [--rounds 2] [--tokens 128] [--threads 2] [--model PATH]
        [--only throughput,ttft,prefix]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import DirectLane

from basertd.client import AsyncClient, Client
from basertd.schema import control

TARGETS = {"tps1": 70.0, "tps8": 134.0, "ttft": 1.0, "prefills": 1.2}
WORDS = [
    a + b for a in ("riv", "sto", "lan", "har", "mea", "cop", "win", "gar") for b in ("er", "on", "ite", "ow")
]
"""Filler words (the prompts' content does not matter, only their length and distinctness)."""


def prose(rng: random.Random, n_words: int) -> str:
    """Deterministic filler text of ``n_words`` words in sentences."""
    out = []
    for i in range(n_words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i % 12 == 0 else w)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


def sized_text(c: Client, head: str, tokens: int, seed: int) -> str:
    """``head`` followed by filler prose, about ``tokens`` tokens long in the daemon's vocabulary."""
    rng = random.Random(seed)
    words = tokens
    for _ in range(6):
        text = head + " " + prose(random.Random(seed), words)
        n = len(c.tokenize(text))
        if abs(n - tokens) <= 8:
            return text
        words = max(8, int(words * tokens / n))
    del rng
    return text


class Served:
    """``basertd serve`` on ``model`` as a subprocess with 8 lanes of 2048 tokens."""

    def __init__(self, model: str, threads: int) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="brt-serving-", dir="/tmp"))
        cfg = self.base / "basertd.toml"
        cfg.write_text(
            f'runtime_dir = "{self.base / "rt"}"\n'
            f'[[workers]]\nengine = "llamacpp"\nmodel = "{model}"\nlanes = 8\ncontext_length = 2048\n'
            f"threads = {threads}\n"
        )
        self.sock = self.base / "rt" / "basertd.sock"
        self.log = self.base / "daemon.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "basertd.cli", "serve", "--config", str(cfg)], stdout=log, stderr=log
            )
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"basertd did not start; its log is {self.log}")
            try:
                with Client(self.sock, timeout=5) as c:
                    if c.health().status == "ok":
                        break
            except OSError:
                pass
            time.sleep(0.1)

    def client(self) -> Client:
        return Client(self.sock, timeout=600)

    def engine_stats(self) -> dict[str, int]:
        """The engine's counters once the daemon is idle (a worker answers a PING that arrives
        mid-tick with the counters of before the tick)."""
        with self.client() as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                st = c.status()
                if st.lanes_busy == 0 and st.queued == 0:
                    break
                time.sleep(0.05)
            return dict(c.request(control.Workers()).workers[0].engine_stats)

    def access(self) -> dict[str, dict]:
        out = {}
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") == "access":
                out[ev["request_id"]] = ev
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)


# --- scenario 1 ---------------------------------------------------------------------------------


async def aggregate(sock: Path, prompts: list[str], tokens: int) -> float:
    async with await AsyncClient.connect(sock) as c:
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(c.generate(p, max_tokens=tokens, temperature=0.0, ignore_eos=True) for p in prompts)
        )
        wall = time.perf_counter() - t0
    return sum(o.usage.completion_tokens for o in outs) / wall


def throughput(served: Served, model: str, threads: int, rounds: int, tokens: int) -> dict:
    direct = DirectLane(model, threads)
    try:
        direct.rate(8)
        asyncio.run(aggregate(served.sock, ["warm up"], 8))
        rows = []
        for r in range(rounds):
            prompts = [f"Run {r}, story {i}: once upon a time, in a land far away," for i in range(8)]
            rows.append(
                (
                    direct.rate(tokens),
                    asyncio.run(aggregate(served.sock, prompts[:1], tokens)),
                    asyncio.run(aggregate(served.sock, prompts, tokens)),
                )
            )
    finally:
        direct.close()
    base, one, eight = (statistics.median(col) for col in zip(*rows, strict=True))
    return {"direct": base, "tps1": one, "tps8": eight, "rows": rows}


# --- scenario 2 ---------------------------------------------------------------------------------


async def first_token_s(c: AsyncClient, prompt: str, request_id: str, max_tokens: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    s = await c.stream(prompt, request_id=request_id, max_tokens=max_tokens, temperature=0.0)
    ttft = None
    ids: list[int] = []
    async for t in s:
        if ttft is None and t.ids:
            ttft = time.perf_counter() - t0
        ids.extend(t.ids)
    return (ttft if ttft is not None else float("nan")), ids


def interactive_ttft(served: Served, nonce: str, prompt_tokens: int, delay_s: float) -> dict:
    with served.client() as c:
        batch = [
            sized_text(c, f"{nonce} batch job {i}: summarise this report.", prompt_tokens, i)
            for i in range(8)
        ]
        lengths = [len(c.tokenize(p)) for p in batch]
    question = f"{nonce}: what is the capital of France?"

    async def idle() -> float:
        async with await AsyncClient.connect(served.sock) as c:
            return (await first_token_s(c, question + " (idle)", f"{nonce}-idle", 16))[0]

    async def loaded() -> dict:
        async with await AsyncClient.connect(served.sock) as c:
            t0 = time.perf_counter()
            jobs = [
                asyncio.ensure_future(
                    c.generate(
                        p, request_id=f"{nonce}-batch-{i}", max_tokens=128, temperature=0.0, qos="batch"
                    )
                )
                for i, p in enumerate(batch)
            ]
            await asyncio.sleep(delay_s)
            ttft, _ = await first_token_s(c, question, f"{nonce}-inter", 16)
            outs = await asyncio.gather(*jobs)
            return {
                "ttft": ttft,
                "batch_wall": time.perf_counter() - t0,
                "batch_tokens": [len(o.ids) for o in outs],
            }

    base = asyncio.run(idle())
    res = asyncio.run(loaded())
    line = served.access().get(f"{nonce}-inter", {})
    res.update(idle=base, ticks=line.get("ttft_ticks"), prompt_lengths=lengths)
    res["preemptions"] = sum(
        v.get("preemptions", 0) for k, v in served.access().items() if k.startswith(nonce)
    )
    return res


# --- scenario 3 ---------------------------------------------------------------------------------


def shared_prefix(served: Served, nonce: str, prefix_tokens: int, n: int = 16) -> dict:
    with served.client() as c:
        prefix = sized_text(c, f"{nonce} You are the assistant of a shared inference box.", prefix_tokens, 99)
        prompts = [prefix + f"\nQuestion {i}: in one sentence, what is item {i} about?" for i in range(n)]
        prefix_ids = c.tokenize(prefix)
        ids = [c.tokenize(p) for p in prompts]
    common = 0
    while all(len(x) > common and x[common] == ids[0][common] for x in ids):
        common += 1
    before = served.engine_stats()

    async def burst() -> tuple[list, float]:
        async with await AsyncClient.connect(served.sock) as c:
            t0 = time.perf_counter()
            outs = await asyncio.gather(
                *(
                    c.generate(p, request_id=f"{nonce}-p{i}", max_tokens=32, temperature=0.0, qos="batch")
                    for i, p in enumerate(prompts)
                )
            )
            return outs, time.perf_counter() - t0

    outs, wall = asyncio.run(burst())
    after = served.engine_stats()
    plen = common  # the tokens every prompt shares (the prefix text and the start of the question)
    cached = sum(o.usage.cached_tokens for o in outs)
    page = 16
    pages = common // page * page
    suffix = sum(len(x) - pages for x in ids)
    prefilled = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    return {
        "prefix_len": plen,
        "prefix_text_tokens": len(prefix_ids),
        "common": common,
        "cached": cached,
        "prefills": n - cached / plen,
        "engine_prefills": (prefilled - suffix) / plen,
        "prefilled": prefilled,
        "wall": wall,
        "cold_fallbacks": after.get("cold_fallbacks_total", 0) - before.get("cold_fallbacks_total", 0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="alternating throughput rounds (medians)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per throughput request")
    ap.add_argument("--prompt-tokens", type=int, default=1500, help="batch prompt / shared prefix length")
    ap.add_argument(
        "--delay", type=float, default=2.0, help="seconds between the batch and the interactive request"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    ap.add_argument("--only", default="throughput,ttft,prefix", help="comma-separated scenarios")
    args = ap.parse_args()
    if args.model is None:
        from basertd.models import default_model_path

        args.model = str(default_model_path())
    only = set(args.only.split(","))
    nonce = f"run{os.getpid()}"
    loads: dict[str, tuple[float, float]] = {}
    results: dict[str, dict] = {}
    served = Served(args.model, args.threads)
    try:
        for name, fn in (
            ("throughput", lambda: throughput(served, args.model, args.threads, args.rounds, args.tokens)),
            ("ttft", lambda: interactive_ttft(served, nonce, args.prompt_tokens, args.delay)),
            ("prefix", lambda: shared_prefix(served, nonce, args.prompt_tokens)),
        ):
            if name not in only:
                continue
            l0 = os.getloadavg()[0]
            results[name] = fn()
            loads[name] = (l0, os.getloadavg()[0])
    finally:
        served.close()

    ok = True
    print(f"model {Path(args.model).name}, {args.threads} threads, daemon: 8 lanes x 2048 tokens, defaults")
    print(f"{'scenario':44} {'result':>14} {'target':>12}  baseline / notes")

    def row(label: str, value: float, unit: str, target: str, met: bool, note: str) -> None:
        nonlocal ok
        ok = ok and met
        mark = "ok" if met else "MISSED"
        print(f"{label:44} {value:>9.2f} {unit:<4} {target:>12}  {mark:6} {note}")

    if "throughput" in results:
        t = results["throughput"]
        la = loads["throughput"]
        row(
            f"1 request, {args.tokens} tokens",
            t["tps1"],
            "tok/s",
            f">= {TARGETS['tps1']:.0f}",
            t["tps1"] >= TARGETS["tps1"],
            f"direct engine {t['direct']:.1f} tok/s (ratio {t['tps1'] / t['direct']:.2f}); "
            f"load {la[0]:.2f}->{la[1]:.2f}",
        )
        row(
            f"8 concurrent, {args.tokens} tokens each",
            t["tps8"],
            "tok/s",
            f">= {TARGETS['tps8']:.0f}",
            t["tps8"] >= TARGETS["tps8"],
            f"median of {args.rounds} rounds: {', '.join(f'{r[2]:.0f}' for r in t['rows'])}",
        )
    if "ttft" in results:
        r = results["ttft"]
        la = loads["ttft"]
        row(
            f"interactive TTFT, 8 batch x ~{args.prompt_tokens} tok",
            r["ttft"],
            "s",
            f"< {TARGETS['ttft']:.0f} s",
            r["ttft"] < TARGETS["ttft"],
            f"{r['ticks']} ticks; idle daemon {r['idle']:.3f} s; {r['preemptions']} preemption(s); "
            f"batch done in {r['batch_wall']:.1f} s ({sum(r['batch_tokens'])} tokens); "
            f"load {la[0]:.2f}->{la[1]:.2f}",
        )
    if "prefix" in results:
        p = results["prefix"]
        la = loads["prefix"]
        row(
            f"16 requests sharing {p['prefix_len']} tokens: prefills",
            p["prefills"],
            "",
            f"<= {TARGETS['prefills']}",
            p["prefills"] <= TARGETS["prefills"],
            f"engine counter: {p['engine_prefills']:.2f} prefix prefills "
            f"({p['prefilled']} tokens prefilled); wall {p['wall']:.1f} s; load {la[0]:.2f}->{la[1]:.2f}",
        )
    print("all targets met" if ok else "TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
