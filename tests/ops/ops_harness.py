"""A real ``basertd serve`` for the operators tests (issue 9), with what systemd would give it.

``OpsDaemon(config_toml, notify=..., listen=..., env=...)`` writes the config (runtime directory in
a short private directory under /tmp, reachable by other users so a dropped-privilege child can
connect), starts ``python -m basertd.cli serve --config ...`` with its log in ``daemon.log``, and
waits until every worker has handshaken. ``notify`` is a ``NotifyListener`` whose path goes into
``$NOTIFY_SOCKET``; ``listen`` a listening socket (``listening_socket``, owned by the test like
systemd's socket unit owns it) handed over as ``LISTEN_FDS=1`` on descriptor 3 with ``LISTEN_PID``
set to the daemon's own pid (``bash -c "export LISTEN_PID=$$; exec ..."``, as systemd arranges
it). ``stop()`` sends SIGTERM and asserts the clean exit of the e2e harness (status 0, no child
left, runtime files gone, /dev/shm untouched); ``kill()`` is the emergency teardown.
``run_as(uid, gid, groups, fn)`` runs ``fn`` in a forked child with dropped privileges and returns
what it returned (pickled through a pipe).
"""

from __future__ import annotations

import json
import os
import pickle
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from e2e_harness import children_of, pid_alive, shm_entries

from basertd.client import Client

REF_WORKER = (
    '[[workers]]\nengine = "basert"\nlanes = {lanes}\ncontext_length = 256\n'
    "[workers.ref_config]\nvocab_size = 259\neos_period = 0\ntick_delay_us = {delay}\n"
)


def ref_worker(lanes: int = 4, delay_us: int = 2000) -> str:
    """A ``[[workers]]`` table for the C reference engine (no EOS, ``delay_us`` per tick)."""
    return REF_WORKER.format(lanes=lanes, delay=delay_us)


class NotifyListener:
    """A fake systemd notify socket: an ``AF_UNIX`` datagram socket at ``path``. ``messages``
    holds every datagram received so far, each as a dict of its ``KEY=VALUE`` lines (in order)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.messages: list[dict[str, str]] = []

    def poll(self, timeout: float) -> None:
        """Receive datagrams for up to ``timeout`` seconds (blocking reads, no spinning)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(fields)

    def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0) -> dict[str, str]:
        """The first message (already received or arriving within ``timeout``) with ``key``
        (equal to ``value`` when given); AssertionError when none comes."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for msg in self.messages[seen:]:
                if key in msg and (value is None or msg[key] == value):
                    return msg
            seen = len(self.messages)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key}={value or '*'} within {timeout} s; got {self.messages}")
            self.poll(min(left, 0.5))

    def count(self, key: str) -> int:
        """Messages carrying ``key`` so far."""
        return sum(1 for m in self.messages if key in m)

    def close(self) -> None:
        """Close and remove the socket."""
        self.sock.close()
        self.path.unlink(missing_ok=True)


class OpsDaemon:
    """One ``basertd serve`` (module docstring). ``socket``: its client socket path."""

    def __init__(
        self,
        config_toml: str,
        *,
        notify: Callable[[Path], NotifyListener] | None = None,
        listen: socket.socket | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 60.0,
        open_to_all: bool = False,
    ) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="brt-ops-", dir="/tmp"))
        os.chmod(self.base, 0o755)
        self.runtime_dir = self.base / "rt"
        self.runtime_dir.mkdir(mode=0o755)
        os.chmod(self.runtime_dir, 0o755)
        self.socket = self.runtime_dir / "basertd.sock"
        self.config_path = self.base / "basertd.toml"
        mode = 'socket_mode = "0666"\n' if open_to_all else ""
        self.config_path.write_text(f'runtime_dir = "{self.runtime_dir}"\n{mode}' + config_toml)
        self.log_path = self.base / "daemon.log"
        self.shm_before = shm_entries()
        self.seen_children: set[int] = set()
        self.notify = notify(self.base) if notify is not None else None
        self.listener = listen
        full_env = {**os.environ, **(env or {})}
        for key in ("BASERTD_SOCKET", "NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC"):
            full_env.pop(key, None)
        full_env.update(env or {})
        if self.notify is not None:
            full_env["NOTIFY_SOCKET"] = str(self.notify.path)
        argv = [sys.executable, "-m", "basertd.cli", "serve", "--config", str(self.config_path)]
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
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                pass_fds=pass_fds,
            )
        try:
            self.wait_ready(ready_timeout)
        except BaseException:
            self.kill()
            raise

    # --- helpers -------------------------------------------------------------------------------

    def log_text(self) -> str:
        """The daemon's log so far."""
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict]:
        """The daemon's JSON log lines (other lines skipped)."""
        out = []
        for line in self.log_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def client(self, timeout: float | None = 60.0) -> Client:
        """A blocking client connected to this daemon."""
        return Client(self.socket, timeout=timeout)

    def ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``basertctl --socket <ours> ARGS`` and return the completed process (text)."""
        return subprocess.run(
            [sys.executable, "-m", "basertd.ctl", "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def workers_pids(self) -> list[int]:
        """Each worker's current pid (Workers, as root)."""
        from basertd.schema import control

        with self.client() as c:
            return [w.pid for w in c.request(control.Workers()).workers]

    def wait_ready(self, timeout: float) -> None:
        """Until the socket answers Health with every worker ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            if self.socket.exists():
                try:
                    with self.client(timeout=5) as c:
                        h = c.health()
                    if h.workers_ready == h.workers_total and h.status == "ok":
                        self.track_children()
                        return
                except OSError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready within {timeout} s:\n{self.log_text()}")

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no lane is busy and nothing is queued or in flight."""
        from basertd.schema import control

        deadline = time.monotonic() + timeout
        while True:
            with self.client() as c:
                st = c.request(control.Status())
            if st.lanes_busy == 0 and st.queued == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout} s: {st}")
            time.sleep(0.05)

    def track_children(self) -> set[int]:
        """Record (and return) the daemon's current children (the bash wrapper execs the daemon,
        so it is ``proc`` itself)."""
        kids = children_of(self.proc.pid)
        self.seen_children |= kids
        return kids

    def assert_released(self) -> None:
        """After exit: no child left, runtime files gone, /dev/shm untouched."""
        left = [pid for pid in self.seen_children if pid_alive(pid)]
        assert not left, f"child processes left: {left}"
        leftovers = list(self.runtime_dir.iterdir())
        assert not leftovers, f"runtime files left: {leftovers}"
        assert shm_entries() == self.shm_before, "/dev/shm changed"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then assert a clean exit (status 0) and that everything was released."""
        self.track_children()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"daemon did not stop within {timeout} s:\n{self.log_text()}") from None
        assert rc == 0, f"daemon exited with {rc}:\n{self.log_text()}"
        self.assert_released()
        self.cleanup()

    def cleanup(self) -> None:
        """Close the test's sockets and remove the directory."""
        if self.notify is not None:
            self.notify.close()
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
        self.cleanup()


def listening_socket(directory: Path) -> socket.socket:
    """A listening ``AF_UNIX`` stream socket at ``directory/basertd.sock``, mode 0666 (what
    basertd.socket creates, for a test)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = directory / "basertd.sock"
    sock.bind(str(path))
    os.chmod(path, 0o666)
    sock.listen(16)
    return sock


def run_as(uid: int, gid: int, groups: list[int], fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Run ``fn()`` in a forked child that first drops to ``uid`` / ``gid`` with supplementary
    ``groups``; returns its result, or raises the exception it raised (both pickled)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        os.close(r)
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            out: tuple[str, Any] = ("ok", fn())
        except BaseException as exc:
            out = ("error", exc)
        try:
            data = pickle.dumps(out)
        except Exception as exc:
            data = pickle.dumps(("error", RuntimeError(repr(exc))))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    kind, value = pickle.loads(data)
    if kind == "error":
        raise value
    return value
