"""The native API over the Unix socket: a thin adapter from client frames to the front end.

``NativeService`` is the ``basertd.server.api.Service`` of the client socket. Generate goes to
``Frontend.submit`` with a ``ConnectionSink`` (replies are frames on that connection, tagged
with the request id); Resume follows a journaled request (``Frontend.resume``,
``basertd.server.durable``) under its resume id; Cancel, Tokenize, Models and Health are
answered from the front end; everything else is a control verb for ``ControlService``. A
connection that goes away cancels every generation it still had (DESIGN.md "Client API").
"""

from __future__ import annotations

from typing import Any

import structlog

from basertd import __version__
from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.server.api import ClientConnection
from basertd.server.control import ControlService
from basertd.server.frontend import Frontend
from basertd.server.requests import AdmissionError

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


class NativeService:
    """Answers native client frames (module docstring). Never raises."""

    def __init__(self, frontend: Frontend, control: ControlService, version: str = __version__) -> None:
        self.frontend = frontend
        self.control = control
        self.version = version

    async def handle(self, conn: ClientConnection, msg: Any) -> None:
        """Answer one request; refusals are ``Error`` frames with the request's id."""
        try:
            if isinstance(msg, api.Generate):
                await self._generate(conn, msg)
            elif isinstance(msg, api.Resume):
                self._resume(conn, msg)
            elif isinstance(msg, api.Cancel):
                req = conn.generations.get(msg.request_id)
                if req is not None:
                    self.frontend.cancel(req)
            elif isinstance(msg, api.Tokenize):
                tokens = await self.frontend.tokenize(msg.model, msg.text, add_special=msg.add_special)
                conn.send(api.TokenizeResult(request_id=msg.request_id, tokens=tokens))
            elif isinstance(msg, api.Models):
                conn.send(api.ModelsResult(request_id=msg.request_id, models=self.frontend.fleet.models()))
            elif isinstance(msg, api.Health):
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
            else:
                await self.control.handle(conn, msg)
        except AdmissionError as exc:
            conn.send(
                api.Error(code=exc.code, request_id=getattr(msg, "request_id", ""), message=exc.message)
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
            req = await self.frontend.submit(gen, ConnectionSink(conn, rid))
        except BaseException:
            conn.generations.pop(rid, None)
            raise
        if not req.finished:
            conn.generations[rid] = req
        else:
            conn.generations.pop(rid, None)

    def _resume(self, conn: ClientConnection, msg: api.Resume) -> None:
        """Follow journaled request ``msg.request_id`` on this connection (``Frontend.resume``);
        its replies carry that id. Leaving does not cancel it: it belongs to the log, not to this
        connection."""
        rid = msg.request_id
        if rid in conn.generations:
            raise AdmissionError(
                ErrorCode.INVALID_REQUEST, f"request id {rid!r} is already in use on this connection"
            )
        sink = ConnectionSink(conn, rid)
        if self.frontend.resume(rid, msg.after, sink):
            conn.generations[rid] = None  # routed here until its Done or Error

    def connection_lost(self, conn: ClientConnection) -> None:
        """Cancel every generation of a gone client (its lanes retire in the next plan)."""
        for req in list(conn.generations.values()):
            if req is not None:
                self.frontend.cancel(req, message="client disconnected")
        conn.generations.clear()
