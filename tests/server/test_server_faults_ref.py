"""A plan the engine rejects because of one lane, and a scheduler that stalls, end to end on the
reference engine (``basertd.server.sched.rejects``, ``basertd.server.sched.watchdog``).

The reference engine's test hooks (``basertd.worker.engines.ref_hooks.HookedEngine``) reject every
plan that admits a lane with a marked ``top_k`` (as an out-of-range value would be), or hang the
tick that admits one.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from daemon_harness import Daemon
from serving_harness import direct_ref, ref_toml

from basertd.client import AsyncClient
from basertd.client._common import ClientError
from basertd.schema import client as api
from basertd.schema.client import ErrorCode

REJECT_K = 77
STALL_K = 55
NORMAL = {"max_tokens": 24, "temperature": 0.0}


@pytest.fixture(scope="module")
def direct():
    with direct_ref(lanes=4) as d:
        yield d


def uninterrupted(direct, prompt_ids: list[int], **params) -> list[int]:
    return direct.run(prompt_ids, api.Generate(request_id="x", prompt="", **params))


async def _poison(c: AsyncClient, request_id: str, top_k: int) -> ClientError:
    with pytest.raises(ClientError) as info:
        await c.generate("poison", request_id=request_id, max_tokens=8, temperature=1.0, top_k=top_k, seed=3)
    return info.value


def test_a_rejected_admit_fails_alone_while_three_streams_complete_exactly(direct):
    prompts = [f"an ordinary stream {i}" for i in range(3)]
    with Daemon(ref_toml(lanes=4, ref={"test_reject_top_k": REJECT_K})) as d:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                normal = [c.generate(p, request_id=f"n{i}", **NORMAL) for i, p in enumerate(prompts)]
                return await asyncio.gather(_poison(c, "bad", REJECT_K), *normal)

        err, *outs = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert err.code == ErrorCode.INVALID_REQUEST and "top_k" in err.message, err
        with d.client() as c:
            for p, out in zip(prompts, outs, strict=True):
                assert out.ids == uninterrupted(direct, c.tokenize(p), **NORMAL)
                assert out.finish_reason == "length"

        # On an idle worker: the poison fails alone, and the next request is served at once.
        async def idle():
            async with await AsyncClient.connect(d.socket) as c:
                err = await _poison(c, "bad-idle", REJECT_K)
                t0 = time.monotonic()
                out = await c.generate("after the poison", request_id="after", **NORMAL)
                return err, out, time.monotonic() - t0

        err, out, took = asyncio.run(asyncio.wait_for(idle(), 30))
        assert err.code == ErrorCode.INVALID_REQUEST and "top_k" in err.message
        assert len(out.ids) == NORMAL["max_tokens"] and took < 5.0
        assert all(w.state == "ready" and w.respawns == 0 for w in d.workers())  # no restart needed


def test_a_stuck_tick_is_noticed_within_the_bound_and_the_worker_restarted():
    bound = 1.0
    toml = ref_toml(lanes=2, ref={"test_stall_top_k": STALL_K}, scheduler=f"stall_timeout_s = {bound}")
    with Daemon(toml) as d:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                t0 = time.monotonic()
                err = await _poison(c, "stuck", STALL_K)
                noticed = time.monotonic() - t0
                out = await c.generate("served after the restart", request_id="later", **NORMAL)
                return err, noticed, out

        err, noticed, out = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert err.code == ErrorCode.WORKER_FAILED, err
        assert noticed < bound + 4.0, noticed
        assert len(out.ids) == NORMAL["max_tokens"]
        stalls = [e for e in d.log_events() if e.get("event") == "scheduler_stalled"]
        assert stalls and "tick" in stalls[0]["reason"], stalls
        assert any(w.respawns >= 1 for w in d.workers())
