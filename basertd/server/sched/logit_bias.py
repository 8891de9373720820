"""Logit-bias tables of the requests running on one worker (DESIGN.md "Link W"; ABI rule 113).

A Generate's ``logit_bias`` reaches the engine as a table the worker creates on LOGIT_BIAS_CREATE
(token ids as u32, biases as f32, added to the logits before sampling) and names in
``LaneAdmit.logit_bias_handle``. ``BiasTables`` holds one table per request for the life of a
worker incarnation: created when the request is first admitted there, reused when it is
re-admitted after a preemption or checkpoint, and freed (LOGIT_BIAS_FREE) by ``sweep`` between
ticks once the request is finished and no lane of it is left, whichever way it ended (Done, Error,
cancel, disconnect, lane fault, refused admit). A dead worker's tables die with it: ``clear``
forgets them without a message.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import structlog

from basertd.schema import link
from basertd.server.request.record import GenerationRequest
from basertd.server.workers.link_errors import WorkerError

log = structlog.get_logger("basertd.logit_bias")


class LogitBiasError(Exception):
    """The worker made no table for a request's ``logit_bias`` (handle 0: an id outside its
    vocabulary, or the engine refused it)."""


class BiasTables:
    """The logit-bias handle of each request (by ``GenerationRequest.key``) on one worker
    incarnation; ``len()`` is the number of live tables."""

    def __init__(self) -> None:
        self._tables: dict[int, tuple[GenerationRequest, int]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    async def handle(self, wlink: Any, req: GenerationRequest) -> int:
        """The ``LaneAdmit.logit_bias_handle`` of ``req``: 0 without a bias, else its table
        (created on this worker on first use). Raises ``LogitBiasError`` when the worker made none,
        ``LinkError`` when the link fails."""
        bias = req.sampler.logit_bias
        if not bias:
            return 0
        got = self._tables.get(req.key)
        if got is not None:
            return got[1]
        tokens = np.fromiter((t for t, _ in bias), dtype=np.uint32, count=len(bias))
        values = np.fromiter((v for _, v in bias), dtype=np.float32, count=len(bias))
        reply = await wlink.request(link.LogitBiasCreate(tokens=tokens, values=values))
        if not reply.handle:
            raise LogitBiasError(f"the worker refused the logit_bias of request {req.request_id!r}")
        self._tables[req.key] = (req, reply.handle)
        return reply.handle

    async def handles(
        self, wlink: Any, reqs: list[GenerationRequest]
    ) -> tuple[dict[int, int], list[tuple[GenerationRequest, LogitBiasError]]]:
        """``handle`` for each request of ``reqs`` that carries a bias: ``({key: handle},
        [(request, why) refused])``. Requests without a bias are absent (handle 0) and cost no
        await. Raises ``LinkError`` when the link fails."""
        got: dict[int, int] = {}
        refused: list[tuple[GenerationRequest, LogitBiasError]] = []
        for req in reqs:
            if req.sampler.logit_bias:
                try:
                    got[req.key] = await self.handle(wlink, req)
                except LogitBiasError as exc:
                    refused.append((req, exc))
        return got, refused

    async def sweep(self, wlink: Any, live: Collection[int]) -> int:
        """Free the tables of finished requests whose key is not in ``live`` (keys of requests
        that still own a lane). Returns how many were freed; an unknown handle is logged (the
        engine already lost it) and forgotten. Raises ``LinkError`` when the link fails."""
        done = [key for key, (req, _) in self._tables.items() if req.finished and key not in live]
        for key in done:
            _, handle = self._tables.pop(key)
            try:
                await wlink.request(link.LogitBiasFree(handle=handle))
            except WorkerError as exc:
                log.warning("logit_bias_free_refused", handle=handle, error=str(exc))
        return len(done)

    def clear(self) -> None:
        """Forget every table (the worker incarnation that held them is gone)."""
        self._tables.clear()
