"""Ollama's API over a ``FrontendPort``: ``POST /api/generate``, ``POST /api/chat``,
``GET /api/tags``, ``GET /api/ps``, ``POST /api/show``, ``GET /api/version`` and ``GET /``
("Ollama is running").

Generation requests become one ``Generate`` (``translate``); a request without a prompt (or
messages) answers ``done_reason: "load"`` at once, as Ollama does. Replies: NDJSON lines
(``application/x-ndjson``) by default, one object with ``stream: false``; the last has the closing
fields (``wire.done_fields``). Model names: a served model's id, also with the ``:latest`` tag
Ollama tools add. A failure is ``{"error": "<message>"}`` with the statuses of
``errors.STATUS_OF``; after a stream began it is one line ``{"error": ...}``. ``pull`` / ``push`` /
``create`` / ``delete`` / ``copy`` answer 501: basertd serves the models of its configuration.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from basertd.schema import client as api
from basertd.server.transport.http import body, literal, tool_calls
from basertd.server.transport.http.auth import requester_of
from basertd.server.transport.http.chat_template import ChatTemplateError
from basertd.server.transport.http.errors import HttpError, bad_request, from_code
from basertd.server.transport.http.ollama import translate as tr
from basertd.server.transport.http.ollama.wire import (
    API_VERSION,
    NDJSON,
    ChatRequest,
    Common,
    GenerateRequest,
    Options,
    ShowRequest,
    created_at,
    done_fields,
    error_body,
    model_details,
    model_entries,
)
from basertd.server.transport.http.port import FrontendPort
from basertd.server.transport.http.templates import Templates

API_NAME = "ollama"
UNSERVED_VERBS = ("pull", "push", "create", "delete", "copy")
_encode = msgspec.json.Encoder().encode


class OllamaApi:
    """Ollama's endpoints over ``frontend`` (module docstring); ``templates`` renders chats."""

    def __init__(self, frontend: FrontendPort, templates: Templates) -> None:
        self.frontend = frontend
        self.templates = templates

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/", self.root),
            web.get("/api/version", self.version),
            web.get("/api/tags", self.tags),
            web.get("/api/ps", self.ps),
            web.post("/api/show", self.show),
            web.post("/api/generate", self.generate),
            web.post("/api/chat", self.chat),
            *(web.post(f"/api/{verb}", self.unserved) for verb in UNSERVED_VERBS if verb != "delete"),
            web.delete("/api/delete", self.unserved),
        ]

    # --- models ----------------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """The served model id of an Ollama model name (``name`` or ``name`` without
        ``:latest``). Raises 404."""
        ids = [m.id for m in self.frontend.models()]
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in ids or candidate == "":
                return candidate
        raise HttpError(404, f"model '{name}' not found", param="model", code="model_not_found")

    def _model_entries(self, running: bool) -> list[dict[str, Any]]:
        return model_entries(self.frontend.models(), running)

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": API_VERSION})

    async def tags(self, request: web.Request) -> web.Response:
        return web.json_response({"models": self._model_entries(False)})

    async def ps(self, request: web.Request) -> web.Response:
        return web.json_response({"models": self._model_entries(True)})

    async def show(self, request: web.Request) -> web.Response:
        req = body.decode(await body.read(request), ShowRequest)
        model = self.resolve(req.model or req.name)
        info = next(m for m in self.frontend.models() if m.id == model or model == "")
        try:
            _, template = self.templates.for_model(model)
            source = template.source
        except ChatTemplateError:
            source = ""
        return web.json_response(
            {
                "modelfile": f"# basertd serves {info.id} from its configuration\n",
                "parameters": "",
                "template": source,
                "details": model_details(info),
                "model_info": {
                    "general.context_length": info.context_length,
                    "vocab_size": info.vocab_size,
                    **({"general.architecture": info.family} if info.family else {}),
                    **({"general.parameter_count": info.parameters} if info.parameters else {}),
                },
                "capabilities": ["completion", "tools"],
                "modified_at": created_at(),
            }
        )

    async def unserved(self, request: web.Request) -> web.Response:
        verb = request.path.rsplit("/", 1)[1]
        raise HttpError(
            501,
            f"{verb} is not available: basertd serves the models of its configuration "
            "(edit the config and reload to change them)",
            code="not_implemented",
        )

    # --- generation ------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = body.decode(await body.read(request), GenerateRequest)
        tr.refuse(req, ("images", "suffix", "template", "context", "think"))
        model = self.resolve(req.model)
        if not req.prompt:
            loaded = {"response": "", "done": True, "done_reason": "load"}
            return web.json_response(self._head(model) | loaded)
        if req.raw:  # the client's own prompt, markup included: control texts stay control tokens
            prompt = await self.frontend.tokenize(model, req.prompt, add_special=True)
        else:
            prompt = await self._render(model, tr.generate_messages(req))
        return await self._run(request, req, model, prompt, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = body.decode(await body.read(request), ChatRequest)
        tr.refuse(req, ("think",))
        model = self.resolve(req.model)
        if not req.messages:
            head = self._head(model) | {"message": {"role": "assistant", "content": ""}}
            return web.json_response(head | {"done": True, "done_reason": "load"})
        self.templates.check_messages(len(req.messages or []))
        qos = body.qos_of(req.qos, request.headers.get(body.QOS_HEADER))
        plan = (  # the client sends [] for no tools
            await self.templates.tool_plan(model, qos, req.tools, None, True) if req.tools else None
        )
        if plan is not None and req.format:
            raise bad_request("format and tools cannot be used together", "format")
        prompt = await self._render(model, tr.chat_messages(req), plan)
        return await self._run(request, req, model, prompt, chat=True, plan=plan)

    async def _render(
        self, model: str, messages: list[dict[str, Any]], plan: tool_calls.ToolPlan | None = None
    ) -> list[int]:
        """The prompt ids of ``messages`` (``literal.encode_chat``: client text stays text)."""
        try:
            _, template = self.templates.for_model(model)
            return await literal.encode_chat(
                self.frontend,
                model,
                messages,
                lambda m: self.templates.render_chat(template, m, plan),
                template.needs_bos,
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None

    def _head(self, model: str) -> dict[str, Any]:
        name = model or self._model_entries(False)[0]["name"]
        return {"model": name if ":" in name else f"{name}:latest", "created_at": created_at()}

    async def _run(
        self,
        request: web.Request,
        req: Common,
        model: str,
        prompt: list[int],
        *,
        chat: bool,
        plan: tool_calls.ToolPlan | None = None,
    ) -> web.StreamResponse:
        qos = body.qos_of(req.qos, request.headers.get(body.QOS_HEADER))
        response_format, spec = tr.response_format_of(req.format)
        if spec is not None:  # compiled now to name ``format`` in an error; admission finds it cached
            await self.frontend.compile_spec(model, qos, spec)
        grammar = None
        if plan is not None:
            fields = tool_calls.generate_fields(plan.spec)
            response_format, grammar = fields.get("response_format"), fields.get("grammar")
        ctx = self.frontend.context_length(self.frontend.route(model))
        max_tokens = tr.max_tokens_of(req.options or Options(), ctx, len(prompt))
        gen = tr.generate_of(
            req,
            body.new_id(API_NAME),
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            qos=qos,
            response_format=response_format,
            grammar=grammar,
        )
        head = self._head(model)

        def piece(s: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
            # each line stamped when written, as Ollama does
            out: dict[str, Any] = {"response": s}
            if chat:
                out = {"message": {"role": "assistant", "content": s}}
                if calls:
                    out["message"]["tool_calls"] = tr.tool_calls_of(calls)
            return head | {"created_at": created_at()} | out

        stream = await self.frontend.stream(gen, api_name=API_NAME, requester=requester_of(request))
        async with stream as out:
            if not gen.stream:
                parts, done = [], None
                async for msg in out:
                    if isinstance(msg, api.Tokens):
                        parts.append(msg.text)
                    elif isinstance(msg, api.Done):
                        done = msg
                    elif isinstance(msg, api.Error):
                        raise from_code(msg.code, msg.message)
                if done is None:
                    raise HttpError(500, "the generation ended without a result", code="internal")
                whole = "".join(parts)
                calls = tool_calls.parse(plan, whole) if plan is not None else None
                shown = "" if calls else tool_calls.content_of(plan, whole)
                return web.json_response(piece(shown, calls) | done_fields(done))
            resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
            await resp.prepare(request)
            held = tool_calls.ToolStream(plan) if plan is not None else None
            async for msg in out:
                if isinstance(msg, api.Tokens) and msg.text:
                    now = held.feed(msg.text) if held is not None else msg.text
                    if now:
                        await resp.write(_encode(piece(now) | {"done": False}) + b"\n")
                elif isinstance(msg, api.Done):
                    if held is not None:  # a call is sent whole, in the line before the last
                        calls, rest = held.finish()
                        if calls or rest:
                            await resp.write(_encode(piece(rest, calls) | {"done": False}) + b"\n")
                    await resp.write(_encode(piece("") | done_fields(msg)) + b"\n")
                elif isinstance(msg, api.Error):
                    await resp.write(_encode(error_body(from_code(msg.code, msg.message))) + b"\n")
            return resp
