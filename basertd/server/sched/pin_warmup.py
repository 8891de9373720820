"""Warming a prefix into a worker's prefix cache, and restoring lost pins (DESIGN.md "Prefix
cache policy", "Pins").

A prefix that is not cached is prefilled by an internal one-token greedy request (class batch)
whose lane retires with publish; the pin is then held by a seed lease (``HoldPin`` run between
ticks). A pin whose lease was lost (a respawned worker, an expired lease) is warmed and held
again; one that cannot be is retried after ``PIN_RETRY_S`` seconds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import structlog

from basertd.schema import client as api
from basertd.schema.abi import Sampling
from basertd.schema.tick import SamplingParams
from basertd.server.cache.commands import Command, HoldPin
from basertd.server.request.record import GenerationRequest, Sampler
from basertd.server.sched.state import SchedulerState
from basertd.server.workers.link_errors import LinkError

log = structlog.get_logger("basertd.scheduler")

PIN_RETRY_S = 5.0
"""Seconds before a pin that could not be warmed again is retried."""


class LoopLike(Protocol):
    """What warm-up needs of a worker's scheduler loop (``basertd.server.sched.loop.Scheduler``)."""

    worker_id: int
    tokenizer: Any
    core: SchedulerState  # its lanes and prefix-cache policy

    def submit(self, req: GenerationRequest) -> None: ...

    def cancel(self, req: GenerationRequest, *, message: str = ...) -> None: ...

    async def command(self, cmd: Command, timeout: float = ...) -> Any: ...

    async def ticked(self) -> None: ...


class WarmupSink:
    """The sink of an internal request that prefills a prefix to pin (nobody reads its tokens):
    ``done`` resolves with its Done or Error."""

    closed = False

    def __init__(self) -> None:
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def send(self, msg: object) -> None:
        if isinstance(msg, (api.Done, api.Error)) and not self.done.done():
            self.done.set_result(msg)


async def warm_prefix(sched: LoopLike, tokens: list[int], tag: int, timeout: float = 120.0) -> None:
    """Prefill ``tokens`` on ``sched``'s worker with an internal one-token greedy request (class
    batch, named after ``tag``) and wait until its lane has retired with publish, so the prefix is
    in the engine's cache. Raises ``TimeoutError``, or ``LinkError`` when the request failed."""
    if sched.tokenizer is None:
        raise LinkError("no tokenizer to run a warm-up request with")
    sink = WarmupSink()
    req = GenerationRequest(
        request_id=f"warmup-{sched.worker_id}-{tag}",
        prompt=list(tokens),
        max_tokens=1,
        sampler=Sampler(Sampling.GPU_GREEDY, SamplingParams(), 0),
        sink=sink,
        tokenizer=sched.tokenizer,
        qos="batch",
        stream=False,
    )
    sched.submit(req)

    async def settled() -> None:
        msg = await sink.done
        if isinstance(msg, api.Error):
            raise LinkError(f"warm-up failed: {msg.message}")
        while any(lane.request is req for lane in sched.core.lanes.values()):
            await sched.ticked()  # its lane retires (and publishes) in a coming tick

    try:
        await asyncio.wait_for(settled(), timeout)
    except BaseException:
        sched.cancel(req, message="warm-up abandoned")
        raise


async def rewarm(sched: LoopLike, pin_id: int, warm) -> None:
    """Warm (``warm(tokens)``) and hold again pin ``pin_id`` of ``sched``'s worker, whose lease
    was lost. Failures are logged and the pin is retried after ``PIN_RETRY_S`` seconds."""
    wc = sched.core.cache_policy
    try:
        pin = wc.pins.get(pin_id)
        if pin is None:
            return
        if not await sched.command(HoldPin(pin)):
            await warm([int(t) for t in pin.tokens])
            if pin_id in wc.pins and not await sched.command(HoldPin(pin)):
                log.warning("pin_not_restored", worker_id=sched.worker_id, pin_id=pin_id)
                pin.retry_at = time.monotonic() + PIN_RETRY_S
    except (LinkError, TimeoutError) as exc:
        log.warning("pin_rewarm_failed", worker_id=sched.worker_id, pin_id=pin_id, error=str(exc))
        pin = wc.pins.get(pin_id)
        if pin is not None:
            pin.retry_at = time.monotonic() + PIN_RETRY_S
