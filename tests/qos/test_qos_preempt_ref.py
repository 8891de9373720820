"""Preemption with exact resume and aging, end to end on the reference engine
(DESIGN.md "Scheduling"; ABI rules 71-73).

Two lanes are kept busy decoding long batch requests; interactive requests arrive and must get
their first token within two ticks of arrival (counted by the daemon in ticks, ``ttft_ticks`` of
the access line: the tick in flight at arrival, then the tick that admits it). The batch
requests are preempted, resumed with ``decode_replay``, and must deliver exactly the tokens an
uninterrupted run of the same engine delivers, greedy and seeded sampling alike.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from daemon_harness import Daemon
from serving_harness import access_lines, direct_ref, engine_stats, ref_toml, wait_leases

from basertd.client import AsyncClient
from basertd.schema import client as api

LONG = 120  # tokens of each batch request: 60 ticks of 20 ms at a grant of 2


@pytest.fixture(scope="module")
def direct():
    with direct_ref() as d:
        yield d


@pytest.fixture(scope="module")
def daemon():
    with Daemon(ref_toml(scheduler="aging_s = 0.4")) as d:
        yield d


def uninterrupted(direct, prompt_ids: list[int], **params) -> list[int]:
    gen = api.Generate(request_id="x", prompt="", **params)
    return direct.run(prompt_ids, gen)


class Reader:
    """One iterator over a stream (an ``AsyncStream`` forgets its request once an iterator over it
    is dropped), read in two steps: ``head(n)``, then ``rest()``."""

    def __init__(self, stream) -> None:
        self.it = stream.__aiter__()
        self.ids: list[int] = []

    async def head(self, n: int) -> list[int]:
        while len(self.ids) < n:
            self.ids.extend((await self.it.__anext__()).ids)
        return self.ids

    async def rest(self) -> list[int]:
        async for t in self.it:
            self.ids.extend(t.ids)
        return self.ids


def test_interactive_preempts_within_two_ticks_and_batch_resumes_exactly(daemon, direct):
    batch = {
        "greedy": dict(max_tokens=LONG, temperature=0.0, qos="batch", ignore_eos=True),
        "seeded": dict(max_tokens=LONG, temperature=0.9, seed=7, qos="batch", ignore_eos=True),
    }
    prompts = {"greedy": "a long batch job, greedy", "seeded": "another batch job, sampled with a seed"}

    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:
            readers = {}
            for name, params in batch.items():
                readers[name] = Reader(await c.stream(prompts[name], request_id=f"batch-{name}", **params))
            for r in readers.values():
                await r.head(4)  # both lanes are decoding now
            inter = []
            for i in range(2):
                s = await c.stream(
                    f"quick question {i}", request_id=f"inter-{i}", max_tokens=24, temperature=0.0
                )
                r = Reader(s)
                await r.head(1)
                inter.append(r)  # the second one arrives while the first still holds its lane
            inter_out = [await r.rest() for r in inter]
            batch_out = {name: await r.rest() for name, r in readers.items()}
            return batch_out, inter_out

    batch_out, inter_out = asyncio.run(scenario())
    daemon.wait_idle()
    access = access_lines(daemon)
    with daemon.client() as c:
        for name, params in batch.items():
            want = uninterrupted(direct, c.tokenize(prompts[name]), **params)
            assert batch_out[name] == want, (
                f"{name}: the resumed generation differs from the uninterrupted one"
            )
            line = access[f"batch-{name}"]
            assert line["preemptions"] >= 1, line  # each batch lane was preempted at least once
            assert line["completion_tokens"] == LONG and line["finish_reason"] == "length"
        for i, out in enumerate(inter_out):
            ids = c.tokenize(f"quick question {i}")
            assert out == uninterrupted(direct, ids, max_tokens=24, temperature=0.0)
            line = access[f"inter-{i}"]
            assert line["ttft_ticks"] is not None and line["ttft_ticks"] <= 2, line
            assert line["preemptions"] == 0
    stats = engine_stats(daemon)
    assert stats[0]["replay_tokens_total"] > 0  # the resumes replayed their tokens (ABI rule 72)
    wait_leases(daemon, 0)


def test_aging_lets_a_background_request_finish_under_a_stream_of_interactive_ones(daemon, direct):
    stop = time.monotonic() + 30.0
    done_at: dict[str, float] = {}

    async def interactive_loop(c, i: int, counter: list[float]) -> None:
        n = 0
        while time.monotonic() < stop and "bg" not in done_at:
            await c.generate(f"stream {i}-{n}", max_tokens=6, temperature=0.0)
            counter.append(time.monotonic())
            n += 1
        # keep the pressure on a little after the background request finished
        for k in range(2):
            await c.generate(f"after {i}-{k}", max_tokens=6, temperature=0.0)
            counter.append(time.monotonic())

    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:
            served: list[float] = []
            loops = [asyncio.ensure_future(interactive_loop(c, i, served)) for i in range(3)]
            await asyncio.sleep(0.3)  # the interactive stream is queueing
            t0 = time.monotonic()
            out = await c.generate(
                "background chores", request_id="bg", max_tokens=10, temperature=0.0, qos="background"
            )
            done_at["bg"] = time.monotonic()
            await asyncio.gather(*loops)
            during = [t for t in served if t0 < t < done_at["bg"]]
            return out, t0, during

    out, t0, during = asyncio.run(scenario())
    assert done_at["bg"] - t0 < 20.0
    assert len(during) >= 3, "the interactive stream was not running while the background request waited"
    with daemon.client() as c:
        want = uninterrupted(direct, c.tokenize("background chores"), max_tokens=10, temperature=0.0)
    assert out.ids == want
    line = access_lines(daemon)["bg"]
    assert line["queue_s"] >= 0.4, line  # it did wait for its turn: aging, not a free lane, admitted it
    daemon.wait_idle()
    wait_leases(daemon, 0)
