"""``basertd.server.tasks.cancel_and_wait``: a task that swallows a cancellation (as Python 3.11's
``asyncio.wait_for`` can, CPython gh-86296) is cancelled again until it ends."""

from __future__ import annotations

import asyncio

import pytest

from basertd.server.tasks import cancel_and_wait


async def _swallows_once(ended: list[str]) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()  # carries on as if never cancelled
    try:
        await asyncio.sleep(3600)
    finally:
        ended.append("stubborn")


async def _fails() -> None:
    raise ValueError("boom")


def test_a_task_that_swallows_a_cancellation_is_cancelled_again_until_it_ends():
    async def main() -> list[str]:
        ended: list[str] = []
        stubborn = asyncio.create_task(_swallows_once(ended))
        failing = asyncio.create_task(_fails())
        plain = asyncio.create_task(asyncio.sleep(3600))
        await asyncio.sleep(0.01)
        await asyncio.wait_for(cancel_and_wait([stubborn, failing, plain], recancel_s=0.2), 10)
        assert stubborn.cancelled() and plain.cancelled()
        assert isinstance(failing.exception(), ValueError)
        return ended

    assert asyncio.run(main()) == ["stubborn"]


def test_nothing_to_cancel_returns_at_once():
    asyncio.run(asyncio.wait_for(cancel_and_wait([]), 1))


@pytest.mark.parametrize("n", [1, 5])
def test_done_tasks_are_left_as_they_are(n):
    async def main() -> None:
        tasks = [asyncio.create_task(asyncio.sleep(0, result=i)) for i in range(n)]
        await asyncio.gather(*tasks)
        await cancel_and_wait(tasks)
        assert [t.result() for t in tasks] == list(range(n))

    asyncio.run(main())
