"""A refused tick plan, the one exception for it in every layer (ABI rules 13, 17-52).

``baseRT_tick`` answers a plan it will not run with a status in -100..-114 and changes nothing.
The native binding, every engine adapter behind the worker's ``Engine`` protocol, and the
coordinator's end of Link W (a TICK_REJECTED answer) all raise this same ``PlanRejected``, so one
``except PlanRejected`` means the same thing wherever it is written. It is deliberately not a
subclass of a layer's call-error family (``AbiError``, ``EngineError``, ``WorkerError``): those
report a call that failed, while a rejection is the engine's verdict on a plan, which the caller
answers by planning again.
"""

from __future__ import annotations

from basertd.schema.abi import Status, status_name

__all__ = ["PLAN_REJECTION_RANGE", "PlanRejected"]

PLAN_REJECTION_RANGE = range(-114, -99)
"""``baseRT_tick`` return codes that refuse the whole plan (-100..-114; -109 is unassigned, rule 13)."""


class PlanRejected(Exception):
    """The engine refused the whole plan and changed nothing (ABI rules 13, 17-52).

    ``status``: the ABI ``Status`` (a code in ``PLAN_REJECTION_RANGE``; the raw int when the code
    is unknown). ``message``: the engine's reason, naming the offending plan entry when it can.
    ``plan_seq``: the refused plan's ``plan_seq`` where the raiser knows it (Link W's
    TICK_REJECTED carries it), else None."""

    def __init__(self, status: Status | int, message: str = "", *, plan_seq: int | None = None) -> None:
        status = Status.of(status)
        self.status = status
        self.message = message
        self.plan_seq = plan_seq
        name = status_name(status)
        super().__init__(f"{name}: {message}" if message else name)
