"""Helpers of the shared-memory tests (a uniquely named module, so no other tests folder's conftest
can shadow it): /dev/shm listing and the memfd descriptors of a process."""

from __future__ import annotations

import os


def devshm_listing() -> set[str]:
    """Names in /dev/shm (empty set where it does not exist)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def memfds_of(pid: int | str = "self") -> list[str]:
    """The memfd descriptors a process holds, as /proc/<pid>/fd link targets."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:"):
            out.append(target)
    return out
