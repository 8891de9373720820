"""The first part of the daemon's start, run before it imports the rest of itself (DESIGN.md
"Processes"): the worker processes are spawned here, so that their own start (the interpreter's
imports, the model's load, the context's creation; most of the time to ready) overlaps the
coordinator's imports (the scheduler, metrics, front end: about 0.3 s of a 2-core box) instead of
following them. This module imports little: the configuration, the paths, the write-ahead log and
the worker process; ``basertd.cli`` imports it, configures logging and calls ``launch`` before it
imports ``basertd.server.daemon``.

``launch(config)`` does, in this order (the order ``Daemon.start`` had):

1. takes the descriptors systemd passed (``LISTEN_FDS``; removed from the environment before any
   worker inherits it);
2. creates the runtime directory and this daemon's private ``workers-<pid>/`` in it, removing the
   ones a coordinator killed with SIGKILL left;
3. opens the write-ahead log in ``state_dir`` (locked, recovered; ``[durability] mode = "off"``: a
   ``NullJournal``): a second daemon on the same ``state_dir`` stops here, before any model load;
4. spawns every configured worker (``WorkerProcess.spawn``; the handshakes come later, on the
   daemon's loop, ``WorkerSlot.start(spawned)``). A worker that does not spawn (a runtime
   directory too long for its ipc path, descriptors exhausted) is left to its slot, which tries
   again and reports it as any start failure: the daemon starts all the same.

The ``Launch`` it returns is handed to ``basertd.server.daemon.run``, whose ``Daemon`` takes over
everything in it; ``abandon()`` releases what nobody took over (a start that failed in between).
On a failure ``launch`` itself releases what it created and raises: ``ConfigError``,
``basertd.models.ModelUnavailable``, the ``WalError`` family (``StateDirLocked``, ``WalCorrupt``,
...), OSError.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from basertd.json_logs import route_stdlib
from basertd.server.config import Config
from basertd.server.durability.wal import Journal
from basertd.server.durability.wal_disk import open_journal
from basertd.server.durability.wal_recover import RecoverMode
from basertd.server.observe.notify import listen_fds
from basertd.server.ops.runtime_files import remove_stale_worker_dirs
from basertd.server.paths import resolve_runtime_dir, resolve_state_dir
from basertd.server.workers.process import SpawnedWorker, WorkerProcess
from basertd.server.workers.specs import daemon_worker_spec

log = structlog.get_logger("basertd.daemon")


def configure_logging(level: str = "info") -> None:
    """structlog JSON lines on stderr at ``level`` (content-free: no prompt text is ever logged); a
    line logged with ``exc_info`` (``log.exception``) carries the traceback in ``exception``. The
    ``logging`` module's records become JSON lines too (``basertd.json_logs``)."""
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,  # ``exc_info`` -> an "exception" traceback field
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),  # one write(2) per line
        cache_logger_on_first_use=False,
    )
    route_stdlib(getattr(logging, level.upper()), [stamp, structlog.processors.format_exc_info])


@dataclass
class Launch:
    """What ``launch`` made (module docstring): ``listen_fds`` (systemd's descriptors, (fd, name)
    pairs), ``runtime_dir`` (and whether this daemon created it: ``created_runtime_dir``),
    ``workers_dir``, ``journal`` and ``spawned`` (worker id -> ``SpawnedWorker``, taken out one
    by one by the fleet as it adopts them)."""

    listen_fds: list[tuple[int, str]]
    runtime_dir: Path
    created_runtime_dir: bool
    workers_dir: Path
    journal: Journal | None = None
    spawned: dict[int, SpawnedWorker] = field(default_factory=dict)
    adopted: bool = False
    """True once a ``Daemon`` took over the directories and the journal (it releases them)."""

    def abandon(self) -> None:
        """Kill every worker still waiting for its handshake; unless a daemon took them over, close
        the journal and remove the directories this launch created. Idempotent."""
        for spawned in self.spawned.values():
            spawned.kill()
        self.spawned.clear()
        if self.adopted:
            return
        self.adopted = True  # nothing below runs twice
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        shutil.rmtree(self.workers_dir, ignore_errors=True)
        if self.created_runtime_dir:
            with contextlib.suppress(OSError):
                self.runtime_dir.rmdir()  # only when empty: never remove what others put there


def launch(config: Config, *, wal_recover: RecoverMode = "refuse") -> Launch:
    """Steps 1-4 of the module docstring. Raises what the module docstring lists, after releasing
    what it created."""
    fds = listen_fds()
    planned = resolve_runtime_dir(config, create=False)
    existed = planned.is_dir()
    runtime_dir = resolve_runtime_dir(config)
    workers_dir = runtime_dir / f"workers-{os.getpid()}"
    # Remove at exit only a directory this daemon created (an empty one).
    out = Launch(fds, runtime_dir, not existed and runtime_dir == planned, workers_dir)
    try:
        remove_stale_worker_dirs(runtime_dir)  # left by a coordinator killed with SIGKILL
        workers_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(workers_dir, 0o700)
        out.journal = _open_journal(config, wal_recover)
        for worker_id, wcfg in enumerate(config.workers):
            spec, _, _ = daemon_worker_spec(config, worker_id, wcfg, str(workers_dir))
            try:
                out.spawned[worker_id] = WorkerProcess.spawn(spec)
            except Exception:  # its slot spawns it again: a start failure, retried and reported
                continue
    except BaseException:
        out.abandon()
        raise
    return out


def _open_journal(config: Config, wal_recover: RecoverMode) -> Journal:
    """The write-ahead log in ``state_dir`` (mode "off": a ``NullJournal``, no directory touched);
    its ``on_commit`` and ``on_sync`` hooks are set by the daemon once its metrics exist."""
    if config.durability.mode == "off":
        return open_journal("", mode="off")
    state_dir = resolve_state_dir(config)
    journal = open_journal(
        state_dir,
        mode=config.durability.mode,
        result_ttl_s=config.durability.result_ttl_s,
        recover=wal_recover,
        min_free_bytes=config.durability.min_free_bytes,
    )
    log.info("journal_opened", state_dir=str(state_dir), epoch=journal.epoch)
    return journal
