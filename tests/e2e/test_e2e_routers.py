"""Three basertd daemons (reference engine) behind the two routers people install from PyPI,
vllm-router and SGLang's gateway (``sglang-router``, binary ``smg``), both on loopback, driven with
the ``openai`` package (docs/scale-out.md).

For each router: 50 shared-prefix requests (five prefix groups, completions and chat, streamed and
not) all succeed unchanged from the client's side; each group's requests stick to one daemon
(read from the daemons' own access lines, which name the request id the client saw) and most
prompt tokens come from the daemons' prefix caches; then one daemon is SIGKILLed while it serves
requests: no non-streamed request is lost (the router retries it elsewhere), every stream cut on
the dead daemon ends in an error at the client (never a clean end without a finish reason); the
daemon restarted on the same port is used again. The figures of each run are printed (``-s``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from daemon_harness import Daemon
from proc_testutil import wait_until
from serving_harness import ref_toml

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
ROUTERS = ("vllm-router", "smg")
ROUTER_RETRIES = 10
"""Attempts a router makes for a failed request. Both routers back off 50 ms x 1.5 per attempt, so
their default of 5 spends about 0.7 s, and a cache-aware router retries a prefix group on the daemon
that has its prefix until a health check (every second here) marks it down: on a slow box a request
caught by the SIGKILL could run out of attempts on the dead daemon. 10 attempts span about 6 s."""
GROUPS = 5
PER_GROUP = 10
PREFIX_CHARS = 320  # 20 pages of the reference engine's byte vocabulary
REF = {"vocab_size": 259, "eos_token": 2, "eos_period": 0, "tick_delay_us": 3000}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def box_config(port: int, kv_port: int) -> str:
    """A box: HTTP on ``port``, KV events bound on ``kv_port`` in vLLM 0.28's layout, with the
    token ids (vllm-router's ``kv_aware`` hashes them; they are off by default)."""
    return ref_toml(lanes=4, context=1024, grant=4, ref=REF, worker='chat_template = "chatml"') + (
        f'[http]\nlisten = ["127.0.0.1:{port}"]\n'
        f'[kv_events]\nendpoint = "tcp://127.0.0.1:{kv_port}"\nbind = "bind"\nlayout = "map"\n'
        "include_token_ids = true\n"
    )


@dataclass
class Box:
    """One daemon and the HTTP and KV-event ports it keeps across a restart."""

    port: int
    kv_port: int
    daemon: Daemon

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def served(self) -> dict[str, tuple[int, int]]:
        """request id -> (prompt tokens, cached tokens) of every request this daemon ended."""
        return {
            e["request_id"]: (e["prompt_tokens"], e["cached_tokens"])
            for e in self.daemon.log_events()
            if e.get("event") == "access"
        }


@pytest.fixture(scope="module")
def boxes():
    out: list[Box] = []
    ports = [(free_port(), free_port()) for _ in range(3)]
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # start them side by side
            futs = [pool.submit(Daemon, box_config(*p)) for p in ports]
            for p, f in zip(ports, futs, strict=True):
                out.append(Box(*p, f.result()))
        yield out
        for b in out:
            b.daemon.stop()
    except BaseException:
        for b in out:
            b.daemon.kill()
        raise


@dataclass
class Router:
    """A router process in front of ``urls`` (its log in ``log_path``)."""

    kind: str
    urls: list[str]
    policy: str = "cache_aware"
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="brt-router-")))

    def __post_init__(self) -> None:
        common = [
            "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *self.urls,
            "--policy", self.policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1", "--health-success-threshold", "1",
            "--cb-timeout-duration-secs", "2", "--retry-max-retries", str(ROUTER_RETRIES), *self.extra,
        ]  # fmt: skip
        argv = (
            [str(BIN / "vllm-router"), *common]
            if self.kind == "vllm-router"
            else [str(BIN / "smg"), "launch", *common]
        )
        self.log_path = self.logdir / "router.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        shutil.rmtree(self.logdir, ignore_errors=True)

    def log_tail(self, lines: int = 8) -> str:
        """The last ``lines`` lines of the router's log that are not health checks, uncoloured."""
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace")).splitlines()
        return "\n".join([line for line in text if "health" not in line.lower()][-lines:])


@dataclass
class Outcome:
    group: int
    chat: bool
    stream: bool
    rid: str = ""
    finish: str | None = None
    error: str = ""


def one(client: openai.OpenAI, model: str, prefix: str, group: int, i: int, max_tokens: int) -> Outcome:
    """One request of ``group`` (chat for groups 3 and 4, streamed on odd ``i``)."""
    chat, stream = group >= 3, i % 2 == 1
    out = Outcome(group, chat, stream)
    question = f" Question {i} of group {group}: what comes next?"
    try:
        if chat:
            msgs = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
            r = client.chat.completions.create(
                model=model, messages=msgs, max_tokens=max_tokens, stream=stream
            )
        else:
            r = client.completions.create(
                model=model, prompt=prefix + question, max_tokens=max_tokens, stream=stream
            )
        if stream:
            for chunk in r:
                out.rid = chunk.id
                for c in chunk.choices:
                    out.finish = c.finish_reason or out.finish
        else:
            out.rid, out.finish = r.id, r.choices[0].finish_reason
    except Exception as exc:  # what a client of the router sees
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def prefix_of(tag: str, group: int) -> str:
    seed = f"[{tag} group {group}] You are a careful assistant for team {group}. "
    return (seed * (PREFIX_CHARS // len(seed) + 1))[:PREFIX_CHARS]


def run(client, model, tag, groups, per_group, max_tokens, *, workers=6, before=None):
    """Send ``per_group`` requests of each group, interleaved, ``workers`` at a time."""
    jobs = [(g, i) for i in range(per_group) for g in groups]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futs = [pool.submit(one, client, model, prefix_of(tag, g), g, i, max_tokens) for g, i in jobs]
        if before is not None:
            before()
        return [f.result() for f in futs]


def where(boxes: list[Box], outs: list[Outcome]) -> dict[str, tuple[int, int, int]]:
    """response id -> (box index, prompt tokens, cached tokens), from the daemons' access lines."""
    served = [b.served() for b in boxes]
    found = {}
    for o in outs:
        for k, s in enumerate(served):
            hit = s.get(o.rid + "-0")
            if hit is not None:
                found[o.rid] = (k, *hit)
    return found


def placed_all(boxes: list[Box], outs: list[Outcome]) -> dict[str, tuple[int, int, int]] | None:
    """``where`` once every request of ``outs`` has its access line (None before)."""
    found = where(boxes, outs)
    return found if len(found) == len(outs) else None


@pytest.mark.parametrize("kind", ROUTERS)
def test_router_in_front_of_three_daemons(boxes, kind):
    model = httpx.get(boxes[0].url + "/v1/models").json()["data"][0]["id"]
    router = Router(kind, [b.url for b in boxes])
    try:
        client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=60)

        def through() -> bool:
            try:
                return (
                    client.completions.create(model=model, prompt="ping", max_tokens=1).choices[0].text
                    is not None
                )
            except openai.APIError:
                return False

        wait_until(through, 60, interval=0.5, what=f"{kind} serves a request")
        probes = itertools.count()

        def spread() -> bool:
            # fresh prefixes each probe: a cache-aware router sends a prefix it has seen back to
            # the box that has it, so repeating one probe would only repeat its first placement
            outs = run(client, model, f"warm{next(probes)}", range(6), 1, 1)
            return len({k for k, *_ in where(boxes, outs).values()}) == 3

        wait_until(  # every daemon registered (SGLang's gateway registers them in the background)
            spread,
            60,
            interval=0.5,
            what=f"{kind} routes to all three daemons",
        )

        # 1. shared-prefix traffic: every request succeeds, groups stick, prompts come from cache
        outs = run(client, model, kind, range(GROUPS), PER_GROUP, 8)
        failed = [o for o in outs if o.error or o.finish is None]
        assert not failed, failed[:3]
        placed = wait_until(lambda: placed_all(boxes, outs), 20, what="every request's access line")
        per_group: dict[int, Counter] = defaultdict(Counter)
        for o in outs:
            per_group[o.group][placed[o.rid][0]] += 1
        sticky = [max(c.values()) / sum(c.values()) for c in per_group.values()]
        prompt = sum(p for _, p, _ in placed.values())
        cached = sum(c for *_, c in placed.values())
        print(
            f"\n{kind}: {len(outs) - len(failed)}/{len(outs)} succeeded; per group on one daemon: "
            f"{[f'{s:.0%}' for s in sticky]}; prompt tokens from cache {cached / prompt:.0%} "
            f"({cached}/{prompt}); groups per daemon {[dict(c) for c in per_group.values()]}"
        )
        assert min(sticky) >= 0.9, per_group
        assert cached / prompt >= 0.6, (cached, prompt)

        # 2. SIGKILL the first daemon seen running two requests (the router's own choice)
        victims: list[Box] = []

        def busy() -> Box | None:
            return next((b for b in boxes if httpx.get(b.url + "/get_load").json()["load"] >= 2), None)

        def kill_when_busy() -> None:
            victims.append(wait_until(busy, 30, interval=0.02, what="a daemon running two requests"))
            victims[0].daemon.proc.send_signal(signal.SIGKILL)

        outs2 = run(client, model, f"{kind}-kill", [0, 3], 6, 160, workers=8, before=kill_when_busy)
        victim = victims[0]
        victim.daemon.proc.wait(10)
        victim.daemon.kill()  # its workers and directory
        lost = [o for o in outs2 if not o.stream and (o.error or o.finish is None)]
        cut = [o for o in outs2 if o.stream and (o.error or o.finish is None)]
        silent = [o for o in cut if not o.error]
        print(
            f"{kind}: SIGKILL mid-traffic: {len(outs2)} requests, non-streamed lost {len(lost)}, streams cut "
            f"{len(cut)} ({len(silent)} without an error at the client)"
        )
        assert not lost, lost[:3]
        assert not silent, silent[:3]

        # 3. the daemon restarted on its port is used again
        victim.daemon = Daemon(box_config(victim.port, victim.kv_port))
        k = boxes.index(victim)
        tags = iter(range(1000))

        def used_again() -> bool:
            outs3 = run(client, model, f"{kind}-after-{next(tags)}", range(GROUPS), 1, 2)
            return any(v[0] == k for v in where(boxes, outs3).values())

        wait_until(used_again, 60, interval=0.5, what=f"{kind} sends to the restarted daemon")
        print(f"{kind} log (last lines):\n{router.log_tail()}")
    finally:
        router.close()


def test_vllm_router_kv_aware_credits_the_cached_prefix_from_our_events(boxes):
    """vllm-router's ``kv_aware`` subscribes to each box's KV events (``bind``, ``layout = "map"``)
    and credits a request with the prefix a box already holds; before, it decoded none of our
    batches and credited 0 tokens in every decision."""
    model = httpx.get(boxes[0].url + "/v1/models").json()["data"][0]["id"]
    sources = [a for b in boxes for a in ("--kv-event-source", f"{b.url}=tcp://127.0.0.1:{b.kv_port}")]
    extra = [*sources, "--kv-event-block-size", "16", "--kv-event-model", model, "--log-level", "debug"]
    router = Router("vllm-router", [b.url for b in boxes], policy="kv_aware", extra=extra)
    try:
        client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=60)
        wait_until(
            lambda: not one(client, model, "kv-ping", 0, 0, 1).error, 60, interval=0.5, what="kv_aware serves"
        )
        outs = run(client, model, "kv", range(2), 5, 4, workers=1)  # each sees the events of the last
        assert not [o for o in outs if o.error or o.finish is None]
        placed = wait_until(lambda: placed_all(boxes, outs), 20, what="every request's access line")
        per_group: dict[int, Counter] = defaultdict(Counter)
        for o in outs:
            per_group[o.group][placed[o.rid][0]] += 1
        log = re.sub(r"\x1b\[[0-9;]*m", "", router.log_path.read_text(errors="replace"))
        credited = [int(x) for x in re.findall(r"credited_prefix_tokens=(\d+)", log)]
        print(f"\nvllm-router kv_aware: credited prefix tokens {credited}; groups {dict(per_group)}")
        assert max(credited) >= 10 * 16, credited  # at least 10 of the shared 20 pages
        assert all(max(c.values()) / sum(c.values()) >= 0.8 for c in per_group.values()), per_group
    finally:
        router.close()
