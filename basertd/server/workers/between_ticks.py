"""Requests a worker serves between its ticks: embeddings (Link W EMBED, packed or one long
input in chunks, and EMBED_CANCEL) and prompt scoring (SCORE).

``BetweenTicks(proc_of, respawned, max_crash_resumes)``: ``proc_of(worker_id)`` is that worker's current
process (a ``WorkerProcess``, or None while it is not running) and ``respawned(worker_id)`` waits
for its next live one (falsy when none comes: ``WorkerSlot.live``); the fleet passes its slots', and
``max_crash_resumes()`` the configured bound. Every failure reaches the caller as an ``AdmissionError``
(``embed``), so the front end refuses the one request it belongs to and nothing else.

A worker that dies or restarts during an exchange is a preemption, as for a generation (DESIGN.md,
"Crash = preemption"): the request is sent again, whole, to the next incarnation (a long input
from its first chunk: the new process has none of its cells); it fails at its
``[scheduler] max_crash_resumes``-th death, as a generation does, so an input that kills its
worker cannot crash-loop it.

A long input is sent as chunks so the worker's ticks run between them; the worker keeps one such
input open at a time (its KV cells stay between chunks, DESIGN.md "Client API"). Two locks per
worker order the exchanges: the *embed lock*, held for one EMBED or EMBED_CANCEL exchange, and
the *input lock*, held by the ``embed_chunked`` call whose input is open. A packed ``embed`` takes
only the embed lock, so it goes between another input's chunks, served in the cells that input
leaves; when those do not hold it (the worker answers EBUSY) it waits for the input lock, i.e. for
that input to finish, and is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import structlog

from basertd.schema import link
from basertd.schema.abi import Status
from basertd.schema.client import ErrorCode
from basertd.server.request.record import AdmissionError
from basertd.server.workers.link_errors import LinkError, LinkTimeout, WorkerError

EMBED_TIMEOUT_S = 120.0
"""Seconds one EMBED or SCORE may take (it waits for the tick in flight, then runs between ticks)."""

log = structlog.get_logger("basertd.between_ticks")


class BetweenTicks:
    """EMBED, EMBED_CANCEL and SCORE exchanges with the workers (module docstring)."""

    def __init__(
        self,
        proc_of: Callable[[int], Any],
        respawned: Callable[[int], Awaitable[object]],
        max_crash_resumes: Callable[[], int] = lambda: 2,
    ) -> None:
        self._proc_of = proc_of
        self._respawned = respawned
        self.max_crash_resumes = max_crash_resumes
        self._embed_locks: dict[int, asyncio.Lock] = {}
        self._input_locks: dict[int, asyncio.Lock] = {}
        self._embed_open: dict[int, tuple[object, int]] = {}  # worker → (process, input id) maybe left open
        self._embed_ids = itertools.count(1)

    async def embed(self, worker_id: int, inputs: list[list[int]]) -> np.ndarray:
        """The pooled embeddings of ``inputs`` (token-id lists) from worker ``worker_id`` as an
        ``(len(inputs), dim)`` float32 array. Raises ``AdmissionError``: WORKER_FAILED when the
        worker is not running and none respawns, or it died ``max_crash_resumes`` times during
        the request; INVALID_REQUEST when its engine serves no embeddings or refuses an input, TIMEOUT
        after ``EMBED_TIMEOUT_S``.

        It runs between the chunks of a long input open on the worker (``embed_chunked``), in
        the cells that input leaves; when it does not fit there (the worker answers EBUSY) it
        waits for that input to finish and is sent again."""
        msg = link.Embed(
            tokens=np.fromiter(itertools.chain.from_iterable(inputs), np.uint32),
            lengths=np.array([len(x) for x in inputs], np.uint32),
        )

        async def attempt() -> Any:
            while True:
                async with self._embed_lock(worker_id):
                    beside = self._input_lock(worker_id).locked()  # a request has an input open
                    if not beside:
                        await self._close_left_open(worker_id)  # none does: free a left one's cells
                    try:
                        return await self._request(worker_id, msg, "serves no embeddings")
                    except _StateLost as exc:  # EBUSY: no room beside the chunked input open now
                        if not beside:
                            raise AdmissionError(
                                ErrorCode.WORKER_FAILED, f"worker {worker_id} refused EMBED: {exc}"
                            ) from None
                async with self._input_lock(worker_id):  # until that input is done
                    pass

        reply = await self._surviving(worker_id, attempt)
        return reply.values.reshape(len(inputs), reply.dim)

    async def embed_chunked(self, worker_id: int, tokens: list[int], chunk_tokens: int) -> np.ndarray:
        """The pooled embedding of one long input ``tokens`` from worker ``worker_id``, sent as
        chunks of ``chunk_tokens`` tokens, one EMBED each (``input_id`` set); a ``(dim,)`` float32
        unit vector equal to the one-pass one up to float noise (``schema.link.Embed``). Another
        chunked input waits for this one; packed ``embed`` calls run between its chunks. An input
        left open by a cancelled or failed request is cancelled (EMBED_CANCEL) before the next one
        opens or a packed ``embed`` runs. A worker that restarts meanwhile has none of the input's
        state: the new incarnation is sent the input again from its first chunk (module
        docstring). Raises ``AdmissionError`` as ``embed`` does, and WORKER_FAILED when the same
        incarnation lost the input."""
        chunks = [tokens[i : i + chunk_tokens] for i in range(0, len(tokens), chunk_tokens)]
        async with self._input_lock(worker_id):
            return await self._surviving(worker_id, lambda: self._send_input(worker_id, chunks))

    async def score(self, worker_id: int, tokens: list[int], top_k: int) -> link.ScoreResult:
        """Prompt log-probabilities of ``tokens`` from worker ``worker_id`` (SCORE): ``logprobs``
        of tokens 1.. given the ones before, ``top_k`` alternatives each. Raises
        ``AdmissionError`` as ``embed`` does."""
        msg = link.Score(tokens=np.array(tokens, np.uint32), top_k=top_k)
        return await self._surviving(worker_id, lambda: self._request(worker_id, msg, "scores no prompts"))

    async def _surviving(self, worker_id: int, attempt: Callable[[], Awaitable[Any]]) -> Any:
        """``attempt()``'s result, run again on the next incarnation each time worker
        ``worker_id`` dies or restarts during it; the last failure is raised at the
        ``max_crash_resumes()``-th death or when no incarnation comes
        (``respawned``)."""
        for restarts in itertools.count():
            try:
                return await attempt()
            except (_WorkerLost, _Restarted) as exc:
                if restarts + 1 >= self.max_crash_resumes() or not await self._respawned(worker_id):
                    if isinstance(exc, _Restarted):
                        raise _lost(worker_id) from None
                    raise
                log.info("between_ticks_resent", worker_id=worker_id, deaths=restarts + 1)
        raise AssertionError("unreachable")

    async def _send_input(self, worker_id: int, chunks: list[list[int]]) -> np.ndarray:
        """One pass of ``embed_chunked`` over ``chunks`` (its input lock held). Raises
        ``_Restarted`` when the worker's process changed since the first chunk (or answered
        without the input after a change)."""
        input_id = next(self._embed_ids)
        async with self._embed_lock(worker_id):
            await self._close_left_open(worker_id)
        proc = self._proc_of(worker_id)
        self._embed_open[worker_id] = (proc, input_id)
        reply: Any = None
        for k, chunk in enumerate(chunks):
            if self._proc_of(worker_id) is not proc:
                raise _Restarted
            msg = link.Embed(
                tokens=np.array(chunk, np.uint32),
                lengths=np.array([len(chunk)], np.uint32),
                input_id=input_id,
                chunk=k,
                last=k == len(chunks) - 1,
            )
            try:
                async with self._embed_lock(worker_id):  # packed embeds go between chunks
                    reply = await self._request(worker_id, msg, "serves no embeddings")
            except _StateLost:
                if self._proc_of(worker_id) is not proc:
                    raise _Restarted from None
                raise _lost(worker_id) from None
        del self._embed_open[worker_id]
        return reply.values.reshape(reply.dim)

    def _embed_lock(self, worker_id: int) -> asyncio.Lock:
        return self._embed_locks.setdefault(worker_id, asyncio.Lock())

    def _input_lock(self, worker_id: int) -> asyncio.Lock:
        return self._input_locks.setdefault(worker_id, asyncio.Lock())

    async def _close_left_open(self, worker_id: int) -> None:
        """EMBED_CANCEL the chunked input a cancelled or failed ``embed_chunked`` may have left
        open on worker ``worker_id``'s current incarnation (under its embed lock); a worker that
        has none of it (restarted, or the input never opened) answers ERR_UNKNOWN_HANDLE, which
        is what was wanted."""
        left = self._embed_open.pop(worker_id, None)
        if left is None:
            return
        proc, input_id = left
        if proc is not self._proc_of(worker_id):
            return
        with contextlib.suppress(AdmissionError, _StateLost):
            await self._request(worker_id, link.EmbedCancel(input_id=input_id), "serves no embeddings")

    async def _request(self, worker_id: int, msg: object, unsupported: str) -> Any:
        """The reply to ``msg`` within ``EMBED_TIMEOUT_S``; its failures as ``AdmissionError``
        (``embed``), an engine without the capability as "worker N's engine ``unsupported``",
        ERR_UNKNOWN_HANDLE and EBUSY (a chunked input's state) as ``_StateLost``."""
        proc = self._proc_of(worker_id)
        if proc is None or not proc.link.alive:
            raise _WorkerLost(ErrorCode.WORKER_FAILED, f"worker {worker_id} is not running")
        what = type(msg).__name__.upper()
        try:
            return await proc.link.request(msg, timeout=EMBED_TIMEOUT_S)
        except WorkerError as exc:
            if exc.status in (Status.ERR_UNKNOWN_HANDLE, Status.EBUSY):
                raise _StateLost(exc.message) from None
            if exc.status == Status.REJECT_BOUNDS:  # what is out of bounds, from the engine's checks
                raise AdmissionError(ErrorCode.INVALID_REQUEST, exc.message) from None
            why = unsupported if exc.status == Status.ERR_OP_UNSUPPORTED else f"failed {what}"
            raise AdmissionError(ErrorCode.INVALID_REQUEST, f"worker {worker_id}'s engine {why}") from None
        except LinkTimeout:
            raise AdmissionError(
                ErrorCode.TIMEOUT, f"worker {worker_id} did not answer {what} in time"
            ) from None
        except LinkError:
            raise _WorkerLost(ErrorCode.WORKER_FAILED, f"worker {worker_id} failed during {what}") from None


class _WorkerLost(AdmissionError):
    """WORKER_FAILED: the worker is not running, or its link failed during the exchange."""


class _Restarted(Exception):
    """The worker's process changed in the middle of a chunked input."""


class _StateLost(Exception):
    """A chunked EMBED answered ERR_UNKNOWN_HANDLE or EBUSY: the worker has not got the input
    open (a restarted incarnation), or has another one open."""


def _lost(worker_id: int) -> AdmissionError:
    return AdmissionError(
        ErrorCode.WORKER_FAILED,
        f"worker {worker_id} lost the state of a chunked embedding (it restarted); send the request again",
    )
