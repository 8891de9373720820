"""The HTTP server: aiohttp on the daemon's event loop, a sibling of the native API
(``basertd.server.transport.native_api``): every endpoint turns its request into ``Generate``\\ s for the
front end (``basertd.server.frontend.admission``) and its ``GenerationStream``\\ s back into OpenAI's shapes
(``basertd.server.transport.http.openai``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` (200 while every worker serves, else 503 with the
reason, draining included), ``GET /metrics`` (the daemon's registry), ``POST /tokenize`` and
``POST /detokenize`` (llama-server's and vLLM's field names both accepted). Every failure is an
OpenAI error object (``basertd.server.transport.http.errors``); after an SSE stream began it is one
``error`` event, then ``[DONE]``.

A client that disconnects cancels its request at once: aiohttp cancels the handler
(``handler_cancellation``), and leaving the handler closes every ``GenerationStream`` (the lane
retires in the next plan; a queued request never starts).

``HttpServer(config, frontend, ...)``: ``start()`` binds every ``[http] listen`` entry and each
adopted socket (systemd's ``FileDescriptorName=http``); ``addresses`` lists what it serves;
``stop_listening()`` then ``stop()``. Raises ``OSError`` when an address cannot be bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aiohttp import web

from basertd.schema import client as api
from basertd.server.config import HttpConfig, parse_listen
from basertd.server.frontend.admission import Frontend
from basertd.server.frontend.streams import GenerationStream
from basertd.server.request.record import AdmissionError
from basertd.server.states import HealthStatus
from basertd.server.transport.http import anthropic, ollama, resume, sse, tool_calls
from basertd.server.transport.http import openai as oa
from basertd.server.transport.http.auth import Authorizer, load_api_keys
from basertd.server.transport.http.chat_template import ChatTemplate, ChatTemplateError, template_source
from basertd.server.transport.http.errors import HttpError, bad_request, from_admission, from_code

log = structlog.get_logger("basertd.http")

SHUTDOWN_TIMEOUT_S = 2.0
"""Seconds ``stop()`` lets running handlers finish (their requests already failed) before they
are cancelled."""
API_NAME = "openai"

_json = msgspec.json.Encoder()


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=_json.encode(data), status=status, headers=headers, content_type="application/json"
    )


def error_response(err: HttpError, path: str = "") -> web.Response:
    """``err`` in the error shape of the API ``path`` belongs to (OpenAI's by default)."""
    if path.startswith(anthropic.PATHS):
        body = _json.encode(anthropic.error_body(err))
    elif path.startswith("/api/"):
        body = _json.encode(ollama.error_body(err))
    else:
        body = err.encode()
    return web.Response(body=body, status=err.status, headers=err.headers, content_type="application/json")


class HttpServer:
    """The OpenAI-compatible API of one daemon (module docstring). ``socket_mode``: permission
    bits of the Unix sockets it binds; ``adopted``: listening sockets passed by systemd."""

    def __init__(
        self,
        config: HttpConfig,
        frontend: Frontend,
        *,
        socket_mode: int = 0o660,
        adopted: list[socket.socket] | None = None,
    ) -> None:
        self.config = config
        self.frontend = frontend
        self.socket_mode = socket_mode
        self.adopted = list(adopted or [])
        keys = load_api_keys(config.api_key_file) if config.api_key_file else []
        self.auth = Authorizer(keys)
        self._templates: dict[int, ChatTemplate | ChatTemplateError] = {}
        self.resumes = resume.ResumeIndex()
        self._closers: set[asyncio.Future[None]] = set()
        self._runner: web.AppRunner | None = None
        self._unix: list[tuple[Path, int]] = []
        self.addresses: list[str] = []
        app = web.Application(middlewares=[self._middleware], client_max_size=config.max_body_bytes)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{id:.+}", self.model),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                *anthropic.AnthropicApi(self).routes(),
                *ollama.OllamaApi(self).routes(),
            ]
        )
        self.app = app

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind every listener (module docstring). Raises ``OSError``; nothing stays bound then."""
        runner = self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
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

    # --- middleware ------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            sock = request.transport.get_extra_info("socket") if request.transport else None
            authorization = request.headers.get("Authorization")
            if authorization is None and "x-api-key" in request.headers:  # Anthropic's clients
                authorization = "Bearer " + request.headers["x-api-key"]
            self.auth.check(sock, authorization, public=request.path == "/health")
            return await handler(request)
        except HttpError as err:
            return error_response(err, request.path)
        except AdmissionError as exc:
            return error_response(from_admission(exc), request.path)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            reason = {404: f"no route {request.method} {request.path}", 405: "method not allowed"}
            message = reason.get(exc.status, exc.reason)
            if exc.status == 413:
                message = f"the request body is larger than max_body_bytes ({self.config.max_body_bytes})"
            err = HttpError(exc.status, message, code=exc.reason.lower().replace(" ", "_"))
            return error_response(err, request.path)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            log.exception("http_request_failed", path=request.path)
            return error_response(
                HttpError(500, f"internal error: {type(exc).__name__}", code="internal"), request.path
            )

    # --- simple endpoints ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        status, reason = self.frontend.health()
        body = {"status": status, "reason": reason, "workers_ready": self.frontend.fleet.ready_count}
        return json_response(body, 200 if status == HealthStatus.OK else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.frontend.metrics.exposition()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def _model_objects(self) -> list[dict[str, Any]]:
        return [
            {
                "id": m.id,
                "object": "model",
                "created": 0,
                "owned_by": "basertd",
                "max_model_len": m.context_length,
            }
            for m in self.frontend.fleet.models()
        ]

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": self._model_objects()})

    async def model(self, request: web.Request) -> web.Response:
        wanted = request.match_info["id"]
        for m in self._model_objects():
            if m["id"] == wanted:
                return json_response(m)
        raise HttpError(404, f"model {wanted!r} is not served here", param="model", code="model_not_found")

    async def _body(self, request: web.Request) -> bytes:
        body = await request.read()
        if not body:
            raise bad_request("the request body is empty (a JSON object is expected)")
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        req = oa.decode(await self._body(request), TokenizeBody)
        text = req.content if req.content is not None else req.prompt
        if text is None:
            raise bad_request("give content (or prompt)", "content")
        add = req.add_special if req.add_special is not None else req.add_special_tokens
        tokens = await self.frontend.tokenize(req.model, text, add_special=True if add is None else add)
        wid = self.frontend.fleet.route(req.model)
        ctx = self.frontend.fleet.context_length(wid)
        return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": ctx})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = oa.decode(await self._body(request), DetokenizeBody)
        text = await self.frontend.detokenize(req.model, req.tokens)
        return json_response({"content": text, "prompt": text})

    # --- generation ------------------------------------------------------------------------------

    def template_for(self, model: str) -> tuple[int, ChatTemplate]:
        """The chat template of the worker a request for ``model`` goes to (cached per worker).
        Raises ``ChatTemplateError`` when it has none, ``AdmissionError`` for an unknown model."""
        wid, tok = self.frontend.template_tokenizer(model)
        cached = self._templates.get(wid)
        if cached is None:
            cfg = self.frontend.fleet[wid].config
            meta = getattr(tok, "meta", None)
            own = meta("tokenizer.chat_template") if meta is not None else None
            text_of = getattr(tok, "token_text", None)
            try:
                source = template_source(
                    cfg.chat_template, own, default_model=cfg.engine == "llamacpp" and not cfg.model
                )
                cached = ChatTemplate(
                    source,
                    bos_token=text_of(getattr(tok, "bos_id", -1)) if text_of else "",
                    eos_token=text_of(getattr(tok, "eos_id", -1)) if text_of else "",
                )
            except ChatTemplateError as exc:
                cached = exc
            self._templates[wid] = cached
        if isinstance(cached, ChatTemplateError):
            raise cached
        return wid, cached

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if resume.HEADER in request.headers:
            return await self._resume(request, chat=False)
        req = oa.decode(await self._body(request), oa.CompletionRequest)
        oa.check_fields(req)
        prompts = oa.prompts_of(req.prompt)
        max_tokens = oa.COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        return await self._generate(request, req, [(p, max_tokens) for p in prompts], chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if resume.HEADER in request.headers:
            return await self._resume(request, chat=True)
        req = oa.decode(await self._body(request), oa.ChatRequest)
        oa.check_fields(req)
        messages = oa.message_dicts(req.messages)
        plan = tool_calls.plan_of(req.tools, req.tool_choice, req.parallel_tool_calls)
        try:
            wid, template = self.template_for(req.model)
            text = tool_calls.render(template, messages, plan)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages", code="chat_template") from None
        prompt = await self.frontend.tokenize(req.model, text, add_special=template.needs_bos(text))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            ctx = self.frontend.fleet.context_length(wid)
            max_tokens = max(1, ctx - len(prompt))
        return await self._generate(request, req, [(prompt, max_tokens)], chat=True, tools=plan)

    async def _generate(
        self,
        request: web.Request,
        req: oa._Common,
        prompts: list[tuple[str | list[int], int]],
        *,
        chat: bool,
        tools: tool_calls.ToolPlan | None = None,
    ) -> web.StreamResponse:
        qos = oa.qos_of(req, request.headers.get(oa.QOS_HEADER))
        stream = bool(req.stream)
        if req.stream_options is not None and not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        n = req.n or 1
        rid = oa.new_id("chatcmpl" if chat else "cmpl")
        gens = [
            oa.generate_of(
                req,
                f"{rid}-{i * n + j}",
                prompt=prompt,
                max_tokens=max_tokens,
                qos=qos,
                stream=stream,
                tool_spec=tools.spec if tools else None,
            )
            for i, (prompt, max_tokens) in enumerate(prompts)
            for j in range(n)
        ]
        model_name = self.frontend.fleet[self.frontend.fleet.route(req.model)].model_name
        shape = oa.Shape(chat, rid, model_name, tools)
        streams: list[GenerationStream] = []
        resumable = False
        try:
            for gen in gens:
                streams.append(await self.frontend.stream(gen, api_name=API_NAME))
            if stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                if (
                    len(streams) == 1 and streams[0].accepted is not None and tools is None
                ):  # one id to resume
                    state = {"response_id": rid, "model": model_name, "include_usage": include_usage}
                    resume_id = streams[0].accepted.resume_id
                    self.resumes.remember(gens[0].request_id, _kind(chat), state, resume_id)
                    resumable = bool(resume_id)
                return await self._sse(request, shape, streams, n, include_usage)
            return await self._collect(shape, streams, n)
        finally:
            await self.release(streams, resumable)

    async def release(self, streams: list[Any], resumable: bool) -> None:
        """Close the streams of a finished or abandoned handler; a resumable stream's request
        keeps running ``resume_grace_s`` for a reconnect (``basertd.server.transport.http.resume``)."""
        grace = self.config.resume_grace_s
        for s in streams:
            if resumable and grace > 0:
                task = asyncio.ensure_future(resume.close_later(s, grace))
                self._closers.add(task)
                task.add_done_callback(self._closers.discard)
            else:
                await s.aclose()

    async def _resume(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        """The rest of a stream after ``Last-Event-ID`` (``basertd.server.transport.http.resume``)."""
        rid, entry, after = self.resumes.lookup(request.headers[resume.HEADER], _kind(chat))
        shape = oa.Shape(chat, entry.state["response_id"], entry.state["model"])
        async with resume.follow(self.frontend, entry.resume_id, after) as followed:
            return await self._sse(
                request, shape, [followed], 1, entry.state["include_usage"], ids=[rid], after=after
            )

    def _logprobs(self, shape: oa.Shape, stream: Any) -> oa.Logprobs:
        """The logprobs builder of one choice, with the vocabulary of the worker serving it."""
        req = getattr(stream, "request", None)
        if req is not None:
            return oa.Logprobs(shape.chat, req.tokenizer.piece)
        fleet = self.frontend.fleet
        return oa.Logprobs(shape.chat, lambda t: fleet[fleet.route("")].tokenizer.piece(t))

    async def _collect(self, shape: oa.Shape, streams: list[GenerationStream], n: int) -> web.Response:
        async def one(s: GenerationStream) -> tuple[oa.Choice, api.Done]:
            parts = []
            lp = self._logprobs(shape, s)
            async for msg in s:
                if isinstance(msg, api.Tokens):
                    parts.append(msg.text)
                    lp.add(msg.logprobs)
                elif isinstance(msg, api.Done):
                    return ("".join(parts), oa.finish_reason(msg), lp.take()), msg
                elif isinstance(msg, api.Error):
                    raise from_code(msg.code, msg.message)
            raise HttpError(500, "the generation ended without a result", code="internal")

        results = await asyncio.gather(*(one(s) for s in streams))
        choices = [choice for choice, _ in results]
        return json_response(shape.full(choices, _usage([d for _, d in results], n)))

    async def _sse(
        self,
        request: web.Request,
        shape: oa.Shape,
        streams: list[GenerationStream],
        n: int,
        include_usage: bool,
        *,
        ids: list[str] | None = None,
        after: int = 0,
    ) -> web.StreamResponse:
        """Stream ``streams`` as SSE; a resumed stream (``after`` > 0 tokens the client has) gets
        no role chunk and its ids count on from ``after``."""
        resp = web.StreamResponse(headers=sse.HEADERS)
        await resp.prepare(request)
        counts = [after] * len(streams)
        ids = ids or [s.request.request_id for s in streams]
        if shape.chat and after == 0:
            first = b"".join(
                sse.event(shape.chunk(i, "", role=True, include_usage=include_usage), f"{ids[i]}:0")
                for i in range(len(streams))
            )
            await resp.write(first)
        dones: list[api.Done | None] = [None] * len(streams)
        lps = [self._logprobs(shape, s) for s in streams]
        held = [shape.tool_stream() for _ in streams]  # tool calls wait until complete
        async for i, msg in _merge(streams):
            if isinstance(msg, api.Tokens):
                counts[i] += len(msg.ids)
                lps[i].add(msg.logprobs)
                text = held[i].feed(msg.text) if held[i] is not None else msg.text  # type: ignore[union-attr]
                if text:
                    chunk = shape.chunk(i, text, include_usage=include_usage, logprobs=lps[i].take())
                    await resp.write(sse.event(chunk, f"{ids[i]}:{counts[i]}"))
            elif isinstance(msg, api.Done):
                dones[i] = msg
                finish, calls, rest = oa.finish_reason(msg), None, None
                if held[i] is not None:
                    calls, rest = held[i].finish()  # type: ignore[union-attr]
                    if calls:
                        finish = "tool_calls"
                if calls or rest:
                    chunk = shape.chunk(
                        i, rest, include_usage=include_usage, logprobs=lps[i].take(), calls=calls
                    )
                    await resp.write(sse.event(chunk, f"{ids[i]}:{counts[i]}"))
                chunk = shape.chunk(
                    i,
                    None if shape.chat else "",
                    finish,
                    include_usage=include_usage,
                    logprobs=lps[i].take(),
                )
                await resp.write(sse.event(chunk, f"{ids[i]}:{counts[i]}"))
            elif isinstance(msg, api.Error):
                await resp.write(sse.event(from_code(msg.code, msg.message).body(), f"{ids[i]}:{counts[i]}"))
                await resp.write(sse.DONE)
                return resp
            elif isinstance(msg, api.Queued):
                await resp.write(f": queued at position {msg.position}\n\n".encode())
        if include_usage:
            usage = _usage([d for d in dones if d is not None], n)
            await resp.write(sse.event(shape.usage_chunk(usage), f"{ids[0]}:{sum(counts)}"))
        await resp.write(sse.DONE)
        return resp


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /tokenize``: llama-server's ``content`` / ``add_special`` or vLLM's ``prompt`` /
    ``add_special_tokens``."""

    content: str | None = None
    prompt: str | None = None
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    model: str = ""
    with_pieces: bool | None = None


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /detokenize``."""

    tokens: list[int]
    model: str = ""


def _usage(dones: list[api.Done], n: int) -> dict[str, Any]:
    """Usage over the choices: prompt tokens counted once per prompt (every n-th choice)."""
    prompt = sum(d.usage.prompt_tokens for d in dones[::n])
    cached = sum(d.usage.cached_tokens for d in dones[::n])
    completion = sum(d.usage.completion_tokens for d in dones)
    return oa.usage_of(prompt, cached, completion)


async def _merge(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, Any]]:
    """``(index, reply)`` of every stream as they arrive, until each has ended."""
    if len(streams) == 1:
        async for msg in streams[0]:
            yield 0, msg
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: GenerationStream) -> None:
        async for msg in s:
            queue.put_nowait((i, msg))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, msg = await queue.get()
            if isinstance(msg, (api.Done, api.Error)):
                remaining -= 1
            yield i, msg
    finally:
        for t in tasks:
            t.cancel()


def _kind(chat: bool) -> str:
    return "chat" if chat else "completions"


def _describe(address: Any) -> str:
    if isinstance(address, tuple):
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"unix:{address}"
