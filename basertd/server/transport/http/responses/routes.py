"""OpenAI's Responses API over a ``FrontendPort``: ``POST /v1/responses``, ``GET
/v1/responses/{id}`` and ``DELETE /v1/responses/{id}``, and ``POST /v1/responses/render`` (vLLM's:
the request's prompt tokens and sampling, nothing generated; what vllm-router's cache-aware policy
asks before it routes a response, as for chat, ``openai.render``).

A request becomes one ``Generate`` (``translate``): its input (and a ``previous_response_id``'s
conversation, ``store``) rendered with the worker's chat template (``templates``; tools as
``tool_calls.render`` renders them). The replies become a ``response`` object (``wire``) or its
stream of events (``events``). A finished response is kept unless ``store`` is false, for
``previous_response_id`` and ``GET``. Failures are OpenAI error objects (``errors``): an unknown
``previous_response_id`` is a 400 (code ``previous_response_not_found``), an unknown id on
``GET`` / ``DELETE`` a 404; a generation that fails after a stream began ends it with
``response.failed``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from basertd.schema import client as api
from basertd.server.transport.http import body, sse, tool_calls
from basertd.server.transport.http.chat_template import ChatTemplateError
from basertd.server.transport.http.errors import PARAM_ALIASES, HttpError, bad_request, from_code
from basertd.server.transport.http.openai.render import generate_request
from basertd.server.transport.http.port import FrontendPort, StreamPort
from basertd.server.transport.http.responses import translate as tr
from basertd.server.transport.http.responses import wire
from basertd.server.transport.http.responses.events import OutputStream
from basertd.server.transport.http.responses.store import ResponseStore
from basertd.server.transport.http.router_api import served_model
from basertd.server.transport.http.templates import Templates

API_NAME = "responses"


class Turn:
    """One response being made: its request ``req``, tool ``plan``, ``shape`` and ``conversation``
    (the chat messages of its input, a previous response's included, without instructions)."""

    def __init__(
        self,
        req: wire.ResponsesRequest,
        plan: tool_calls.ToolPlan | None,
        shape: wire.Shape,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.req = req
        self.plan = plan
        self.shape = shape
        self.conversation = conversation

    def outcome(self, text: str, done: api.Done) -> tuple[str, str | None, list[dict[str, Any]] | None]:
        """``(status, message text or None, calls or None)`` of the finished output ``text``: calls
        when it is one; else the message (none when a forced call was cut by max_output_tokens)."""
        calls = tool_calls.parse(self.plan, text) if self.plan is not None else None
        if calls:
            return "completed", None, calls
        status = "incomplete" if done.finish_reason == "length" else "completed"
        if self.plan is not None and self.plan.calls_only:
            return status, None, None
        return status, text, None


class ResponsesApi:
    """The Responses endpoints over ``frontend`` (module docstring); ``templates`` renders the
    conversation, ``store`` keeps finished responses."""

    def __init__(
        self, frontend: FrontendPort, templates: Templates, store: ResponseStore | None = None
    ) -> None:
        self.frontend = frontend
        self.templates = templates
        self.store = store if store is not None else ResponseStore()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/responses", self.create),
            web.post("/v1/responses/render", self.render),
            web.get("/v1/responses/{id}", self.retrieve),
            web.delete("/v1/responses/{id}", self.delete),
        ]

    def _stored(self, request: web.Request) -> str:
        rid = request.match_info["id"]
        if request.query:
            field = sorted(request.query)[0]
            raise bad_request(f"query parameter {field!r} is not served", field)
        if self.store.get(rid) is None:
            raise HttpError(404, f"No response with id {rid!r} is stored here", param="id", code="not_found")
        return rid

    async def retrieve(self, request: web.Request) -> web.Response:
        entry = self.store.get(self._stored(request))
        assert entry is not None
        return body.json_response(entry.response)

    async def delete(self, request: web.Request) -> web.Response:
        rid = self._stored(request)
        self.store.delete(rid)
        return body.json_response({"id": rid, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        req = body.decode(await body.read(request), wire.ResponsesRequest)
        gen, turn = await self._turn(request, req)
        async with await self.frontend.stream(gen, api_name=API_NAME) as stream:
            if req.stream:
                return await self._sse(request, turn, stream)
            return await self._collect(turn, stream)

    async def render(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/responses/render``: the ``Generate`` of the request as vLLM's
        ``GenerateRequest`` (token ids, sampling params), nothing stored or generated."""
        req = body.decode(await body.read(request), wire.ResponsesRequest)
        gen, turn = await self._turn(request, req)
        return body.json_response(generate_request(gen, turn.shape.model, bool(req.stream)))

    async def _turn(self, request: web.Request, req: wire.ResponsesRequest) -> tuple[api.Generate, Turn]:
        """The ``Generate`` of ``req`` and its ``Turn`` (the input rendered and tokenized, the
        tools compiled). Raises 400 ``HttpError`` or ``AdmissionError``."""
        request[PARAM_ALIASES] = {"max_tokens": "max_output_tokens"}  # a refusal says the client's name
        req.model = served_model(self.frontend, req.model)
        tr.check_fields(req)
        qos = body.qos_of(req.qos, request.headers.get(body.QOS_HEADER))
        conversation: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise bad_request(
                    f"Previous response with id {req.previous_response_id!r} not found.",
                    "previous_response_id",
                    code="previous_response_not_found",
                )
            conversation = list(previous.conversation)
        items = len(req.input) if isinstance(req.input, list) else 1
        self.templates.check_messages(len(conversation) + items + 1)  # before converting them
        conversation += tr.conversation_of(req.input)  # type: ignore[arg-type]
        plan = await self.templates.tool_plan(
            req.model,
            qos,
            tr.chat_tools_of(req.tools),
            tr.chat_tool_choice_of(req.tool_choice),
            req.parallel_tool_calls,
        )
        response_format = tr.response_format_of(req.text)
        combined = None
        if plan is not None and plan.mode == "auto" and response_format is not None:
            combined = await self.frontend.compile_spec(
                req.model, qos, tr.answer_or_call(plan, response_format)
            )
        structured = tr.structured_fields(plan, response_format, combined)
        messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
        try:
            wid, template = self.templates.for_model(req.model)
            text = await self.templates.render_chat(template, messages + conversation, plan)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "input", code="chat_template") from None
        prompt = await self.frontend.tokenize(req.model, text, add_special=template.needs_bos(text))
        max_tokens = req.max_output_tokens
        if max_tokens is None:
            max_tokens = max(1, self.frontend.context_length(wid) - len(prompt))
        rid = wire.new_id("resp")
        gen = tr.generate_of(req, rid, prompt, max_tokens, qos, structured)
        shape = wire.Shape(rid, self.frontend.model_name(wid), _echo(req))
        return gen, Turn(req, plan, shape, conversation)

    def _keep(self, turn: Turn, response: dict[str, Any], text: str | None, calls: Any) -> None:
        if turn.req.store is not False and response["status"] in ("completed", "incomplete"):
            self.store.put(response, turn.conversation + tr.output_messages(text, calls))

    async def _collect(self, turn: Turn, stream: StreamPort) -> web.Response:
        parts: list[str] = []
        async for msg in stream:
            if isinstance(msg, api.Tokens):
                parts.append(msg.text)
            elif isinstance(msg, api.Done):
                status, text, calls = turn.outcome("".join(parts), msg)
                output = [wire.call_item(wire.new_id("fc"), c) for c in calls or []]
                if text is not None:
                    output.append(wire.message_item(wire.new_id("msg"), text, status))
                response = turn.shape.object(status, output, wire.usage_of(msg))
                self._keep(turn, response, text, calls)
                return body.json_response(response)
            elif isinstance(msg, api.Error):
                raise from_code(msg.code, msg.message)
        raise HttpError(500, "the generation ended without a result", code="internal")

    async def _sse(self, request: web.Request, turn: Turn, stream: StreamPort) -> web.StreamResponse:
        resp = web.StreamResponse(headers=sse.HEADERS)
        await resp.prepare(request)
        out = OutputStream(resp, turn.shape)
        await out.begin()
        held = tool_calls.ToolStream(turn.plan) if turn.plan is not None else None
        parts: list[str] = []
        async for msg in stream:
            if isinstance(msg, api.Tokens):
                parts.append(msg.text)
                await out.delta(held.feed(msg.text) if held is not None else msg.text)
            elif isinstance(msg, api.Done):
                if held is not None:
                    await out.delta(held.finish()[1])
                status, text, calls = turn.outcome("".join(parts), msg)
                if calls:
                    await out.calls(calls)
                elif text is not None:
                    await out.close_message(status)
                response = turn.shape.object(status, out.output, wire.usage_of(msg))
                self._keep(turn, response, text, calls)
                await out.end(response)
                return resp
            elif isinstance(msg, api.Error):
                err = from_code(msg.code, msg.message)
                error = {"code": "server_error", "message": err.message}
                await out.end(turn.shape.object("failed", out.output, error=error))
                return resp
            elif isinstance(msg, api.Queued):
                await out.comment(f"queued at position {msg.position}")
        error = {"code": "server_error", "message": "the generation ended without a result"}
        await out.end(turn.shape.object("failed", out.output, error=error))
        return resp


def _echo(req: wire.ResponsesRequest) -> dict[str, Any]:
    """The request fields a ``response`` object repeats."""
    fmt: Any = {"type": "text"}
    if req.text is not None and req.text.format is not None:
        fmt = req.text.format
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt, "verbosity": "medium"},
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        "tools": req.tools or [],
        "top_logprobs": 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
    }
