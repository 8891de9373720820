"""The outputs of one admitted request for a transport that consumes them as an async iterator
(HTTP): ``QueueSink`` queues the replies the scheduler sends, ``GenerationStream`` yields them in
order and cancels the request when the consumer leaves before its end (``Frontend.stream``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from basertd.schema import client as api

if TYPE_CHECKING:
    from basertd.server.frontend.admission import Frontend
    from basertd.server.request.record import GenerationRequest


class QueueSink:
    """A ``RequestSink`` that queues replies for a ``GenerationStream`` (never blocks: replies of
    one request are bounded by its max_tokens)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def send(self, msg: object) -> None:
        if not self._closed:
            self.queue.put_nowait(msg)


class GenerationStream:
    """The outputs of one admitted request as an async iterator of ``Tokens`` (and ``Queued``
    notices), ending after ``Done`` or ``Error`` (both yielded). ``accepted`` is the Accepted
    reply. ``aclose()`` (or leaving ``async with``) before the end cancels the request."""

    def __init__(
        self, frontend: Frontend, request: GenerationRequest, sink: QueueSink, accepted: Any
    ) -> None:
        self.frontend = frontend
        self.request = request
        self.accepted = accepted
        self._sink = sink
        self._ended = False
        self._front: list[Any] = []

    def push_front(self, msg: Any) -> None:
        """Yield ``msg`` before anything queued."""
        self._front.append(msg)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while not self._ended:
            msg = self._front.pop(0) if self._front else await self._sink.queue.get()
            if isinstance(msg, (api.Done, api.Error)):
                self._ended = True
            yield msg

    def pending(self) -> list[Any]:
        """Replies already queued, taken without waiting (in order)."""
        out, self._front = self._front, []
        while not self._sink.queue.empty():
            msg = self._sink.queue.get_nowait()
            if isinstance(msg, (api.Done, api.Error)):
                self._ended = True
            out.append(msg)
        return out

    async def aclose(self, message: str = "client disconnected") -> None:
        """Stop consuming: a request that has not ended is cancelled."""
        if not self._ended:
            self._ended = True
            self.frontend.cancel(self.request, message=message)
        self._sink.close()

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
