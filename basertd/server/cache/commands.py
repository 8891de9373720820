"""Typed commands into a worker's scheduler loop, run between two ticks (DESIGN.md "Prefix cache
policy", "Scheduling").

The operator cache verbs and the pin warm-up need the live worker (its link, its prompt ring) at a
moment no tick is in flight, so that nothing races a tick's prompt-ring writes or seed leases. They
send one of these commands with ``Scheduler.command``; the loop runs each in the gap between two
ticks, in arrival order, in one place (a ``match`` over the command type), and resolves the
command's future with its result or its exception.
"""

from __future__ import annotations

from dataclasses import dataclass

from basertd.server.cache.policy import PinHold


@dataclass(frozen=True)
class HoldPin:
    """Match and acquire a lease on ``pin``'s prefix (``WorkerCache.hold``); the result is True
    when it is held, False when the engine no longer serves the whole prefix."""

    pin: PinHold


@dataclass(frozen=True)
class DropPin:
    """Forget pin ``pin_id`` on this worker and release its lease (``WorkerCache.drop_pin``); the
    result is False when it was not pinned here."""

    pin_id: int


@dataclass(frozen=True)
class Evict:
    """CACHE_EVICT up to ``bytes_target`` bytes of unpinned prefixes (0: all of them) inside the
    shed envelope (``WorkerCache.evict``, ABI rule 89); the result is the bytes freed."""

    bytes_target: int


@dataclass(frozen=True)
class ListEntries:
    """The prefix index, each entry verified against ``space_match`` (``WorkerCache.
    verified_entries``); the result is a list of (``IndexEntry``, ``Tier``), most recently used first."""


Command = HoldPin | DropPin | Evict | ListEntries
"""Every command the loop runs between ticks."""
