"""The supervisor (``basertd.server.workers.slot.WorkerSlot``) treats any exception of a worker
start as a start failure: retried with backoff, then given up with the reason, never a dead task.

The fault is real: the test process's descriptor table is filled (under a lowered
``RLIMIT_NOFILE``) so that a start runs out of descriptors at each step in turn: memfd segments
(``SegmentError``), the zmq socket and its bind (``zmq.ZMQError``, the case that used to kill the
supervisor task and leave the slot ``restarting`` with no worker forever), the spawn (``OSError``).
It runs in a child interpreter so the lowered limit touches nothing else of the suite."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, resource, tempfile
    from basertd.server.daemon import configure_logging
    from basertd.server.states import SlotState
    from basertd.server.workers.process import WorkerProcess, WorkerSpec
    from basertd.server.workers.slot import WorkerSlot

    def fill(free):
        held = []
        while True:
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        for _ in range(free):
            os.close(held.pop())
        return held

    async def until(cond, timeout=20.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while not cond():
            assert asyncio.get_running_loop().time() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def main():
        configure_logging("info")  # the daemon's JSON lines, tracebacks included
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        spec = WorkerSpec(engine="basert", lanes=2, context_length=128, runtime_dir=tempfile.mkdtemp())
        warm = await WorkerProcess.start(spec)  # as in a running daemon: zmq's I/O thread is up
        await warm.close(1.0)
        rows = []
        for free in range(0, 11):
            gave_up = []
            slot = WorkerSlot(spec, backoff_initial_s=0.01, backoff_max_s=0.02, max_failures=2,
                              on_give_up=gave_up.append)
            held = fill(free)
            slot.start()
            try:
                await until(lambda: slot.state in (SlotState.GIVEN_UP, SlotState.READY))
            finally:
                for fd in held:
                    os.close(fd)
            row = {"free": free, "state": str(slot.state), "last_error": slot.last_error,
                   "gave_up": gave_up, "task_alive": not slot._task.done()}
            if "ZMQError" in slot.last_error:
                slot.poke()  # descriptors are back: a request retries and the worker comes up
                proc = await asyncio.wait_for(slot.ready(), 60)
                row["recovered_pid"] = proc.pid
            await slot.stop()
            rows.append(row)
        print(json.dumps(rows))

    asyncio.run(main())
    """
)


def test_every_start_failure_under_fd_exhaustion_is_retried_then_given_up_with_its_reason():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    kinds = set()
    for row in rows:
        assert row["task_alive"], row  # the supervisor task never dies
        assert row["state"] == "given_up", row
        assert row["last_error"].startswith("start failed: "), row
        assert row["gave_up"] == [row["last_error"]], row  # queued requests fail with the reason
        kinds.add(row["last_error"].split(":")[1].strip())
    zmq_rows = [r for r in rows if "ZMQError" in r["last_error"]]
    assert zmq_rows, rows  # the fault that used to kill the supervisor was reached
    assert all(r["recovered_pid"] > 0 for r in zmq_rows), zmq_rows  # poked: the worker comes up
