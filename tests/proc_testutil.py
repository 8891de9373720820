"""What every test folder checks about processes and shared memory, in one place (importable from any
test folder, like ``tinymodel``: ``tests/`` is on ``sys.path`` through ``tests/conftest.py``): the
names in /dev/shm, a process's memfd descriptors, its children, whether a pid still runs, and the
JSON log lines a daemon or worker wrote. The ``no_leaks`` fixture of ``tests/conftest.py`` and the
daemon harness (``daemon_harness.py``) are built on these."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def children_of(pid: int) -> set[int]:
    """Pids whose parent is ``pid``, zombies included (from /proc/<pid>/task/*/children); empty once
    ``pid`` itself is gone."""
    out: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.update(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended while we read
    return out


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def log_lines(path: Path, *, plain_ok: bool = False, live: bool = False) -> list[dict[str, Any]]:
    """The JSON log lines in ``path``. Raises AssertionError naming any line that is not JSON (a
    traceback or a stray print would be one), except that ``plain_ok`` skips lines that do not start
    with ``{`` (the exit-2/3 messages, a library writing to the shared stderr) and ``live`` skips an
    unterminated last line (the writer may be in the middle of it)."""
    text = path.read_text(errors="replace")
    if live and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    out = []
    for line in text.splitlines():
        if not line.strip() or (plain_ok and not line.startswith("{")):
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"non-JSON line in {path.name}: {line!r}") from None
    return out


def wait_until(
    cond: Callable[[], Any], timeout: float = 10.0, *, interval: float = 0.01, what: str = ""
) -> Any:
    """Poll ``cond()`` every ``interval`` seconds until it returns something truthy and return that;
    raise ``TimeoutError`` naming ``what`` after ``timeout`` seconds. Tests wait on the condition
    they need instead of sleeping a fixed time, which fails on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout} s: {what or cond}")
        time.sleep(interval)


async def wait_until_async(
    cond: Callable[[], Any], timeout: float = 10.0, *, interval: float = 0.01, what: str = ""
) -> Any:
    """``wait_until`` for a coroutine: polls with ``asyncio.sleep`` so the event loop keeps running."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout} s: {what or cond}")
        await asyncio.sleep(interval)


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc/<pid>/stat (``R``, ``S``, ``T`` stopped, ``Z`` ...); ""
    once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0]
