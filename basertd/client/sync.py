"""Blocking client of the basertd socket (one request at a time per connection)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.codec import ClientCodec, FrameError, FrameReader

from ._common import (
    ClientError,
    Completion,
    ConnectionLost,
    connect_unix,
    generate_message,
    new_request_id,
    resolve_socket,
)


class Stream:
    """The replies of one Generate as they arrive: iterate for ``api.Tokens`` messages; afterwards
    ``done`` holds the ``api.Done``. ``prompt_tokens`` and ``seed`` come from ``api.Accepted``;
    ``queued`` holds the latest ``api.Queued`` wait notice (None when the request never waited).
    Iteration raises ``ClientError`` for an ``Error`` reply (``CANCELLED`` after ``cancel()``) and
    ``ConnectionLost`` if the daemon goes away."""

    def __init__(self, client: Client, request_id: str, prompt_tokens: int, seed: int | None = None) -> None:
        self._client = client
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.seed = seed
        self.done: api.Done | None = None
        self.queued: api.Queued | None = None

    def __iter__(self) -> Iterator[api.Tokens]:
        while self.done is None:
            msg = self._client._recv_for(self.request_id)
            if isinstance(msg, api.Tokens):
                yield msg
            elif isinstance(msg, api.Done):
                self.done = msg
            elif isinstance(msg, api.Queued):
                self.queued = msg  # the latest wait notice, for the caller; never yielded
            elif isinstance(msg, api.Error):
                raise ClientError(msg.code, msg.message, msg.request_id)

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
        self._codec = ClientCodec("client")
        self._reader = FrameReader(self._codec)
        self._sock = connect_unix(self.socket_path, timeout)

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
                raise ClientError(refusal.code, refusal.message, refusal.request_id) from None
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
            raise ClientError(reply.code, reply.message, reply.request_id)
        return reply

    def stream(self, prompt: str | None = None, **params: Any) -> Stream:
        """Start a Generate (``prompt`` text, or ``prompt_tokens=[...]``; other fields as in
        ``api.Generate``) and return its ``Stream`` once it is Accepted. Raises ``ClientError`` for a
        refused request (EMPTY_PROMPT, CONTEXT_LENGTH_EXCEEDED, QUEUE_FULL, INVALID_REQUEST, ...)."""
        gen = generate_message(prompt, **params)
        self.send(gen)
        reply = self._recv_for(gen.request_id)
        if isinstance(reply, api.Error):
            raise ClientError(reply.code, reply.message, reply.request_id)
        if not isinstance(reply, api.Accepted):
            raise ConnectionLost(f"expected Accepted, got {type(reply).__name__}", gen.request_id)
        return Stream(self, gen.request_id, reply.prompt_tokens, reply.seed)

    def generate(self, prompt: str | None = None, **params: Any) -> Completion:
        """Run one Generate to the end and return its ``Completion``; errors as ``stream``."""
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
