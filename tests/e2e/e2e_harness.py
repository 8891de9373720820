"""A real ``basertd serve`` process for end-to-end tests, and the checks that it left nothing behind.

``Daemon(tmp, config_toml)`` writes the config (runtime_dir in a short private directory, so the
ipc endpoints fit ``sun_path``), starts ``python -m basertd.cli serve --config ...`` with its log in
``daemon.log``, and waits until every worker has handshaken. ``stop()`` sends SIGTERM and asserts a
clean exit: status 0, socket and runtime files removed, no child process left (every pid the daemon
ever had as a child is gone), and /dev/shm exactly as before.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from basertd.client import Client
from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.abi import AdmitStatus, Finish
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, TickPlan
from basertd.server.requests import sampler_for
from basertd.server.worker_proc import SyncWorker, WorkerSpec


def children_of(pid: int) -> set[int]:
    """Direct children of ``pid`` (from /proc)."""
    out: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.update(int(x) for x in f.read().split())
    except FileNotFoundError:
        pass
    return out


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def shm_entries() -> set[str]:
    """Names in /dev/shm."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


class Daemon:
    """One ``basertd serve`` (module docstring). ``socket`` is its client socket path."""

    def __init__(
        self,
        config_toml: str = "",
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = 60.0,
        wait_workers: bool = True,
    ) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="brt-e2e-", dir="/tmp"))
        self.runtime_dir = self.base / "rt"
        self.socket = self.runtime_dir / "basertd.sock"
        self.config_path = self.base / "basertd.toml"
        self.config_path.write_text(f'runtime_dir = "{self.runtime_dir}"\n' + config_toml)
        self.log_path = self.base / "daemon.log"
        self.shm_before = shm_entries()
        self.seen_children: set[int] = set()
        full_env = {**os.environ, **(env or {})}
        full_env.pop("BASERTD_SOCKET", None)
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "basertd.cli", "serve", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
            )
        try:
            self.wait_ready(ready_timeout, wait_workers)
        except BaseException:
            self.kill()
            raise

    def log_text(self) -> str:
        """The daemon's log so far."""
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float | None = 60.0) -> Client:
        """A blocking client connected to this daemon."""
        return Client(self.socket, timeout=timeout)

    def wait_ready(self, timeout: float, wait_workers: bool = True) -> None:
        """Until the socket answers and (``wait_workers``) every worker is ready (AssertionError on
        timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            if self.socket.exists():
                try:
                    with self.client(timeout=5) as c:
                        h = c.health()
                        if not wait_workers or (h.workers_ready == h.workers_total and h.status == "ok"):
                            self.track_children()
                            return
                except OSError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready within {timeout} s:\n{self.log_text()}")

    def track_children(self) -> set[int]:
        """Record (and return) the daemon's current children."""
        kids = children_of(self.proc.pid)
        self.seen_children |= kids
        return kids

    def workers(self) -> list[control.WorkerRow]:
        """The Workers rows."""
        with self.client() as c:
            return c.request(control.Workers()).workers

    def status(self) -> control.StatusResult:
        """The Status summary."""
        with self.client() as c:
            return c.status()

    def wait_idle(self, timeout: float = 30.0) -> control.StatusResult:
        """Until no lane is busy and nothing is queued; returns that status."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st.lanes_busy == 0 and st.queued == 0:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout} s: {st}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM and assert everything was released (module docstring)."""
        self.track_children()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"daemon did not stop within {timeout} s:\n{self.log_text()}") from None
        log = self.log_text()
        assert rc == 0, f"daemon exited with {rc}:\n{log}"
        assert not self.socket.exists(), "the client socket was left behind"
        assert not self.runtime_dir.exists() or not any(self.runtime_dir.iterdir()), (
            f"runtime files left: {list(self.runtime_dir.iterdir())}"
        )
        left = [pid for pid in self.seen_children if pid_alive(pid)]
        assert not left, f"child processes left: {left}"
        assert shm_entries() == self.shm_before, "/dev/shm changed"
        shutil.rmtree(self.base, ignore_errors=True)

    def kill(self) -> None:
        """Emergency teardown (a failed test): SIGKILL the daemon and every child it had."""
        for pid in self.track_children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class DirectRun:
    """An engine worker driven without the coordinator, for token-exact comparisons: one lane at a
    time, the whole prompt prefilled in the admit tick, then decode grants of up to 7 tokens until
    the engine finishes the lane or ``max_tokens`` is reached. Sampling comes from the same
    ``sampler_for`` the daemon uses (temperature 0 greedy, else Gumbel with rng base seed << 32)."""

    def __init__(self, spec: WorkerSpec) -> None:
        import dataclasses

        self.rundir = tempfile.mkdtemp(prefix="brt-direct-", dir="/tmp")
        self.worker = SyncWorker(dataclasses.replace(spec, runtime_dir=self.rundir))
        self.seq = 0
        self.tag = 0

    def run(self, prompt: list[int], gen: api.Generate) -> list[int]:
        """Token ids the engine generates for ``prompt`` under ``gen``'s sampling and max_tokens."""
        proc = self.worker.proc
        sampler = sampler_for(gen)
        self.tag += 1
        ref = proc.prompt_ring.write(np.asarray(prompt, dtype=np.uint32))
        admit = LaneAdmit(
            lane_tag=self.tag,
            prompt=ref,
            sampling=int(sampler.mode),
            params=sampler.params,
            rng_counter_base=sampler.rng_counter_base(),
        )
        out: list[int] = []
        first = True
        while len(out) < gen.max_tokens:
            self.seq += 1
            plan = TickPlan(
                plan_seq=self.seq,
                prefill_token_budget=len(prompt) if first else 0,
                max_decode_lanes=1,
                admits=[admit] if first else [],
                prefills=[LanePrefill(lane_tag=self.tag, token_offset=0, token_count=len(prompt))]
                if first
                else [],
                decodes=[LaneDecode(lane_tag=self.tag, max_new_tokens=min(7, gen.max_tokens - len(out)))],
            )
            ev = self.worker.tick(plan)
            if first:
                assert ev.admit_results[0].status == AdmitStatus.ADMITTED, ev.admit_results
            first = False
            (emit,) = ev.emits
            if emit.n_tokens:
                out += proc.emit_ring.read(emit.token_ref).tolist()
            if emit.finish != Finish.NONE:
                break
        self.seq += 1
        self.worker.tick(TickPlan(plan_seq=self.seq, retires=[LaneRetire(lane_tag=self.tag)]))
        return out[: gen.max_tokens]

    def close(self) -> None:
        """Stop the worker and remove its directory."""
        self.worker.close()
        shutil.rmtree(self.rundir, ignore_errors=True)
