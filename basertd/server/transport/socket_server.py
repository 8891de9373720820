"""The client socket: length-prefixed msgspec frames over a Unix socket (DESIGN.md "Client API").

``ApiServer`` listens on the configured path with the configured mode and runs one
``ClientConnection`` per client on the daemon's event loop. A connection reads requests with
``conn_limits.read_frame`` and hands each to the ``Service`` (the native API), which answers
through the connection's ``send``. Replies of several generations on one connection interleave, each tagged
with its ``request_id``.

Failure rules: a frame that does not decode (``FrameError``) is answered with
``Error(PROTOCOL_ERROR)`` and closes that connection only; a client that disconnects, or reads so
slowly that ``max_buffered_bytes`` of replies pile up, has its connection closed and every one of
its generations cancelled (lanes retired in the next plan, queued requests never start). The
socket file is removed when the server stops.

Resource caps (``[limits]``, ``basertd.server.config_sections.LimitsConfig``; the reading rules are in
``basertd.server.transport.conn_limits``): connections in all and per peer uid, bytes of half-received
request frames over all connections, a frame timeout and an idle timeout. A connection over a cap
gets ``Error(queue_full)``, one that times out ``Error(timeout)``; either is then closed, counted
in ``basertd_connections_dropped_total{reason}``, and what it held is released. Accepts that fail
for want of descriptors are logged once per burst (``accept_errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import stat
from pathlib import Path
from typing import Any, Protocol

import structlog

from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.schema.codec import ClientCodec, FrameError
from basertd.server.config_sections import LimitsConfig
from basertd.server.observe.metrics import NULL_METRICS, Metrics
from basertd.server.transport import accept_errors
from basertd.server.transport.conn_limits import BufferBudget, ConnectionCaps, ConnectionDropped, read_frame
from basertd.server.transport.peercred import peer_credentials

log = structlog.get_logger("basertd.api")

MAX_BUFFERED_BYTES = LimitsConfig().max_reply_buffer_bytes
"""Replies (bytes) allowed to wait in one connection's send buffer before the client is dropped
(the default of ``limits.max_reply_buffer_bytes``)."""
SPARE_FDS = 256
"""Descriptors kept for everything but client connections when raising RLIMIT_NOFILE."""


class Service(Protocol):
    """What the API server needs of the daemon. ``handle`` answers one decoded request through
    ``conn.send`` (it may keep ``conn`` for later replies); ``connection_lost`` cancels what a gone
    client still had running. Neither may raise."""

    async def handle(self, conn: ClientConnection, msg: Any) -> None: ...

    def connection_lost(self, conn: ClientConnection) -> None: ...


class ClientConnection:
    """One client. ``send(msg)`` queues one reply frame without blocking (a no-op once closed);
    ``closed`` turns True when the client went away or was dropped; ``generations`` maps the
    client's live ``request_id`` to the daemon's request object; ``credentials`` is the kernel's
    record of the peer (``basertd.server.transport.peercred.PeerCredentials``: SO_PEERCRED and
    SO_PEERGROUPS) and ``peer`` its (pid, uid, gid).

    ``limits`` (default: every ``[limits]`` default) and ``budget`` (the server's shared
    ``BufferBudget``; default: a private one of ``limits.max_request_buffer_bytes``) bound its
    reading (``basertd.server.transport.conn_limits.read_frame``); ``drop_reason`` names the cap that closed
    it (None when the client left or broke the framing)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        codec: ClientCodec,
        *,
        limits: LimitsConfig | None = None,
        budget: BufferBudget | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._codec = codec
        self._closed = False
        self.generations: dict[str, Any] = {}
        self.credentials = peer_credentials(writer.get_extra_info("socket"))
        self.peer = (self.credentials.pid, self.credentials.uid, self.credentials.gid)
        self.limits = limits or LimitsConfig()
        self.budget = budget or BufferBudget(self.limits.max_request_buffer_bytes)
        self.max_buffered_bytes = self.limits.max_reply_buffer_bytes
        self.drop_reason: str | None = None

    @property
    def closed(self) -> bool:
        """True once the connection is closed (by either side)."""
        return self._closed

    def send(self, msg: Any) -> None:
        """Queue ``msg`` (a client-API or control reply) as one frame. Never blocks or raises; a
        client that lets more than ``max_buffered_bytes`` pile up is dropped."""
        if self._closed:
            return
        if self._writer.transport.is_closing():  # the client went away; the reader reports it
            self._closed = True
            return
        try:
            frame = self._codec.encode(msg)
        except FrameError as exc:  # a reply we cannot encode is our bug; the client gets a typed error
            log.error("reply_encode_failed", error=str(exc))
            frame = self._codec.encode(
                api.Error(
                    code=ErrorCode.INTERNAL,
                    request_id=getattr(msg, "request_id", ""),
                    message="reply too large",
                )
            )
        self._writer.write(frame)
        transport = self._writer.transport
        if transport.get_write_buffer_size() > self.max_buffered_bytes:
            log.warning("client_too_slow", buffered=transport.get_write_buffer_size())
            self.drop_reason = "slow_reader"
            self.close()

    def close(self) -> None:
        """Close the connection (idempotent); the read loop then reports it lost."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._writer.close()

    def refuse(self, exc: ConnectionDropped) -> None:
        """Answer ``Error(exc.code)`` and close: ``exc`` broke a ``[limits]`` cap."""
        log.info("connection_dropped", reason=exc.reason, peer=self.peer, error=exc.message)
        self.drop_reason = exc.reason
        self.send(api.Error(code=exc.code, message=exc.message))
        self.close()

    async def serve(self, service: Service) -> None:
        """Read and dispatch requests until the client leaves, breaks the framing or a cap."""
        lim = self.limits
        try:
            while not self._closed:
                try:
                    msg = await read_frame(
                        self._reader,
                        self._codec,
                        self.budget,
                        frame_timeout_s=lim.frame_timeout_s,
                        idle_timeout_s=lim.idle_timeout_s,
                        busy=lambda: bool(self.generations),
                    )
                except ConnectionDropped as exc:
                    self.refuse(exc)
                    break
                except FrameError as exc:
                    log.info("protocol_error", error=str(exc))
                    self.send(api.Error(code=ErrorCode.PROTOCOL_ERROR, message=str(exc)))
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self._writer.drain(), 1.0)
                    break
                if msg is None:
                    break
                await service.handle(self, msg)
        except (ConnectionError, OSError):
            pass
        finally:
            self.close()
            service.connection_lost(self)


class ApiServer:
    """The Unix-socket server. ``start()`` binds ``path`` (a stale socket file left by a dead
    daemon is replaced; a live one is an error) and sets ``mode``; ``stop()`` closes every
    connection, stops listening and removes the socket file. Raises ``OSError`` when the path is
    in use by a live daemon or cannot be bound.

    With ``sock`` (a listening socket passed by systemd, ``basertd.server.observe.notify.adopt_listener``)
    nothing is bound: the server accepts on ``sock``, leaves its mode and owner to the socket unit
    and never removes its file (systemd keeps listening while the daemon restarts; its backlog is
    the socket unit's ``Backlog=``).

    ``limits`` (default: every ``[limits]`` default) caps connections and buffered request bytes
    (module docstring); ``metrics`` counts what the caps drop."""

    def __init__(
        self,
        path: Path,
        mode: int,
        service: Service,
        *,
        sock: socket.socket | None = None,
        limits: LimitsConfig | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.path = Path(path)
        self.mode = mode
        self.service = service
        self.sock = sock
        self.codec = ClientCodec("server")
        self.limits = limits or LimitsConfig()
        self.metrics = metrics or NULL_METRICS
        self.caps = ConnectionCaps(self.limits.max_connections, self.limits.max_connections_per_uid)
        self.budget = BufferBudget(
            self.limits.max_request_buffer_bytes, on_change=self.metrics.request_buffer_bytes.set
        )
        self.connections: set[ClientConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._inode: int | None = None

    async def start(self) -> None:
        """Bind and listen (or, with ``sock``, start accepting on it)."""
        _raise_fd_limit(self.limits.max_connections + SPARE_FDS)
        accept_errors.install(asyncio.get_running_loop())
        if self.sock is not None:
            self._server = await asyncio.start_unix_server(self._on_client, sock=self.sock, limit=1 << 16)
            log.info("listening", socket=str(self.path), inherited=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise OSError(f"{self.path} exists and is not a socket")
            if await _socket_alive(self.path):
                raise OSError(f"{self.path} is in use by a running daemon")
            self.path.unlink()
        old_umask = os.umask(0o777 & ~self.mode)
        try:
            self._server = await asyncio.start_unix_server(
                self._on_client, path=str(self.path), limit=1 << 16, backlog=self.limits.listen_backlog
            )
        finally:
            os.umask(old_umask)
        self._inode = self.path.stat().st_ino
        os.chmod(self.path, self.mode)
        log.info("listening", socket=str(self.path), mode=f"{self.mode:04o}")

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ClientConnection(reader, writer, self.codec, limits=self.limits, budget=self.budget)
        uid = conn.credentials.uid
        try:
            self.caps.admit(uid)
        except ConnectionDropped as exc:
            conn.refuse(exc)  # the Error frame is flushed before the transport closes
            self.metrics.connection_dropped(exc.reason)
            return
        self.metrics.connections_open.set(self.caps.open)
        self.connections.add(conn)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await conn.serve(self.service)
        finally:
            self.connections.discard(conn)
            self.caps.leave(uid)
            self.metrics.connections_open.set(self.caps.open)
            if conn.drop_reason is not None:
                self.metrics.connection_dropped(conn.drop_reason)
            if task is not None:
                self._tasks.discard(task)

    def stop_listening(self) -> None:
        """Accept no new clients (existing connections stay)."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        """Close every connection, stop listening and remove the socket file this server bound.
        Idempotent."""
        self.stop_listening()
        for conn in list(self.connections):
            conn.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            st = self.path.lstat()
            if self._inode is not None and stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inode:
                self.path.unlink()  # ours only: never the socket of a daemon found running
        self._inode = None


def _raise_fd_limit(wanted: int) -> None:
    """Raise the soft RLIMIT_NOFILE towards ``wanted`` descriptors (never above the hard limit,
    never lowered), so the connection caps rather than EMFILE bound the clients."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _socket_alive(path: Path) -> bool:
    """True when something accepts connections on the Unix socket ``path``."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 1.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True
