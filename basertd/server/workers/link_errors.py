"""The errors of the coordinator's end of Link W (DESIGN.md "Link W"): ``LinkError`` and its kinds.

``basertd.server.workers.link.WorkerLink`` raises them; callers that only handle errors import them from
here. ``LinkError`` is the base of every one; ``WorkerError`` is a refusal by the worker (an ABI
``Status``, nothing changed); ``PlanRejected`` (a TICK_REJECTED answer) is the schema's one
exception for a refused plan, re-exported here and not a ``LinkError``; the others end or guard the
link itself (closed, timed out, peer died, protocol broken, message not encodable, a second tick).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from basertd.schema.abi import Status, status_name
from basertd.schema.rejection import PlanRejected

if TYPE_CHECKING:
    from basertd.schema.tick import TickEvents

__all__ = [
    "EmitCallbackError",
    "LinkClosed",
    "LinkError",
    "LinkProtocolError",
    "LinkTimeout",
    "MessageNotEncodable",
    "PlanRejected",
    "TickInFlight",
    "WorkerDied",
    "WorkerError",
]


class LinkError(Exception):
    """Base of every error a ``WorkerLink`` raises."""


class LinkClosed(LinkError):
    """The link was closed by this side; nothing more can be sent or received."""


class LinkTimeout(LinkError):
    """A reply did not come within the caller's timeout. The request may still run in the worker
    (a late reply is logged and dropped); a timed-out tick keeps the tick slot busy until its
    result arrives, so treat the worker as hung and restart it."""


class WorkerDied(LinkError):
    """The worker process exited (noticed through its pidfd). ``pid``; ``returncode`` as
    ``subprocess`` reports it (negative: killed by that signal; None if not yet known)."""

    def __init__(self, pid: int | None, returncode: int | None, detail: str = "") -> None:
        self.pid = pid
        self.returncode = returncode
        how = "exit status unknown" if returncode is None else _describe_exit(returncode)
        super().__init__(f"worker pid {pid} died ({how}){': ' + detail if detail else ''}")


class LinkProtocolError(LinkError):
    """The worker broke Link W: an undecodable frame (``code`` is its ``FrameErrorCode``), an
    unexpected reply type, or a tick result that does not echo its plan. The link is dead."""

    def __init__(self, message: str, code: int | None = None) -> None:
        self.code = code
        super().__init__(message)


class MessageNotEncodable(LinkError, ValueError):
    """A message that does not fit Link W (a field out of its integer range, an oversize body);
    nothing was sent and the link is unaffected."""


class TickInFlight(LinkError):
    """``tick`` was called while another plan of this link had no result yet (DESIGN.md "Link W":
    exactly one tick in flight per worker). Nothing was sent."""


class WorkerError(LinkError):
    """The worker answered ERROR: the request was refused and nothing changed. ``status`` is the
    ABI ``Status`` (``ERR_FATAL`` when the engine died; the process exits with code 70 next)."""

    def __init__(self, status: Status | int, message: str = "") -> None:
        status = Status.of(status)
        self.status = status
        self.message = message
        name = status_name(status)
        super().__init__(f"{name}: {message}" if message else name)


class EmitCallbackError(LinkError):
    """The caller's ``on_emit`` raised during a tick. The tick itself completed: its result is in
    ``events``; the callback's exception is the ``__cause__``."""

    def __init__(self, events: TickEvents) -> None:
        self.events = events
        super().__init__("on_emit raised during the tick; the tick completed")


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
