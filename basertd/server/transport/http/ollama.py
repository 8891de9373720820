"""Ollama's API on the front end: ``POST /api/generate``, ``POST /api/chat``, ``GET /api/tags``,
``GET /api/ps``, ``POST /api/show``, ``GET /api/version`` and ``GET /`` ("Ollama is running").

Generation requests become one ``Generate`` (DESIGN.md "Client API"). ``/api/chat`` renders
``messages`` with the worker's chat template (``basertd.server.transport.http.chat_template``);
``/api/generate`` renders ``system`` + ``prompt`` as one user turn the same way, or sends ``prompt`` as is
with ``raw: true``. ``options``: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``num_predict`` (max tokens; -1 or absent: the rest of the context), ``stop``, ``repeat_penalty``,
``presence_penalty``, ``frequency_penalty``; model-loading options (``num_ctx``, ``num_gpu``,
``num_thread``, ...) are ignored (the daemon's configuration decides them), as is ``keep_alive``;
``format`` ``"json"`` (any JSON object) or a JSON schema constrains the output
(``basertd.server.request.grammar``; an invalid schema is a 400 with llguidance's message); any other
option, ``images``, ``tools``, ``suffix``, ``template``, ``context`` and ``think`` are a 400
naming the field. ``qos`` (or the header ``X-Basertd-QoS``) is our extension.
A request without a prompt (or messages) answers ``done_reason: "load"`` at once, as Ollama does.

Replies: NDJSON lines (``application/x-ndjson``) by default, one object with ``stream: false``;
the last has ``done: true``, ``done_reason`` (``stop``: the end-of-generation token or a stop
string; ``length``: ``num_predict`` or the context), ``prompt_eval_count`` (prompt tokens),
``eval_count`` (generated tokens) and ``total_duration`` / ``load_duration`` (0) /
``prompt_eval_duration`` / ``eval_duration`` in nanoseconds from the request's ``Timings``.
Model names: a served model's id, also with the ``:latest`` tag Ollama tools add. A failure is
``{"error": "<message>"}`` with the statuses of ``errors.STATUS_OF``; after a stream began it is
one line ``{"error": ...}``. ``pull`` / ``push`` / ``create`` / ``delete`` / ``copy`` answer 501:
basertd serves the models of its configuration.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

import msgspec
from aiohttp import web

from basertd.schema import client as api
from basertd.server.request.grammar import GrammarRequestError, spec_from_request
from basertd.server.transport.http import openai as oa
from basertd.server.transport.http.chat_template import ChatTemplateError
from basertd.server.transport.http.errors import HttpError, bad_request, from_code

API_NAME = "ollama"
API_VERSION = "0.9.0"
"""The Ollama API version ``/api/version`` reports (the one whose fields this module serves)."""
NDJSON = "application/x-ndjson"
NANOS = 1_000_000_000
UNSERVED_VERBS = ("pull", "push", "create", "delete", "copy")
_encode = msgspec.json.Encoder().encode


def error_body(err: HttpError) -> dict[str, Any]:
    return {"error": err.message}


class Options(msgspec.Struct, forbid_unknown_fields=True):
    """``options``: sampling fields are served; loading fields are accepted and ignored."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # model loading: the daemon's configuration decides these
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    vocab_only: bool | None = None


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    stream: bool | None = None
    options: Options | None = None
    format: Any = None
    keep_alive: Any = None
    think: Any = None
    qos: str | None = None


class GenerateRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/generate``."""

    prompt: str = ""
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    thinking: str | None = None


class ChatRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/chat``."""

    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None


class ShowRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str = ""
    name: str = ""
    verbose: bool | None = None


def _refuse(req: _Common, fields: tuple[str, ...]) -> None:
    for name in fields:
        if getattr(req, name):
            raise bad_request(f"{name} is not supported by this server yet", name)


def response_format_of(fmt: Any) -> dict[str, Any] | None:
    """``Generate.response_format`` of Ollama's ``format``: ``"json"`` any JSON object, an
    object a JSON schema, ``""`` / null nothing. Raises 400 for anything else."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if not isinstance(fmt, (dict, bool)):
        raise bad_request('format must be "json" or a JSON schema object', "format")
    rf = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    try:
        spec_from_request(rf)
    except GrammarRequestError as exc:
        raise bad_request(f"format: {exc}", "format") from None
    return rf


def created_at() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def done_fields(done: api.Done) -> dict[str, Any]:
    """The closing fields of a generation (module docstring)."""
    t = done.timings
    return {
        "done": True,
        "done_reason": "length" if done.finish_reason == "length" else "stop",
        "total_duration": int(t.total_s * NANOS),
        "load_duration": 0,
        "prompt_eval_count": done.usage.prompt_tokens,
        "prompt_eval_duration": int(max(0.0, t.ttft_s - t.queue_s) * NANOS),
        "eval_count": done.usage.completion_tokens,
        "eval_duration": int(max(0.0, t.total_s - t.ttft_s) * NANOS),
    }


class OllamaApi:
    """Ollama's endpoints on one ``HttpServer`` (``host``: its ``frontend``,
    ``template_for(model)``)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.frontend = host.frontend

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
        ids = [m.id for m in self.frontend.fleet.models()]
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in ids or candidate == "":
                return candidate
        raise HttpError(404, f"model '{name}' not found", param="model", code="model_not_found")

    def _model_entries(self, running: bool) -> list[dict[str, Any]]:
        out = []
        for m in self.frontend.fleet.models():
            name = m.id if ":" in m.id else f"{m.id}:latest"
            entry: dict[str, Any] = {
                "name": name,
                "model": name,
                "size": 0,
                "digest": "",
                "details": {
                    "parent_model": "",
                    "format": "gguf" if m.engine == "llamacpp" else m.engine,
                    "family": "",
                    "families": None,
                    "parameter_size": "",
                    "quantization_level": "",
                },
            }
            if running:
                entry.update(expires_at="9999-12-31T23:59:59Z", size_vram=0, context_length=m.context_length)
            else:
                entry["modified_at"] = created_at()
            out.append(entry)
        return out

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": API_VERSION})

    async def tags(self, request: web.Request) -> web.Response:
        return web.json_response({"models": self._model_entries(False)})

    async def ps(self, request: web.Request) -> web.Response:
        return web.json_response({"models": self._model_entries(True)})

    async def show(self, request: web.Request) -> web.Response:
        req = oa.decode(await _body(request), ShowRequest)
        model = self.resolve(req.model or req.name)
        info = next(m for m in self.frontend.fleet.models() if m.id == model or model == "")
        try:
            _, template = self.host.template_for(model)
            source = template.source
        except ChatTemplateError:
            source = ""
        return web.json_response(
            {
                "modelfile": f"# basertd serves {info.id} from its configuration\n",
                "parameters": "",
                "template": source,
                "details": self._model_entries(False)[0]["details"],
                "model_info": {"general.context_length": info.context_length, "vocab_size": info.vocab_size},
                "capabilities": ["completion"],
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
        req = oa.decode(await _body(request), GenerateRequest)
        _refuse(req, ("images", "suffix", "template", "context", "think"))
        model = self.resolve(req.model)
        if not req.prompt:
            loaded = {"response": "", "done": True, "done_reason": "load"}
            return web.json_response(self._head(model) | loaded)
        if req.raw:
            text, add_special = req.prompt, True
        else:
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
                {"role": "user", "content": req.prompt}
            ]
            text, add_special = self._render(model, messages)
        return await self._run(request, req, model, text, add_special, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = oa.decode(await _body(request), ChatRequest)
        _refuse(req, ("tools", "think"))
        model = self.resolve(req.model)
        if not req.messages:
            head = self._head(model) | {"message": {"role": "assistant", "content": ""}}
            return web.json_response(head | {"done": True, "done_reason": "load"})
        for i, m in enumerate(req.messages):
            if m.images or m.tool_calls:
                field = "images" if m.images else "tool_calls"
                raise bad_request(f"messages[{i}].{field} is not supported yet", f"messages[{i}].{field}")
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        text, add_special = self._render(model, messages)
        return await self._run(request, req, model, text, add_special, chat=True)

    def _render(self, model: str, messages: list[dict[str, Any]]) -> tuple[str, bool]:
        try:
            _, template = self.host.template_for(model)
            text = template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        return text, template.needs_bos(text)

    def _head(self, model: str) -> dict[str, Any]:
        name = model or self._model_entries(False)[0]["name"]
        return {"model": name if ":" in name else f"{name}:latest", "created_at": created_at()}

    async def _run(
        self, request: web.Request, req: _Common, model: str, text: str, add_special: bool, *, chat: bool
    ) -> web.StreamResponse:
        qos = oa.qos_of(req, request.headers.get(oa.QOS_HEADER))  # type: ignore[arg-type]
        o = req.options or Options()
        response_format = response_format_of(req.format)
        prompt = await self.frontend.tokenize(model, text, add_special=add_special)
        wid = self.frontend.fleet.route(model)
        if o.num_predict is None or o.num_predict < 0:
            ctx = self.frontend.fleet.context_length(wid)
            max_tokens = max(1, ctx - len(prompt))
        elif o.num_predict == 0:
            raise bad_request("options.num_predict must be > 0 (or -1: the rest of the context)", "options")
        else:
            max_tokens = o.num_predict
        stream = req.stream is None or req.stream
        gen = api.Generate(
            request_id=oa.new_id(API_NAME),
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            temperature=0.8 if o.temperature is None else o.temperature,  # Ollama's defaults
            top_p=0.9 if o.top_p is None else o.top_p,
            top_k=40 if o.top_k is None else o.top_k,
            min_p=o.min_p or 0.0,
            repeat_penalty=1.0 if o.repeat_penalty is None else o.repeat_penalty,
            presence_penalty=o.presence_penalty or 0.0,
            frequency_penalty=o.frequency_penalty or 0.0,
            seed=o.seed if o.seed is None or o.seed >= 0 else None,
            stop=list(o.stop or []),
            qos=qos,  # type: ignore[arg-type]
            stream=stream,
            model=model,
            response_format=response_format,
        )
        head = self._head(model)

        def piece(s: str) -> dict[str, Any]:  # each line stamped when written, as Ollama does
            body = {"message": {"role": "assistant", "content": s}} if chat else {"response": s}
            return head | {"created_at": created_at()} | body

        async with await self.frontend.stream(gen, api_name=API_NAME) as out:
            if not stream:
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
                return web.json_response(piece("".join(parts)) | done_fields(done))
            resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
            await resp.prepare(request)
            async for msg in out:
                if isinstance(msg, api.Tokens) and msg.text:
                    await resp.write(_encode(piece(msg.text) | {"done": False}) + b"\n")
                elif isinstance(msg, api.Done):
                    await resp.write(_encode(piece("") | done_fields(msg)) + b"\n")
                elif isinstance(msg, api.Error):
                    await resp.write(_encode(error_body(from_code(msg.code, msg.message))) + b"\n")
            return resp


async def _body(request: web.Request) -> bytes:
    body = await request.read()
    if not body:
        raise bad_request("the request body is empty (a JSON object is expected)")
    return body
