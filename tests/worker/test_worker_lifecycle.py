"""The worker process's life and death, with real processes.

- SIGKILL mid-tick: the link client notices within 100 ms (pidfd), the tick fails with
  WorkerDied, and nothing is left in /dev/shm, the runtime directory or the process table.
- SIGTERM mid-tick: the tick in flight finishes, its result arrives, then exit 0.
- The coordinator dies: the worker exits by itself (PR_SET_PDEATHSIG); a worker started with
  the wrong parent exits at once (the fork/prctl race check).
- An engine FATAL: ERROR{ERR_FATAL} for the tick, then exit 70.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from proc_testutil import log_lines, pid_alive

from basertd.schema import link
from basertd.schema.abi import Status, TickFlag
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, TickPlan
from basertd.server.workers.link_errors import WorkerDied, WorkerError
from basertd.server.workers.process import WorkerProcess, WorkerSpec
from basertd.server.workers.sync_worker import SyncWorker
from basertd.worker.logging import CONTENT_KEYS, drop_content

HERE = Path(__file__).resolve().parent


def _admit_plan(w, seq: int = 1, tag: int = 7, n: int = 5, decode: int = 2, flags: int = 0) -> TickPlan:
    ref = w.proc.prompt_ring.write(np.arange(10, 10 + n, dtype=np.uint32))
    return TickPlan(
        plan_seq=seq,
        flags=flags,
        prefill_token_budget=64,
        max_decode_lanes=1,
        admits=[LaneAdmit(lane_tag=tag, prompt=ref)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=n)],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=decode)],
    )


def test_sigkill_mid_tick_is_noticed_within_100ms(make_spec, rundir):
    spec = make_spec(ref_config={"tick_delay_us": 5_000_000})
    w = SyncWorker(spec)
    try:
        assert any(rundir.iterdir()), "the worker's private directory exists while it runs"
        assert oct(os.stat(w.proc.runtime_dir).st_mode & 0o777) == "0o700"
        assert os.path.exists(w.proc.ipc_path)

        async def scenario() -> tuple[float, WorkerDied]:
            task = asyncio.ensure_future(w.link.tick(_admit_plan(w)))
            await asyncio.sleep(0.3)  # the tick is now sleeping inside the engine
            assert not task.done()
            t0 = time.monotonic()
            os.kill(w.proc.pid, signal.SIGKILL)
            try:
                await task
            except WorkerDied as exc:
                return time.monotonic() - t0, exc
            raise AssertionError("the tick did not fail")

        elapsed, exc = w.call(scenario())
        assert elapsed < 0.1, f"noticed after {elapsed * 1000:.1f} ms"
        assert exc.returncode == -signal.SIGKILL
        assert not w.link.alive
        with pytest.raises(WorkerDied):
            w.ping()
    finally:
        assert w.close() == -signal.SIGKILL
    assert not os.path.exists(w.proc.ipc_path)


def test_sigterm_finishes_the_tick_in_flight_then_exits_0(make_spec, worker_log):
    with SyncWorker(make_spec(ref_config={"tick_delay_us": 400_000})) as w:

        async def scenario():
            task = asyncio.ensure_future(w.link.tick(_admit_plan(w, decode=3)))
            await asyncio.sleep(0.15)  # lets the tick reach the engine (each step takes 400 ms)
            os.kill(w.proc.pid, signal.SIGTERM)
            events = await task
            code = await w.proc.wait()
            return events, code

        events, code = w.call(scenario())
        assert events.plan_seq == 1 and events.emits[0].n_tokens == 3
        assert len(w.proc.emit_ring.read(events.emits[0].token_ref)) == 3
        assert code == 0
    lines = log_lines(worker_log)
    assert any(line["event"] == "stop_signal" and line["signal"] == "SIGTERM" for line in lines)
    assert all(line["worker_id"] == 0 for line in lines)


def test_worker_exits_when_its_coordinator_dies(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        from basertd.server.workers.process import WorkerSpec
        from basertd.server.workers.sync_worker import SyncWorker
        log = open({str(tmp_path / "w.log")!r}, "ab")
        w = SyncWorker(WorkerSpec(runtime_dir={str(tmp_path)!r}, stderr=log))
        print("WORKER_PID", w.proc.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pidfd = -1
    try:
        line = ""
        while not line.startswith("WORKER_PID"):
            line = parent.stdout.readline()
            assert line, "the helper exited without starting a worker"
        worker_pid = int(line.split()[1])
        pidfd = os.pidfd_open(worker_pid)
        assert pid_alive(worker_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        ready, _, _ = select.select([pidfd], [], [], 5.0)
        assert ready, "the worker outlived its coordinator by 5 s"
        assert not pid_alive(worker_pid)
    finally:
        if pidfd >= 0:
            os.close(pidfd)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()


def test_wrong_parent_at_startup_exits_0(tmp_path):
    # The race check after prctl: a worker whose parent is not the coordinator it was told of
    # (here: our pid is not pid 1) exits at once, before loading anything.
    log = tmp_path / "w.log"
    with open(log, "wb") as err:
        rc = subprocess.run(
            [
                sys.executable,
                "-m",
                "basertd.worker.main",
                "--link",
                "ipc:///nonexistent",
                "--parent-pid",
                "1",
            ],
            stderr=err,
            timeout=30,
        ).returncode
    assert rc == 0
    assert [line["event"] for line in log_lines(log)] == ["parent_gone"]


FATAL_ENGINE = """
import sys
from basertd.worker import engines, main
from basertd.worker.engines import basert
from basertd.worker.engines.base import EngineFatal
from basertd.schema.abi import Status

class DyingEngine(basert.BasertEngine):
    def tick(self, plan, on_partial_emit=None):
        if plan.plan_seq == 3:
            raise EngineFatal(Status.ERR_FATAL, "device lost")
        return super().tick(plan, on_partial_emit)

def open_dying(options):
    e = basert.open_engine(options)
    e.__class__ = DyingEngine
    return e

sys.modules["dying_engine"] = sys.modules[__name__]
engines.ENGINES["dying"] = "dying_engine:open_dying"
sys.exit(main.run(sys.argv[1:]))
"""


def test_engine_fatal_answers_error_and_exits_70(tmp_path, rundir, worker_log, no_leaks):
    # A real worker process whose engine (the reference engine) reports FATAL on its third tick;
    # the entry point is basertd.worker.main.run with one more engine registered.
    script = tmp_path / "dying_worker.py"
    script.write_text(FATAL_ENGINE)

    async def scenario(w: WorkerProcess):
        for seq in (1, 2):
            plan = _admit_plan_proc(w, seq)
            await w.link.tick(plan)
        with pytest.raises(WorkerError) as err:
            await w.link.tick(TickPlan(plan_seq=3))
        assert err.value.status == Status.ERR_FATAL
        return await w.wait()

    loop = asyncio.new_event_loop()
    try:
        with open(worker_log, "ab") as log:
            spec = WorkerSpec(
                engine="dying", runtime_dir=str(rundir), stderr=log, command=[sys.executable, str(script)]
            )
            w = loop.run_until_complete(WorkerProcess.start(spec))
            try:
                assert loop.run_until_complete(scenario(w)) == 70
            finally:
                loop.run_until_complete(w.close())
    finally:
        loop.close()
    events = [line["event"] for line in log_lines(worker_log)]
    assert "engine_fatal" in events


def _admit_plan_proc(w: WorkerProcess, seq: int) -> TickPlan:
    ref = w.prompt_ring.write(np.arange(20, 24, dtype=np.uint32))
    tag = 100 + seq
    return TickPlan(
        plan_seq=seq,
        flags=int(TickFlag.PARTIAL_EMITS),
        prefill_token_budget=16,
        max_decode_lanes=1,
        admits=[LaneAdmit(lane_tag=tag, prompt=ref)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=4)],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=2)],
    )


def test_close_after_the_link_was_closed_stops_the_worker_with_sigterm(make_spec):
    w = SyncWorker(make_spec())
    w.link.close()  # e.g. the supervisor restarting a misbehaving worker
    t0 = time.monotonic()
    assert w.close(grace=10) == 0  # SIGTERM, not the grace period and SIGKILL
    assert time.monotonic() - t0 < 5


def test_logs_are_json_and_content_free(make_spec, worker_log):
    secret = b"SECRET-PROMPT-TEXT"
    with SyncWorker(make_spec()) as w:
        toks = w.request(link.Tokenize(text=secret, add_special=False)).tokens
        ref = w.proc.prompt_ring.write(toks)
        w.tick(
            TickPlan(
                plan_seq=1,
                prefill_token_budget=64,
                max_decode_lanes=1,
                admits=[LaneAdmit(lane_tag=1, prompt=ref)],
                prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=len(toks))],
                decodes=[LaneDecode(lane_tag=1, max_new_tokens=2)],
            )
        )
    text = worker_log.read_text()
    assert "SECRET" not in text and str(toks.tolist()[:4])[1:-1] not in text
    lines = log_lines(worker_log)
    assert {line["event"] for line in lines} >= {
        "engine_loaded",
        "link_hello",
        "rings_attached",
        "worker_exit",
    }
    for line in lines:
        assert line["worker_id"] == 0 and isinstance(line["pid"], int) and line["timestamp"].endswith("Z")
        assert not CONTENT_KEYS & line.keys()


def test_content_keys_are_redacted_whatever_the_call_site():
    out = drop_content(None, "info", {"event": "x", "prompt": "hello", "tokens": [1, 2], "n": 3})
    assert out == {"event": "x", "prompt": "<redacted>", "tokens": "<redacted>", "n": 3}
