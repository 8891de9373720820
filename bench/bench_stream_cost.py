"""What one streamed token costs each server's processes, beside llama-server in the same run: the
CPU seconds and context switches per completion token of every thread of basertd's coordinator, of
its worker, and of llama-server, over single greedy streams on the OpenAI HTTP API.

On a 2-core box whose two llama.cpp compute threads meet at a barrier after every operation, every
wake-up of another thread takes a core from one of them and the other waits at the next barrier, so
serving work per token costs decode speed even though it runs in another process. Wall-clock
tokens/s on a shared box swings by 10 %; these counts hardly move with the load, so a change to the
per-token path shows in them first (``/proc/PID/task/*/stat`` utime + stime,
``/proc/PID/task/*/status`` voluntary and non-voluntary context switches, read before and after
each request). Also printed per request: tokens/s (send to last token), TTFT and the inter-token
gap's p50 / p99 (between content chunks).

``--extra`` is TOML appended to basertd's configuration (e.g. ``[scheduler]\\ndecode_grant = 4``);
``--durability write,tick`` runs one basertd per ``[durability] mode`` listed, one after the other
in this run, and prints each mode's medians as ratios to the first's; ``write:1000`` also sets
``sync_interval_ms`` (do not also set ``[durability]`` in ``--extra``); ``--threads-detail``
prints every thread that woke at least 0.05 times a token.

    .venv/bin/python bench/bench_stream_cost.py [--requests 3] [--tokens 256] [--threads 2]
        [--no-llama-server] [--extra TOML] [--durability MODE[:MS],...] [--threads-detail]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import BenchDaemon, workers_toml
from bench_vs_llama_server import Server, stream
from llama_server import LlamaServer

from basertd.models import default_model_path

HZ = os.sysconf("SC_CLK_TCK")


def thread_counters(pid: int) -> dict[str, tuple[float, int, int]]:
    """Every thread of ``pid``: "name:tid" -> (CPU seconds, voluntary, non-voluntary switches)."""
    out: dict[str, tuple[float, int, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = Path(f"/proc/{pid}/task/{tid}")
        try:
            name = (base / "comm").read_text().strip()
            fields = (base / "stat").read_text().rsplit(")", 1)[1].split()
            vol = inv = 0
            for line in (base / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    inv = int(line.split()[1])
        except OSError:
            continue  # the thread ended
        out[f"{name}:{tid}"] = ((int(fields[11]) + int(fields[12])) / HZ, vol, inv)
    return out


def per_token(
    before: dict[str, tuple[float, int, int]], after: dict[str, tuple[float, int, int]], tokens: int
) -> dict[str, tuple[float, float, float]]:
    """Per thread present both times: (CPU ms, voluntary, non-voluntary switches) per token."""
    out = {}
    for k, (c1, v1, i1) in after.items():
        if k in before:
            c0, v0, i0 = before[k]
            out[k] = (1000 * (c1 - c0) / tokens, (v1 - v0) / tokens, (i1 - i0) / tokens)
    return out


async def measure(
    srv: Server, procs: dict[str, int], a: argparse.Namespace
) -> list[dict[str, tuple[float, float, float]]]:
    """``a.requests`` single streams one after the other (after a short warm-up); per request the
    per-token totals of each process in ``procs`` (label -> pid), printed as they come."""
    rows = []
    conn = aiohttp.TCPConnector(force_close=True)  # llama-server closes kept-alive connections
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=conn) as http:
        await stream(http, srv, "warm up: once upon a time", 16)
        for i in range(a.requests):
            prompt = f"{srv.name} {i} {time.time()} story: once upon a time, in a land far away,"
            before = {label: thread_counters(pid) for label, pid in procs.items()}
            r = await stream(http, srv, prompt, a.tokens)
            after = {label: thread_counters(pid) for label, pid in procs.items()}
            times, n = r["times"], r["tokens"]
            gaps = sorted(y - x for x, y in itertools.pairwise(times)) or [float("nan")]
            rate, ttft = n / (times[-1] - r["t0"]), 1000 * (times[0] - r["t0"])
            p50, p99 = 1000 * gaps[len(gaps) // 2], 1000 * gaps[int(0.99 * len(gaps))]
            line = f"{srv.name:12s} {rate:5.1f} tok/s  ttft {ttft:5.0f} ms  gap p50 {p50:5.1f} p99 {p99:5.1f}"
            row = {}
            for label in procs:
                threads = per_token(before[label], after[label], n)
                tot = tuple(sum(t[j] for t in threads.values()) for j in range(3))
                row[label] = tot
                line += f" | {label} cpu {tot[0]:5.2f} ms vcs {tot[1]:5.2f} ics {tot[2]:5.2f}"
                if a.threads_detail:
                    for k, (c, v, iv) in sorted(threads.items()):
                        if v >= 0.05 or c >= 0.05:
                            line += f"\n      {label} {k:26s} cpu {c:6.2f} ms vcs {v:6.2f} ics {iv:5.2f}"
            print(line, flush=True)
            rows.append(row)
    return rows


def medians(rows: list[dict[str, tuple[float, float, float]]], label: str) -> list[float]:
    """(CPU ms, voluntary, non-voluntary switches) per token of ``label``, medians over ``rows``."""
    return [statistics.median(r[label][j] for r in rows) for j in range(3)]


def summary(name: str, rows: list[dict[str, tuple[float, float, float]]]) -> None:
    for label in rows[0]:
        med = medians(rows, label)
        print(
            f"{name:12s} {label:12s} per token, medians: cpu {med[0]:6.2f} ms, "
            f"voluntary switches {med[1]:6.2f}, involuntary {med[2]:5.2f}"
        )


def ratios(name: str, rows: list[dict], base_name: str, base: list[dict]) -> None:
    """Each process's medians of ``rows`` over those of the baseline ``base`` (same run)."""
    for label in rows[0]:
        med, ref = medians(rows, label), medians(base, label)
        cpu, vcs, ics = (m / r if r else float("nan") for m, r in zip(med, ref, strict=True))
        print(
            f"{name:12s} {label:12s} / {base_name}: cpu x{cpu:5.2f}, voluntary x{vcs:5.2f}, "
            f"involuntary x{ics:5.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="")
    p.add_argument("--extra", default="", help="TOML appended to basertd's config (\\n for newlines)")
    p.add_argument("--no-llama-server", action="store_true")
    p.add_argument(
        "--durability",
        default="",
        help="comma-separated [durability] modes (write, tick, off; write:MS sets sync_interval_ms): "
        "one basertd each, ratios to the first",
    )
    p.add_argument("--threads-detail", action="store_true")
    a = p.parse_args()
    model = a.model or str(default_model_path())
    extra = a.extra.replace("\\n", "\n")
    if extra and not extra.endswith("\n"):
        extra += "\n"
    toml = workers_toml(model=model, lanes=8, context_length=2048, threads=a.threads)
    modes = [m.strip() for m in a.durability.split(",") if m.strip()] or [""]
    ours: dict[str, list] = {}
    for mode in modes:
        kind, _, interval = mode.partition(":")
        mode_toml = f'[durability]\nmode = "{kind}"\n' if kind else ""
        mode_toml += f"sync_interval_ms = {int(interval)}\n" if interval else ""
        name = f"basertd/{mode}" if mode else "basertd"
        with BenchDaemon(toml, prefix="brt-cost-", http=True, extra=extra + mode_toml) as d:
            srv = Server(name, d.url or "", lambda d=d: [d.proc.pid], True, 0.0)
            ours[name] = asyncio.run(measure(srv, {"coordinator": d.proc.pid, "worker": d.worker_pid()}, a))
    theirs = None
    if not a.no_llama_server:
        with LlamaServer(model, ctx=8 * 2048, parallel=8, threads=a.threads) as ls:
            srv = Server("llama-server", ls.url, lambda: ls.pids, False, 0.0)
            theirs = asyncio.run(measure(srv, {"llama-server": ls.proc.pid}, a))
    print()
    for name, rows in ours.items():
        summary(name, rows)
    base_name = next(iter(ours))
    for name, rows in list(ours.items())[1:]:
        ratios(name, rows, base_name, ours[base_name])
    if theirs:
        summary("llama-server", theirs)


if __name__ == "__main__":
    main()
