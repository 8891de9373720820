"""What goes into and comes out of the scheduler core (DESIGN.md "Scheduling"): plain values.

In: the outcome of the tick of a launched plan, one of

- ``Accepted(events, tokens)``: the engine ran the plan; its ``TickEvents`` and the emitted tokens
  the loop read from the emit ring (lane tag -> tokens; None: unreadable);
- ``Rejected(status, message, plan_seq)``: the engine refused the plan whole and changed nothing
  (``PlanRejected``, ABI rules 13, 17-52);
- ``Lost(error, stalled)``: the worker died or broke the link (``stalled``: the progress watchdog
  restarted it, naming what stalled).

Out: ``Delivery`` records, one per request a verb touched: the client messages (``Tokens``,
``Done``, ``Error``, ``Queued`` of ``basertd.schema.client``) its sink is to receive, in order.
The core builds them and never calls a sink; the loop hands each to the request's sink chain
(``Delivery.send``). ``Applied`` is what ``SchedulerCore.apply`` returns: the deliveries, and the
restart reason of a rejected plan or the requests to resume of a lost worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from basertd.schema.tick import TickEvents
from basertd.server.request.record import GenerationRequest


@dataclass(frozen=True, slots=True)
class Accepted:
    """The engine ran the plan: its ``events`` and the ``tokens`` of each emit with ``n_tokens``
    (lane tag -> token ids read from the emit ring; None: unreadable, that request fails
    INTERNAL)."""

    events: TickEvents
    tokens: dict[int, list[int] | None]


@dataclass(frozen=True, slots=True)
class Rejected:
    """The engine refused the plan with ``status`` (an ABI ``Status`` or its int) and changed
    nothing (ABI rules 13, 50); ``message`` and ``plan_seq`` are the engine's, for the log."""

    status: int
    message: str = ""
    plan_seq: int = 0


@dataclass(frozen=True, slots=True)
class Lost:
    """The worker died or broke the link (``error``); ``stalled``: why the progress watchdog
    restarted it (its running work then fails instead of resuming), else None. ``planned``: not a
    death but a hand-over (a reload replacing or removing the worker, ``basertctl worker
    restart``): every live lane resumes and no crash is charged to its request."""

    error: str
    stalled: str | None = None
    planned: bool = False


Outcome = Accepted | Rejected | Lost


@dataclass(slots=True)
class Delivery:
    """The client messages one request's sink is to receive from one verb, in order."""

    request: GenerationRequest
    messages: list = field(default_factory=list)

    def send(self) -> None:
        """Hand the messages to the request's sink chain (the loop's step, never the core's)."""
        send = self.request.sink.send
        for msg in self.messages:
            send(msg)


class Outbox:
    """Deliveries being collected by one verb: one ``Delivery`` per request, in the order the
    requests were first reached."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[int, Delivery] = {}

    def to(self, req: GenerationRequest) -> list:
        """The message list of ``req``'s delivery (the ``out`` of ``GenerationRequest.deliver /
        finish / fail``)."""
        d = self._by_key.get(req.key)
        if d is None:
            d = self._by_key[req.key] = Delivery(req)
        return d.messages

    def take(self) -> list[Delivery]:
        """The deliveries with at least one message."""
        return [d for d in self._by_key.values() if d.messages]


@dataclass(slots=True)
class Applied:
    """What ``SchedulerCore.apply`` did: ``deliveries`` for the sinks; ``restart``: why the worker
    must be restarted (a plan rejected again and again), else None; ``resume``: a lost worker's
    requests to resume (youngest first: requeue each at the head of its class in this order, so
    the oldest ends at the head, here or on a peer); ``failed``: the keys of those it failed."""

    deliveries: list[Delivery] = field(default_factory=list)
    restart: str | None = None
    resume: list[GenerationRequest] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
