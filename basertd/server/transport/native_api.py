"""The native API over the Unix socket: a thin adapter from client frames to the front end.

``NativeService`` is the ``basertd.server.transport.socket_server.Service`` of the client socket.
Generate goes to ``Frontend.submit`` with a ``ConnectionSink`` (replies are frames on that
connection, tagged with the request id); Resume follows a journaled request (``Frontend.resume``,
``basertd.server.durability.durable``) under its resume id; Cancel, Tokenize, Models and Health
are answered from the front end; everything else is a control verb for the ``ControlHandler``
(``basertd.server.ops.control.ControlService``). A connection that goes away cancels every
generation it still had (DESIGN.md "Client API").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog

from basertd import __version__
from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.server.frontend.admission import Frontend
from basertd.server.request import requester
from basertd.server.request.record import AdmissionError
from basertd.server.transport.peercred import PeerCredentials
from basertd.server.transport.socket_server import ClientConnection

log = structlog.get_logger("basertd.native_api")


class ConnectionSink:
    """The ``RequestSink`` of one generation on a native connection: frames go to ``conn``; the
    request id is forgotten by the connection once Done or Error went out."""

    __slots__ = ("conn", "request_id")

    def __init__(self, conn: ClientConnection, request_id: str) -> None:
        self.conn = conn
        self.request_id = request_id

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def send(self, msg: object) -> None:
        self.conn.send(msg)
        if isinstance(msg, (api.Done, api.Error)):
            self.conn.generations.pop(self.request_id, None)


class ControlHandler(Protocol):
    """Answers the control verbs (``basertd.server.ops.control.ControlService``)."""

    async def handle(self, conn: ClientConnection, msg: Any) -> None: ...


class NativeService:
    """Answers native client frames (module docstring): one handler per request type
    (``_handlers``); a type without one is a control verb. Never raises."""

    def __init__(
        self,
        frontend: Frontend,
        control: ControlHandler,
        version: str = __version__,
        *,
        is_operator: Callable[[PeerCredentials], bool] | None = None,
    ) -> None:
        self.frontend = frontend
        self.control = control
        self.version = version
        self.is_operator = is_operator or (lambda _peer: False)
        self._handlers: dict[type, Callable[[ClientConnection, Any], Awaitable[None]]] = {
            api.Generate: self._generate,
            api.Resume: self._resume,
            api.Cancel: self._cancel,
            api.Tokenize: self._tokenize,
            api.Models: self._models,
            api.Health: self._health,
        }

    async def handle(self, conn: ClientConnection, msg: Any) -> None:
        """Answer one request; refusals are ``Error`` frames with the request's id."""
        try:
            await self._handlers.get(type(msg), self.control.handle)(conn, msg)
        except AdmissionError as exc:
            conn.send(
                api.Error(
                    code=exc.code,
                    request_id=getattr(msg, "request_id", ""),
                    message=exc.message,
                    param=exc.param,
                )
            )
        except Exception as exc:  # a bug must not take the connection's other streams down
            log.exception("request_failed", kind=type(msg).__name__)
            conn.send(
                api.Error(
                    code=ErrorCode.INTERNAL,
                    request_id=getattr(msg, "request_id", ""),
                    message=f"internal error: {type(exc).__name__}",
                )
            )

    async def _cancel(self, conn: ClientConnection, msg: api.Cancel) -> None:
        req = conn.generations.get(msg.request_id)
        if req is not None:
            self.frontend.cancel(req)

    async def _tokenize(self, conn: ClientConnection, msg: api.Tokenize) -> None:
        tokens = await self.frontend.tokenize(msg.model, msg.text, add_special=msg.add_special)
        conn.send(api.TokenizeResult(request_id=msg.request_id, tokens=tokens))

    async def _models(self, conn: ClientConnection, msg: api.Models) -> None:
        conn.send(api.ModelsResult(request_id=msg.request_id, models=self.frontend.fleet.models()))

    async def _health(self, conn: ClientConnection, msg: api.Health) -> None:
        status, reason = self.frontend.health()
        conn.send(
            api.HealthResult(
                request_id=msg.request_id,
                status=status,
                workers_ready=self.frontend.fleet.ready_count,
                workers_total=len(self.frontend.fleet),
                version=self.version,
                reason=reason,
            )
        )

    async def _generate(self, conn: ClientConnection, gen: api.Generate) -> None:
        rid = gen.request_id
        if rid in conn.generations:
            # The refusal must not look like an event of the running request with this id: it
            # carries no request id, and names the id it refers to.
            self.frontend.metrics.admission_error(ErrorCode.INVALID_REQUEST)
            conn.send(
                api.Error(
                    code=ErrorCode.INVALID_REQUEST,
                    request_id="",
                    message=f"refused a Generate: request id {rid!r} is already running on this "
                    "connection (the running request continues)",
                )
            )
            return
        conn.generations[rid] = None  # reserved while the prompt is tokenized
        try:
            req = await self.frontend.submit(
                gen, ConnectionSink(conn, rid), requester=requester.of_uid(conn.credentials.uid)
            )
        except BaseException:
            conn.generations.pop(rid, None)
            raise
        if not req.finished:
            conn.generations[rid] = req
        else:
            conn.generations.pop(rid, None)

    async def _resume(self, conn: ClientConnection, msg: api.Resume) -> None:
        """Follow journaled request ``msg.request_id`` on this connection (``Frontend.resume``),
        if the peer's uid sent it or the peer is an operator; its replies carry that id. Leaving
        does not cancel it: it belongs to the log, not to this connection."""
        rid = msg.request_id
        if rid in conn.generations:
            raise AdmissionError(
                ErrorCode.INVALID_REQUEST, f"request id {rid!r} is already in use on this connection"
            )
        sink = ConnectionSink(conn, rid)
        conn.generations[rid] = None  # reserved while the text is prepared
        try:
            following, _ = await self.frontend.resume(
                rid,
                msg.after,
                sink,
                requester.of_uid(conn.credentials.uid),
                operator=self.is_operator(conn.credentials),
            )
        except BaseException:
            conn.generations.pop(rid, None)
            raise
        if not following:
            conn.generations.pop(rid, None)  # answered whole; routed here until Done/Error otherwise

    def connection_lost(self, conn: ClientConnection) -> None:
        """Cancel every generation of a gone client (its lanes retire in the next plan)."""
        for req in list(conn.generations.values()):
            if req is not None:
                self.frontend.cancel(req, message="client disconnected")
        conn.generations.clear()
