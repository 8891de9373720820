"""What systemd would give the daemon in the operators tests, and the other ops-only helpers.
The daemon itself is ``daemon_harness.Daemon`` (tests/daemon_harness.py): pass it
``notify=NotifyListener`` for a fake ``$NOTIFY_SOCKET``, ``listen=listening_socket(dir)`` for a
``LISTEN_FDS`` socket the test owns like systemd's socket unit owns it, ``open_to_all=True`` for a
daemon that a child with dropped privileges can reach. ``run_as(uid, gid, groups, fn)`` runs ``fn``
in a forked child with dropped privileges and returns what it returned (pickled through a pipe).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
