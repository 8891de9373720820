"""``Drainer.serving``: an embedding request in flight counts in ``in_flight`` and a drain waits
for it; one still running at the drain's timeout makes the drain unclean (it is not cancelled)."""

from __future__ import annotations

import asyncio

from basertd.server.frontend.drain import Drainer


def test_a_drain_waits_for_an_embedding_being_served():
    async def run():
        drainer = Drainer(lambda req, code, message: None)
        done = asyncio.Event()

        async def embedding():
            with drainer.serving():
                await done.wait()

        task = asyncio.create_task(embedding())
        await asyncio.sleep(0)
        assert drainer.in_flight == 1 and drainer.requests() == []
        drain = asyncio.create_task(drainer.drain(30.0))
        await asyncio.sleep(0.05)
        assert not drain.done()  # waiting for the embedding
        done.set()
        outcome = await drain
        await task
        return outcome, drainer.in_flight

    outcome, left = asyncio.run(run())
    assert outcome.drained and outcome.cancelled == 0 and left == 0


def test_an_embedding_running_past_the_timeout_leaves_the_drain_unclean():
    async def run():
        drainer = Drainer(lambda req, code, message: None)
        with drainer.serving():
            return await drainer.drain(0.05)

    outcome = asyncio.run(run())
    assert not outcome.drained and outcome.cancelled == 0 and outcome.waited_s >= 0.05
