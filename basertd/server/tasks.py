"""Ending asyncio tasks for good.

Python 3.11's ``asyncio.wait_for`` can swallow a cancellation that arrives in the same loop
iteration as its inner result (CPython gh-86296, fixed in 3.12): the cancelled task carries on as if
never cancelled. A stop path that cancels a serving loop once and awaits it then waits forever —
the daemon's stop hung that way, idle in a scheduler's wait for work. ``cancel_and_wait`` cancels
again until the task has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

log = structlog.get_logger("basertd.tasks")

RECANCEL_S = 5.0  # how long one cancellation is given before the next (a cleanup may await)


async def cancel_and_wait(tasks: Iterable[asyncio.Future], recancel_s: float = RECANCEL_S) -> None:
    """Cancel every task of ``tasks`` and return once all have ended, cancelling again every
    ``recancel_s`` seconds those still running. Give ``recancel_s`` more than the longest cleanup
    the tasks run when cancelled (a new cancellation interrupts it). What they raise or return is
    dropped. If the caller is cancelled meanwhile, the tasks have still all been cancelled once."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
        for task in pending:
            log.warning("task_cancelled_again", task=task.get_name())
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at exit
