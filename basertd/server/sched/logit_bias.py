"""Logit-bias tables of the requests running on one worker (DESIGN.md "Link W"; ABI rule 113).

A Generate's ``logit_bias`` reaches the engine as a table the worker creates on LOGIT_BIAS_CREATE
(token ids as u32, biases as f32, added to the logits before sampling) and names in
``LaneAdmit.logit_bias_handle``. One table per request lives for the request's life on a worker
incarnation, booked in a ``WorkerHandles`` (``basertd.server.sched.handles``: ``bias_tables``) by
request: created when the request is first admitted there (``handles``), reused when it is
re-admitted after a preemption or checkpoint, dropped by the loop between ticks once the request
is finished and no lane of it is left, whichever way it ended (Done, Error, cancel, disconnect,
lane fault, refused admit), and freed (LOGIT_BIAS_FREE) right after. A dead worker's tables die
with it: ``forget``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from basertd.schema import link
from basertd.server.request.record import GenerationRequest
from basertd.server.sched.handles import WorkerHandles


class LogitBiasError(Exception):
    """The worker made no table for a request's ``logit_bias`` (handle 0: an id outside its
    vocabulary, or the engine refused it)."""


async def _free(wlink: Any, handle: int) -> None:
    await wlink.request(link.LogitBiasFree(handle=handle))


def bias_tables(worker_id: int) -> WorkerHandles[GenerationRequest]:
    """The logit-bias tables of one worker's requests, by request."""
    return WorkerHandles("logit_bias", worker_id, _free)


async def handle(tables: WorkerHandles[GenerationRequest], wlink: Any, req: GenerationRequest) -> int:
    """The ``LaneAdmit.logit_bias_handle`` of ``req``: 0 without a bias, else its table (created on
    this worker on first use). Raises ``LogitBiasError`` when the worker made none,
    ``LinkError`` when the link fails."""
    bias = req.sampler.logit_bias
    if not bias:
        return 0
    got = tables.get(req)
    if got:
        return got
    tokens = np.fromiter((t for t, _ in bias), dtype=np.uint32, count=len(bias))
    values = np.fromiter((v for _, v in bias), dtype=np.float32, count=len(bias))
    reply = await wlink.request(link.LogitBiasCreate(tokens=tokens, values=values))
    if not reply.handle:
        raise LogitBiasError(f"the worker refused the logit_bias of request {req.request_id!r}")
    tables.hold(req, reply.handle)
    return reply.handle


async def handles(
    tables: WorkerHandles[GenerationRequest], wlink: Any, reqs: list[GenerationRequest]
) -> tuple[dict[int, int], list[tuple[GenerationRequest, LogitBiasError]]]:
    """``handle`` for each request of ``reqs`` that carries a bias: ``({request key: handle},
    [(request, why) refused])``. Requests without a bias are absent (handle 0) and cost no
    await. Raises ``LinkError`` when the link fails."""
    got: dict[int, int] = {}
    refused: list[tuple[GenerationRequest, LogitBiasError]] = []
    for req in reqs:
        if req.sampler.logit_bias:
            try:
                got[req.key] = await handle(tables, wlink, req)
            except LogitBiasError as exc:
                refused.append((req, exc))
    return got, refused
