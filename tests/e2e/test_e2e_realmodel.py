"""The one end-to-end test on the default model (Gemma 3 270M Q4_K_M) through ``basertd serve``."""

from __future__ import annotations

import asyncio

import pytest
from e2e_harness import Daemon

from basertd.client import AsyncClient


@pytest.mark.realmodel
@pytest.mark.slow
def test_default_model_serves_real_text(default_model):
    d = Daemon(
        '[[workers]]\nengine = "llamacpp"\nlanes = 4\ncontext_length = 512\nthreads = 2\n', ready_timeout=180
    )
    try:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                prompts = ["The capital of France is", "1, 2, 3, 4, 5,", "The color of the sky is"]
                return await asyncio.gather(*(c.generate(p, max_tokens=12, temperature=0.0) for p in prompts))

        paris, digits, sky = asyncio.run(scenario())
        assert "Paris" in paris.text
        assert "6" in digits.text
        assert sky.usage.completion_tokens >= 1 and sky.text.strip()
        for out in (paris, digits, sky):
            assert out.timings.ttft_s > 0 and out.usage.completion_tokens <= 12
        with d.client() as c:  # the same prompt again, alone: greedy gives the same text
            again = c.generate("The capital of France is", max_tokens=12, temperature=0.0)
        assert again.text == paris.text
    except BaseException:
        d.kill()
        raise
    d.stop()
