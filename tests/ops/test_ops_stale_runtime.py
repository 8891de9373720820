"""Runtime files of a dead coordinator are removed at the next start
(``basertd.server.ops.runtime_files``): a coordinator killed with SIGKILL leaves ``workers-<pid>/``;
the next daemon on that runtime directory removes it, and never a live coordinator's directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from daemon_harness import Daemon
from ops_harness import ref_worker

from basertd.client import Client
from basertd.server.ops.runtime_files import coordinator_alive, remove_stale_worker_dirs


def test_only_dirs_of_dead_or_foreign_pids_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    sleeper = subprocess.Popen(["sleep", "60"])  # alive, but not a basertd coordinator
    try:
        stale_dead = tmp_path / f"workers-{dead.pid}"
        (stale_dead / "basertd-w0-abc").mkdir(parents=True)
        (stale_dead / "basertd-w0-abc" / "link.sock").write_text("")
        stale_reused = tmp_path / f"workers-{sleeper.pid}"
        stale_reused.mkdir()
        own = tmp_path / f"workers-{os.getpid()}"
        own.mkdir()
        other_names = [tmp_path / "workers-abc", tmp_path / "basertd.sock", tmp_path / "workers-12x"]
        for p in other_names:
            p.mkdir()
        plain_file = tmp_path / "workers-1234567"
        plain_file.write_text("not a directory")
        target = tmp_path / "elsewhere"
        target.mkdir()
        link = tmp_path / f"workers-{dead.pid + 1_000_000}"
        link.symlink_to(target)

        removed = remove_stale_worker_dirs(tmp_path)
        assert removed == sorted([stale_dead, stale_reused])
        assert not stale_dead.exists() and not stale_reused.exists()
        for p in [own, plain_file, link, target, *other_names]:
            assert p.exists(), p
        assert remove_stale_worker_dirs(tmp_path) == []
        assert not coordinator_alive(sleeper.pid) and not coordinator_alive(dead.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_restarted_daemon_removes_the_dir_of_a_killed_one():
    d1 = Daemon(ref_worker(lanes=1), open_to_all=True)
    second = None
    try:
        kids = d1.track_children()
        old_pid = d1.proc.pid
        left = d1.runtime_dir / f"workers-{old_pid}"
        assert left.is_dir()
        d1.proc.send_signal(signal.SIGKILL)  # the OOM killer: nothing is cleaned up
        d1.proc.wait()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert left.is_dir()

        with open(d1.base / "second.log", "wb") as log:  # the child keeps its own descriptor
            second = subprocess.Popen(
                [sys.executable, "-m", "basertd.cli", "serve", "--config", str(d1.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 60
        while True:
            assert second.poll() is None, (d1.base / "second.log").read_text()
            try:
                with Client(d1.socket, timeout=5) as c:
                    if c.health().status == "ok":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (d1.base / "second.log").read_text()
            time.sleep(0.05)
        assert not left.exists()
        mine = d1.runtime_dir / f"workers-{second.pid}"
        assert mine.is_dir()
        assert coordinator_alive(second.pid)
        assert remove_stale_worker_dirs(d1.runtime_dir) == []  # a live coordinator's is kept
        assert mine.is_dir()
        assert "stale_workers_dir_removed" in (d1.base / "second.log").read_text()

        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
        assert not mine.exists()
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
        d1.kill()
