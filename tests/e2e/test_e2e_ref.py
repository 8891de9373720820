"""End to end on the C reference engine: a real ``basertd serve``, real workers, real sockets and
shared memory. The reference engine is deterministic (next token = hash of the committed
tokens and the RNG counter), so every output is checked token for token against a direct engine
run of the same prompt through ``basertd.server.workers.sync_worker.SyncWorker``."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from daemon_harness import Daemon
from proc_testutil import pid_alive
from serving_harness import DirectRun, direct_ref, ref_toml

from basertd.client import AsyncClient, ClientError, ConnectionLost
from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.client import ErrorCode
from basertd.server.request.tokenizer import BytesTokenizer, IncrementalDetokenizer

REF = {"vocab_size": 259, "eos_token": 2, "eos_period": 48, "tick_delay_us": 1000}
LANES = 8
CONTEXT = 512


def ref_config(ref: dict | None = None, *, lanes: int = LANES, grant: int = 4, **kw) -> str:
    """``serving_harness.ref_toml`` with this file's engine (``REF`` here: an EOS every 48 tokens,
    1 ms ticks), ``LANES`` lanes of ``CONTEXT`` tokens and a decode grant of 4."""
    kw.setdefault("context", CONTEXT)
    return ref_toml(lanes=lanes, grant=grant, ref={**REF, **(ref or {})}, **kw)


def direct_engine(ref: dict | None = None) -> DirectRun:
    """The reference engine driven without the coordinator (same config, no tick delay)."""
    return direct_ref(lanes=LANES, context=CONTEXT, ref={**REF, **(ref or {})})


@pytest.fixture(scope="module")
def direct():
    with direct_engine() as d:
        yield d


@pytest.fixture(scope="module")
def daemon():
    with Daemon(ref_config()) as d:
        yield d


def text_of(ids: list[int]) -> str:
    detok = IncrementalDetokenizer(BytesTokenizer())
    return detok.feed(ids) + detok.flush()


def test_generate_streams_text_token_exact(daemon, direct):
    with daemon.client() as c:
        prompt_ids = c.tokenize("Hello, basertd!")
        assert prompt_ids[-len(b"Hello, basertd!") :] == [3 + b for b in b"Hello, basertd!"]
        for gen in (
            api.Generate(request_id="g1", prompt="Hello, basertd!", max_tokens=40, temperature=0.0),
            api.Generate(
                request_id="g2", prompt="Hello, basertd!", max_tokens=40, temperature=0.8, seed=1234
            ),
            api.Generate(
                request_id="g3", prompt="Hello, basertd!", max_tokens=40, temperature=0.8, seed=99, top_k=5
            ),
        ):
            s = c.stream(
                gen.prompt, **{f: getattr(gen, f) for f in ("max_tokens", "temperature", "seed", "top_k")}
            )
            assert s.prompt_tokens == len(prompt_ids)
            ids, text = [], []
            for t in s:
                ids += t.ids
                text.append(t.text)
            expected = direct.run(prompt_ids, gen)
            assert ids == expected  # token-exact against the engine alone
            assert "".join(text) == text_of(ids)
            done = s.done
            assert done.usage.prompt_tokens == len(prompt_ids)
            assert done.usage.completion_tokens == len(ids) <= 40
            assert done.finish_reason == ("length" if len(ids) == 40 else "eos")
            assert done.timings.ttft_s > 0 and done.timings.total_s >= done.timings.ttft_s
            assert s.seed == gen.seed or (gen.seed is None and s.seed is not None)
        drawn = c.generate("Hello, basertd!", max_tokens=20, temperature=0.8)  # the daemon draws a seed
        gen = api.Generate(request_id="g4", prompt="", max_tokens=20, temperature=0.8, seed=drawn.seed)
        assert drawn.seed is not None and drawn.ids == direct.run(prompt_ids, gen)  # reported, reproducible


def test_typed_admission_errors_change_nothing(daemon):
    before = daemon.wait_idle()  # lanes of earlier tests retire in the plan after their Done
    with daemon.client() as c:
        cases = [
            (dict(prompt=""), ErrorCode.EMPTY_PROMPT),
            (dict(prompt=None, prompt_tokens=[]), ErrorCode.EMPTY_PROMPT),
            (dict(prompt="x" * 400, max_tokens=200), ErrorCode.CONTEXT_LENGTH_EXCEEDED),
            (dict(prompt="x", max_tokens=CONTEXT), ErrorCode.CONTEXT_LENGTH_EXCEEDED),
            (dict(prompt="x", max_tokens=0), ErrorCode.INVALID_REQUEST),
            (dict(prompt="x", temperature=-0.5), ErrorCode.INVALID_REQUEST),
            (dict(prompt=None, prompt_tokens=[1, 5, 100000]), ErrorCode.INVALID_REQUEST),
            (dict(prompt="x", model="no-such-model"), ErrorCode.NOT_FOUND),
        ]
        for fields, code in cases:
            with pytest.raises(ClientError) as info:
                c.generate(**fields)
            assert info.value.code == code, (fields, info.value)
        after = c.status()
        assert after.requests_total == before.requests_total and after.queued == 0 and after.lanes_busy == 0
        assert c.generate("still fine", max_tokens=3, temperature=0).usage.completion_tokens >= 1


def test_stop_strings_end_the_text_without_leaking(daemon, direct):
    with daemon.client() as c:
        prompt = "stop strings"
        ids = c.tokenize(prompt)
        gen = api.Generate(request_id="s", prompt=prompt, max_tokens=60, temperature=0.0, ignore_eos=True)
        full = direct.run(ids, gen)
        text = text_of(full)
        # two characters from the middle of the output, the second occurrence-free of U+FFFD
        stop = next(
            text[i : i + 2] for i in range(len(text) // 2, len(text) - 2) if "\ufffd" not in text[i : i + 2]
        )
        out = c.generate(prompt, max_tokens=60, temperature=0.0, ignore_eos=True, stop=[stop])
        assert out.finish_reason == "stop"
        assert out.text == text[: text.find(stop)]  # cut right before it, nothing of it leaked
        assert out.ids == full[: len(out.ids)] and len(out.ids) < 60


def test_protocol_error_closes_only_that_connection(daemon):
    with daemon.client() as good:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(daemon.socket))
        s.sendall(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")  # not msgpack
        s.settimeout(5)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        s.close()
        assert b"protocol_error" in data
        s = socket.socket(socket.AF_UNIX)  # an oversize length prefix: refused before any body
        s.connect(str(daemon.socket))
        s.sendall(struct.pack(">I", 1 << 31))
        s.settimeout(5)
        assert b"protocol_error" in s.recv(4096)
        s.close()
        assert good.generate("after", max_tokens=4, temperature=0).usage.completion_tokens >= 1


def test_basertctl_generate_and_status(daemon, direct):
    env = {**os.environ, "BASERTD_SOCKET": str(daemon.socket)}
    ctl = [sys.executable, "-m", "basertd.ctl"]
    r = subprocess.run(
        [*ctl, "generate", "--max-tokens", "12", "--temperature", "0", "--seed", "5", "ctl prompt"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    with daemon.client() as c:
        ids = c.tokenize("ctl prompt")
    expected = direct.run(
        ids, api.Generate(request_id="x", prompt="", max_tokens=12, temperature=0.0, seed=5)
    )
    assert r.stdout.decode("utf-8") == text_of(expected) + "\n"
    big = 2**63 + 12345  # the whole u64 seed range, as the API takes it
    r = subprocess.run(
        [*ctl, "generate", "--max-tokens", "12", "--temperature", "0.9", "--seed", str(big), "ctl prompt"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    with daemon.client() as c:
        same = c.generate("ctl prompt", max_tokens=12, temperature=0.9, seed=big)
    assert r.stdout.decode("utf-8") == same.text + "\n"
    r = subprocess.run(
        [*ctl, "--socket", str(daemon.socket), "status", "--json"], capture_output=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    import json

    st = json.loads(r.stdout)
    assert st["workers_ready"] == 1 and st["lanes_max"] == LANES and st["state"] == "ready"
    assert [q["qos"] for q in st["queue"]] == ["interactive", "batch", "background"]
    assert st["workers"][0]["engine"] == "basert" and st["workers"][0]["state"] == "ready"
    r = subprocess.run([*ctl, "--socket", str(daemon.socket), "status"], capture_output=True, timeout=60)
    assert r.returncode == 0 and b"worker" in r.stdout and b"interactive" in r.stdout
    r = subprocess.run(
        [*ctl, "--socket", str(daemon.socket), "generate", ""], capture_output=True, timeout=60
    )
    assert r.returncode == 1 and b"empty_prompt" in r.stderr
    r = subprocess.run(
        [*ctl, "--socket", "/nonexistent/basertd.sock", "status"], capture_output=True, timeout=60
    )
    assert r.returncode == 3 and b"/nonexistent/basertd.sock" in r.stderr  # unreachable, named


async def _storm(sock, n: int, seed: int):
    """n requests over 10 connections: random prompts and lengths, some cancelled mid-stream,
    two connections dropped mid-stream. Returns one record per request."""
    rng = random.Random(seed)
    clients = [await AsyncClient.connect(sock) for _ in range(10)]
    records = []

    async def one(i: int):
        conn = i % 10
        prompt = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(rng.randint(1, 200)))
        gen = dict(
            max_tokens=rng.randint(1, 64), temperature=rng.choice([0.0, 0.7]), seed=rng.randint(0, 1 << 31)
        )
        cancel_after = rng.choice([None, None, None, 1, 3])
        rec = {"i": i, "conn": conn, "prompt": prompt, "gen": gen, "ids": [], "outcome": None}
        rec["cancel_after"] = cancel_after
        records.append(rec)
        try:
            s = await clients[conn].stream(prompt, resume=False, **gen)  # a vanishing client
            async for t in s:
                rec["ids"] += t.ids
                if cancel_after is not None and len(rec["ids"]) >= cancel_after:
                    await s.cancel()
                    cancel_after = None
            rec["outcome"] = s.done.finish_reason
            rec["usage"] = s.done.usage
        except ConnectionLost:
            rec["outcome"] = "lost"
        except ClientError as exc:
            rec["outcome"] = exc.code

    async def dropper():
        # drop connections 3 and 7 once each has a stream under way (a condition, not a sleep;
        # bounded, so a run where they finished first still ends)
        deadline = time.monotonic() + 10.0
        while not all(any(r["conn"] == k and r["ids"] for r in records) for k in (3, 7)):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.002)
        for k in (3, 7):
            clients[k]._writer.transport.abort()  # the client vanishes mid-stream

    await asyncio.gather(*(one(i) for i in range(n)), dropper())
    for c in clients:
        await c.close()
    return records


def test_200_concurrent_with_cancels_and_disconnects(daemon, direct):
    records = asyncio.run(_storm(daemon.socket, 200, seed=7))
    outcomes = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    assert sum(outcomes.values()) == 200 and None not in outcomes, outcomes
    assert set(outcomes) <= {"eos", "length", ErrorCode.CANCELLED, "lost"}, outcomes
    assert outcomes.get(ErrorCode.CANCELLED, 0) > 10 and outcomes.get("lost", 0) > 0
    st = daemon.wait_idle()
    assert st.lanes_busy == 0 and st.queued == 0
    workers = daemon.workers()
    assert workers[0].lanes_busy == 0 and workers[0].queue_depth == 0
    assert workers[0].engine_lanes == 0 and workers[0].seed_leases == 0  # nothing left in the engine
    with daemon.client() as c:
        tok = {r["prompt"]: c.tokenize(r["prompt"]) for r in records}
    checked = 0
    for r in records:
        gen = api.Generate(request_id="x", prompt="", **r["gen"])
        expected = direct.run(tok[r["prompt"]], gen)
        if r["outcome"] in ("eos", "length"):
            assert r["ids"] == expected, r["i"]  # token-exact: nothing lost, repeated or reordered
            assert r["usage"].completion_tokens == len(r["ids"])
            checked += 1
        else:
            assert r["ids"] == expected[: len(r["ids"])], r["i"]  # a prefix, never a repeat
    # every request on a surviving connection that was not cancelled completed
    kept = [r for r in records if r["conn"] not in (3, 7) and r["cancel_after"] is None]
    assert all(r["outcome"] in ("eos", "length") for r in kept)
    assert checked >= len(kept) > 60


def test_worker_sigkill_mid_stream_resumes_lanes_exactly_and_respawns():
    with (
        Daemon(ref_config({"tick_delay_us": 20000, "eos_period": 0}, grant=2)) as d,
        direct_engine({"eos_period": 0}) as direct,
    ):
        (w0,) = d.workers()

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                streams = [await c.stream(f"kill me {i}", max_tokens=300, temperature=0.0) for i in range(4)]
                got = [[] for _ in streams]
                errors = [None] * len(streams)
                at_kill = []

                async def read(k):
                    try:
                        async for t in streams[k]:
                            got[k] += t.ids
                    except ClientError as exc:
                        errors[k] = exc

                readers = [asyncio.create_task(read(k)) for k in range(len(streams))]
                while min(len(g) for g in got) < 6:
                    await asyncio.sleep(0.01)
                at_kill = [len(g) for g in got]
                os.kill(w0.pid, signal.SIGKILL)
                await asyncio.gather(*readers)
                return got, errors, at_kill, [s.done for s in streams]

        got, errors, at_kill, dones = asyncio.run(scenario())
        # A crash is a preemption: every stream completes, none repeats or loses a token.
        assert errors == [None] * 4, errors
        assert all(done.finish_reason == "length" for done in dones), dones
        assert all(n < 300 for n in at_kill), at_kill  # killed mid-stream
        with d.client() as c:
            for k, ids in enumerate(got):
                expected = direct.run(
                    c.tokenize(f"kill me {k}"),
                    api.Generate(request_id="x", prompt="", max_tokens=300, temperature=0.0),
                )
                assert ids == expected  # delivered once, in order, token-exact
            (w1,) = d.workers()
            assert w1.pid != w0.pid and w1.respawns == 1 and not pid_alive(w0.pid)
            out = c.generate("after the crash", max_tokens=8, temperature=0)
            assert out.usage.completion_tokens == 8
        log = d.log_text()
        assert "worker_lost" in log and "worker_lanes_resumed" in log
        access = [e for e in d.log_events() if e.get("event") == "access"]
        access = [e for e in access if e["request_id"] in {s.request_id for s in dones}]
        assert len(access) == 4 and all(e["crash_resumes"] == 1 for e in access), access


def test_queue_full_and_cancel_of_queued_request_never_starts():
    with Daemon(ref_config({"tick_delay_us": 20000, "eos_period": 0}, lanes=1, grant=1, queue_limit=2)) as d:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                running = await c.stream("busy", max_tokens=100, temperature=0)
                q1 = await c.stream("queued one", max_tokens=5, temperature=0)
                q2 = await c.stream("queued two", max_tokens=5, temperature=0, qos="batch")
                q3 = await c.stream("queued three", max_tokens=5, temperature=0)
                with pytest.raises(ClientError) as info:
                    await c.stream("no room", max_tokens=5, temperature=0)
                assert info.value.code == ErrorCode.QUEUE_FULL
                await q1.cancel()
                with pytest.raises(ClientError) as info:
                    async for _ in q1:
                        pass
                assert info.value.code == ErrorCode.CANCELLED
                await running.cancel()
                with pytest.raises(ClientError):
                    async for _ in running:
                        pass
                outs = []
                for s in (q3, q2):  # interactive before batch
                    ids = []
                    async for t in s:
                        ids += t.ids
                    outs.append((s.done.finish_reason, len(ids)))
                return outs

        assert asyncio.run(scenario()) == [("length", 5), ("length", 5)]
        d.wait_idle()  # the last lanes retire in the plan after their Done
        with d.client() as c:
            lanes = c.request(control.Lanes()).lanes
        assert lanes == []


def test_worker_that_cannot_start_is_given_up_then_retried_on_the_next_request(tmp_path):
    missing = tmp_path / "libmissing.so"  # the coordinator starts, the worker cannot load its engine
    cfg = f'[[workers]]\nengine = "basert"\nmodel = "{missing}"\n'
    # the daemon serves its socket even while no worker runs
    with Daemon(cfg, wait_workers=False) as d:
        deadline = time.monotonic() + 60
        while "worker_given_up" not in d.log_text():
            assert d.proc.poll() is None and time.monotonic() < deadline, d.log_text()
            time.sleep(0.1)
        given_up_at = time.monotonic()
        # exit status 3 (the engine cannot load) will not fix itself: given up after one start
        assert d.log_text().count("worker_spawned") == 1
        with d.client() as c:
            health = c.health()  # a given-up worker is named with its reason, not "starting"
            assert health.status == "degraded" and health.workers_ready == 0
            assert health.reason.startswith("worker 0: ") and health.reason.endswith("(exit status 3)")
            assert "cannot load the basert engine" in health.reason and str(missing) in health.reason
            with pytest.raises(ClientError) as info:  # at once, without a doomed respawn
                c.generate("anyone there?", max_tokens=4)
            assert (
                info.value.code == ErrorCode.WORKER_FAILED and "worker 0 is unavailable" in info.value.message
            )
            assert str(missing) not in info.value.message  # the worker's own line is for operators
            assert d.log_text().count("worker_spawned") == 1
            time.sleep(max(0.0, given_up_at + 5.5 - time.monotonic()))  # the supervisor's backoff_max_s
            with pytest.raises(ClientError) as info:  # now it tries once more, and fails the same way
                c.generate("anyone there?", max_tokens=4)
            assert info.value.code == ErrorCode.WORKER_FAILED
        log = d.log_text()
        assert log.count("worker_retry_on_request") == 1 and log.count("worker_given_up") == 2
        assert log.count("worker_spawned") == 2


def test_rejected_plan_is_logged_and_replanned_never_a_crash():
    # A 1024-token pool whose published prefixes may not be evicted inside a tick: after the first
    # request retires and publishes, a long prompt no longer fits and the engine answers
    # NEEDS_REPLAN (ABI rule 50); the daemon logs it, fails that request typed, and serves on.
    ref = {"pool_bytes": 1024 * 64, "bytes_per_token": 64, "page_size_tokens": 16, "eos_period": 0}
    cfg = ref_config(ref, context=1024, cache="publish_on_retire = true\nevict_in_tick = false")
    with Daemon(cfg) as d:
        with d.client() as c:
            first = c.generate("a" * 600, max_tokens=100, temperature=0)
            assert first.usage.completion_tokens == 100
            d.wait_idle()
            with pytest.raises(ClientError) as info:
                c.generate("b" * 400, max_tokens=10, temperature=0)
            assert info.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
            assert "KV pool" in info.value.message
            small = c.generate("c" * 50, max_tokens=10, temperature=0)
            assert small.usage.completion_tokens == 10
        log = d.log_text()
        assert '"plan_rejected"' in log and "NEEDS_REPLAN" in log
        assert d.proc.poll() is None


def test_one_connection_multiplexes_and_refuses_a_duplicate_live_request_id(daemon):
    with daemon.client() as c:
        c.send(api.Generate(request_id="dup", prompt="first", max_tokens=30, temperature=0))
        c.send(api.Generate(request_id="dup", prompt="second", max_tokens=30, temperature=0))
        c.send(api.Generate(request_id="other", prompt="third", max_tokens=5, temperature=0))
        replies: dict[str, list] = {"dup": [], "other": [], "": []}
        while not any(isinstance(m, api.Done) for m in replies["dup"]) or not any(
            isinstance(m, api.Done) for m in replies["other"]
        ):
            m = c._recv()
            replies[m.request_id].append(m)
        dup = replies["dup"]
        assert isinstance(dup[0], api.Accepted)
        # the refusal of the second "dup" is not an event of the running one: no request id, and
        # its message names the id it refers to; the running "dup" ends normally
        assert not [m for m in dup if isinstance(m, api.Error)]
        (refusal,) = replies[""]
        assert isinstance(refusal, api.Error) and refusal.code == ErrorCode.INVALID_REQUEST
        assert "'dup'" in refusal.message and "already running" in refusal.message
        assert sum(isinstance(m, api.Done) for m in dup) == 1
        assert sum(len(m.ids) for m in replies["other"] if isinstance(m, api.Tokens)) == 5
