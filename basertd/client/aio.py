"""asyncio client of the basertd socket: many concurrent generations over one connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.codec import ClientCodec, FrameError, read_message

from ._common import (
    RESUME_RETRY_S,
    RESUME_TIMEOUT_S,
    ClientError,
    Completion,
    ConnectionLost,
    connect_unix_async,
    generate_message,
    new_request_id,
    resolve_socket,
    resumable,
)


async def _open(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream pair on a fresh connection to ``path`` (EAGAIN retried briefly)."""
    sock = await connect_unix_async(path)
    try:
        return await asyncio.open_unix_connection(sock=sock, limit=1 << 16)
    except BaseException:
        sock.close()
        raise


class _Closed:
    """Queued to every waiting stream when connection number ``conn`` ended."""

    __slots__ = ("conn",)

    def __init__(self, conn: int) -> None:
        self.conn = conn


class AsyncStream:
    """Replies of one Generate: ``async for`` yields ``api.Tokens``; ``done`` holds the
    ``api.Done`` afterwards; ``prompt_tokens``, ``seed`` and ``resume_id`` come from
    ``api.Accepted``; ``queued`` holds the latest ``api.Queued`` wait notice (None when the request
    never waited); ``received`` counts the ids yielded (plus ``after`` of a ``resume``). With
    ``resume`` and a ``resume_id`` it survives a daemon restart as ``basertd.client.Stream`` does
    (the client reconnects once for all its streams). Raises ``ClientError`` for an ``Error``
    reply, ``ConnectionLost``."""

    def __init__(
        self,
        client: AsyncClient,
        request_id: str,
        queue: asyncio.Queue,
        prompt_tokens: int,
        seed: int | None = None,
        *,
        resume_id: str = "",
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT_S,
        received: int = 0,
        wire_id: str | None = None,
    ) -> None:
        self._client = client
        self._queue = queue
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.seed = seed
        self.resume_id = resume_id
        self.resume = resume
        self.resume_timeout = resume_timeout
        self.received = received
        self.resumes = 0
        self.done: api.Done | None = None
        self.queued: api.Queued | None = None
        self._wire_id = wire_id or request_id

    async def __aiter__(self) -> AsyncIterator[api.Tokens]:
        try:
            while self.done is None:
                msg = await self._queue.get()
                conn = msg.conn if isinstance(msg, _Closed) else self._client._conn_gen
                try:
                    if isinstance(msg, _Closed):
                        raise ConnectionLost(request_id=self.request_id)
                    if isinstance(msg, api.Error):
                        raise ClientError.of(msg)
                except ClientError as exc:
                    if not (self.resume and self.resume_id and resumable(exc)) or self._client._user_closed:
                        raise
                    await self._resume(conn)
                    continue
                if isinstance(msg, api.Tokens):
                    self.received += len(msg.ids)
                    msg.request_id = self.request_id
                    yield msg
                elif isinstance(msg, api.Done):
                    msg.request_id = self.request_id
                    self.done = msg
                elif isinstance(msg, api.Queued):
                    self.queued = msg  # the latest wait notice, for the caller; never yielded
        finally:
            self._client._routes.pop(self._wire_id, None)

    async def _resume(self, conn: int) -> None:
        """Reconnect (once per lost connection, for every stream) and Resume until Accepted."""
        deadline = time.monotonic() + self.resume_timeout
        self._client._routes.pop(self._wire_id, None)
        while True:
            try:
                conn = await self._client._reconnect(conn)
                await self._client._resume(self.resume_id, self.received, self._queue)
                self._wire_id = self.resume_id
                self.resumes += 1
                return
            except (OSError, ClientError) as exc:
                if isinstance(exc, ClientError) and not resumable(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise ConnectionLost(
                        f"connection lost; could not resume within {self.resume_timeout:g} s: {exc}",
                        self.request_id,
                    ) from None
                if isinstance(exc, ClientError) and not isinstance(exc, ConnectionLost):
                    conn = self._client._conn_gen  # SHUTTING_DOWN: wait for the next daemon
                    self._client._drop(conn)
                await asyncio.sleep(RESUME_RETRY_S)

    async def cancel(self) -> None:
        """Ask the daemon to stop this generation (the stream then ends with CANCELLED)."""
        await self._client.cancel(self.request_id)


class AsyncClient:
    """asyncio client; ``await AsyncClient.connect(path)`` (None: ``$BASERTD_SOCKET`` or the
    default). One reader task routes replies by ``request_id``, so any number of generations and
    requests may run at once. ``close()`` (or ``async with``) ends it."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, socket_path: Path | None = None
    ) -> None:
        self._routes: dict[str, asyncio.Queue] = {}
        self._socket_path = socket_path
        self._user_closed = False
        self._conn_gen = 0
        self._reconnect_lock = asyncio.Lock()
        self._attach(reader, writer)

    def _attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._codec = ClientCodec("client")
        self._closed = False
        self._parting_error: api.Error | None = None
        self._conn_gen += 1
        self._task = asyncio.get_running_loop().create_task(self._read_loop(self._conn_gen))

    @classmethod
    async def connect(cls, socket_path: str | Path | None = None) -> AsyncClient:
        """Connect; raises ``OSError`` when the daemon cannot be reached (``EAGAIN``, a full listen
        queue, is first retried briefly: ``basertd.client._common.connect_unix_async``)."""
        path = resolve_socket(socket_path)
        reader, writer = await _open(path)
        return cls(reader, writer, path)

    def _drop(self, conn: int) -> None:
        """Close connection ``conn`` if it is still the current one (its streams then resume)."""
        if conn == self._conn_gen and not self._closed:
            self._closed = True
            self._writer.close()

    async def _reconnect(self, seen: int) -> int:
        """A fresh connection unless one newer than ``seen`` exists already; returns the current
        connection number. Raises OSError (the daemon is not back yet), ConnectionLost (closed)."""
        async with self._reconnect_lock:
            if self._user_closed or self._socket_path is None:
                raise ConnectionLost("the client is closed")
            if self._conn_gen != seen and not self._closed:
                return self._conn_gen
            self._drop(self._conn_gen)
            reader, writer = await _open(self._socket_path)
            self._attach(reader, writer)
            return self._conn_gen

    async def _resume(self, resume_id: str, after: int, queue: asyncio.Queue) -> api.Accepted:
        if resume_id in self._routes:
            raise ValueError(f"request id {resume_id!r} is already in use on this connection")
        self._routes[resume_id] = queue
        try:
            await self.send(api.Resume(request_id=resume_id, after=after))
            reply = await queue.get()
        except BaseException:
            self._routes.pop(resume_id, None)
            raise
        if not isinstance(reply, api.Accepted):
            self._routes.pop(resume_id, None)
            if isinstance(reply, _Closed):
                raise ConnectionLost(request_id=resume_id)
            if isinstance(reply, api.Error):
                raise ClientError.of(reply)
            raise ConnectionLost(f"expected Accepted, got {type(reply).__name__}", resume_id)
        return reply

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; pending streams end with ``ConnectionLost``."""
        self._user_closed = True
        if not self._closed:
            self._closed = True
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._fail_all(self._conn_gen)

    def _fail_all(self, conn: int) -> None:
        for q in self._routes.values():
            q.put_nowait(_Closed(conn))

    async def _read_loop(self, conn: int) -> None:
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
            if conn == self._conn_gen:  # a replaced connection's end concerns nobody
                self._closed = True
                self._fail_all(conn)

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
            raise ClientError.of(refusal)
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
        if isinstance(reply, _Closed):
            raise ConnectionLost(request_id=msg.request_id)
        if isinstance(reply, api.Error):
            raise ClientError.of(reply)
        return reply

    async def resume(
        self,
        request_id: str,
        after: int = 0,
        *,
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT_S,
    ) -> AsyncStream:
        """Pick up journaled generation ``request_id`` (an Accepted's ``resume_id``) after its
        first ``after`` tokens (see ``basertd.client.Client.resume``)."""
        q: asyncio.Queue = asyncio.Queue()
        acc = await self._resume(request_id, after, q)
        return AsyncStream(
            self,
            request_id,
            q,
            acc.prompt_tokens,
            acc.seed,
            resume_id=request_id,
            resume=resume,
            resume_timeout=resume_timeout,
            received=after,
        )

    async def stream(
        self,
        prompt: str | None = None,
        *,
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT_S,
        **params: Any,
    ) -> AsyncStream:
        """Start a Generate and return its ``AsyncStream`` once Accepted (surviving a daemon
        restart with ``resume``); ``ClientError`` when it is refused (see
        ``basertd.client.Client.stream``)."""
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
        if isinstance(reply, _Closed):
            self._routes.pop(gen.request_id, None)
            raise ConnectionLost(request_id=gen.request_id)
        if isinstance(reply, api.Error):
            self._routes.pop(gen.request_id, None)
            raise ClientError.of(reply)
        return AsyncStream(
            self,
            gen.request_id,
            q,
            reply.prompt_tokens,
            reply.seed,
            resume_id=reply.resume_id,
            resume=resume,
            resume_timeout=resume_timeout,
        )

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
