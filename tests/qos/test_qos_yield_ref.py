"""Long ticks that yield at once, end to end on the reference engine (DESIGN.md "Scheduling";
``basertd.shm.control``; ABI rules 56, 57).

The engine prefills in steps of 16 tokens, each a real 20 ms sleep (800 prompt tokens a second),
and its decode step is a 20 ms sleep. With nothing urgent waiting the scheduler sends long ticks
(a whole 1,500-token prompt, about 1.9 s); an interactive request that arrives meanwhile makes the
tick in flight end at its next step, and its first token comes within one step plus one short
tick. Streaming lanes get a token at least every ``max_itl_s`` while long prefills run, the long
prompts still prefill in long steps, and every yielded prefill resumes token-exact.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from daemon_harness import Daemon
from serving_harness import access_lines, direct_ref, ref_toml

from basertd.client import AsyncClient
from basertd.schema import client as api

STEP_S = 0.02  # one 16-token prefill step, and one decode step
PREFILL_TOK_S = 16 / STEP_S
LONG_PROMPT = 1500  # ~1.9 s of prefill in one long tick
MAX_ITL_S = 0.4
REF = {"prefill_step_tokens": 16, "prefill_step_us": 20000, "tick_delay_us": 20000}
SCHED = f"long_prefill_budget = 4096\nmax_itl_s = {MAX_ITL_S}\nprefill_budget = 256\n"


def long_text(i: int) -> str:
    """A prompt of ``LONG_PROMPT`` bytes (one token each in the reference vocabulary)."""
    body = f"long batch document {i}: " + "".join(chr(97 + (k * (i + 3)) % 26) for k in range(LONG_PROMPT))
    return body[:LONG_PROMPT]


@pytest.fixture(scope="module")
def daemon():
    with Daemon(ref_toml(lanes=4, context=2048, grant=4, ref=REF, scheduler=SCHED)) as d:
        yield d


@pytest.fixture(scope="module")
def direct():
    with direct_ref(lanes=2, context=2048, ref=REF) as d:
        yield d


def reference(direct, daemon, text: str, **params) -> list[int]:
    with daemon.client() as c:
        ids = c.tokenize(text)
    return direct.run(ids, api.Generate(request_id="x", prompt="", **params))


async def timed(stream) -> tuple[list[int], list[float]]:
    """Token ids of ``stream`` and the monotonic time each Tokens frame arrived."""
    ids: list[int] = []
    times: list[float] = []
    async for t in stream:
        ids.extend(t.ids)
        times.append(time.monotonic())
    return ids, times


def test_an_interactive_request_cuts_a_long_prefill_tick_and_the_prefill_resumes_exactly(daemon, direct):
    batch = dict(max_tokens=6, temperature=0.0, qos="batch", ignore_eos=True)
    inter = dict(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:
            t_batch = time.monotonic()
            b = asyncio.ensure_future(timed(await c.stream(long_text(0), request_id="long-0", **batch)))
            await asyncio.sleep(0.5)  # the long prefill tick is in flight (about 1.9 s in all)
            t_inter = time.monotonic()
            ids, times = await timed(await c.stream("are you there?", request_id="quick", **inter))
            return t_batch, t_inter, ids, times, await b

    t_batch, t_inter, inter_ids, inter_times, (batch_ids, batch_times) = asyncio.run(scenario())
    ttft = inter_times[0] - t_inter
    # One prefill step of the tick in flight, then one short tick: the interactive prompt's whole
    # prefill (1 step), a short slice of the long prompt (the tick target), one decode step; and
    # the planning, the link and a loaded machine around them. The unyielded tick alone had ~1.4 s
    # left to run.
    assert ttft < 0.45, f"interactive TTFT {ttft:.3f} s behind a long prefill"
    assert batch_times[0] - t_batch > LONG_PROMPT / PREFILL_TOK_S  # the long prefill ran meanwhile
    daemon.wait_idle()
    assert inter_ids == reference(direct, daemon, "are you there?", **inter)
    assert batch_ids == reference(direct, daemon, long_text(0), **batch)  # the cut prefill resumed exactly
    line = access_lines(daemon)["quick"]
    assert line["ttft_ticks"] is not None and line["ttft_ticks"] <= 2, line


def test_streaming_lanes_wait_at_most_max_itl_s_while_long_prefills_run(daemon, direct):
    stream = dict(max_tokens=80, temperature=0.0, qos="batch", ignore_eos=True)
    long = dict(max_tokens=3, temperature=0.0, qos="batch", ignore_eos=True)

    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:
            streams = [
                asyncio.ensure_future(timed(await c.stream(f"chat {i}", request_id=f"chat-{i}", **stream)))
                for i in range(2)
            ]
            await asyncio.sleep(0.3)  # both decode now
            t0 = time.monotonic()
            longs = [
                asyncio.ensure_future(timed(await c.stream(long_text(i), request_id=f"doc-{i}", **long)))
                for i in range(1, 3)
            ]
            long_out = [await f for f in longs]
            t_long = time.monotonic() - t0
            return [await f for f in streams], long_out, t0, t_long

    stream_out, long_out, t0, t_long = asyncio.run(scenario())
    for i, (ids, times) in enumerate(stream_out):
        during = [b - a for a, b in itertools.pairwise(times) if b > t0]
        assert during, "the streams ended before the long prefills started"
        worst = max(during)
        assert worst <= MAX_ITL_S, f"chat-{i} waited {worst:.3f} s between tokens (bound {MAX_ITL_S} s)"
        assert ids == reference(direct, daemon, f"chat {i}", **stream)
    # The long prompts still prefill in long steps: 3,000 prompt tokens take 3.75 s at the engine's
    # rate; ticks cut every ~0.3 s cost a decode step each, not a collapse to tiny chunks.
    assert t_long < 2.0 * 2 * LONG_PROMPT / PREFILL_TOK_S, f"long prompts took {t_long:.1f} s"
    for i, (ids, _) in enumerate(long_out, start=1):
        assert ids == reference(direct, daemon, long_text(i), **long)  # yielded prefills resumed exactly
