"""Helpers of the worker tests (a uniquely named module): leak checks (/dev/shm, child processes,
memfds, the runtime directory) and reading a worker's JSON log lines."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def devshm_listing() -> set[str]:
    """Names in /dev/shm (empty set where it does not exist)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (zombies included), from /proc/<pid>/task/*/children."""
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    for task in task_dir.iterdir():
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def memfds_of(pid: int | str = "self") -> list[str]:
    """The memfd descriptors a process holds (their /proc/<pid>/fd link targets)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:"):
            out.append(target)
    return out


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie waiting to be reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    for line in status.splitlines():
        if line.startswith("State:"):
            return "Z" in line.split()[1]
    return False


def log_lines(path: Path, *, plain_ok: bool = False) -> list[dict[str, Any]]:
    """The JSON log lines in ``path``. Unless ``plain_ok`` (plain lines skipped: the exit-2/3
    messages), raises AssertionError naming any line that is not JSON (a traceback or a stray
    print would be one)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip() or (plain_ok and not line.startswith("{")):
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"non-JSON line in the worker log: {line!r}") from None
    return out
