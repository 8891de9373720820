"""What a ``WorkerLink`` waits for, and the frames that answer it (DESIGN.md "Link W").

Three kinds of wait, each resolved by the frames the worker sends back:

- a request's reply: one future per request, keyed by the envelope ``seq`` it was sent with; the
  reply carries that ``seq`` back in ``corr`` and the future gets ``(envelope, body, None)``;
- the tick in flight (one plan at most): its TICK_EMIT frames go to its ``on_emit`` as they arrive
  (an exception there is kept for ``WorkerLink.tick`` to raise once the result is in), its
  TICK_RESULT must echo the plan's ``plan_seq`` (ABI rule 55) and resolves its future with
  ``(envelope, body, tick)``;
- a state op's end: STATE_OP_DONE frames by op id, kept until ``take_op_done`` collects them or
  handed to the waiter ``op_waiter`` made.

``fail(error)`` fails every wait with the link's error. A reply nobody waits for is logged and
dropped. Everything runs on the link's event loop thread; not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from basertd.schema import link
from basertd.schema.link import MsgType
from basertd.server.workers.link_errors import LinkError, LinkProtocolError

EmitCallback = Callable[[link.TickEmit], None]
"""``on_emit(emit)``: called on the event loop thread for each TICK_EMIT of the plan in flight, in
arrival order, before ``tick`` returns. ``emit.tokens`` is a u32 array owned by the callee."""


class TickWait:
    """The tick in flight: the envelope ``seq`` of its TICK_SUBMIT, its ``plan_seq``, its
    ``on_emit`` and the exception ``on_emit`` raised, if any."""

    __slots__ = ("callback_error", "on_emit", "plan_seq", "seq")

    def __init__(self, seq: int, plan_seq: int, on_emit: EmitCallback | None) -> None:
        self.seq = seq
        self.plan_seq = plan_seq
        self.on_emit = on_emit
        self.callback_error: BaseException | None = None


class Replies:
    """The waits of one link (module docstring). ``pending``: request futures by envelope seq;
    ``tick``: the tick in flight, or None; ``log``: the link's bound logger."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self.pending: dict[int, asyncio.Future] = {}
        self.tick: TickWait | None = None
        self._ops_done: dict[int, link.StateOpDone] = {}
        self._op_waiters: dict[int, asyncio.Future] = {}

    def forget(self, seq: int, fut: asyncio.Future) -> None:
        """Stop waiting for the reply to ``seq`` (its caller gave up or got it)."""
        if self.pending.get(seq) is fut:
            del self.pending[seq]

    def on_tick_emit(self, env: link.Envelope, body: link.TickEmit) -> None:
        """A TICK_EMIT: to the tick in flight's ``on_emit``; a stray one is logged."""
        tick = self.tick
        if tick is None or env.corr != tick.seq:
            self.log.warning("stray_tick_emit", corr=env.corr)
            return
        if tick.on_emit is not None and tick.callback_error is None:
            try:
                tick.on_emit(body)
            except Exception as exc:  # surfaced by tick() once its result is in
                tick.callback_error = exc

    def on_op_done(self, env: link.Envelope, body: link.StateOpDone) -> None:
        """A STATE_OP_DONE: to its waiter, else kept for ``take_op_done``."""
        waiter = self._op_waiters.pop(body.op, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(body)
        else:
            self._ops_done[body.op] = body

    def on_reply(self, env: link.Envelope, body: Any) -> LinkProtocolError | None:
        """Resolve the pending request (or the tick in flight) that ``env.corr`` answers. Returns
        the protocol error that ends the link (a TICK_RESULT that does not echo its plan), else
        None."""
        mt = env.msg_type
        tick = self.tick
        if tick is not None and env.corr == tick.seq:
            if mt == MsgType.TICK_RESULT and body.plan_seq != tick.plan_seq:
                return LinkProtocolError(
                    f"TICK_RESULT plan_seq {body.plan_seq} does not echo plan {tick.plan_seq}"
                )
            self.tick = None
            fut = self.pending.pop(env.corr, None)
            if fut is not None and not fut.done():
                fut.set_result((env, body, tick))
            return None
        fut = self.pending.pop(env.corr, None)
        if fut is None or fut.done():
            # a PONG past ``worker_stats``' short wait is expected while the worker runs a long
            # step between ticks (an embedding chunk): the operator view went without its counters
            late = self.log.debug if mt == MsgType.PONG else self.log.warning
            late("late_reply", msg_type=int(mt), corr=env.corr)
            return None
        fut.set_result((env, body, None))
        return None

    def take_op_done(self, op: int) -> link.StateOpDone | None:
        """The STATE_OP_DONE of ``op`` if it arrived unclaimed (each is returned once), else None."""
        return self._ops_done.pop(op, None)

    def op_waiter(self, op: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """The future the STATE_OP_DONE of ``op`` resolves (one per op, shared by its callers)."""
        fut = self._op_waiters.get(op)
        if fut is None:
            fut = self._op_waiters[op] = loop.create_future()
        return fut

    def drop_op_waiter(self, op: int, fut: asyncio.Future) -> None:
        """Forget ``fut`` once it is done (a caller that timed out leaves it for the next)."""
        if self._op_waiters.get(op) is fut and fut.done():
            del self._op_waiters[op]

    def fail(self, error: LinkError) -> bool:
        """Fail every wait with ``error``; returns whether a tick was in flight."""
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(error)
        self.pending.clear()
        for fut in self._op_waiters.values():
            if not fut.done():
                fut.set_exception(error)
        self._op_waiters.clear()
        in_tick = self.tick is not None
        self.tick = None
        return in_tick
