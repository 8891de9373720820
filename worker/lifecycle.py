"""The worker dies with its parent and stops on request (DESIGN.md "Processes").

- ``die_with_parent(expected_ppid)``: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes, then a
  check that the parent is still ``expected_ppid``: if the coordinator died between our fork and
  the prctl, the signal will never come, and the worker is already an orphan (reparented to init
  or a subreaper). SIGKILL, not SIGTERM: a worker whose coordinator is gone has nobody to send
  results to, and an engine stuck inside a tick must not keep a GPU forever. Nothing the worker
  holds outlives it (memfds and sockets close with the process; the ipc endpoint belongs to the
  coordinator). The signal fires when the parent *thread* exits (see ``basertd.server.workers.process``).
- ``parent_alive(expected_ppid)``: the periodic check the link loop runs while idle, as a backstop.
- ``StopSignals``: SIGTERM and SIGINT set a flag (the tick in flight finishes and its result is
  sent, then the worker exits 0) and write a byte to a self-pipe (``signal.set_wakeup_fd``) whose
  read end the link loop polls next to its socket, so an idle worker wakes at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from enum import IntEnum

PR_SET_PDEATHSIG = 1
"""prctl option: signal sent to this process when its parent (thread) dies (linux/prctl.h)."""


class LifecycleError(OSError):
    """prctl failed (errno in ``errno``)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def die_with_parent(expected_ppid: int, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` when the parent dies; returns False when the parent is
    already not ``expected_ppid`` (the caller should exit at once). Raises ``LifecycleError`` if
    prctl fails."""
    libc = _libc()
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise LifecycleError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    return parent_alive(expected_ppid)


def parent_alive(expected_ppid: int) -> bool:
    """True while our parent is still ``expected_ppid`` (an orphan is reparented elsewhere)."""
    return os.getppid() == expected_ppid


class StopSignals:
    """SIGTERM/SIGINT -> ``requested`` (with the signal's name in ``signal_name``) plus a wake-up
    byte on ``wakeup_fd`` (the non-blocking read end of a pipe; poll it for POLLIN and call
    ``drain``). ``install()`` once from the main thread; ``close()`` restores the defaults."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_wakeup: int | None = None
        self._installed = False

    @property
    def wakeup_fd(self) -> int:
        """Read end of the self-pipe; readable after a signal arrived."""
        return self._r

    def _handler(self, signum: int, _frame: object) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def install(self) -> None:
        """Install the handlers and the wake-up fd (main thread only)."""
        self._old_wakeup = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        for sig in self.SIGNALS:
            signal.signal(sig, self._handler)
        self._installed = True

    def drain(self) -> None:
        """Empty the self-pipe."""
        try:
            while os.read(self._r, 256):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Restore default handlers and close the pipe. Idempotent."""
        if self._installed:
            for sig in self.SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            self._installed = False
        for fd in (self._r, self._w):
            if fd >= 0:
                os.close(fd)
        self._r = self._w = -1


class ExitCode(IntEnum):
    """Exit statuses of ``basertd-worker`` (the supervisor reads them)."""

    OK = 0
    """Orderly shutdown: SHUTDOWN, SIGTERM/SIGINT after the tick in flight, or the parent is gone."""
    USAGE = 2
    """Bad command line; the message names the flag (or the engine that is not available)."""
    MODEL_LOAD = 3
    """The engine or model could not be loaded; the message says why."""
    ENGINE_FATAL = 70
    """The engine reported BASERT_ERR_FATAL (or a fatal tick): its state is gone. Also used for an
    unexpected error inside the worker itself (logged as ``worker_internal_error``)."""
    LINK = 76
    """Link W failed: a malformed frame, a protocol violation, a refused handshake, or a socket
    error. Logged as one JSON line with the frame error code, never a traceback."""
