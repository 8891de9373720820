"""The daemon's process contract: socket mode, a socket in use, SIGINT, runtime files."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
import time

from daemon_harness import Daemon
from proc_testutil import pid_alive

REF_WORKER = (
    '[[workers]]\nengine = "basert"\nlanes = 2\ncontext_length = 128\n'
    "[workers.ref_config]\nvocab_size = 259\n"
)


def test_socket_mode_private_link_dir_and_a_second_daemon_on_the_same_socket():
    with Daemon('socket_mode = "0600"\n' + REF_WORKER) as d:
        assert stat.S_IMODE(d.socket.stat().st_mode) == 0o600
        link_dirs = [p for p in d.runtime_dir.iterdir() if p.name.startswith("workers-")]
        assert len(link_dirs) == 1 and stat.S_IMODE(link_dirs[0].stat().st_mode) == 0o700
        endpoints = list(link_dirs[0].glob("*/link.sock"))
        assert len(endpoints) == 1 and stat.S_IMODE(endpoints[0].parent.stat().st_mode) == 0o700
        second = subprocess.run(
            [sys.executable, "-m", "basertd.cli", "serve", "--config", str(d.config_path)],
            capture_output=True,
            timeout=60,
        )
        assert second.returncode == 1 and b"in use" in second.stderr
        assert d.socket.exists()  # the running daemon's socket was not touched
        with d.client() as c:
            assert c.generate("still mine", max_tokens=3, temperature=0).usage.completion_tokens >= 1


def test_sigint_stops_cleanly_and_fails_running_work_typed():
    with Daemon(
        REF_WORKER.replace("vocab_size = 259\n", "vocab_size = 259\ntick_delay_us = 50000\neos_period = 0\n")
    ) as d:
        c = d.client()
        # resume=False: this test watches the daemon end the stream, not the client resume it
        s = c.stream("long", max_tokens=100, temperature=0, resume=False)
        it = iter(s)
        next(it)
        kids = d.track_children()
        d.proc.send_signal(signal.SIGINT)
        try:
            for _ in it:
                pass
            raise AssertionError("the stream should end with an error")
        except Exception as exc:  # ClientError(SHUTTING_DOWN) or the connection closing
            assert "shutting_down" in str(exc) or "lost" in str(exc), exc
        c.close()
        assert d.proc.wait(30) == 0
        assert not any(pid_alive(p) for p in kids)
        assert not d.socket.exists()


def test_bad_config_is_refused_before_anything_starts(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[[workers]]\nengine = "basert"\nlanse = 2\n')
    r = subprocess.run(
        [sys.executable, "-m", "basertd.cli", "serve", "--config", str(cfg)], capture_output=True, timeout=60
    )
    assert r.returncode == 2 and b"workers[0].lanse" in r.stderr


def test_a_runtime_directory_the_daemon_created_is_removed_at_exit(tmp_path):
    """With no runtime_dir key the daemon uses $RUNTIME_DIRECTORY; a directory it had to create
    is removed when it stops, and one that existed before is left in place."""
    import os
    import time

    config = tmp_path / "basertd.toml"
    config.write_text(REF_WORKER + "[http]\nlisten = []\n")
    for pre_existing in (False, True):
        rt = tmp_path / f"rt-{pre_existing}"
        if pre_existing:
            rt.mkdir()
        env = {**os.environ, "RUNTIME_DIRECTORY": str(rt), "STATE_DIRECTORY": str(tmp_path / "state")}
        env.pop("BASERTD_SOCKET", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "basertd.cli", "serve", "--config", str(config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while not (rt / "basertd.sock").exists():
                assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
                assert time.monotonic() < deadline, "no socket within 60 s"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert rt.exists() == pre_existing, (pre_existing, rt.exists())
        if pre_existing:
            assert not any(rt.iterdir())


def test_a_clean_stop_logs_no_worker_death():
    # SIGTERM drains, sends SHUTDOWN, and the worker exits 0: that is a closed link, not a death.
    with Daemon(REF_WORKER) as d:
        with d.client() as c:
            assert c.generate("bye", max_tokens=2, temperature=0).usage.completion_tokens >= 1
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        events = d.log_events()  # read before the context's stop() checks the release and cleans up
    assert any(e.get("event") == "link_closed" for e in events), [e.get("event") for e in events]
    assert not any(e.get("event") == "link_down" or "WorkerDied" in str(e) for e in events)


def test_one_sandbox_child_per_pool_while_idle_and_one_ahead_of_the_jobs():
    """One child per sandbox pool starts with the daemon and an idle daemon keeps just those; a
    structured request takes the grammar pool's ready child, and the next starts ahead of the
    next request (``request.sandbox``): 2 grammar children then, of the default 2."""
    from proc_testutil import children_of, wait_until

    def sandbox_children(pid: int) -> list[str]:
        out = []
        for kid in children_of(pid):
            try:
                with open(f"/proc/{kid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            out += [m for m in ("spec_check", "template_render") if m in cmd]
        return sorted(out)

    with Daemon(REF_WORKER + '[http]\nlisten = ["127.0.0.1:0"]\n') as d:
        one_each = ["spec_check", "template_render"]
        wait_until(lambda: sandbox_children(d.proc.pid) == one_each, timeout=30, what="a child per pool")
        with d.client() as c:
            assert c.generate("hi", max_tokens=4, temperature=0).usage.completion_tokens >= 1
            time.sleep(1.0)
            assert sandbox_children(d.proc.pid) == one_each  # no structured work: no more processes
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
            out = c.generate("hi", max_tokens=4, temperature=0, response_format=fmt)
            assert out.text.startswith("{"), out.text  # compiled (in the ready child), applied
        want = ["spec_check", "spec_check", "template_render"]
        wait_until(lambda: sandbox_children(d.proc.pid) == want, timeout=30, what="one grammar child ahead")
