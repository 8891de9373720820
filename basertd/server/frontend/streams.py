"""The outputs of one admitted request for a transport that consumes them as an async iterator
(HTTP): ``QueueSink`` queues the replies the scheduler sends, ``GenerationStream`` yields them in
order and cancels the request when the consumer leaves before its end (``Frontend.stream``);
``ResumedStream`` yields those of a resumed request (``Frontend.follow``). Both are the
``StreamPort`` of ``basertd.server.transport.http.port``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from basertd.schema import client as api

if TYPE_CHECKING:
    from basertd.server.request.record import GenerationRequest


class Canceller(Protocol):
    """What a stream needs of the front end (``admission.Frontend``): ending its request."""

    def cancel(self, req: GenerationRequest, *, message: str = ...) -> None: ...


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
        self, frontend: Canceller, request: GenerationRequest, sink: QueueSink, accepted: Any
    ) -> None:
        self.frontend = frontend
        self.request = request
        self.accepted = accepted
        self._sink = sink
        self._ended = False
        self._front: list[Any] = []

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        """True once the request ended."""
        return self.request.finished

    @property
    def followed(self) -> bool:
        """True while a resumed stream still follows the request (an open subscriber of its
        durable sink)."""
        subscribers = getattr(self.request.sink, "subscribers", None) or []
        return any(not s.closed for s in subscribers)

    def piece(self, token_id: int) -> bytes:
        """``token_id``'s bytes in the vocabulary of the worker serving the request."""
        return self.request.tokenizer.piece(token_id)

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


class ResumedStream:
    """The replies of a resumed request as an async iterator (like ``GenerationStream``): Tokens
    after the client's count, then the live ones, ending after Done or Error. ``accepted`` is its
    Accepted; ``piece`` is the vocabulary lookup of its tokens; ``context`` is what the transport
    journaled with the request to shape the rest ({} when nothing). ``aclose()`` stops following
    (the request itself runs on)."""

    def __init__(
        self,
        sink: QueueSink,
        accepted: api.Accepted,
        piece: Callable[[int], bytes],
        context: dict[str, Any] | None = None,
    ) -> None:
        self._sink = sink
        self.accepted = accepted
        self._piece = piece
        self.context: dict[str, Any] = dict(context or {})
        self._ended = False

    @property
    def request_id(self) -> str:
        return self.accepted.request_id

    @property
    def finished(self) -> bool:
        return self._ended

    @property
    def followed(self) -> bool:
        return False

    def piece(self, token_id: int) -> bytes:
        return self._piece(token_id)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while not self._ended:
            msg = await self._sink.queue.get()
            if isinstance(msg, (api.Done, api.Error)):
                self._ended = True
            yield msg

    async def aclose(self) -> None:
        self._ended = True
        self._sink.close()

    async def __aenter__(self) -> ResumedStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
