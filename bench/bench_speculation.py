"""Single-stream decode rate with prompt-lookup speculation, against basertd without it and against
llama-server (built from the same llama.cpp, ``bench/llama_server.py``) with and without its n-gram
speculation, on the default model (a base model: /v1/completions prompts).

Workloads: ``code`` (rewrite a ~1,000-token Python file with one identifier renamed), ``quote``
(answer by quoting a given passage), ``prose`` (a story: this base model falls into loops on it
greedily, so it repeats more than free text does) and ``free`` (the same story with
``frequency_penalty`` 1.0: free text with little repetition, where speculation must back off).
Each run is one streamed greedy completion of ``--tokens`` tokens (ignore_eos); the decode rate is
tokens after the first over the seconds after the first. basertd runs with ``[speculation]
strategies = ["prompt-lookup"]`` and each request says ``speculation`` "off" or "auto" (which picks
prompt-lookup and backs off where it does not pay): both in the same process and minute. Then
``--streams`` concurrent ``code`` completions (distinct files), aggregate tokens/s, off vs auto.
Prints tokens/s per workload, the ratios, and the drafts accepted.

The ``same`` column says whether the greedy text with speculation matched the text without it
(``yes``, or the characters they share before they part: a near-tie flipped by the batch shape).
``--device cuda`` runs the worker with every layer on the GPU (``device = "cuda:0"``) and
llama-server with ``-ngl 99``; ``--model`` names another GGUF.

    .venv/bin/python bench/bench_speculation.py --threads 2 --tokens 256
        [--streams 8] [--reps 1] [--no-llama-server] [--spec-types ngram-simple,ngram-map-k,ngram-mod]
        [--device cpu|cuda] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import BenchDaemon, workers_toml
from llama_server import LlamaServer

from basertd.models import default_model_path

_FUNC = '''def compute_total_{i}(items, factor={i}):
    """Sum the scaled values of the items of batch {i}."""
    result = 0
    for item in items:
        if item.enabled and item.weight > {i}:
            result += compute_total_helper(item.value, factor)
        else:
            result -= item.penalty * {i}
    return result

'''


def workloads() -> dict[str, str]:
    """The four prompts (module docstring)."""
    passage = (
        "The committee met on the third of March to review the harbour accounts. It found that the "
        "lighthouse fund had been spent on new ropes, two rowing boats and the repair of the north "
        "wall, and that the remaining balance of forty pounds would be kept for the winter. The "
        "members thanked the keeper for his careful records and asked that the next report include "
        "the cost of oil, the wages of the two assistants and a list of the ships that had called. "
    ) * 3
    prose = (
        "Write a long story about a fox who travels from the mountains to the sea, meeting many "
        "strange creatures, learning new songs and changing its mind about the world.\n\nStory:"
    )
    return {
        "code": code_prompt(0),
        "quote": f"Passage:\n{passage}\n\nQuestion: what did the committee find? Answer by quoting "
        f'the passage exactly.\nAnswer: "{passage[:60]}',
        "prose": prose,
        "free": prose,
    }


EXTRA = {"free": {"frequency_penalty": 1.0}}
"""Per-workload request fields beyond the common ones."""


def code_prompt(variant: int) -> str:
    """The rename-a-file prompt on file ``variant`` (distinct numbers per variant), ending with the
    renamed file's first line to continue from."""
    code = "".join(_FUNC.format(i=i + 100 * variant) for i in range(14))
    renamed = code.replace("compute_total", "sum_scaled")
    head = renamed[: renamed.index("\n") + 1]
    return (
        f"# file.py\n```python\n{code}```\n\n# The same file with compute_total renamed to "
        f"sum_scaled:\n```python\n{head}"
    )


def completion(url: str, prompt: str, tokens: int, extra: dict) -> tuple[float, int, dict, str]:
    """One streamed greedy /v1/completions: (decode tok/s after the first token, tokens, usage,
    text)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    times: list[float] = []
    usage: dict = {}
    text: list[str] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[5:])
            pieces = [c.get("text") or "" for c in obj.get("choices") or []]
            if any(pieces):
                times.append(time.perf_counter())
                text.extend(pieces)
            usage = obj.get("usage") or usage
    n = usage.get("completion_tokens", len(times))
    rate = (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")
    return rate, n, usage, "".join(text)


def best(url: str, prompt: str, tokens: int, extra: dict, reps: int) -> tuple[float, dict, str]:
    """The median decode rate of ``reps`` runs, the last run's usage and text."""
    rates, usage, text = [], {}, ""
    for _ in range(reps):
        rate, _, usage, text = completion(url, prompt, tokens, extra)
        rates.append(rate)
    return statistics.median(rates), usage, text


def agreement(a: str, b: str) -> str:
    """``yes`` when the texts are equal, else how many characters they share before they part."""
    if a == b:
        return "yes"
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"{n}/{max(len(a), len(b))}"


def aggregate(url: str, n: int, tokens: int, extra: dict) -> tuple[float, int, int]:
    """``n`` concurrent ``code`` completions on distinct files: (tokens/s over the wall time from the
    first send to the last token, drafts accepted, drafts proposed)."""
    out: list[tuple[float, int, dict, str]] = [(0.0, 0, {}, "")] * n

    def one(i: int) -> None:
        out[i] = completion(url, code_prompt(i + 1), tokens, extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    details = [u.get("completion_tokens_details") or {} for _, _, u, _ in out]
    acc = sum(x.get("accepted_prediction_tokens", 0) for x in details)
    rej = sum(x.get("rejected_prediction_tokens", 0) for x in details)
    return sum(k for _, k, _, _ in out) / wall, acc, acc + rej


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams of the batch row (0: none)")
    ap.add_argument(
        "--spec-types",
        default="ngram-simple,ngram-map-k,ngram-mod",
        help="llama-server's n-gram --spec-type values to run; each workload compares with the best",
    )
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the layers run")
    ap.add_argument("--model", default="", help="a GGUF (default: the default model)")
    ap.add_argument("--kv-layout", default=None, choices=["unified", "per-lane"],
                    help="basertd's KV layout ([[workers]] kv_layout; default: the daemon's)")  # fmt: skip
    a = ap.parse_args()
    model = a.model or str(default_model_path())
    gpu = a.device == "cuda"
    loads = workloads()
    spec = (
        f'[speculation]\nstrategies = ["prompt-lookup"]\ndraft_max = {a.draft_max}\nngram_min = 2\n'
        "ngram_max = 4\n"
    )
    rows: dict[str, dict[str, float]] = {w: {} for w in loads}
    accept: dict[str, str] = {}
    same: dict[str, str] = {}
    batch: dict[str, float] = {}
    lanes = max(2, a.streams)
    workers = workers_toml(
        model=model,
        threads=a.threads,
        lanes=lanes,
        context_length=4096,
        device="cuda:0" if gpu else None,
        kv_layout=a.kv_layout,
    )
    with BenchDaemon(workers, extra=spec, http=True, prefix="brt-spec-") as d:
        assert d.url is not None
        for w, prompt in loads.items():
            off = {"speculation": "off", **EXTRA.get(w, {})}
            auto = {"speculation": "auto", **EXTRA.get(w, {})}
            completion(d.url, prompt, 8, off)  # warm: the prompt cached, pages hot
            rows[w]["off"], _, text_off = best(d.url, prompt, a.tokens, off, a.reps)
            rows[w]["on"], usage, text_on = best(d.url, prompt, a.tokens, auto, a.reps)
            same[w] = agreement(text_off, text_on)
            det = usage.get("completion_tokens_details") or {}
            acc, rej = det.get("accepted_prediction_tokens", 0), det.get("rejected_prediction_tokens", 0)
            accept[w] = f"{acc}/{acc + rej}" if acc + rej else "0/0"
            print(f"basertd {w}: off {rows[w]['off']:.1f} auto {rows[w]['on']:.1f} tok/s, accepted "
                  f"{accept[w]}, same {same[w]}", file=sys.stderr, flush=True)  # fmt: skip
        if a.streams:
            aggregate(d.url, a.streams, 1, {"speculation": "off"})  # warm: every file's prompt cached
            for label in ("off", "auto", "off2", "auto2"):  # alternating, each measured twice
                rate, acc, drafted = aggregate(d.url, a.streams, a.tokens, {"speculation": label.rstrip("2")})
                batch[label] = rate
                if label.startswith("auto"):
                    batch["accepted"], batch["drafted"] = acc, drafted
    if not a.no_llama_server:
        types = [t for t in a.spec_types.split(",") if t]
        ngl = ("-ngl", "99" if gpu else "0")
        for label, extra in [("ls", ())] + [(t, ("--spec-type", t)) for t in types]:
            with LlamaServer(model, ctx=4096, parallel=1, threads=a.threads, extra=(*ngl, *extra)) as srv:
                for w, prompt in loads.items():
                    completion(srv.url, prompt, 8, EXTRA.get(w, {}))
                    rows[w][label], _, _ = best(srv.url, prompt, a.tokens, EXTRA.get(w, {}), a.reps)
                    got = rows[w][label]
                    print(f"llama-server {label} {w}: {got:.1f} tok/s", file=sys.stderr, flush=True)
        for r in rows.values():  # llama-server's best n-gram type per workload
            r["ls_spec"], r["ls_type"] = max((r[t], i) for i, t in enumerate(types))
            r["ls_type"] = float(r["ls_type"])
    print(
        f"single stream, {a.tokens} tokens, {a.threads} threads, {a.device}, greedy; decode tok/s after the"
        " first token; basertd's speculation 'auto' (prompt-lookup) against 'off'"
    )
    types = [t for t in a.spec_types.split(",") if t]
    head = f"{'workload':8} {'off':>7} {'auto':>7} {'x off':>6} {'ls':>7}"
    print(f"{head} {'ls best n-gram':>27} {'x ls+':>6} accepted  same")
    for w, r in rows.items():
        ls, lss = r.get("ls", float("nan")), r.get("ls_spec", float("nan"))
        kind = types[int(r["ls_type"])] if "ls_type" in r else "-"
        print(f"{w:8} {r['off']:7.1f} {r['on']:7.1f} {r['on'] / r['off']:6.2f} {ls:7.1f} {lss:7.1f} "
              f"({kind:>17}) {r['on'] / lss:6.2f} {accept[w]:>9} {same[w]}")  # fmt: skip
    if batch:
        off = statistics.mean((batch["off"], batch["off2"]))
        auto = statistics.mean((batch["auto"], batch["auto2"]))
        print(
            f"{a.streams} concurrent code streams, aggregate tok/s: off {off:.1f} (runs {batch['off']:.1f}, "
            f"{batch['off2']:.1f}), auto {auto:.1f} (runs {batch['auto']:.1f}, {batch['auto2']:.1f}), "
            f"x off {auto / off:.2f}, accepted {batch['accepted']:.0f}/{batch['drafted']:.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
