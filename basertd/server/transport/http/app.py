"""The HTTP server: aiohttp on the daemon's event loop, a sibling of the native API
(``basertd.server.transport.native_api``). It serves four dialects, one package each with its
``routes`` (aiohttp handlers), ``wire`` (request and response shapes) and ``translate`` (wire to
``Generate`` and back): ``openai/`` (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/tokenize``, ``/detokenize``; ``openai/render.py``: vLLM's ``/v1/*/render``), ``responses/``
(``/v1/responses``), ``anthropic/`` (``/v1/messages``) and ``ollama/`` (``/api/...``);
``router_api`` serves what routers poll (``/server_info``, ``/model_info``, ``/get_load``).
Every handler sees the front end only through ``port.FrontendPort``; shared pieces are ``body``
(reading and decoding bodies), ``templates`` (chat templates per worker), ``resume``
(``Last-Event-ID``, closing streams), ``sse``, ``errors``, ``auth`` and ``tool_calls``.

This module adds ``GET /health`` (200 while every worker serves, else 503 with the reason,
draining included), ``GET /metrics`` (the daemon's registry), the operator's page at ``/`` with
its JSON (``opsview``, given an ``overview`` source), API keys, W3C ``traceparent`` handed to the
request's trace (``observe.tracing``), and one error shape
per dialect: every failure is an ``HttpError`` rendered as the error object of the API its path
belongs to (``error_response``; OpenAI's by default).

A client that disconnects cancels its request at once: aiohttp cancels the handler
(``handler_cancellation``), and leaving the handler closes every stream (the lane retires in the
next plan; a queued request never starts). Every connection enters through the ``door``
(``door.Door``: caps, head / body / idle deadlines, the write timeout that closes a connection
whose replies go unread, cancelling its requests the same way); on a loopback TCP listener every
request first passes the ``Host`` / ``Origin`` checks (``origin.HostPolicy``, 403).

``HttpServer(config, frontend, ...)``: ``start()`` binds every ``[http] listen`` entry and each
adopted socket (systemd's ``FileDescriptorName=http``); ``addresses`` lists what it serves;
``stop_listening()`` then ``stop()``. Raises ``OSError`` when an address cannot be bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import BadHttpMessage

from basertd.server.config_sections import CompileConfig, HttpConfig, parse_listen
from basertd.server.observe.metrics import Metrics
from basertd.server.observe.tracing import TRACEPARENT
from basertd.server.request.record import AdmissionError
from basertd.server.states import HealthStatus
from basertd.server.transport import accept_errors
from basertd.server.transport.http import opsview, resume
from basertd.server.transport.http.anthropic import wire as anthropic_wire
from basertd.server.transport.http.anthropic.routes import AnthropicApi
from basertd.server.transport.http.auth import REQUESTER, Authorizer, load_api_keys
from basertd.server.transport.http.body import BODY_TIMEOUT_S, json_response
from basertd.server.transport.http.door import Door, DoorRunner, door_middleware
from basertd.server.transport.http.embeddings import EmbeddingsApi
from basertd.server.transport.http.errors import PARAM_ALIASES, HttpError, from_admission
from basertd.server.transport.http.ollama import wire as ollama_wire
from basertd.server.transport.http.ollama.routes import OllamaApi
from basertd.server.transport.http.openai.render import RenderApi
from basertd.server.transport.http.openai.routes import OpenAiApi
from basertd.server.transport.http.opsview import OpsView, OverviewSource
from basertd.server.transport.http.origin import HostPolicy
from basertd.server.transport.http.port import FrontendPort
from basertd.server.transport.http.responses.routes import ResponsesApi
from basertd.server.transport.http.router_api import RouterApi
from basertd.server.transport.http.templates import Templates

log = structlog.get_logger("basertd.http")


class MalformedRequests(logging.Filter):
    """aiohttp answers a request it cannot parse (a header over its limits, a bad request line, a
    body in an encoding it cannot decode) with a plain-text 400 before any handler runs, and logs it
    at error level with a traceback: any client could fill the log with errors and trip alerts. A
    client's malformed request is not the server's failure: this filter, on the ``aiohttp.server``
    logger, makes such a record info level, ``bad_http_request`` with ``error`` (the parser's
    reason) and ``peer``, without the traceback. A body that cannot be decoded is answered 400 by
    ``body.read``; aiohttp then meets the same error again draining the rest of it and reports
    that as an unhandled exception: debug level."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, web.RequestPayloadError) and isinstance(exc.__cause__, BadHttpMessage):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        if isinstance(exc, BadHttpMessage):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.peer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
            record.error = exc.message if isinstance(exc.message, str) else str(exc)
            record.msg, record.args = "bad_http_request", ()
            record.exc_info = record.exc_text = None
        return True


def quiet_malformed_requests() -> None:
    """Install ``MalformedRequests`` on aiohttp's server logger once."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in logger.filters):
        logger.addFilter(MalformedRequests())


SHUTDOWN_TIMEOUT_S = 2.0
"""Seconds ``stop()`` lets running handlers finish (their requests already failed) before they
are cancelled."""
_json = msgspec.json.Encoder()


def error_response(err: HttpError, path: str = "") -> web.Response:
    """``err`` in the error shape of the API ``path`` belongs to (OpenAI's by default)."""
    if path.startswith(anthropic_wire.PATHS):
        body = _json.encode(anthropic_wire.error_body(err))
    elif path.startswith("/api/"):
        body = _json.encode(ollama_wire.error_body(err))
    else:
        body = err.encode()
    resp = web.Response(body=body, status=err.status, headers=err.headers, content_type="application/json")
    if err.close:
        resp.force_close()
    return resp


class HttpServer:
    """The HTTP APIs of one daemon over ``frontend`` (module docstring). ``socket_mode``:
    permission bits of the Unix sockets it binds; ``adopted``: listening sockets passed by
    systemd; ``metrics`` counts connections the door drops (``door``); ``native_connections``
    (the native socket's ``[limits] max_connections``) sizes the descriptor limit
    (``Door.fit_fd_limit``); ``compile``: the limits chats render under (``templates``),
    ``on_sandbox_failure(pool, reason)`` counts a render that gave no text."""

    def __init__(
        self,
        config: HttpConfig,
        frontend: FrontendPort,
        *,
        socket_mode: int = 0o660,
        adopted: list[socket.socket] | None = None,
        overview: OverviewSource | None = None,
        metrics: Metrics | None = None,
        native_connections: int = 0,
        compile: CompileConfig | None = None,
        on_sandbox_failure: Any = None,
    ) -> None:
        self.config = config
        self.frontend = frontend
        self.socket_mode = socket_mode
        self.adopted = list(adopted or [])
        keys = load_api_keys(config.api_key_file) if config.api_key_file else []
        self.auth = Authorizer(keys)
        self.hosts = HostPolicy(config.allowed_hosts)
        self.door = Door(config, metrics)
        self.native_connections = native_connections
        self.templates = Templates(frontend, compile, on_sandbox_failure)
        self.releaser = resume.Releaser(config.resume_grace_s)
        self._runner: web.AppRunner | None = None
        self._unix: list[tuple[Path, int]] = []
        quiet_malformed_requests()
        self.addresses: list[str] = []
        app = web.Application(
            middlewares=[door_middleware(self.door), self._middleware], client_max_size=config.max_body_bytes
        )
        app[BODY_TIMEOUT_S] = config.body_timeout_s
        openai_api = OpenAiApi(frontend, self.templates, self.releaser)
        ollama_api = OllamaApi(frontend, self.templates)
        ollama_routes = ollama_api.routes()
        if overview is not None:  # the page at / (opsview); Ollama's / answers non-browsers
            ollama_routes = [r for r in ollama_routes if getattr(r, "path", None) != "/"]
            ollama_routes += OpsView(overview, ollama_api.root).routes()
        routes = [
            *openai_api.routes(),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
            *AnthropicApi(frontend, self.templates, self.releaser).routes(),
            *ollama_routes,
            *EmbeddingsApi(frontend).routes(),
            *RenderApi(frontend, self.templates).routes(),
            *RouterApi(frontend).routes(),
            *ResponsesApi(frontend, self.templates).routes(),
        ]
        app.add_routes(
            [
                web.RouteDef(r.method, r.path, r.handler, {**r.kwargs, "expect_handler": self._expect})
                if isinstance(r, web.RouteDef)
                else r
                for r in routes
            ]
        )
        self.app = app

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self, children: int | None = None) -> None:
        """Bind every listener (module docstring) and start ``children`` of the chat-template
        processes (default: all; the rest start one ahead of the jobs, ``request.sandbox``).
        Raises ``OSError``; nothing stays bound then."""
        self.templates.pool.start(children)
        self.door.fit_fd_limit(self.native_connections)
        accept_errors.install(asyncio.get_running_loop())
        cfg = self.config
        runner = self._runner = DoorRunner(
            self.app,
            self.door,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            # the door closes idle connections (idle_timeout_s); aiohttp's own timer is a backstop
            keepalive_timeout=cfg.idle_timeout_s + cfg.header_timeout_s,
        )
        await runner.setup()
        try:
            for entry in self.config.listen:
                kind, host, port = parse_listen(entry)
                if kind == "tcp":
                    site: web.BaseSite = web.TCPSite(runner, host, port, reuse_address=True)
                    await site.start()
                else:
                    await self._start_unix(runner, Path(host))
            for sock in self.adopted:
                await web.SockSite(runner, sock).start()
        except BaseException:
            await self.stop()
            raise
        self.addresses = [_describe(a) for a in runner.addresses]
        log.info("http_listening", addresses=self.addresses, api_keys=len(self.auth.keys))

    async def _start_unix(self, runner: web.AppRunner, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise OSError(f"{path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(1.0)
                probe.connect(str(path))
                raise OSError(f"{path} is in use by a running server")
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)
            finally:
                probe.close()
        old_umask = os.umask(0o777 & ~self.socket_mode)
        try:
            await web.UnixSite(runner, str(path)).start()
        finally:
            os.umask(old_umask)
        os.chmod(path, self.socket_mode)
        self._unix.append((path, path.stat().st_ino))

    def stop_listening(self) -> None:
        """Accept no new connections (running requests continue)."""
        if self._runner is not None:
            for site in list(self._runner.sites):
                server = getattr(site, "_server", None)
                if server is not None:
                    server.close()

    async def stop(self) -> None:
        """Stop serving: handlers get ``SHUTDOWN_TIMEOUT_S`` to finish, then are cancelled; the
        Unix socket files this server bound are removed. Idempotent; never raises."""
        runner, self._runner = self._runner, None
        if runner is not None:
            with contextlib.suppress(Exception):
                await runner.cleanup()
        for path, inode in self._unix:
            with contextlib.suppress(OSError):
                if path.lstat().st_ino == inode:
                    path.unlink()
        self._unix.clear()
        await self.templates.close()

    # --- middleware ------------------------------------------------------------------------------

    def _check_head(self, request: web.Request) -> str:
        """The requester of a request whose head passes the door's checks before its body is read:
        its Host and Origin (``HostPolicy``), its credentials (``Authorizer``) and a
        Content-Length within ``max_body_bytes``. Raises ``HttpError`` (403, 401) or
        ``HTTPRequestEntityTooLarge``."""
        sock = request.transport.get_extra_info("socket") if request.transport else None
        authorization = request.headers.get("Authorization")
        if authorization is None and "x-api-key" in request.headers:  # Anthropic's clients
            authorization = "Bearer " + request.headers["x-api-key"]
        self.hosts.check(request)
        public = request.path == "/health" or opsview.is_public(request.path)
        requester = self.auth.check(sock, authorization, public=public)
        if (request.content_length or 0) > self.config.max_body_bytes:  # refused before it is sent
            raise web.HTTPRequestEntityTooLarge(self.config.max_body_bytes, request.content_length or 0)
        return requester

    async def _expect(self, request: web.Request) -> None:
        """``Expect: 100-continue`` (RFC 9110 section 10.1.1): the interim ``100 Continue`` only for
        a head the door would read the body of; for one it refuses (a body over ``max_body_bytes``,
        no or a wrong API key, a foreign Host) nothing is sent, and the middleware answers the
        final refusal before the client sends the body. Another expectation is 417."""
        if request.headers.get("Expect", "").lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"unknown Expect: {request.headers.get('Expect')}")
        if request.version != HttpVersion11:
            return
        with contextlib.suppress(HttpError, web.HTTPException):
            self._check_head(request)
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            request[REQUESTER] = self._check_head(request)
            TRACEPARENT.set(request.headers.get("traceparent"))  # this request's task only
            return await handler(request)
        except HttpError as err:
            return error_response(err, request.path)
        except AdmissionError as exc:
            err = from_admission(exc, request.path, request.get(PARAM_ALIASES))
            return error_response(err, request.path)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            reason = {404: f"no route {request.method} {request.path}", 405: "method not allowed"}
            message = reason.get(exc.status, exc.reason)
            if exc.status == 413:
                message = f"the request body is larger than max_body_bytes ({self.config.max_body_bytes})"
            code = exc.reason.lower().replace(" ", "_")
            err = HttpError(exc.status, message, code=code, close=exc.status == 413)  # body unread
            return error_response(err, request.path)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            log.exception("http_request_failed", path=request.path)
            return error_response(
                HttpError(500, f"internal error: {type(exc).__name__}", code="internal"), request.path
            )

    # --- server-wide endpoints -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        status, reason = self.frontend.health()
        body = {"status": status, "reason": reason, "workers_ready": self.frontend.workers_ready()}
        return json_response(body, 200 if status == HealthStatus.OK else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.frontend.metrics_exposition()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")


def _describe(address: Any) -> str:
    if isinstance(address, tuple):
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"unix:{address}"
