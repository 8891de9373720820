"""Connection bounds of the HTTP listeners, the twins of the native socket's ``[limits]``
(``basertd.server.transport.conn_limits``), configured in ``[http]`` (``HttpConfig``).

aiohttp parses and answers requests; this module wraps each of its connections (``Gate``, an
``asyncio.Protocol`` in front of aiohttp's ``RequestHandler``, made by ``Door.factory`` for every
listener) and bounds what a client can hold:

- **Caps.** ``max_connections`` open connections in all and ``max_connections_per_peer`` per peer
  (the remote IP on TCP, the uid from ``SO_PEERCRED`` on a Unix socket). A connection over a cap is
  answered at once, before it sends anything — 503 over the total cap, 429 over the peer cap, each
  with ``Retry-After`` and ``Connection: close`` — and closed when it has sent its request (or
  after ``REFUSE_LINGER_S``); aiohttp never sees it.
- **Deadlines.** A request head must be complete ``header_timeout_s`` after its first byte (else
  408 and the connection closes); a connection with no request in progress that sends nothing for
  ``idle_timeout_s`` is closed (a fresh one included); the body deadline (``body_timeout_s``) is
  applied where bodies are read (``body.read``, 408) and counted here.
- **Readers that never read.** Each transport queues at most ``write_buffer_bytes`` of replies
  before aiohttp's writer waits (``set_write_buffer_limits`` + ``drain``), and the socket's kernel
  send buffer is set to the same size (``SO_SNDBUF``, which the kernel doubles), so a connection
  holds about three times ``write_buffer_bytes`` of replies at most. When replies stay over that
  mark for ``write_timeout_s`` (the transport paused for writing that long), the connection is
  aborted: aiohttp cancels its handler (``handler_cancellation``), which closes the handler's
  streams, so the requests are cancelled and their lanes retire in the next plan. Until then the
  replies a stream produced wait in its reply queue (behind ``port.StreamPort``): bounded by the
  write timeout times the token rate.

Every bound broken is logged (``http_connection_dropped``) and counted in
``basertd_connections_dropped_total{reason}`` with one of ``REASONS``. ``Door.fit_fd_limit``
sizes the total cap to the process's descriptor limit, so the cap, never EMFILE, refuses a flood.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
from collections import Counter
from collections.abc import Callable
from enum import Enum
from typing import Any

import structlog
from aiohttp import web

from basertd.server.config_sections import HttpConfig
from basertd.server.observe.metrics import NULL_METRICS, Metrics
from basertd.server.transport.http.errors import HttpError
from basertd.server.transport.peercred import peer_credentials

log = structlog.get_logger("basertd.http")

REFUSE_LINGER_S = 1.0
"""Seconds a refused connection is kept at most, so its client reads the refusal rather than a
reset; it is closed earlier once its client half-closes or, having sent something, stays quiet for
``REFUSE_QUIET_S``."""
REFUSE_QUIET_S = 0.05
MAX_LINGERING = 64
"""Refused connections kept lingering at once; beyond, a refusal is written and closed at once, so
a flood of connects holds at most this many descriptors past the caps."""
SPARE_FDS = 256
"""Descriptors left for everything but client connections (workers, the journal, the native
socket's own spare) when the HTTP cap is fitted to RLIMIT_NOFILE."""

REASONS = (
    "http_total_cap",
    "http_peer_cap",
    "http_header_timeout",
    "http_body_timeout",
    "http_idle_timeout",
    "http_write_timeout",
)
"""Labels of ``basertd_connections_dropped_total`` for the HTTP listeners."""


class Phase(Enum):
    """Where a connection is: waiting for a request (``IDLE``), receiving a request head
    (``HEAD``), or with a request in progress (``REQUEST``: from the end of its head to the end of
    its handler)."""

    IDLE = "idle"
    HEAD = "head"
    REQUEST = "request"


def refusal_bytes(err: HttpError) -> bytes:
    """A whole HTTP/1.1 response carrying ``err`` (OpenAI's error object), closing the connection."""
    body = err.encode()
    reason = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}.get(
        err.status, "Error"
    )
    head = [f"HTTP/1.1 {err.status} {reason}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in err.headers.items()]
    head += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(head).encode("latin-1") + body


def peer_of(transport: asyncio.BaseTransport) -> str:
    """The key the peer cap counts: ``ip:<address>`` on TCP, ``uid:<uid>`` on a Unix socket."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        return f"uid:{peer_credentials(sock).uid}"
    peer = transport.get_extra_info("peername")
    return f"ip:{peer[0]}" if isinstance(peer, tuple) and peer else "ip:?"


class Door:
    """The bounds of every HTTP listener of one server (module docstring). ``factory(server)``:
    the protocol factory a listener is created with (``server``: aiohttp's ``web.Server``, called
    once per admitted connection). ``open`` / ``by_peer``: connections counted now."""

    def __init__(self, config: HttpConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or NULL_METRICS
        self.max_connections = config.max_connections
        self.open = 0
        self.by_peer: Counter[str] = Counter()
        self.lingering = 0

    def fit_fd_limit(self, native_connections: int) -> int:
        """Raise the soft RLIMIT_NOFILE towards ``native_connections`` + ``max_connections`` +
        ``SPARE_FDS`` (never above the hard limit); where it cannot reach that, lower this door's
        total cap to half the descriptors left after ``SPARE_FDS`` (at least 1) and log
        ``fd_limit_low``. Returns the total cap in force."""
        wanted = native_connections + self.config.max_connections + SPARE_FDS
        with contextlib.suppress(ValueError, OSError):
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft != resource.RLIM_INFINITY and soft < wanted:
                target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
                if target > soft:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                    soft = target
            if soft != resource.RLIM_INFINITY and soft < wanted:
                self.max_connections = max(1, min(self.config.max_connections, (soft - SPARE_FDS) // 2))
                log.warning(
                    "fd_limit_low",
                    nofile=soft,
                    wanted=wanted,
                    http_max_connections=self.max_connections,
                    hint="raise LimitNOFILE= (systemd) or ulimit -n, or lower the max_connections keys",
                )
        return self.max_connections

    def factory(self, server: Callable[[], Any]) -> Callable[[], Gate]:
        """The protocol factory of one listener serving aiohttp's ``server``."""
        return lambda: Gate(self, server)

    def admit(self, peer: str) -> HttpError | None:
        """Count a new connection of ``peer``; the refusal (503 or 429) instead when it would
        break a cap (nothing counted then)."""
        if self.open >= self.max_connections:
            return HttpError(
                503,
                f"too many HTTP connections: {self.open} open, "
                f"http.max_connections is {self.max_connections}",
                code="http_total_cap",
            )
        if self.by_peer[peer] >= self.config.max_connections_per_peer:
            return HttpError(
                429,
                f"too many HTTP connections from this peer: {self.by_peer[peer]} open, "
                f"http.max_connections_per_peer is {self.config.max_connections_per_peer}",
                code="http_peer_cap",
            )
        self.open += 1
        self.by_peer[peer] += 1
        self.metrics.http_connections_open.set(self.open)
        return None

    def leave(self, peer: str) -> None:
        """Uncount a connection ``admit`` counted."""
        self.open -= 1
        self.metrics.http_connections_open.set(self.open)
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]

    def dropped(self, reason: str, peer: str, message: str) -> None:
        """Log and count one bound broken (``reason``: one of ``REASONS``)."""
        log.info("http_connection_dropped", reason=reason, peer=peer, error=message)
        self.metrics.connection_dropped(reason)


class Gate(asyncio.Protocol):
    """One HTTP connection in front of aiohttp's handler (module docstring). The door's
    middleware calls ``request_started`` / ``request_ended`` around each request's handler."""

    def __init__(self, door: Door, server: Callable[[], Any]) -> None:
        self.door = door
        self.server = server
        self.inner: Any = None  # aiohttp's RequestHandler, once admitted
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.phase = Phase.IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused_at = 0.0
        self._lingering = False

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = peer_of(transport)
        refusal = self.door.admit(self.peer)
        if refusal is not None:
            self._refuse(refusal)
            return
        limit = self.door.config.write_buffer_bytes
        self.transport.set_write_buffer_limits(high=limit)  # type: ignore[union-attr]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # the kernel's share of the bound (no autotuning past it)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)
        self.inner = self.server()
        self.inner.connection_made(transport)
        self._arm(Phase.IDLE)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            self._refused_data()
            return
        self.inner.data_received(data)
        if self.phase is Phase.IDLE and not self._request_pending():
            self._arm(Phase.HEAD)

    def eof_received(self) -> bool | None:
        if self.inner is None:
            return False  # refused: the transport closes
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._lingering:
            self._lingering = False
            self.door.lingering -= 1
        if self.inner is None:
            return
        self.door.leave(self.peer)
        inner, self.inner = self.inner, None
        inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is None:
            return
        self.inner.pause_writing()
        if self._write_timer is None:
            loop = asyncio.get_running_loop()
            self._write_timer = loop.call_later(self.door.config.write_timeout_s, self._write_expired)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self.inner is not None:
            self.inner.resume_writing()

    # --- requests (the door's middleware) ------------------------------------------------------

    def request_started(self) -> None:
        """A request's head is complete and its handler starts: no head or idle deadline runs."""
        self._arm(Phase.REQUEST)

    def request_ended(self) -> None:
        """The request's handler returned: the idle deadline runs again."""
        if self.inner is not None:
            self._arm(Phase.IDLE)

    # --- deadlines -----------------------------------------------------------------------------

    def _request_pending(self) -> bool:
        """aiohttp has a complete head queued or a handler running (the middleware has not yet
        been told, or a pipelined request waits)."""
        inner = self.inner
        return bool(getattr(inner, "_messages", None)) or bool(getattr(inner, "_request_in_progress", False))

    def _arm(self, phase: Phase) -> None:
        self.phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        cfg = self.door.config
        delay = {Phase.IDLE: cfg.idle_timeout_s, Phase.HEAD: cfg.header_timeout_s}.get(phase)
        if delay is not None:
            self._timer = asyncio.get_running_loop().call_later(delay, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.inner is None or self.transport is None:
            return
        if self._request_pending():
            self.phase = Phase.REQUEST
            return
        cfg = self.door.config
        if self.phase is Phase.HEAD:
            message = f"request head incomplete after http.header_timeout_s ({cfg.header_timeout_s:g} s)"
            self.door.dropped("http_header_timeout", self.peer, message)
            self.transport.write(refusal_bytes(HttpError(408, message, code="header_timeout")))
            self.transport.close()
        elif self.phase is Phase.IDLE:
            message = f"connection idle for http.idle_timeout_s ({cfg.idle_timeout_s:g} s)"
            self.door.dropped("http_idle_timeout", self.peer, message)
            self.transport.close()

    def _write_expired(self) -> None:
        self._write_timer = None
        if self.inner is None or self.transport is None:
            return
        cfg = self.door.config
        message = (
            f"replies unread for http.write_timeout_s ({cfg.write_timeout_s:g} s) with "
            f"{self.transport.get_write_buffer_size()} bytes queued: connection closed, requests cancelled"
        )
        self.door.dropped("http_write_timeout", self.peer, message)
        self.transport.abort()  # connection_lost: aiohttp cancels the handler, which closes its streams

    def _cancel_timers(self) -> None:
        for timer in (self._timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._write_timer = None

    # --- refused connections -------------------------------------------------------------------

    def _refuse(self, err: HttpError) -> None:
        assert self.transport is not None
        self.door.dropped(err.code or "", self.peer, err.message)
        self.transport.write(refusal_bytes(err))
        if self.door.lingering >= MAX_LINGERING:
            self.transport.close()
            return
        self.door.lingering += 1
        self._lingering = True
        loop = asyncio.get_running_loop()
        self._refused_at = loop.time()
        self._timer = loop.call_later(REFUSE_LINGER_S, self.transport.close)

    def _refused_data(self) -> None:
        """A refused client sent (part of) its request: discard it, close once it is quiet."""
        if self.transport is None:
            return
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        close_at = min(loop.time() + REFUSE_QUIET_S, self._refused_at + REFUSE_LINGER_S)
        self._timer = loop.call_at(close_at, self.transport.close)


def gate_of(request: web.BaseRequest) -> Gate | None:
    """The ``Gate`` ``request`` came through (None for a connection not made by a ``Door``)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, Gate) else None


def door_middleware(door: Door) -> Any:
    """The aiohttp middleware telling each request's ``Gate`` when its handler starts and ends
    (the head and idle deadlines stop and restart), and counting a body that missed its deadline
    (a 408 from ``body.read``; the connection then closes)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        gate = gate_of(request)
        if gate is None:
            return await handler(request)
        gate.request_started()
        try:
            resp = await handler(request)
        finally:
            gate.request_ended()
        if resp.status == 408:
            door.dropped(
                "http_body_timeout",
                gate.peer,
                f"request body incomplete after {door.config.body_timeout_s:g} s",
            )
            resp.force_close()
        return resp

    return middleware


class DoorRunner(web.AppRunner):
    """aiohttp's ``AppRunner`` whose listeners make their connections through ``door``
    (``Door.factory`` around aiohttp's ``web.Server``)."""

    def __init__(self, app: web.Application, door: Door, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.door = door

    @property
    def server(self) -> Any:  # what every site passes to ``loop.create_server``
        server = self._server
        return None if server is None else self.door.factory(server)
