"""A daemon's claim on its ``state_dir`` (DESIGN.md "Crash = preemption; acceptance is durable"):
the lock file, one daemon per state directory, and the epoch file that fences every earlier one.

``lock``: an exclusive ``flock`` on ``<state_dir>/lock`` held for the journal's life (closing its
only descriptor releases it), the holder's pid written in the file for the message of the next
daemon that tries; a held lock raises ``StateDirLocked``. ``read_epoch`` / ``write_epoch``: the
decimal epoch in ``<state_dir>/epoch``; the journal writes one past every earlier epoch (the file's
and the log's) at each open, durably (a temporary file fsynced, renamed, the directory fsynced)
before it returns, and stamps every frame with it, so anything stamped with an older epoch (lane
tags, shm names, worker generations) belongs to a dead daemon. An epoch file that is not a number
is ``WalCorrupt`` unless recovery truncates (then it counts as 0). Other failures are ``OSError``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from basertd.server.durability.wal_files import fsync_dir, write_all
from basertd.server.durability.wal_format import WalCorrupt, WalError
from basertd.server.durability.wal_recover import RecoverMode

log = logging.getLogger("basertd.wal")

LOCK_FILE = "lock"
EPOCH_FILE = "epoch"


class StateDirLocked(WalError):
    """Another daemon holds ``state_dir`` (one daemon per state directory)."""


def lock(state_dir: Path) -> int:
    """Take the lock of ``state_dir`` and return its descriptor (close it to release the lock).
    Raises ``StateDirLocked`` naming the holder's pid, ``OSError``."""
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise StateDirLocked(
                f"state_dir {state_dir} is in use by another basertd (pid {holder}); one daemon "
                "per state directory: stop it, or give this one another state_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_epoch(state_dir: Path, recover: RecoverMode) -> int:
    """The epoch in ``state_dir``'s epoch file, 0 when there is none. Raises ``WalCorrupt`` when it
    is not a number, unless ``recover`` is "truncate" (logged, 0)."""
    path = state_dir / EPOCH_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    try:
        return int(text.strip())
    except ValueError:
        if recover != "truncate":
            raise WalCorrupt(state_dir, path, 0, "the epoch file is not a number") from None
        log.error("write-ahead log: unreadable epoch file %s ignored (--wal-recover=truncate)", path)
        return 0


def write_epoch(state_dir: Path, epoch: int) -> None:
    """Make ``epoch`` the durable content of ``state_dir``'s epoch file (write, fsync, rename,
    directory fsync). Raises ``OSError``."""
    tmp = state_dir / f"{EPOCH_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, f"{epoch}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, state_dir / EPOCH_FILE)
    fsync_dir(state_dir)
