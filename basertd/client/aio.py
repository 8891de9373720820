"""asyncio client of the basertd socket: many concurrent generations over one connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.codec import ClientCodec, FrameError, read_message

from ._common import (
    ClientError,
    Completion,
    ConnectionLost,
    connect_unix_async,
    generate_message,
    new_request_id,
    resolve_socket,
)

_CLOSED = object()


class AsyncStream:
    """Replies of one Generate: ``async for`` yields ``api.Tokens``; ``done`` holds the
    ``api.Done`` afterwards; ``prompt_tokens`` and ``seed`` come from ``api.Accepted``; ``queued``
    holds the latest ``api.Queued`` wait notice (None when the request never waited). Raises
    ``ClientError`` for an ``Error`` reply, ``ConnectionLost``."""

    def __init__(
        self,
        client: AsyncClient,
        request_id: str,
        queue: asyncio.Queue,
        prompt_tokens: int,
        seed: int | None = None,
    ) -> None:
        self._client = client
        self._queue = queue
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.seed = seed
        self.done: api.Done | None = None
        self.queued: api.Queued | None = None

    async def __aiter__(self) -> AsyncIterator[api.Tokens]:
        try:
            while self.done is None:
                msg = await self._queue.get()
                if msg is _CLOSED:
                    raise ConnectionLost(request_id=self.request_id)
                if isinstance(msg, api.Tokens):
                    yield msg
                elif isinstance(msg, api.Done):
                    self.done = msg
                elif isinstance(msg, api.Queued):
                    self.queued = msg  # the latest wait notice, for the caller; never yielded
                elif isinstance(msg, api.Error):
                    raise ClientError(msg.code, msg.message, msg.request_id)
        finally:
            self._client._routes.pop(self.request_id, None)

    async def cancel(self) -> None:
        """Ask the daemon to stop this generation (the stream then ends with CANCELLED)."""
        await self._client.cancel(self.request_id)


class AsyncClient:
    """asyncio client; ``await AsyncClient.connect(path)`` (None: ``$BASERTD_SOCKET`` or the
    default). One reader task routes replies by ``request_id``, so any number of generations and
    requests may run at once. ``close()`` (or ``async with``) ends it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._codec = ClientCodec("client")
        self._routes: dict[str, asyncio.Queue] = {}
        self._closed = False
        self._parting_error: api.Error | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, socket_path: str | Path | None = None) -> AsyncClient:
        """Connect; raises ``OSError`` when the daemon cannot be reached (``EAGAIN``, a full listen
        queue, is first retried briefly: ``basertd.client._common.connect_unix_async``)."""
        sock = await connect_unix_async(resolve_socket(socket_path))
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 16)
        except BaseException:
            sock.close()
            raise
        return cls(reader, writer)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; pending streams end with ``ConnectionLost``."""
        if not self._closed:
            self._closed = True
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._fail_all()

    def _fail_all(self) -> None:
        for q in self._routes.values():
            q.put_nowait(_CLOSED)

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    msg = await read_message(self._reader, self._codec)
                except (FrameError, OSError):
                    break
                if msg is None:
                    break
                rid = getattr(msg, "request_id", "")
                if not rid and isinstance(msg, api.Error):  # a protocol error: everything is lost
                    self._parting_error = msg  # or a [limits] cap, the reason the daemon closes
                    for q in self._routes.values():
                        q.put_nowait(msg)
                    continue
                q = self._routes.get(rid)
                if q is not None:
                    q.put_nowait(msg)
        finally:
            self._closed = True
            self._fail_all()

    async def send(self, msg: Any) -> None:
        """Send one request frame; raises ``ConnectionLost`` when the connection is closed, or
        ``ClientError`` with the daemon's reason when it closed it with an ``Error``."""
        if not self._closed:
            try:
                self._writer.write(self._codec.encode(msg))
                await self._writer.drain()
                return
            except OSError as exc:
                lost = ConnectionLost(f"send failed: {exc}")
        else:
            lost = ConnectionLost()
        refusal = self._parting_error
        if refusal is not None:  # the daemon said why it closed (a [limits] cap)
            raise ClientError(refusal.code, refusal.message, refusal.request_id)
        raise lost

    async def request(self, msg: Any) -> Any:
        """Send ``msg`` (``request_id`` set if empty) and await its reply; ``ClientError`` for Error."""
        if not getattr(msg, "request_id", ""):
            msg.request_id = new_request_id()
        q: asyncio.Queue = asyncio.Queue()
        self._routes[msg.request_id] = q
        try:
            await self.send(msg)
            reply = await q.get()
        finally:
            self._routes.pop(msg.request_id, None)
        if reply is _CLOSED:
            raise ConnectionLost(request_id=msg.request_id)
        if isinstance(reply, api.Error):
            raise ClientError(reply.code, reply.message, reply.request_id)
        return reply

    async def stream(self, prompt: str | None = None, **params: Any) -> AsyncStream:
        """Start a Generate and return its ``AsyncStream`` once Accepted; ``ClientError`` when it
        is refused (see ``basertd.client.Client.stream``)."""
        gen = generate_message(prompt, **params)
        q: asyncio.Queue = asyncio.Queue()
        if gen.request_id in self._routes:
            raise ValueError(f"request id {gen.request_id!r} is already in use on this connection")
        self._routes[gen.request_id] = q
        try:
            await self.send(gen)
            reply = await q.get()
        except BaseException:
            self._routes.pop(gen.request_id, None)
            raise
        if reply is _CLOSED:
            self._routes.pop(gen.request_id, None)
            raise ConnectionLost(request_id=gen.request_id)
        if isinstance(reply, api.Error):
            self._routes.pop(gen.request_id, None)
            raise ClientError(reply.code, reply.message, reply.request_id)
        return AsyncStream(self, gen.request_id, q, reply.prompt_tokens, reply.seed)

    async def generate(self, prompt: str | None = None, **params: Any) -> Completion:
        """Run one Generate to the end; errors as ``stream``."""
        s = await self.stream(prompt, **params)
        out = Completion(request_id=s.request_id, seed=s.seed)
        texts = []
        async for t in s:
            out.ids.extend(t.ids)
            texts.append(t.text)
        assert s.done is not None
        out.text = "".join(texts)
        out.finish_reason = s.done.finish_reason
        out.usage = s.done.usage
        out.timings = s.done.timings
        return out

    async def cancel(self, request_id: str) -> None:
        """Send Cancel for ``request_id``."""
        await self.send(api.Cancel(request_id=request_id))

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``."""
        return (await self.request(api.Tokenize(text=text, add_special=add_special))).tokens

    async def health(self) -> api.HealthResult:
        """Liveness and readiness."""
        return await self.request(api.Health())

    async def status(self) -> control.StatusResult:
        """The daemon summary (control API)."""
        return await self.request(control.Status())
