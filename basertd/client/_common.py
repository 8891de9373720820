"""What the sync and asyncio clients share: errors, the Completion record, request building, and
connecting (a connect refused with ``EAGAIN`` because the daemon's listen queue is momentarily
full is retried with a short, bounded backoff)."""

from __future__ import annotations

import asyncio
import errno
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from basertd.schema import client as api
from basertd.schema.client import ErrorCode


class ClientError(Exception):
    """The daemon answered ``Error``: ``code`` (an ``ErrorCode``), ``message``, ``request_id``, and
    ``param``, the request field refused (None when the refusal is not about one field)."""

    def __init__(
        self, code: ErrorCode | str, message: str = "", request_id: str = "", param: str | None = None
    ) -> None:
        try:
            code = ErrorCode(code)
        except ValueError:
            pass
        self.code = code
        self.message = message
        self.request_id = request_id
        self.param = param
        super().__init__(f"{code}: {message}" if message else str(code))

    @classmethod
    def of(cls, frame: api.Error) -> ClientError:
        """The error an ``Error`` frame reports."""
        return cls(frame.code, frame.message, frame.request_id, frame.param)


class ConnectionLost(ClientError):
    """The connection to the daemon closed before the answer was complete (code INTERNAL)."""

    def __init__(self, message: str = "connection to basertd lost", request_id: str = "") -> None:
        super().__init__(ErrorCode.INTERNAL, message, request_id)


@dataclass
class Completion:
    """A whole generation: the text and token ids delivered, the finish reason ("stop", "length",
    "eos"), usage (prompt / cached / completion tokens), timings (seconds, tokens/s) and the
    sampling seed in effect (reuse it to reproduce a sampled generation)."""

    request_id: str
    seed: int | None = None
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: api.Usage = field(default_factory=api.Usage)
    timings: api.Timings = field(default_factory=api.Timings)


RESUME_TIMEOUT_S = 60.0
"""Default bound (seconds) on reconnecting and resuming a stream across a daemon restart."""
RESUME_RETRY_S = 0.1
"""Pause between reconnect attempts while the daemon restarts (seconds)."""


def resumable(exc: ClientError) -> bool:
    """True for what a stream with a ``resume_id`` survives by reconnecting: the connection
    lost, or the daemon stopping (it hands its journaled requests over to its next start)."""
    return isinstance(exc, ConnectionLost) or exc.code == ErrorCode.SHUTTING_DOWN


def new_request_id() -> str:
    """A fresh random request id."""
    return uuid.uuid4().hex


def generate_message(
    prompt: str | None = None,
    *,
    prompt_tokens: list[int] | None = None,
    request_id: str | None = None,
    **params: Any,
) -> api.Generate:
    """A ``Generate`` for ``prompt`` (text) or ``prompt_tokens`` (ids); ``params`` are its other
    fields (max_tokens, temperature, seed, stop, qos, ...). Raises TypeError for an unknown field."""
    return api.Generate(
        request_id=request_id or new_request_id(), prompt=prompt, prompt_tokens=prompt_tokens, **params
    )


def resolve_socket(path: str | Path | None) -> Path:
    """``path``, or the default socket (``$BASERTD_SOCKET``, then the runtime directory's)."""
    if path is not None:
        return Path(path)
    from basertd.server.paths import default_socket_path

    return default_socket_path()


CONNECT_RETRY_S = 2.0
"""Seconds a connect keeps retrying ``EAGAIN`` (the daemon's listen queue is full) before it fails."""
_BACKOFF_FIRST_S = 0.001
_BACKOFF_MAX_S = 0.05


def _full_queue(exc: OSError) -> bool:
    return exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def connect_unix(path: Path, timeout: float | None) -> socket.socket:
    """A ``SOCK_STREAM`` socket connected to ``path`` with ``timeout`` (seconds, None: blocking)
    set. ``EAGAIN`` (the listen queue is full; a socket with a timeout does not wait for room) is
    retried with a backoff from 1 ms doubling to 50 ms, for at most ``CONNECT_RETRY_S`` seconds (or
    ``timeout`` when shorter). Raises ``OSError`` (ENOENT, ECONNREFUSED, EACCES, EAGAIN, ...)."""
    budget = CONNECT_RETRY_S if timeout is None else min(CONNECT_RETRY_S, timeout)
    deadline = time.monotonic() + budget
    delay = _BACKOFF_FIRST_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            return sock
        except OSError as exc:
            sock.close()
            if not _full_queue(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, _BACKOFF_MAX_S)


async def connect_unix_async(path: Path) -> socket.socket:
    """``connect_unix`` for asyncio: a non-blocking socket connected to ``path``, ``EAGAIN`` retried
    as there (the backoff awaits, never blocks the loop). asyncio's own ``sock_connect`` would take
    ``EAGAIN`` of a Unix socket for a connect in progress, so the connect is made here."""
    deadline = time.monotonic() + CONNECT_RETRY_S
    delay = _BACKOFF_FIRST_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(path))
            return sock
        except OSError as exc:
            sock.close()
            if not _full_queue(exc) or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, _BACKOFF_MAX_S)
