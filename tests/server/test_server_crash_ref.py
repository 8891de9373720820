"""A worker crash is a preemption (DESIGN.md "Scheduling"): on the C reference engine, a worker
SIGKILLed at random moments under 16 concurrent sampled and greedy streams leaves every stream
token-exact against an uninterrupted run (resumed with ``decode_replay``, ABI rules 71-73); a
poison request (the ``test_crash_top_k`` hook kills the worker whenever its lane decodes) fails
``worker_failed`` after ``max_crash_resumes`` crashes while the others complete."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from daemon_harness import Daemon
from proc_testutil import pid_alive, wait_until
from serving_harness import direct_ref, ref_toml

from basertd.client import AsyncClient, ClientError
from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.client import ErrorCode

LANES = 8
CONTEXT = 512
REF = {"eos_period": 0, "tick_delay_us": 4000}
POISON_K = 77


async def _until(d: Daemon, ok, stop, timeout: float = 60.0):
    """The worker row once ``ok(row)`` holds, or None once ``stop()`` does (the streams ended)."""
    deadline = time.monotonic() + timeout
    while not stop():
        (w,) = await asyncio.to_thread(d.workers)
        if ok(w):
            return w
        assert time.monotonic() < deadline, w
        await asyncio.sleep(0.01)
    return None


@pytest.mark.slow
def test_random_worker_kills_leave_every_stream_token_exact():
    rng = random.Random(15)
    kills = 20
    # Resumes are what this test checks: a stream may be hit again before it delivers a token,
    # so the poison bound is out of the way here (the poison test below checks it).
    toml = ref_toml(lanes=LANES, context=CONTEXT, grant=4, ref=REF, scheduler="max_crash_resumes = 1000")
    gens = [
        api.Generate(
            request_id=f"s{i}",
            prompt=f"crash stream {i} " * (1 + i % 3),
            max_tokens=160,
            temperature=0.0 if i % 2 else 0.9,
            top_k=0 if i % 2 else 40,
            seed=1000 + i,
        )
        for i in range(16)
    ]
    with Daemon(toml) as d:
        children = d.track_children()

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                fields = [
                    {k: getattr(g, k) for k in ("max_tokens", "temperature", "top_k", "seed")} for g in gens
                ]
                streams = []
                for g, f in zip(gens, fields, strict=True):
                    streams.append(await c.stream(g.prompt, request_id=g.request_id, **f))
                got: list[list[int]] = [[] for _ in streams]
                errors: list = [None] * len(streams)

                async def read(k):
                    try:
                        async for t in streams[k]:
                            got[k] += t.ids
                    except ClientError as exc:
                        errors[k] = exc

                readers = [asyncio.create_task(read(k)) for k in range(len(streams))]
                done_kills = 0
                killed = 0

                def ended():
                    return all(r.done() for r in readers)

                while done_kills < kills:
                    w = await _until(d, lambda w, k=killed: w.state == "ready" and w.pid not in (0, k), ended)
                    if w is None:
                        break
                    # a random tick of this incarnation, after its first (the supervisor counts an
                    # incarnation that never ticked as a failed start); ticks_run counts them all
                    target = w.ticks_run + rng.randint(1, 12)
                    w = await _until(d, lambda w, t=target: w.ticks_run >= t, ended)
                    if w is None:
                        break
                    killed = w.pid
                    os.kill(killed, signal.SIGKILL)
                    done_kills += 1
                await asyncio.wait_for(asyncio.gather(*readers), 300)
                return got, errors, [s.done for s in streams], done_kills

        got, errors, dones, done_kills = asyncio.run(scenario())
        assert errors == [None] * 16, errors
        assert done_kills >= kills // 2, done_kills  # most kills landed before the streams ended
        with d.client() as c, direct_ref(lanes=LANES, context=CONTEXT, ref=REF) as direct:
            for g, ids, done in zip(gens, got, dones, strict=True):
                expected = direct.run(c.tokenize(g.prompt), g)
                assert ids == expected, g.request_id  # no token lost, repeated or changed
                assert done.finish_reason == "length"
        resumed = [e for e in d.log_events() if e.get("event") == "access" and e.get("crash_resumes")]
        assert resumed, "no stream was running at a kill"
        assert d.workers()[0].respawns == done_kills
        with d.client() as c:
            text = c.request(control.Metrics()).text
        (line,) = [x for x in text.splitlines() if x.startswith('basertd_crash_resumes_total{worker="0"}')]
        assert float(line.split()[-1]) == sum(e["crash_resumes"] for e in resumed)
    assert not any(pid_alive(p) for p in children)


def test_a_poison_request_fails_after_max_crash_resumes_and_the_others_complete():
    toml = ref_toml(lanes=4, context=CONTEXT, grant=2, ref={**REF, "test_crash_top_k": POISON_K})
    normal = {"max_tokens": 40, "temperature": 0.0}
    with Daemon(toml) as d:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                others = [await c.stream(f"bystander {i}", request_id=f"ok{i}", **normal) for i in range(3)]
                poison = await c.stream(
                    "poison", request_id="poison", max_tokens=40, temperature=0.7, top_k=POISON_K, seed=5
                )
                err = None
                try:
                    async for _ in poison:
                        pass
                except ClientError as exc:
                    err = exc
                outs = []
                for s in others:
                    ids = []
                    async for t in s:
                        ids += t.ids
                    outs.append((ids, s.done))
                return err, outs

        err, outs = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert err is not None and err.code == ErrorCode.WORKER_FAILED, err
        assert "2 times in a row" in err.message, err.message
        with d.client() as c, direct_ref(lanes=4, context=CONTEXT, ref=REF) as direct:
            for i, (ids, done) in enumerate(outs):
                gen = api.Generate(request_id="x", prompt="", **normal)
                assert ids == direct.run(c.tokenize(f"bystander {i}"), gen)
                assert done.finish_reason == "length"
            (w,) = d.workers()
            assert w.respawns == 2  # default max_crash_resumes: it ran at two crashes, then failed
            assert len(c.generate("after the poison", max_tokens=8, temperature=0).ids) == 8
        events = d.log_events()
        lost = [e for e in events if e.get("event") == "worker_lanes_resumed"]
        assert len(lost) == 2 and lost[-1]["failed"] == 1, lost
        access = {e["request_id"]: e for e in events if e.get("event") == "access"}
        assert access["poison"]["error_code"] == "worker_failed" and access["poison"]["crash_resumes"] == 1


def test_a_crashed_workers_lanes_resume_on_a_live_peer_of_the_same_model():
    toml = ref_toml(lanes=4, context=CONTEXT, grant=2, ref={**REF, "tick_delay_us": 20000}, workers=2)
    normal = {"max_tokens": 120, "temperature": 0.0}
    with Daemon(toml) as d:
        w0 = next(w for w in d.workers() if w.worker_id == 0)

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                streams = [await c.stream(f"peer {i}", request_id=f"p{i}", **normal) for i in range(6)]
                got = [[] for _ in streams]

                async def read(k):
                    async for t in streams[k]:
                        got[k] += t.ids

                readers = [asyncio.create_task(read(k)) for k in range(len(streams))]
                while min(len(g) for g in got) < 4:
                    await asyncio.sleep(0.01)
                os.kill(w0.pid, signal.SIGKILL)
                await asyncio.gather(*readers)
                return got

        got = asyncio.run(asyncio.wait_for(scenario(), 120))
        with d.client() as c, direct_ref(lanes=4, context=CONTEXT, ref=REF) as direct:
            for i, ids in enumerate(got):
                assert ids == direct.run(
                    c.tokenize(f"peer {i}"), api.Generate(request_id="x", prompt="", **normal)
                )
        events = d.log_events()
        access = {e["request_id"]: e for e in events if e.get("event") == "access"}
        crashed = [a for a in access.values() if a["crash_resumes"]]
        assert crashed and all(a["worker_id"] == 1 for a in crashed), access  # finished on the peer
        (lost,) = [e for e in events if e.get("event") == "worker_lanes_resumed"]
        assert sorted(lost["moved_to_peers"]) == sorted(a["key"] for a in crashed)


@pytest.mark.slow
def test_four_poison_requests_on_two_workers_fail_and_leave_both_workers_serving():
    """Each poison request kills whichever worker decodes it, after its partial emits delivered a
    token (``test_crash_emit_top_k``): those tokens are no progress, its crash count travels with
    it from worker to worker, so it fails ``worker_failed`` after ``max_crash_resumes`` deaths in
    all; deaths with a tick in flight never count as a worker's failed starts: no worker is given
    up, the bystanders complete exactly, and both workers serve afterwards."""
    toml = ref_toml(
        lanes=4, context=CONTEXT, grant=2, ref={**REF, "test_crash_emit_top_k": POISON_K}, workers=2
    )
    normal = {"max_tokens": 24, "temperature": 0.0}
    with Daemon(toml) as d:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                poisons = [
                    await c.stream(
                        f"poison {i}", request_id=f"poison{i}", max_tokens=24, top_k=POISON_K, seed=i
                    )
                    for i in range(4)
                ]
                others = [await c.stream(f"bystander {i}", request_id=f"ok{i}", **normal) for i in range(4)]
                errs = []
                for s in poisons:
                    try:
                        async for _ in s:
                            pass
                        errs.append(None)
                    except ClientError as exc:
                        errs.append(exc)
                outs = []
                for s in others:
                    ids = []
                    async for t in s:
                        ids += t.ids
                    outs.append((ids, s.done))
                return errs, outs

        errs, outs = asyncio.run(asyncio.wait_for(scenario(), 180))
        assert all(e is not None and e.code == ErrorCode.WORKER_FAILED for e in errs), errs

        # the last death's respawn may still run: never given up, both come back
        def all_ready():
            rows = d.workers()
            return rows if all(w.state == "ready" for w in rows) else None

        rows = wait_until(all_ready, 30, interval=0.1, what="both workers ready")
        deaths = sum(w.respawns for w in rows)
        assert deaths <= 4 * 2, rows  # at most max_crash_resumes (2) deaths per poison request
        with d.client() as c, direct_ref(lanes=4, context=CONTEXT, ref=REF) as direct:
            for i, (ids, done) in enumerate(outs):
                gen = api.Generate(request_id="x", prompt="", **normal)
                assert ids == direct.run(c.tokenize(f"bystander {i}"), gen)
                assert done.finish_reason == "length"
        events = d.log_events()
        assert not [e for e in events if e.get("event") == "worker_given_up"], events
        access = {e["request_id"]: e for e in events if e.get("event") == "access"}
        served = {access[f"ok{i}"]["worker_id"] for i in range(4)}

        async def after():  # both workers serve: concurrent requests land on each
            async with await AsyncClient.connect(d.socket) as c:
                outs = await asyncio.gather(
                    *(
                        c.generate(f"after the poison {i}", request_id=f"after{i}", max_tokens=16)
                        for i in range(8)
                    )
                )
                assert all(len(o.ids) == 16 for o in outs)

        asyncio.run(asyncio.wait_for(after(), 60))
        access = [e for e in d.log_events() if e.get("event") == "access"]
        assert {e["worker_id"] for e in access if e["request_id"].startswith("after")} == {0, 1}, served
