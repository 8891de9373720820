"""``cache evict``'s entry count (``PolicyCacheControl.evict``) is the engine's entries before the
eviction less those after it, and the counters after it must be a PONG answered after it: one
from an earlier PONG (``STALE_KEY``, the worker inside a tick) is asked again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from basertd.server.cache.commands import Evict
from basertd.server.fleet import STALE_KEY
from basertd.server.ops.cache_verbs import FRESH_TRIES, PolicyCacheControl


class Scheduler:
    """Runs an ``Evict`` as a worker's scheduler would between ticks: ``freed`` bytes."""

    def __init__(self, freed: int) -> None:
        self.freed = freed
        self.commands: list[object] = []

    async def command(self, cmd: object) -> int:
        self.commands.append(cmd)
        return self.freed


def control_with(answers: list[dict[str, int]]) -> tuple[PolicyCacheControl, list[dict[str, int]]]:
    """A cache control over one worker whose PONG counters are ``answers``, in turn."""
    left = list(answers)

    async def engine_stats(worker_id: int) -> dict[str, int]:
        assert worker_id == 0
        return left.pop(0)

    worker = SimpleNamespace(worker_id=0, scheduler=Scheduler(4096), cache=None)
    return PolicyCacheControl([worker], engine_stats, lambda name, worker_id: 0), left


def test_the_count_waits_for_counters_answered_after_the_eviction():
    stale = {"cache_entries": 3, STALE_KEY: 1500}
    ctl, left = control_with([{"cache_entries": 3}, stale, {"cache_entries": 1}])
    out = asyncio.run(ctl.evict(None, 0))
    assert (out.bytes_freed, out.entries) == (4096, 2) and left == []
    assert isinstance(ctl.workers[0].scheduler.commands[0], Evict)


def test_counters_that_stay_stale_are_asked_for_a_bounded_number_of_times():
    stale = {"cache_entries": 3, STALE_KEY: 1500}
    ctl, left = control_with([{"cache_entries": 3}] + [stale] * (FRESH_TRIES + 2))
    out = asyncio.run(ctl.evict(None, 0))
    assert out.bytes_freed == 4096 and out.entries == 0  # no fresh answer: nothing counted as gone
    assert len(left) == 2  # FRESH_TRIES asks, no more
