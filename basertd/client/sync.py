"""Blocking client of the basertd socket (one request at a time per connection)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.codec import ClientCodec, FrameError, FrameReader

from ._common import (
    RESUME_RETRY_S,
    RESUME_TIMEOUT_S,
    ClientError,
    Completion,
    ConnectionLost,
    connect_unix,
    generate_message,
    new_request_id,
    resolve_socket,
    resumable,
)


class Stream:
    """The replies of one Generate as they arrive: iterate for ``api.Tokens`` messages; afterwards
    ``done`` holds the ``api.Done``. ``prompt_tokens``, ``seed`` and ``resume_id`` come from
    ``api.Accepted``; ``queued`` holds the latest ``api.Queued`` wait notice (None when the request
    never waited); ``received`` counts the token ids yielded (plus ``after`` of a ``resume``).

    With ``resume`` (and a ``resume_id``: the daemon journals requests) a lost connection or a
    daemon that stops (SHUTTING_DOWN) does not end the stream: the client reconnects, retrying for
    up to ``resume_timeout`` seconds, and sends ``Resume {resume_id, after=received}``; the
    stream goes on with the next token, none lost or repeated (Tokens keep ``request_id``).
    Iteration raises ``ClientError`` for an ``Error`` reply (``CANCELLED`` after ``cancel()``) and
    ``ConnectionLost`` if the daemon goes away for good (or ``resume`` is off)."""

    def __init__(
        self,
        client: Client,
        request_id: str,
        prompt_tokens: int,
        seed: int | None = None,
        *,
        resume_id: str = "",
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT_S,
        received: int = 0,
    ) -> None:
        self._client = client
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
        self._wire_id = request_id

    def __iter__(self) -> Iterator[api.Tokens]:
        while self.done is None:
            try:
                msg = self._client._recv_for(self._wire_id)
                if isinstance(msg, api.Error):
                    raise ClientError.of(msg)
            except ClientError as exc:
                if not (self.resume and self.resume_id and resumable(exc)):
                    raise
                self._resume()
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

    def _resume(self) -> None:
        """Reconnect and Resume until the daemon answers Accepted (or the deadline passes)."""
        deadline = time.monotonic() + self.resume_timeout
        while True:
            try:
                self._client._reconnect()
                self._client._resume(self.resume_id, self.received)
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
                time.sleep(RESUME_RETRY_S)

    def cancel(self) -> None:
        """Ask the daemon to stop this generation (the stream then ends with CANCELLED)."""
        self._client.cancel(self.request_id)


class Client:
    """Blocking client. ``socket_path`` None means ``$BASERTD_SOCKET`` or the default path;
    ``timeout`` (seconds, None = none) bounds every socket operation. Use as a context manager or
    call ``close()``. Raises ``OSError`` when the daemon cannot be reached (a full listen queue,
    ``EAGAIN``, is first retried briefly: ``basertd.client._common.connect_unix``)."""

    def __init__(self, socket_path: str | Path | None = None, *, timeout: float | None = None) -> None:
        self.socket_path = resolve_socket(socket_path)
        self._timeout = timeout
        self._connect()

    def _connect(self) -> None:
        self._codec = ClientCodec("client")
        self._reader = FrameReader(self._codec)
        self._sock = connect_unix(self.socket_path, self._timeout)

    def _reconnect(self) -> None:
        """A fresh connection to the same socket (the old one is closed). Raises OSError."""
        self._sock.close()
        self._connect()

    def _resume(self, resume_id: str, after: int) -> api.Accepted:
        self.send(api.Resume(request_id=resume_id, after=after))
        reply = self._recv_for(resume_id)
        if isinstance(reply, api.Error):
            raise ClientError.of(reply)
        if not isinstance(reply, api.Accepted):
            raise ConnectionLost(f"expected Accepted, got {type(reply).__name__}", resume_id)
        return reply

    def close(self) -> None:
        """Close the connection (the daemon cancels whatever it still runs for it)."""
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, msg: Any) -> None:
        """Send one request frame. Raises ``ClientError`` with the daemon's reason when it closed
        the connection with an ``Error`` first (a ``[limits]`` cap: ``queue_full``, ``timeout``),
        else ``ConnectionLost``."""
        try:
            self._sock.sendall(self._codec.encode(msg))
        except OSError as exc:
            refusal = self._parting_error()
            if refusal is not None:
                raise ClientError.of(refusal) from None
            raise ConnectionLost(f"send failed: {exc}") from None

    def _parting_error(self) -> api.Error | None:
        """An ``Error`` the daemon sent before closing the connection, if one is already here."""
        try:
            while True:
                msg = self._reader.next_message()
                if isinstance(msg, api.Error):
                    return msg
                if msg is not None:
                    continue
                data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
                if not data:
                    return None
                self._reader.feed_data(data)
        except (OSError, FrameError):
            return None

    def _recv(self) -> Any:
        while True:
            try:
                msg = self._reader.next_message()
            except FrameError as exc:
                raise ConnectionLost(f"bad frame from the daemon: {exc}") from None
            if msg is not None:
                return msg
            try:
                data = self._sock.recv(1 << 16)
            except OSError as exc:
                raise ConnectionLost(f"receive failed: {exc}") from None
            if not data:
                raise ConnectionLost()
            self._reader.feed_data(data)

    def _recv_for(self, request_id: str) -> Any:
        while True:
            msg = self._recv()
            rid = getattr(msg, "request_id", "")
            if rid == request_id or (isinstance(msg, api.Error) and not rid):
                return msg

    def request(self, msg: Any) -> Any:
        """Send ``msg`` (its ``request_id`` set if empty) and return the reply; raises
        ``ClientError`` for an ``Error`` reply."""
        if not getattr(msg, "request_id", ""):
            msg.request_id = new_request_id()
        self.send(msg)
        reply = self._recv_for(msg.request_id)
        if isinstance(reply, api.Error):
            raise ClientError.of(reply)
        return reply

    def resume(
        self,
        request_id: str,
        after: int = 0,
        *,
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT_S,
    ) -> Stream:
        """Pick up journaled generation ``request_id`` (an Accepted's ``resume_id``) with the
        tokens after the first ``after``: a ``Stream`` of the rest, then Done. Raises
        ``ClientError`` (NOT_FOUND: unknown or expired; INVALID_REQUEST: ``after`` past its end;
        SHUTTING_DOWN: the daemon is stopping, resume after its restart)."""
        acc = self._resume(request_id, after)
        s = Stream(
            self,
            request_id,
            acc.prompt_tokens,
            acc.seed,
            resume_id=request_id,
            resume=resume,
            resume_timeout=resume_timeout,
            received=after,
        )
        s._wire_id = request_id
        return s

    def stream(
        self,
        prompt: str | None = None,
        *,
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT_S,
        **params: Any,
    ) -> Stream:
        """Start a Generate (``prompt`` text, or ``prompt_tokens=[...]``; other fields as in
        ``api.Generate``) and return its ``Stream`` once it is Accepted. With ``resume`` the stream
        survives a daemon restart (``Stream``). Raises ``ClientError`` for a refused request
        (EMPTY_PROMPT, CONTEXT_LENGTH_EXCEEDED, QUEUE_FULL, INVALID_REQUEST, ...)."""
        gen = generate_message(prompt, **params)
        self.send(gen)
        reply = self._recv_for(gen.request_id)
        if isinstance(reply, api.Error):
            raise ClientError.of(reply)
        if not isinstance(reply, api.Accepted):
            raise ConnectionLost(f"expected Accepted, got {type(reply).__name__}", gen.request_id)
        return Stream(
            self,
            gen.request_id,
            reply.prompt_tokens,
            reply.seed,
            resume_id=reply.resume_id,
            resume=resume,
            resume_timeout=resume_timeout,
        )

    def generate(self, prompt: str | None = None, **params: Any) -> Completion:
        """Run one Generate to the end and return its ``Completion`` (resuming across a daemon
        restart unless ``resume=False``); errors as ``stream``."""
        s = self.stream(prompt, **params)
        out = Completion(request_id=s.request_id, seed=s.seed)
        texts = []
        for t in s:
            out.ids.extend(t.ids)
            texts.append(t.text)
        assert s.done is not None
        out.text = "".join(texts)
        out.finish_reason = s.done.finish_reason
        out.usage = s.done.usage
        out.timings = s.done.timings
        return out

    def cancel(self, request_id: str) -> None:
        """Send Cancel for ``request_id`` (no reply; the generation ends with CANCELLED)."""
        self.send(api.Cancel(request_id=request_id))

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` with the served model's vocabulary."""
        return self.request(api.Tokenize(text=text, add_special=add_special)).tokens

    def health(self) -> api.HealthResult:
        """Liveness and readiness."""
        return self.request(api.Health())

    def models(self) -> api.ModelsResult:
        """The served models."""
        return self.request(api.Models())

    def status(self) -> control.StatusResult:
        """The daemon summary (control API)."""
        return self.request(control.Status())
