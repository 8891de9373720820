"""A worker's model replaced by a reload while 8 streams run on two workers, on the default model.

    .venv/bin/python bench/demo_worker_reload.py [--tokens 96] [--screenshot /tmp/top.png]

Two llama.cpp workers serve the default model (4 lanes, 1 thread each). Eight greedy streams run
once undisturbed (the reference), then again: while they stream, the script prints one
``basertctl top --once`` frame, takes a screenshot of the page at ``/`` in headless Chromium (when
one is installed), and rewrites the config so worker 1 serves another model (a tiny random-weight
GGUF, ``tests/tinymodel.py``) before sending SIGHUP. Worker 1's streams move to worker 0, the old
model's peer (DESIGN.md "Operators": a replaced worker hands its running requests over); every
stream must finish with its reference tokens, or differ only where llama.cpp's batch numerics flip
a near-tie. So the undisturbed run goes twice (the control: how often a repeat differs with no
reload), and every divergence is shown with the top-2 logit margin a plain one-prompt llama.cpp
loop has there (``tests/serving_harness.bare_reference``). Prints the ``reloaded`` line, where
each stream ran and the comparison, counting divergences where the plain loop's margin is
``--tie`` or more; exits 1 when a stream did not get all its tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import BenchDaemon, workers_toml

from basertd.client import AsyncClient
from basertd.models import default_model_path

PROMPTS = [
    "The history of the printing press begins",
    "A recipe for bread needs flour, water and",
    "In the mountains the weather changes quickly because",
    "The first rule of writing clear code is",
    "Rivers carry sediment from the hills down to",
    "A good night's sleep helps the brain to",
    "The train left the station at dawn, and",
    "Photosynthesis turns sunlight, water and carbon dioxide into",
]


TESTS = Path(__file__).resolve().parent.parent / "tests"


def tiny_model(directory: Path) -> Path:
    """A tiny random-weight llama GGUF: the "other model" worker 1 is switched to."""
    sys.path.insert(0, str(TESTS))
    from tinymodel import write_tiny_gguf

    return write_tiny_gguf(directory / "tiny-llama.gguf", "llama")


async def run_streams(d: BenchDaemon, tag: str, n: int, during=None) -> dict[str, list[int]]:
    """The 8 prompts as concurrent greedy streams (request ids ``{tag}-{i}``); ``during()`` (a
    blocking callable) runs in a thread once every stream has its first 4 tokens."""
    out: dict[str, list[int]] = {}
    started = asyncio.Event()
    counts: dict[str, int] = {}

    async def one(i: int, p: str) -> None:
        rid = f"{tag}-{i}"
        async with await AsyncClient.connect(d.sock) as c:
            stream = await c.stream(p, request_id=rid, max_tokens=n, temperature=0.0, ignore_eos=True)
            ids: list[int] = []
            async for msg in stream:
                ids.extend(msg.ids)
                counts[rid] = len(ids)
                if len(counts) == len(PROMPTS) and min(counts.values()) >= 4:
                    started.set()
            out[rid] = ids

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(PROMPTS)]
    if during is not None:
        await started.wait()
        await asyncio.to_thread(during)
    await asyncio.gather(*tasks)
    return out


def screenshot(url: str, path: Path) -> str:
    """The page at ``url`` rendered by headless Chromium into ``path``; a note of what happened."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return "no chromium on PATH: no screenshot"
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={profile}",
                "--window-size=1400,1100",
                "--virtual-time-budget=4000",
                f"--screenshot={path}",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if r.returncode == 0 and path.exists():
        return f"screenshot {path}"
    return f"chromium failed: {r.stderr[-500:]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96, help="tokens per stream")
    ap.add_argument("--screenshot", type=Path, default=Path("/tmp/opsview-8-streams.png"))
    ap.add_argument("--tie", type=float, default=0.2, help="top-2 logit margin counted as a near-tie")
    args = ap.parse_args()
    model = default_model_path()
    scratch = Path(tempfile.mkdtemp(prefix="brt-reload-demo-"))
    other = tiny_model(scratch)
    table = dict(model=str(model), lanes=4, threads=1, context_length=1024)
    two = workers_toml(**table) + workers_toml(**table)
    try:
        with BenchDaemon(two, prefix="brt-reload-demo-", http=True) as d:
            t0 = time.monotonic()
            ref = asyncio.run(run_streams(d, "ref", args.tokens))
            print(f"reference run: 8 streams x {args.tokens} tokens in {time.monotonic() - t0:.1f} s")
            control = asyncio.run(run_streams(d, "ctl", args.tokens))
            with d.client() as c:
                prompt_ids = [c.tokenize(p) for p in PROMPTS]
            cfg = d.base / "basertd.toml"
            text = cfg.read_text()
            replaced = text.replace(f'model = "{model}"', f'model = "{other}"')
            # only the second table changes: put the first one's model back
            first = replaced.index(f'model = "{other}"')
            replaced = replaced[:first] + f'model = "{model}"' + replaced[first + len(f'model = "{other}"') :]

            def during() -> None:
                top = subprocess.run(
                    [sys.executable, "-m", "basertd.ctl", "--socket", str(d.sock), "top", "--once"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                print("--- basertctl top --once, 8 streams running ---")
                print(top.stdout.rstrip())
                print("---", screenshot(f"{d.url}/", args.screenshot))
                cfg.write_text(replaced)
                d.proc.send_signal(signal.SIGHUP)

            t0 = time.monotonic()
            got = asyncio.run(run_streams(d, "run", args.tokens, during))
            wall = time.monotonic() - t0
            deadline = time.monotonic() + 60
            reloaded = []
            while not reloaded and time.monotonic() < deadline:
                reloaded = [e for e in d.events() if e.get("event") == "reloaded"]
                time.sleep(0.2)
            print("--- the reloaded line ---")
            print(json.dumps(reloaded[-1] if reloaded else None))
            moves = [e for e in d.events() if e.get("event") == "worker_lanes_resumed" and e.get("planned")]
            for e in moves:
                print(f"worker {e['worker_id']} handed over {e['resumed_keys']} -> {e['moved_to_peers']}")
            access = d.access()
        sys.path.insert(0, str(TESTS))
        from serving_harness import bare_reference

        bare = bare_reference(model, prompt_ids, args.tokens)
        same = same_control = clear = 0
        for i in range(len(PROMPTS)):
            a, b, ctl = ref[f"ref-{i}"], got[f"run-{i}"], control[f"ctl-{i}"]
            row = access.get(f"run-{i}", {})
            same += a == b
            same_control += a == ctl
            btoks, margins = bare[i]
            k = next((k for k, (x, y) in enumerate(zip(b, btoks, strict=False)) if x != y), None)
            verdict = (
                "as the plain loop" if k is None else f"leaves the plain loop at {k}, margin {margins[k]:.3f}"
            )
            clear += k is not None and margins[k] >= args.tie
            print(
                f"stream {i}: worker {row.get('worker_id')}, {len(b)} tokens, "
                f"{'same as' if a == b else 'differs from'} the undisturbed run, {verdict}"
            )
        print(
            f"{same}/{len(PROMPTS)} streams equal to the undisturbed run (a repeat of it with no reload: "
            f"{same_control}/{len(PROMPTS)}); divergences from the plain loop at a margin >= {args.tie}: "
            f"{clear}; disturbed run {wall:.1f} s"
        )
        return 0 if all(len(got[f"run-{i}"]) == args.tokens for i in range(len(PROMPTS))) else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
