"""systemd integration: sd_notify, the watchdog and socket activation (DESIGN.md "Operators").

The protocol is a handful of lines, so it is spoken here rather than through a C binding:

- ``Notifier`` sends newline-separated ``KEY=VALUE`` datagrams to the ``AF_UNIX`` socket named by
  ``$NOTIFY_SOCKET`` (a leading ``@`` names an abstract socket): ``READY=1`` once every worker has
  handshaken, ``STATUS=...`` lines, ``WATCHDOG=1``, ``RELOADING=1`` and ``STOPPING=1``. Without
  ``$NOTIFY_SOCKET`` (a terminal, a test) every call is a no-op.
- ``Heartbeat`` is a loop's progress record; ``Watchdog`` sends ``WATCHDOG=1`` every half
  ``$WATCHDOG_USEC`` only when every registered heartbeat has beaten since the previous ping, so a
  scheduler loop that hangs (or dies) stops the pings and systemd restarts the service.
- ``listen_fds`` / ``adopt_listener`` take the client socket systemd passed
  (``$LISTEN_PID``, ``$LISTEN_FDS``, ``$LISTEN_FDNAMES``; descriptors from 3, sd_listen_fds(3));
  ``adopt_named`` takes the sockets of one ``FileDescriptorName=`` (``http``: the HTTP API), which
  ``adopt_listener`` leaves alone.

Every variable is removed from ``os.environ`` once read, so worker processes never inherit them
(systemd only accepts notifications from the main process anyway, ``NotifyAccess=main``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TypeVar

import structlog

log = structlog.get_logger("basertd.notify")

T = TypeVar("T")

SD_LISTEN_FDS_START = 3
"""First descriptor systemd passes (sd_listen_fds(3))."""
HEARTBEAT_INTERVAL_S = 1.0
"""Seconds between heartbeats of a loop that is waiting (idle, a worker starting, a tick running)."""


class SocketActivationError(OSError):
    """``$LISTEN_FDS`` named descriptors, but none is a listening ``AF_UNIX`` stream socket."""


class Notifier:
    """Sends sd_notify messages to ``address`` (a filesystem path, or ``@name`` for an abstract
    socket; None disables it). Never raises: a notification that cannot be sent is logged once and
    dropped (systemd then times the service out, which is the right outcome)."""

    def __init__(self, address: str | None) -> None:
        self.address = address or None
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """A notifier for ``$NOTIFY_SOCKET`` (removed from the environment)."""
        env = os.environ if environ is None else environ
        return cls(env.pop("NOTIFY_SOCKET", None))

    @property
    def enabled(self) -> bool:
        """True when a notify socket is configured."""
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines; True when it was sent."""
        if self.address is None or not lines:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(lines).encode(), target)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("sd_notify_failed", socket=self.address, error=str(exc))
            return False
        return True

    def ready(self, status: str = "") -> bool:
        """``READY=1`` (with a ``STATUS=`` line when given)."""
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """``STATUS=text`` (one line: newlines become spaces)."""
        return self.send("STATUS=" + " ".join(text.splitlines()))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``."""
        return self.send("WATCHDOG=1")

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (a reload started; ``ready`` ends it)."""
        return self.send(
            "RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
        )

    def stopping(self, status: str = "") -> bool:
        """``STOPPING=1`` (a drain or stop started)."""
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def close(self) -> None:
        """Close the datagram socket (idempotent)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: MutableMapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half ``$WATCHDOG_USEC`` when it is set for this
    process (``$WATCHDOG_PID`` absent or equal to our pid), else None. Both variables are removed."""
    env = os.environ if environ is None else environ
    usec = env.pop("WATCHDOG_USEC", "")
    pid = env.pop("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


class Heartbeat:
    """Progress record of one loop (a scheduler task). ``beat()`` on every turn; ``beats`` only
    grows. ``wait(aw)`` awaits ``aw`` while beating every ``interval`` seconds: use it for waits
    that are bounded elsewhere (a tick has its timeout, a worker start its supervisor), so a loop
    parked there still counts as alive while a loop stuck anywhere else does not."""

    def __init__(self, name: str, interval: float = HEARTBEAT_INTERVAL_S) -> None:
        self.name = name
        self.interval = interval
        self.beats = 0
        self.last = time.monotonic()

    def beat(self) -> None:
        """Record progress now."""
        self.beats += 1
        self.last = time.monotonic()

    async def wait(self, aw: Awaitable[T]) -> T:
        """The result of ``aw``, beating every ``interval`` seconds until it is done. Raises what
        ``aw`` raises; cancelling the caller cancels ``aw``."""
        fut = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=self.interval)
                if done:
                    return fut.result()
                self.beat()
        finally:
            if not fut.done():
                fut.cancel()


class Watchdog:
    """Sends ``WATCHDOG=1`` every ``interval`` seconds while every heartbeat of ``heartbeats()``
    beat since the previous ping (so a hung scheduler loop stops the pings). A withheld ping
    is logged once per stall, naming the loops that stalled."""

    def __init__(
        self, notifier: Notifier, interval: float, heartbeats: Callable[[], Iterable[Heartbeat]]
    ) -> None:
        self.notifier = notifier
        self.interval = interval
        self.heartbeats = heartbeats
        self.pings = 0
        self._seen: dict[int, int] = {}
        self._stalled = False

    def check(self) -> list[str]:
        """Names of the loops that have not beaten since the last check (records the current beats)."""
        stalled = []
        for hb in self.heartbeats():
            if self._seen.get(id(hb), -1) == hb.beats:
                stalled.append(hb.name)
            self._seen[id(hb)] = hb.beats
        return stalled

    def tick(self) -> bool:
        """One watchdog turn: ping when nothing stalled. True when a ping was sent."""
        stalled = self.check()
        if stalled:
            if not self._stalled:
                log.error("watchdog_withheld", stalled=stalled, note="scheduler loop made no progress")
            self._stalled = True
            return False
        if self._stalled:
            log.info("watchdog_resumed")
        self._stalled = False
        self.pings += 1
        return self.notifier.watchdog()

    async def run(self) -> None:
        """Ping forever (until cancelled). The first ping goes out at once: the loops just started."""
        self.check()
        self.notifier.watchdog()
        while True:
            await asyncio.sleep(self.interval)
            self.tick()


def listen_fds(environ: MutableMapping[str, str] | None = None) -> list[tuple[int, str]]:
    """The descriptors systemd passed to this process, as (fd, name) pairs (name "" when
    ``$LISTEN_FDNAMES`` gives none), close-on-exec set. Empty when ``$LISTEN_PID`` is not our pid.
    The three variables are removed from the environment."""
    env = os.environ if environ is None else environ
    pid = env.pop("LISTEN_PID", "")
    count = env.pop("LISTEN_FDS", "")
    names = env.pop("LISTEN_FDNAMES", "")
    if not pid or pid != str(os.getpid()):
        return []
    try:
        n = int(count)
    except ValueError:
        return []
    labels = names.split(":") if names else []
    out = []
    for i in range(max(0, n)):
        fd = SD_LISTEN_FDS_START + i
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)
        out.append((fd, labels[i] if i < len(labels) else ""))
    return out


HTTP_FD_NAME = "http"
"""``FileDescriptorName=`` of sockets served as the HTTP API (``basertd.server.transport.http``)."""


def adopt_named(fds: list[tuple[int, str]], name: str) -> list[socket.socket]:
    """The passed descriptors named ``name`` as non-blocking sockets (listening ``AF_UNIX`` or
    ``AF_INET``/``AF_INET6`` stream sockets). Raises ``SocketActivationError`` for one that is not."""
    out = []
    for fd, label in fds:
        if label != name:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise SocketActivationError(f"fd {fd} ({name}): {exc.strerror or exc}") from None
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if sock.type != socket.SOCK_STREAM or not listening:
            sock.detach()
            raise SocketActivationError(f"fd {fd} ({name}): not a listening stream socket")
        sock.setblocking(False)
        out.append(sock)
    return out


def adopt_listener(fds: list[tuple[int, str]]) -> socket.socket | None:
    """The first passed descriptor that is a listening ``AF_UNIX`` stream socket, as a non-blocking
    ``socket.socket`` (None when ``fds`` is empty). Raises ``SocketActivationError`` when
    descriptors were passed but none qualifies."""
    fds = [(fd, name) for fd, name in fds if name != HTTP_FD_NAME]
    if not fds:
        return None
    seen = []
    for fd, name in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                seen.append(f"fd {fd} ({name or 'unnamed'}): not a socket")
                continue
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            seen.append(f"fd {fd}: {exc.strerror or exc}")
            continue
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM and listening:
            sock.setblocking(False)
            return sock
        seen.append(f"fd {fd} ({name or 'unnamed'}): not a listening AF_UNIX stream socket")
        sock.detach()
    raise SocketActivationError("systemd passed no usable client socket: " + "; ".join(seen))
