"""``make demo``: the main job end to end on the default model.

Starts ``basertd serve`` (a real daemon process, default configuration: the default model on the
llamacpp engine on CPU) in a temporary runtime directory, sends 8 concurrent prompts and then one
more through the asyncio client, prints each generated text with its TTFT, decode rate and cached
tokens, then the aggregate tokens/s of the two rounds, and stops the daemon with SIGTERM, checking
that it exited cleanly and removed its socket. The daemon's log stays in the temporary directory
only while the demo runs (printed if anything fails).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from basertd.client import AsyncClient, Client, ClientError, Completion

PROMPTS = [
    "The three primary colors are",
    "A haiku about the ocean:\n",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "The capital of Japan is Tokyo. The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Here is a short list of fruits: apple, banana,",
    "The most important rule of writing clean code is",
]
LAST_PROMPT = "Once upon a time, in a small village by the sea, there lived"
MAX_TOKENS = 48


def _wait_ready(proc: subprocess.Popen, sock: Path, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"basertd exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        if sock.exists():
            try:
                with Client(sock, timeout=5) as c:
                    h = c.health()
                if h.status == "ok":
                    return
            except OSError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"basertd not ready within {timeout} s:\n{log.read_text(errors='replace')}")


def _show(i: int, prompt: str, out: Completion) -> None:
    t, u = out.timings, out.usage
    print(
        f"[{i}] TTFT {t.ttft_s * 1000:6.0f} ms | {t.decode_tokens_per_s:5.1f} tok/s | "
        f"{u.completion_tokens:3d} tokens | cached {u.cached_tokens} | finish {out.finish_reason}"
    )
    body = textwrap.indent((prompt + "\u2588" + out.text).strip(), "    ")
    print(body)
    print()


async def _round(sock: Path, prompts: list[str]) -> tuple[list[Completion], float]:
    async with await AsyncClient.connect(sock) as client:
        t0 = time.monotonic()
        outs = await asyncio.gather(
            *(
                client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, seed=i)
                for i, p in enumerate(prompts)
            )
        )
        return list(outs), time.monotonic() - t0


def main() -> int:
    """Run the demo; returns the exit status."""
    # $TMPDIR, unless the socket's path would pass the 107 bytes a Unix socket address holds
    tmp = tempfile.gettempdir()
    base = Path(tempfile.mkdtemp(prefix="basertd-demo-", dir=tmp if len(tmp) <= 60 else "/tmp"))
    sock = base / "rt" / "basertd.sock"
    config = base / "basertd.toml"
    # a private runtime and state directory: the demo never meets another daemon's files
    config.write_text(f'runtime_dir = "{base / "rt"}"\nstate_dir = "{base / "state"}"\n[http]\nlisten = []\n')
    log = base / "daemon.log"
    print(f"basertd demo: starting `basertd serve` (default model, llamacpp on CPU) in {base / 'rt'}")
    t_start = time.monotonic()
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "basertd.cli", "serve", "--config", str(config)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    ok = False
    try:
        _wait_ready(proc, sock, log, timeout=300)
        print(f"ready in {time.monotonic() - t_start:.1f} s\n")
        print(f"== 8 concurrent prompts (greedy, {MAX_TOKENS} tokens max)\n")
        outs, wall8 = asyncio.run(_round(sock, PROMPTS))
        for i, (p, o) in enumerate(zip(PROMPTS, outs, strict=True)):
            _show(i, p, o)
        print("== one more prompt\n")
        (last,), wall1 = asyncio.run(_round(sock, [LAST_PROMPT]))
        _show(len(PROMPTS), LAST_PROMPT, last)
        tokens8 = sum(o.usage.completion_tokens for o in outs)
        print(
            f"aggregate: {tokens8} tokens in {wall8:.2f} s at 8 concurrent = {tokens8 / wall8:.1f} tok/s; "
            f"{last.usage.completion_tokens} tokens in {wall1:.2f} s at 1 = "
            f"{last.usage.completion_tokens / wall1:.1f} tok/s"
        )
        ok = True
    except (RuntimeError, OSError, ClientError) as exc:
        print(f"basertd demo failed: {exc}", file=sys.stderr)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        else:
            rc = proc.returncode
        clean = rc == 0 and not sock.exists()
        print(f"daemon stopped: exit status {rc}, socket removed: {not sock.exists()}")
        if not (ok and clean):
            print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
        shutil.rmtree(base, ignore_errors=True)
    return 0 if ok and clean else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
