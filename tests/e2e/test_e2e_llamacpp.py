"""End to end on the llamacpp engine with the tiny random-weight GGUF (tests/tinymodel.py): the
same basics as on the reference engine, through real llama.cpp contexts."""

from __future__ import annotations

import asyncio

import pytest
from daemon_harness import Daemon
from serving_harness import DirectRun

from basertd.client import AsyncClient, ClientError
from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.server.workers.process import WorkerSpec

LANES = 4
CONTEXT = 256


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    with Daemon(
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gguf}"\nlanes = {LANES}\n'
        f"context_length = {CONTEXT}\nthreads = 1\n[scheduler]\ndecode_grant = 4\ndecode_tick_s = 0\n"
    ) as d:
        yield d


@pytest.fixture(scope="module")
def direct(tiny_gguf):
    spec = WorkerSpec(engine="llamacpp", model=str(tiny_gguf), lanes=1, context_length=CONTEXT, threads=1)
    with DirectRun(spec) as r:
        yield r


def test_generate_is_token_exact_against_the_engine_alone(daemon, direct):
    with daemon.client() as c:
        for prompt, temperature, seed in [
            ("hello world", 0.0, 0),
            ("the world is", 0.9, 42),
            ("a and the", 0.9, 7),
        ]:
            ids = c.tokenize(prompt)
            assert ids[0] == 1  # BOS of the tiny SPM vocabulary
            out = c.generate(prompt, max_tokens=24, temperature=temperature, seed=seed)
            gen = api.Generate(request_id="x", prompt="", max_tokens=24, temperature=temperature, seed=seed)
            assert out.ids == direct.run(ids, gen)
            assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(out.ids)
            assert out.finish_reason in ("length", "eos")


def test_concurrent_requests_cancel_and_typed_errors(daemon):
    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:

            async def run(i):
                return await c.generate(
                    f"hello {'the ' * i}world", max_tokens=8 + 3 * i, temperature=0.5, seed=i
                )

            outs = await asyncio.gather(*(run(i) for i in range(8)))
            s = await c.stream("the and of", max_tokens=200, temperature=0.0, ignore_eos=True)
            got = 0
            with pytest.raises(ClientError) as info:
                async for t in s:
                    got += len(t.ids)
                    if got >= 2:
                        await s.cancel()
            assert info.value.code == ErrorCode.CANCELLED and got < 200
            with pytest.raises(ClientError) as info:
                await c.generate("hello", max_tokens=CONTEXT)
            assert info.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
            return outs

    outs = asyncio.run(scenario())
    for i, out in enumerate(outs):
        assert out.seed == i  # the asyncio client reports the seed in effect
        assert out.finish_reason in ("length", "eos")
        assert 1 <= out.usage.completion_tokens <= 8 + 3 * i
        if out.finish_reason == "length":
            assert out.usage.completion_tokens == 8 + 3 * i  # max_tokens is exact
    st = daemon.wait_idle()
    assert st.lanes_busy == 0 and st.queued == 0
    (w,) = daemon.workers()
    assert w.engine_lanes == 0 and w.seed_leases == 0


def test_stop_string_on_real_detokenized_text(daemon):
    with daemon.client() as c:
        full = c.generate("hello world", max_tokens=40, temperature=0.0, ignore_eos=True)
        text = full.text
        candidates = [text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()]
        if not candidates:
            pytest.skip("greedy output of the tiny model has no usable stop string")
        stop = candidates[0]
        out = c.generate("hello world", max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
        assert out.finish_reason == "stop"
        assert out.text == text[: text.find(stop)]
        assert out.ids == full.ids[: len(out.ids)]
