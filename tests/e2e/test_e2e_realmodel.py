"""The one end-to-end test on the default model (Gemma 3 270M Q4_K_M) through ``basertd serve``."""

from __future__ import annotations

import asyncio

import pytest
from daemon_harness import Daemon

from basertd.client import AsyncClient

PROMPTS = {
    "The capital of France is the city of": "Paris",
    "1, 2, 3, 4, 5,": "6",
    "The opposite of hot is": "cold",
    "Monday, Tuesday, Wednesday,": "Thursday",
}


@pytest.mark.realmodel
@pytest.mark.slow
def test_default_model_serves_real_text(default_model):
    with Daemon(
        '[[workers]]\nengine = "llamacpp"\nlanes = 4\ncontext_length = 512\nthreads = 2\n', ready_timeout=180
    ) as d:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                return await asyncio.gather(*(c.generate(p, max_tokens=12, temperature=0.0) for p in PROMPTS))

        outs = asyncio.run(scenario())
        for (prompt, answer), out in zip(PROMPTS.items(), outs, strict=True):
            assert answer in out.text, (prompt, out.text)
            assert out.timings.ttft_s > 0 and out.usage.prompt_tokens > 1
            assert (
                out.usage.completion_tokens == 12
                if out.finish_reason == "length"
                else out.finish_reason == "eos"
            )
        with d.client() as c:  # served alone afterwards, with a stop string
            alone = c.generate("1, 2, 3, 4, 5,", max_tokens=12, temperature=0.0, stop=[" 8"])
        assert alone.finish_reason == "stop" and alone.text == " 6, 7,"
