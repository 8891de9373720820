"""A worker spawned before the daemon's event loop runs (``WorkerProcess.spawn``, as
``basertd.server.launch`` does it before the daemon imports the rest of itself) is handshaken
later by its slot (``WorkerSlot.start(spawned)``), and released, child reaped, when nobody
handshakes it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest

from basertd.server.states import SlotState
from basertd.server.workers.process import WorkerProcess, WorkerSpec
from basertd.server.workers.slot import WorkerSlot


@pytest.fixture
def spec():
    rundir = tempfile.mkdtemp(prefix="brt-sp-", dir="/tmp")  # short: the ipc path fits sun_path
    yield WorkerSpec(engine="basert", lanes=2, context_length=128, runtime_dir=rundir)
    shutil.rmtree(rundir, ignore_errors=True)


def test_a_slot_handshakes_the_worker_spawned_before_its_loop(spec, no_leaks):
    spawned = WorkerProcess.spawn(spec)  # no event loop yet

    async def main():
        slot = WorkerSlot(spec)
        slot.start(spawned)
        proc = await asyncio.wait_for(slot.ready(), 60)
        assert slot.state is SlotState.READY and slot.incarnations == 1
        assert proc.pid == spawned.pid and proc.capabilities.max_lanes == 2
        await slot.stop()

    asyncio.run(main())
    with pytest.raises(RuntimeError):
        asyncio.run(spawned.handshake())  # the slot took it over


def test_a_spawned_worker_nobody_handshakes_is_killed_and_reaped(spec, no_leaks):
    async def stopped_before_its_supervisor_ran():
        slot = WorkerSlot(spec)
        slot.start(WorkerProcess.spawn(spec))
        await slot.stop()
        assert slot.state is SlotState.STOPPED and slot.incarnations == 0

    asyncio.run(stopped_before_its_supervisor_ran())
    spawned = WorkerProcess.spawn(spec)
    spawned.kill()
    spawned.kill()  # idempotent
    with pytest.raises(RuntimeError):
        asyncio.run(spawned.handshake())
