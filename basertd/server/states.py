"""The coordinator's lifecycle states, one enum each (DESIGN.md "Operators").

``StrEnum``: a member compares equal to, and prints as, its plain name, which is what the control
and client schemas carry (``Status.state``, ``WorkerRow.state``, ``HealthResult.status``).

- ``DaemonState``: the daemon's life, STARTING -> READY -> STOPPING -> STOPPED. DRAINING is never
  stored: it is the public view of READY while a drain runs (``Daemon.public_state``).
- ``SlotState``: one configured worker (``supervisor.WorkerSlot``): STARTING (first incarnation),
  READY (handshaken, serving), RESTARTING (between incarnations), GIVEN_UP (too many failures in a
  row; a reload or restart verb pokes it again), STOPPED.
- ``HealthStatus``: the answer to Health (``Frontend.health``): OK (every worker serves), DEGRADED
  (some serve; one gave up or stalled), STARTING (none serves yet), or the daemon's own DRAINING /
  STOPPING / STOPPED.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["DaemonState", "HealthStatus", "SlotState"]


class DaemonState(StrEnum):
    """The daemon's lifecycle (module docstring)."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"


class SlotState(StrEnum):
    """One worker slot's state (module docstring)."""

    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    GIVEN_UP = "given_up"
    STOPPED = "stopped"


class HealthStatus(StrEnum):
    """The daemon's health (module docstring)."""

    OK = "ok"
    DEGRADED = "degraded"
    STARTING = "starting"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
