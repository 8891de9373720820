"""What a reload (SIGHUP) can change at run time, and applying it (DESIGN.md "Operators").

Reloadable: ``log_level`` (the coordinator's; workers keep theirs until they respawn), every
``[scheduler]`` and ``[cache]`` knob (applied to each scheduler before its next plan),
``[operators] operator_group`` / ``drain_timeout_s``, and the ``[[workers]]`` tables (each
table one unit, ``workers.N``: added, removed or replaced one worker at a time by
``basertd.server.ops.worker_changes``). Everything else (``runtime_dir``, ``socket``,
``socket_mode``, ``[limits]``, ``[operators] metrics_listen``, ...) needs a restart: a reload
keeps the running values and names those keys in its report and log line.

``config_changes(old, new)`` is the pure comparison (also used by ``basertctl config check``
through the ConfigCheck verb); ``apply_reload(running, schedulers, new)`` applies it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import msgspec

from basertd.server.config import Config

RELOADABLE_SECTIONS = ("scheduler", "cache")
RELOADABLE_KEYS = ("log_level", "operators.operator_group", "operators.drain_timeout_s")
START_KEYS = ("cache.host_bytes",)
"""Keys of reloadable sections that a worker reads only when it starts (its command line)."""


@dataclasses.dataclass(frozen=True)
class ReloadReport:
    """Dotted keys that changed and were applied, and those that changed but need a restart."""

    applied: list[str]
    needs_restart: list[str]


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else k
            if k == "workers" and not prefix:  # each worker's table is one unit
                out.update({f"workers.{i}": w for i, w in enumerate(v)})
            else:
                out.update(_flat(v, key))
        return out
    return {prefix: data}


def _order(key: str) -> tuple:
    """Sort keys by name, ``workers.N`` by number (``workers.10`` after ``workers.9``)."""
    head, _, tail = key.partition(".")
    return (head, int(tail)) if head == "workers" and tail.isdigit() else (key, 0)


def _reloadable(key: str) -> bool:
    if key in START_KEYS:
        return False
    return key in RELOADABLE_KEYS or key.split(".", 1)[0] in (*RELOADABLE_SECTIONS, "workers")


def config_changes(old: Config, new: Config) -> ReloadReport:
    """Compare two configurations: the changed keys a reload applies, and those it cannot
    (``workers.N``: worker N's table was added, removed or changed)."""
    a, b = _flat(msgspec.to_builtins(old)), _flat(msgspec.to_builtins(new))
    changed = sorted((k for k in a.keys() | b.keys() if a.get(k) != b.get(k)), key=_order)
    return ReloadReport(
        applied=[k for k in changed if _reloadable(k)],
        needs_restart=[k for k in changed if not _reloadable(k)],
    )


def effective_config(old: Config, new: Config) -> Config:
    """The configuration a reload leaves running: ``new``'s reloadable keys, ``old``'s others."""
    ops = msgspec.structs.replace(new.operators, metrics_listen=old.operators.metrics_listen)
    cache = msgspec.structs.replace(new.cache, host_bytes=old.cache.host_bytes)
    return msgspec.structs.replace(
        new,
        cache=cache,
        runtime_dir=old.runtime_dir,
        socket=old.socket,
        socket_mode=old.socket_mode,
        limits=old.limits,
        operators=ops,
    )


def apply_reload(old: Config, schedulers: Iterable[Any], new: Config) -> tuple[ReloadReport, Config]:
    """Apply ``new`` over the running configuration ``old``: each scheduler gets the new
    ``[scheduler]`` / ``[cache]`` knobs (the workers' tables are the caller's to apply, with
    ``basertd.server.ops.worker_changes``) (its measured tick rates are kept, their caps updated).
    Returns what was applied and what needs a restart, and the configuration now running
    (``effective_config``), which the caller keeps. The caller switches the log level (after
    logging the report, so the report is written at the level it was asked under)."""
    report = config_changes(old, new)
    running = effective_config(old, new)
    for sched in schedulers:
        sched.reconfigure(running.scheduler, running.cache)
    return report, running
