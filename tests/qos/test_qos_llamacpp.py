"""Preemption with resume on the llama.cpp engine with the tiny GGUF: the basics of
``test_qos_preempt_ref.py`` through real llama.cpp contexts. Tokens are compared with a plain
llama.cpp loop up to the llamacpp issue's tolerance (a different batch composition may flip a
near-tie, never a clear choice)."""

from __future__ import annotations

import asyncio

import pytest
from daemon_harness import Daemon
from serving_harness import access_lines, assert_same_up_to_near_ties, bare_reference, tiny_toml, wait_leases

from basertd.client import AsyncClient

LONG = 160


@pytest.fixture(scope="module", params=["unified", "per-lane"])
def daemon(tiny_gguf, request):
    # both KV layouts ([[workers]] kv_layout): per-lane, a preempted lane's stream is published by
    # copy and its resume seeded by copy
    with Daemon(tiny_toml(tiny_gguf, lanes=2, grant=1, worker=f'kv_layout = "{request.param}"')) as d:
        yield d


def test_interactive_preempts_and_the_batch_lanes_resume_on_llamacpp(daemon, tiny_gguf):
    prompts = ["the world is a", "hello and the world of"]

    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:
            its, ids = [], []
            for i, p in enumerate(prompts):
                s = await c.stream(
                    p, request_id=f"batch-{i}", max_tokens=LONG, temperature=0.0, ignore_eos=True, qos="batch"
                )
                its.append(s.__aiter__())
                ids.append([])
            for it, got in zip(its, ids, strict=True):
                while len(got) < 3:
                    got.extend((await it.__anext__()).ids)
            inter = await c.generate("a quick one", request_id="inter", max_tokens=8, temperature=0.0)
            for it, got in zip(its, ids, strict=True):
                async for t in it:
                    got.extend(t.ids)
            return ids, inter

    outs, inter = asyncio.run(scenario())
    daemon.wait_idle()
    access = access_lines(daemon)
    assert access["inter"]["ttft_ticks"] <= 2, access["inter"]
    assert sum(access[f"batch-{i}"]["preemptions"] for i in range(2)) >= 1, access
    with daemon.client() as c:
        prompt_ids = [c.tokenize(p) for p in prompts]
        inter_ids = c.tokenize("a quick one")
    refs = bare_reference(tiny_gguf, [*prompt_ids, inter_ids], LONG)
    for i, got in enumerate(outs):
        assert len(got) == LONG
        assert_same_up_to_near_ties(got, refs[i], f"batch-{i}")
    assert_same_up_to_near_ties(inter.ids, refs[2], "inter")
    wait_leases(daemon, 0)
