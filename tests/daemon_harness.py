"""A real ``basertd serve`` for the tests that run the daemon (e2e, ops, qos, cache), and the checks
that it left nothing behind. Importable from every test folder (``tests/`` is on ``sys.path``
through ``tests/conftest.py``, as for ``tinymodel``).

``Daemon(config_toml, ...)`` writes the config into a short private directory under /tmp (so the
ipc endpoints fit ``sun_path``) with ``runtime_dir`` at ``<dir>/rt``, starts ``python -m
basertd.cli serve --config ...`` with its output in ``daemon.log``, and waits until the socket
answers Health with every worker ready. It is a context manager: leaving the block normally
``stop()``\\ s it, leaving it by an exception ``kill()``\\ s it::

    with Daemon(config) as d:          # a module fixture: ``with Daemon(config) as d: yield d``
        with d.client() as c:
            ...

``stop()`` sends SIGTERM (or finds the daemon already exited, when the test stopped it itself)
and asserts a clean exit: status 0, then ``assert_released()``: no process the daemon ever had as a
child still runs, the client socket removed (an adopted ``LISTEN_FDS`` socket kept: systemd owns
it), the runtime directory removed when the daemon created it and empty when it was given one, and
/dev/shm exactly as before. ``kill()`` is the emergency teardown.

What systemd would give the daemon (tests/ops): ``notify``, a factory ``notify(dir) -> listener``
whose ``.path`` goes into ``$NOTIFY_SOCKET`` (``ops_harness.NotifyListener``); ``listen``, a
listening socket owned by the test, handed over as ``LISTEN_FDS=1`` on descriptor 3 with
``LISTEN_PID`` set to the daemon's own pid (``bash -c "export LISTEN_PID=$$; exec ..."``, as
systemd arranges it); ``open_to_all``, a runtime directory made beforehand and reachable by other
users and a 0666 socket, so that a child with dropped privileges can connect. ``wrapper``: a
command that execs the daemon's command line after it, in the same process (e.g. ``("prlimit",
"--nofile=1024:1024", "--")`` to start it under a descriptor limit).

HTTP: a config without an ``[http]`` table gets ``[http] listen = []`` (no fixed port is ever
bound); ``http_addresses()`` reads what a configured HTTP server listens on from the log.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proc_testutil import children_of, devshm_listing, log_lines, pid_alive

from basertd.client import Client, ConnectionLost
from basertd.schema import control

_SYSTEMD_ENV = ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID", "WATCHDOG_USEC")
_DROPPED_ENV = ("BASERTD_SOCKET", *_SYSTEMD_ENV)
"""Variables of the test's own environment that would change how the daemon starts (its socket,
what systemd hands over): dropped, then the test's ``env`` applied."""


class Daemon:
    """One ``basertd serve`` (module docstring). ``socket``: its client socket path; ``runtime_dir``,
    ``config_path`` (rewrite it and send SIGHUP to reload), ``log_path``; ``proc``: the process."""

    def __init__(
        self,
        config_toml: str = "",
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = 60.0,
        wait_workers: bool = True,
        notify: Callable[[Path], Any] | None = None,
        listen: socket.socket | None = None,
        open_to_all: bool = False,
        state_dir: str | Path | None = None,
        wrapper: tuple[str, ...] = (),
    ) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="brt-d-", dir="/tmp"))
        # the write-ahead log: private to this daemon unless the test restarts on a given one
        self.state_dir = Path(state_dir) if state_dir is not None else self.base / "state"
        self.runtime_dir = self.base / "rt"
        self.runtime_dir_given = open_to_all
        if open_to_all:
            os.chmod(self.base, 0o755)
            self.runtime_dir.mkdir()
            os.chmod(self.runtime_dir, 0o755)
        self.socket = self.runtime_dir / "basertd.sock"
        self.socket_adopted = listen is not None
        self.config_path = self.base / "basertd.toml"
        mode = 'socket_mode = "0666"\n' if open_to_all else ""
        state = "" if "state_dir" in config_toml else f'state_dir = "{self.state_dir}"\n'
        # Many daemons run at once: HTTP stays off unless the test configures it (the default
        # listener, 127.0.0.1:8000, would collide).
        http = "" if "[http]" in config_toml else "\n[http]\nlisten = []\n"
        self.config_path.write_text(f'runtime_dir = "{self.runtime_dir}"\n{state}{mode}' + config_toml + http)
        self.log_path = self.base / "daemon.log"
        self.shm_before = devshm_listing()
        self.seen_children: set[int] = set()
        self.notify = notify(self.base) if notify is not None else None
        full_env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        full_env.update(env or {})
        if self.notify is not None:
            full_env["NOTIFY_SOCKET"] = str(self.notify.path)
        argv = [*wrapper, sys.executable, "-m", "basertd.cli", "serve", "--config", str(self.config_path)]
        pass_fds: tuple[int, ...] = ()
        if listen is not None:
            self.socket = Path(listen.getsockname())
            fd = listen.fileno()
            pass_fds = (fd,)
            full_env["LISTEN_FDS"] = "1"
            full_env["LISTEN_FDNAMES"] = "basertd.socket"
            # In the child: the socket moves to descriptor 3 and LISTEN_PID names the process that
            # exec keeps (the shell's own pid), as systemd arranges it.
            move = f"exec 3<&{fd} {fd}<&-; " if fd != 3 else ""
            script = move + 'export LISTEN_PID=$$; exec "$@"'
            argv = ["/bin/bash", "-c", script, "bash", *argv]
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                pass_fds=pass_fds,
            )
        try:
            self.wait_ready(ready_timeout, wait_workers)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.stop()
        else:
            self.kill()

    # --- talking to it -------------------------------------------------------------------------

    def log_text(self) -> str:
        """The daemon's log so far."""
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict]:
        """The daemon's JSON log lines so far (plain lines skipped; a line that starts as JSON and
        does not parse fails the test)."""
        return log_lines(self.log_path, plain_ok=True, live=True)

    def http_addresses(self, timeout: float = 10.0) -> list[str]:
        """The addresses the HTTP API listens on (``HOST:PORT`` / ``unix:PATH``), from the
        daemon's ``http_listening`` log line."""
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.log_events():
                if ev.get("event") == "http_listening":
                    return list(ev["addresses"])
            assert time.monotonic() < deadline, "the daemon logged no http_listening line"
            time.sleep(0.05)

    def client(self, timeout: float | None = 60.0) -> Client:
        """A blocking client connected to this daemon."""
        return Client(self.socket, timeout=timeout)

    def ctl(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run ``basertctl --socket <ours> ARGS`` and return the completed process (text)."""
        return subprocess.run(
            [sys.executable, "-m", "basertd.ctl", "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def workers(self) -> list[control.WorkerRow]:
        """The Workers rows."""
        with self.client() as c:
            return c.request(control.Workers()).workers

    def status(self) -> control.StatusResult:
        """The Status summary."""
        with self.client() as c:
            return c.status()

    def wait_ready(self, timeout: float, wait_workers: bool = True) -> None:
        """Until the socket answers and (``wait_workers``) every worker is ready (AssertionError on
        timeout or when the daemon exits)."""
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
                except (OSError, ConnectionLost):  # an adopted socket answers once the daemon runs
                    pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready within {timeout} s:\n{self.log_text()}")

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

    # --- processes and teardown ----------------------------------------------------------------

    def track_children(self) -> set[int]:
        """Record (and return) the daemon's current children; call it after anything that starts a
        worker (a respawn, restart-worker) and before signalling the daemon. With ``listen`` the
        bash wrapper execs the daemon, so ``proc`` is the daemon itself."""
        kids = children_of(self.proc.pid)
        self.seen_children |= kids
        return kids

    def assert_released(self) -> None:
        """After exit: no child left, the socket and runtime files gone, /dev/shm as before (module
        docstring)."""
        left = [pid for pid in self.seen_children if pid_alive(pid)]
        assert not left, f"child processes left: {left}"
        if self.socket_adopted:
            assert self.socket.exists(), "the daemon removed the socket it was handed (LISTEN_FDS)"
        else:
            assert not self.socket.exists(), "the client socket was left behind"
        if self.runtime_dir_given:
            leftovers = list(self.runtime_dir.iterdir())
            assert not leftovers, f"runtime files left: {leftovers}"
        else:
            leftovers = list(self.runtime_dir.iterdir()) if self.runtime_dir.exists() else []
            assert not self.runtime_dir.exists(), f"the runtime directory it created is left: {leftovers}"
        shm_after = devshm_listing()
        assert shm_after == self.shm_before, (
            f"/dev/shm changed: +{shm_after - self.shm_before} -{self.shm_before - shm_after}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (nothing to send when the daemon already exited), then assert a clean exit: status
        0 and everything released (module docstring)."""
        self.track_children()
        self.proc.send_signal(signal.SIGTERM)  # a no-op once the process was waited for
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log = self.log_text()
            self.kill()
            raise AssertionError(f"daemon did not stop within {timeout} s:\n{log}") from None
        assert rc == 0, f"daemon exited with {rc}:\n{self.log_text()}"
        self.assert_released()
        self.cleanup()

    def cleanup(self) -> None:
        """Close the test's notify socket and remove the directory (the log with it)."""
        if self.notify is not None:
            self.notify.close()
        shutil.rmtree(self.base, ignore_errors=True)

    def kill(self) -> None:
        """Emergency teardown (a failed test): SIGKILL the daemon and every child it has, write the
        end of its log to stderr (pytest shows it with the failure), remove the directory."""
        for pid in self.track_children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.log_path.exists():
            tail = self.log_text().splitlines()[-60:]
            print(f"--- end of {self.log_path}:", *tail, sep="\n", file=sys.stderr)
        self.cleanup()
