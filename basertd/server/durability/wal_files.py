"""File-level helpers of the journal on disk (``basertd.server.durability.wal_disk``): whole writes,
directory fsyncs, the free-space check a start makes, and the bound on quarantined segments.

Errors: ``StateDirFull`` and ``StateDirUnwritable`` (``WalError``: the daemon does not start and
says why, exit status 1)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from basertd.server.durability.wal_format import WalError

log = logging.getLogger("basertd.wal")

KEEP_CORRUPT = 4
"""Quarantined ``*.corrupt`` segments kept (the newest); older ones are removed at open."""


class StateDirFull(WalError):
    """``state_dir`` has fewer free bytes than ``[durability] min_free_bytes``: the daemon does not
    start on a log it could not keep writing."""


class StateDirUnwritable(WalError):
    """``state_dir`` cannot take a write (read-only, no permission, no space): the daemon does not
    start."""


def check_free(state_dir: Path, min_free_bytes: int) -> None:
    """Raise ``StateDirFull`` when ``state_dir``'s filesystem has fewer than ``min_free_bytes``
    bytes free for this user (``statvfs`` ``f_bavail``)."""
    st = os.statvfs(state_dir)
    free = st.f_bavail * st.f_frsize
    if free < min_free_bytes:
        raise StateDirFull(
            f"state_dir {state_dir} has {free} bytes free, fewer than [durability] "
            f"min_free_bytes ({min_free_bytes}): free some space (or lower the key)"
        )


def prune_corrupt(wal_dir: Path, keep: int = KEEP_CORRUPT) -> None:
    """Keep the newest ``keep`` quarantined ``*.corrupt`` segments of ``wal_dir``, remove the rest."""
    kept = sorted(wal_dir.glob("*.corrupt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in kept[keep:]:
        log.warning("write-ahead log: removed an old quarantined segment %s", p)
        p.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
