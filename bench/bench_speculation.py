"""Single-stream decode rate with prompt-lookup speculation, against basertd without it and against
llama-server (built from the same llama.cpp, ``bench/llama_server.py``) with and without its n-gram
speculation, on the default model (a base model: /v1/completions prompts).

Workloads: ``code`` (rewrite a ~1,000-token Python file with one identifier renamed), ``quote``
(answer by quoting a given passage) and ``prose`` (free text with little repetition). Each run is
one streamed greedy completion of ``--tokens`` tokens (ignore_eos); the decode rate is tokens after
the first over the seconds after the first. basertd runs with ``[speculation] strategies =
["prompt-lookup"]`` and each request says ``speculation`` "off" or "prompt-lookup": both in the
same process and minute. Prints tokens/s per workload, the ratios, and the drafts accepted.

    .venv/bin/python bench/bench_speculation.py --threads 2 --tokens 256 [--spec-type ngram-simple]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
    """The three prompts (module docstring)."""
    code = "".join(_FUNC.format(i=i) for i in range(14))
    renamed = code.replace("compute_total", "sum_scaled")
    head = renamed[: renamed.index("\n") + 1]
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
        "code": f"# file.py\n```python\n{code}```\n\n# The same file with compute_total renamed to "
        f"sum_scaled:\n```python\n{head}",
        "quote": f"Passage:\n{passage}\n\nQuestion: what did the committee find? Answer by quoting "
        f'the passage exactly.\nAnswer: "{passage[:60]}',
        "prose": prose,
    }


def completion(url: str, prompt: str, tokens: int, extra: dict) -> tuple[float, int, dict]:
    """One streamed greedy /v1/completions: (decode tok/s after the first token, tokens, usage)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    times: list[float] = []
    usage: dict = {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if any(c.get("text") for c in obj.get("choices") or []):
                times.append(time.perf_counter())
            usage = obj.get("usage") or usage
    n = usage.get("completion_tokens", len(times))
    rate = (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")
    return rate, n, usage


def best(url: str, prompt: str, tokens: int, extra: dict, reps: int) -> tuple[float, dict]:
    """The median decode rate of ``reps`` runs and the last run's usage."""
    rates, usage = [], {}
    for _ in range(reps):
        rate, _, usage = completion(url, prompt, tokens, extra)
        rates.append(rate)
    return statistics.median(rates), usage


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("--spec-type", default="ngram-simple", help="llama-server's n-gram --spec-type")
    ap.add_argument("--no-llama-server", action="store_true")
    a = ap.parse_args()
    model = str(default_model_path())
    loads = workloads()
    spec = (
        f'[speculation]\nstrategies = ["prompt-lookup"]\ndraft_max = {a.draft_max}\nngram_min = 2\n'
        "ngram_max = 4\n"
    )
    rows: dict[str, dict[str, float]] = {w: {} for w in loads}
    accept: dict[str, str] = {}
    workers = workers_toml(model=model, threads=a.threads, lanes=2, context_length=4096)
    with BenchDaemon(workers, extra=spec, http=True, prefix="brt-spec-") as d:
        assert d.url is not None
        for w, prompt in loads.items():
            completion(d.url, prompt, 8, {"speculation": "off"})  # warm: the prompt cached, pages hot
            rows[w]["off"], _ = best(d.url, prompt, a.tokens, {"speculation": "off"}, a.reps)
            rows[w]["on"], usage = best(d.url, prompt, a.tokens, {"speculation": "prompt-lookup"}, a.reps)
            det = usage.get("completion_tokens_details") or {}
            acc, rej = det.get("accepted_prediction_tokens", 0), det.get("rejected_prediction_tokens", 0)
            accept[w] = f"{acc}/{acc + rej}" if acc + rej else "0/0"
    if not a.no_llama_server:
        for label, extra in (("ls", ()), ("ls_spec", ("--spec-type", a.spec_type))):
            with LlamaServer(model, ctx=4096, parallel=1, threads=a.threads, extra=extra) as srv:
                for w, prompt in loads.items():
                    completion(srv.url, prompt, 8, {})
                    rows[w][label], _ = best(srv.url, prompt, a.tokens, {}, a.reps)
    print(
        f"single stream, {a.tokens} tokens, {a.threads} threads, greedy; decode tok/s after the first token"
    )
    head = f"{'workload':8} {'off':>7} {'lookup':>7} {'x off':>6} {'ls':>7}"
    print(f"{head} {'ls+' + a.spec_type:>18} {'x ls+':>6} accepted")
    for w, r in rows.items():
        ls, lss = r.get("ls", float("nan")), r.get("ls_spec", float("nan"))
        print(f"{w:8} {r['off']:7.1f} {r['on']:7.1f} {r['on'] / r['off']:6.2f} {ls:7.1f} {lss:18.1f} "
              f"{r['on'] / lss:6.2f} {accept[w]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
