"""Runtime files a dead coordinator left behind (DESIGN.md "Operators").

A coordinator keeps its workers' endpoints in ``<runtime_dir>/workers-<pid>/`` and removes that
directory when it stops; one killed with SIGKILL (or by the OOM killer) cannot. At the next start,
``remove_stale_worker_dirs`` removes every such directory whose pid is not a live basertd
coordinator. It never touches a directory of a live coordinator (another daemon sharing the runtime
directory), one owned by another user, or anything not named ``workers-<digits>``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import structlog

log = structlog.get_logger("basertd.runtime_files")

_WORKERS_DIR = re.compile(r"workers-([0-9]{1,10})")


def coordinator_alive(pid: int) -> bool:
    """True when ``pid`` runs and is (or may be) a basertd coordinator: its command line runs the
    ``basertd`` script or the ``basertd.cli`` module. A process whose command line cannot be read
    (another user's, with ``hidepid``) counts as alive: nothing of it is removed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return False  # exited meanwhile
    except OSError:
        return True
    return any(os.path.basename(a) == b"basertd" or a == b"basertd.cli" for a in argv[:4])


def remove_stale_worker_dirs(runtime_dir: Path) -> list[Path]:
    """Remove the ``workers-<pid>`` directories in ``runtime_dir`` that belong to no live
    coordinator (``coordinator_alive``) and are owned by this process's user; this process's own
    pid is always live. Returns the removed paths (sorted). Never raises: a directory that cannot
    be removed is logged and left."""
    removed: list[Path] = []
    me = os.getpid()
    uid = os.geteuid()
    try:
        entries = sorted(os.scandir(runtime_dir), key=lambda e: e.name)
    except OSError:
        return removed
    for entry in entries:
        m = _WORKERS_DIR.fullmatch(entry.name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or st.st_uid != uid or pid == me:
            continue
        if pid > 0 and coordinator_alive(pid):
            continue
        path = Path(entry.path)
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("stale_workers_dir_kept", path=str(path), error=str(exc))
            continue
        log.info("stale_workers_dir_removed", path=str(path), pid=pid)
        removed.append(path)
    return removed
