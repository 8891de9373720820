"""Aging never holds back a fresh interactive request (the rule of ``basertd.server.sched.qos``), end to
end on the reference engine with 20 ms ticks.

Every lane is held by a batch request that was admitted by aging, and more batch requests older
than ``aging_s`` wait: an interactive request must still get its first token within two ticks
(``ttft_ticks`` of the access line), by preempting an aged lane, which then resumes exactly.
"""

from __future__ import annotations

import asyncio

import pytest
from daemon_harness import Daemon
from serving_harness import access_lines, direct_ref, ref_toml

from basertd.client import AsyncClient
from basertd.schema import client as api

AGING_S = 0.2
LONG = dict(max_tokens=80, temperature=0.0, qos="batch", ignore_eos=True)
SHORT = dict(max_tokens=20, temperature=0.0, qos="batch", ignore_eos=True)


@pytest.fixture(scope="module")
def direct():
    with direct_ref() as d:
        yield d


async def _read(stream, n: int | None = None) -> list[int]:
    ids: list[int] = []
    async for t in stream:
        ids.extend(t.ids)
        if n is not None and len(ids) >= n:
            break
    return ids


def test_an_interactive_request_preempts_aged_batch_lanes_within_two_ticks(direct):
    with Daemon(ref_toml(lanes=2, scheduler=f"aging_s = {AGING_S}")) as d:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                shorts = [await c.stream(f"short {i}", request_id=f"short-{i}", **SHORT) for i in range(2)]
                longs = [await c.stream(f"long batch {i}", request_id=f"long-{i}", **LONG) for i in range(4)]
                for s in shorts:  # the long ones waited > aging_s: long-0/1 are admitted aged
                    await _read(s)
                its = [s.__aiter__() for s in longs[:2]]
                heads = []
                for it in its:  # both aged lanes are decoding; long-2/3 wait, aged
                    heads.append(list((await it.__anext__()).ids))
                inter = await c.stream("urgent question", request_id="inter", max_tokens=6, temperature=0.0)
                inter_ids = await _read(inter)
                outs = []
                for it, head in zip(its, heads, strict=True):
                    ids = head
                    async for t in it:
                        ids.extend(t.ids)
                    outs.append(ids)
                outs += [await _read(s) for s in longs[2:]]
                return inter_ids, outs

        inter_ids, outs = asyncio.run(asyncio.wait_for(scenario(), 60))
        d.wait_idle()
        access = access_lines(d)
        line = access["inter"]
        assert line["ttft_ticks"] is not None and line["ttft_ticks"] <= 2, line
        assert sum(access[f"long-{i}"]["preemptions"] for i in range(4)) >= 1
        with d.client() as c:
            assert inter_ids == direct.run(
                c.tokenize("urgent question"),
                api.Generate(request_id="x", prompt="", max_tokens=6, temperature=0.0),
            )
            for i, out in enumerate(outs):
                gen = api.Generate(request_id="x", prompt="", **LONG)
                want = direct.run(c.tokenize(f"long batch {i}"), gen)
                assert out == want, f"long-{i} differs from its uninterrupted run"
