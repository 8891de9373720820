"""Anthropic's Messages API on the front end: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Requests decode with msgspec into the structs below and become one ``Generate`` (DESIGN.md
"Client API"): ``system`` (a string or text blocks) and ``messages`` (``user`` / ``assistant``,
content a string or text blocks) are rendered with the worker's chat template
(``basertd.server.transport.http.chat_template``); a last ``assistant`` message is a prefill the reply
continues.
``max_tokens`` is required; ``temperature`` (0..1 in Anthropic's API, our limits table allows
more), ``top_p``, ``top_k``, ``stop_sequences``, ``stream`` and ``metadata.user_id`` (logged
nowhere, accepted) are served; ``qos`` (or the header ``X-Basertd-QoS``) is our extension.
``cache_control`` on a block is accepted and has no effect: the prefix cache is automatic.
Images, documents and extended thinking are a 400 naming the field; any unknown field is a 400.

Tools (``basertd.server.transport.http.tool_calls``): ``tools`` (``name``, ``description``,
``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool`` with ``name``, ``none``;
``disable_parallel_tool_use``) map to OpenAI's function tools, ``tool_choice`` and
``parallel_tool_calls``; ``any`` and ``tool`` constrain the reply to calls, ``auto`` to text or
calls. A call comes back as ``tool_use`` content blocks (``id``, ``name``, ``input``) with
``stop_reason`` ``tool_use``; streamed, each is a ``tool_use`` block with one
``input_json_delta`` once the call is complete. ``tool_use`` blocks of assistant turns and
``tool_result`` blocks of user turns go back into the template as tool calls and tool results.

Responses: a ``message`` object with one ``text`` content block, ``stop_reason`` ``end_turn``
(the end-of-generation token), ``max_tokens`` or ``stop_sequence`` (with ``stop_sequence`` set to
the string that matched), ``usage`` with ``input_tokens`` (prompt tokens not served from the
prefix cache), ``cache_read_input_tokens`` (served from it; the sum is the prompt length) and
``output_tokens``. Streams are Anthropic's named SSE events: ``message_start``,
``content_block_start``, ``ping``, ``content_block_delta`` (``text_delta``),
``content_block_stop``, ``message_delta`` (stop reason and usage), ``message_stop``; each carries
``id: <request id>:<tokens so far>`` (a resume point, ``basertd.server.transport.http.resume``). A failure is
``{"type": "error", "error": {"type", "message"}}`` with the statuses of ``errors.STATUS_OF``
(a ``error`` event once a stream began).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec
from aiohttp import web

from basertd.schema import client as api
from basertd.server.transport.http import openai as oa
from basertd.server.transport.http import resume, sse, tool_calls
from basertd.server.transport.http.chat_template import ChatTemplateError
from basertd.server.transport.http.errors import HttpError, bad_request, from_code

API_NAME = "anthropic"
TEXT_BLOCK = {"type": "text", "text": ""}
PATHS = ("/v1/messages", "/v1/messages/count_tokens")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error ``type`` of each status we answer."""


def error_body(err: HttpError) -> dict[str, Any]:
    """Anthropic's error object for ``err``."""
    etype = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": err.message}}


class Block(msgspec.Struct):
    """A content block: ``text``, ``tool_use`` (assistant turns) or ``tool_result`` (user turns);
    other types' fields decode, then are refused by type."""

    type: str
    text: str | None = None
    cache_control: dict[str, Any] | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Any = None
    is_error: bool | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class CountRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/messages/count_tokens``."""

    model: str = ""
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None


class MessagesRequest(CountRequest, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/messages``."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    qos: str | None = None


def _text_of(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise bad_request(
                f"{where}[{j}]: only text blocks are served, got type {block.type!r}", f"{where}[{j}].type"
            )
        texts.append(block.text)
    return "\n".join(texts)


def tools_of(req: CountRequest) -> tool_calls.ToolPlan | None:
    """The tool plan of ``tools`` / ``tool_choice`` in OpenAI's terms (module docstring), or
    None. Raises 400 for malformed tools or choices."""
    tc = req.tool_choice
    parallel = True
    if tc is not None:
        if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
            raise bad_request("tool_choice must be {type: auto | any | tool | none}", "tool_choice")
        parallel = not tc.get("disable_parallel_tool_use", False)
        kind = tc["type"]
        tc = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
            "type": "function",
            "function": {"name": tc.get("name")},
        }
    tools = req.tools
    if tools is not None:
        oa_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                raise bad_request(f"tools[{i}]: only custom tools (name, input_schema) are served", "tools")
            unknown = set(t) - {"type", "name", "description", "input_schema", "cache_control"}
            if unknown:
                raise bad_request(f"tools[{i}]: unsupported field {sorted(unknown)[0]!r}", "tools")
            fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
            if "description" in t:
                fn["description"] = t["description"]
            oa_tools.append({"type": "function", "function": fn})
        tools = oa_tools
    elif tc is not None and tc != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    return tool_calls.plan_of(tools, tc, parallel)


def _result_text(block: Block, where: str) -> str:
    c = block.content
    if c is None or isinstance(c, str):
        text = c or ""
    elif isinstance(c, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in c):
        text = "\n".join(str(b.get("text", "")) for b in c)
    else:
        raise bad_request(f"{where}.content: a tool result is a string or text blocks", f"{where}.content")
    return f"(error) {text}" if block.is_error else text


def _turns(i: int, m: Message) -> list[dict[str, Any]]:
    """The chat-template messages of one Anthropic message (tool blocks as tool turns)."""
    where = f"messages[{i}].content"
    if isinstance(m.content, str) or not any(b.type in ("tool_use", "tool_result") for b in m.content):
        return [{"role": m.role, "content": _text_of(m.content, where)}]
    texts, calls, results = [], [], []
    for j, b in enumerate(m.content):
        if b.type == "tool_use" and m.role == "assistant":
            if not isinstance(b.id, str) or not isinstance(b.name, str) or not isinstance(b.input, dict):
                raise bad_request(f"{where}[{j}]: a tool_use block has id, name and an input object", where)
            args = json.dumps(b.input, ensure_ascii=False)
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}})
        elif b.type == "tool_result" and m.role == "user":
            if not isinstance(b.tool_use_id, str):
                raise bad_request(f"{where}[{j}]: a tool_result block needs tool_use_id", where)
            results.append(
                {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b, f"{where}[{j}]")}
            )
        else:
            texts.append(_text_of([b], where))
    if m.role == "assistant":
        return [{"role": "assistant", "content": "\n".join(texts), "tool_calls": calls}]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def conversation(req: CountRequest) -> tuple[list[dict[str, Any]], str]:
    """``(messages for the chat template, assistant prefill)``. Raises 400 for thinking, blocks
    we do not serve, an empty conversation or one whose first message is not the user's."""
    if req.thinking:
        raise bad_request("thinking is not supported by this server yet", "thinking")
    if not req.messages:
        raise bad_request("messages: at least one message is required", "messages")
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = _text_of(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        out.extend(_turns(i, m))
    prefill = ""
    if req.messages[-1].role == "assistant" and not out[-1].get("tool_calls"):
        prefill = out.pop()["content"]
        if prefill != prefill.rstrip():
            raise bad_request("final assistant content cannot end with trailing whitespace", "messages")
    return out, prefill


def stop_reason(done: api.Done, matched: str | None, calls: Any = None) -> str:
    if calls:
        return "tool_use"
    if done.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if matched is not None else "end_turn"


def matched_stop(full: str, text: str, stops: list[str]) -> str | None:
    """The stop string that ended ``text``: the one at ``len(text)`` of ``full`` (the whole decoded
    output, stop string included)."""
    rest = full[len(text) :] if full.startswith(text) else ""
    hits = [s for s in stops if s and rest.startswith(s)]
    return max(hits, key=len) if hits else None


def usage_of(done: api.Done | None, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    cached = done.usage.cached_tokens if done is not None else 0
    prompt = done.usage.prompt_tokens if done is not None else prompt_tokens
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": done.usage.completion_tokens if done is not None else output_tokens,
    }


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_blocks(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tool_use`` content blocks of OpenAI ``tool_calls`` (ids ``toolu_`` + 24 hex digits)."""
    return [
        {
            "type": "tool_use",
            "id": "toolu_" + c["id"].removeprefix("call_"),
            "name": c["function"]["name"],
            "input": json.loads(c["function"]["arguments"]),
        }
        for c in calls
    ]


def message_object(
    mid: str,
    model: str,
    text: str,
    reason: str | None,
    stop: str | None,
    usage: dict[str, int],
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    if calls:
        content = tool_use_blocks(calls)
    else:
        content = [{"type": "text", "text": text}] if text or reason is not None else []
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": usage,
    }


def event(name: str, data: dict[str, Any], event_id: str | None = None) -> bytes:
    """One named SSE event (``event: <name>``, optional ``id:``, ``data: <json>``)."""
    return b"event: " + name.encode() + b"\n" + sse.event(data, event_id)


class AnthropicApi:
    """The Messages endpoints of one ``HttpServer`` (``host``: its ``frontend``,
    ``template_for(model)``, ``resumes``)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.frontend = host.frontend

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages), web.post("/v1/messages/count_tokens", self.count)]

    async def _prompt(self, req: CountRequest, plan: tool_calls.ToolPlan | None) -> tuple[int, list[int]]:
        messages, prefill = conversation(req)
        if prefill and plan is not None:
            raise bad_request("a final assistant message (prefill) cannot be combined with tools", "messages")
        try:
            wid, template = self.host.template_for(req.model)
            text = tool_calls.render(template, messages, plan) + prefill
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        tokens = await self.frontend.tokenize(req.model, text, add_special=template.needs_bos(text))
        return wid, tokens

    async def count(self, request: web.Request) -> web.Response:
        req = oa.decode(await request.read(), CountRequest)
        _, tokens = await self._prompt(req, tools_of(req))
        return web.json_response({"input_tokens": len(tokens)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        if resume.HEADER in request.headers:
            mid, entry, after = self.host.resumes.lookup(request.headers[resume.HEADER], API_NAME)
            st = entry.state
            shape = StreamShape(self, mid, st["model"], st["stops"], st["model_req"])
            async with resume.follow(self.frontend, entry.resume_id, after) as followed:
                return await shape.write(request, followed, followed.accepted.prompt_tokens, after)
        body = await request.read()
        if not body:
            raise bad_request("the request body is empty (a JSON object is expected)")
        req = oa.decode(body, MessagesRequest)
        qos = oa.qos_of(req, request.headers.get(oa.QOS_HEADER))  # type: ignore[arg-type]
        if req.max_tokens < 1:
            raise bad_request(f"max_tokens: must be >= 1, got {req.max_tokens}", "max_tokens")
        plan = tools_of(req)
        wid, prompt = await self._prompt(req, plan)
        mid = new_id()
        gen = api.Generate(
            request_id=mid,
            prompt_tokens=prompt,
            max_tokens=req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            stop=list(req.stop_sequences or []),
            qos=qos,  # type: ignore[arg-type]
            stream=bool(req.stream),
            model=req.model,
            **(tool_calls.generate_fields(plan.spec) if plan is not None else {}),
        )
        model = self.frontend.fleet[wid].model_name
        stream = await self.frontend.stream(gen, api_name=API_NAME)
        if req.stream:
            resume_id = stream.accepted.resume_id if stream.accepted is not None else ""
            shape = StreamShape(self, mid, model, gen.stop, req.model, plan)
            if plan is not None:  # a held tool call cannot be resumed mid-way
                resume_id = ""
            self.host.resumes.remember(mid, API_NAME, shape.state(), resume_id)
            try:
                return await shape.write(request, stream, len(prompt), 0)
            finally:
                await self.host.release([stream], bool(resume_id))
        async with stream:
            text, ids, done = [], [], None
            async for msg in stream:
                if isinstance(msg, api.Tokens):
                    text.append(msg.text)
                    ids.extend(msg.ids)
                elif isinstance(msg, api.Done):
                    done = msg
                elif isinstance(msg, api.Error):
                    raise from_code(msg.code, msg.message)
            if done is None:
                raise HttpError(500, "the generation ended without a result", code="internal")
            out = "".join(text)
            calls = tool_calls.parse(plan, out) if plan is not None else None
            stop = None if calls else await self.stop_string(req.model, done, out, ids, gen.stop)
            usage = usage_of(done, len(prompt), len(ids))
            reason = stop_reason(done, stop, calls)
            return web.json_response(message_object(mid, model, out, reason, stop, usage, calls))

    async def stop_string(
        self, model: str, done: api.Done, text: str, ids: list[int], stops: list[str]
    ) -> str | None:
        if done.finish_reason != "stop" or not stops:
            return None
        return matched_stop(await self.frontend.detokenize(model, ids), text, stops)


class StreamShape:
    """Writes one Messages stream from front-end replies (module docstring); ``write`` serves a
    fresh stream (``after`` 0) and a resumed one alike."""

    def __init__(
        self,
        owner: AnthropicApi,
        mid: str,
        model: str,
        stops: list[str],
        model_req: str,
        plan: tool_calls.ToolPlan | None = None,
    ) -> None:
        self.plan = plan
        self.owner = owner
        self.mid = mid
        self.model = model
        self.stops = stops
        self.model_req = model_req

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "stops": self.stops, "model_req": self.model_req}

    async def write(
        self, request: web.Request, stream: Any, prompt_tokens: int, after: int
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=sse.HEADERS)
        await resp.prepare(request)
        count = after
        eid = f"{self.mid}:{count}"
        held = tool_calls.ToolStream(self.plan) if self.plan is not None else None
        text_open = after > 0  # a resumed stream's text block is already open
        start_text = event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": TEXT_BLOCK},
            eid,
        )
        if after == 0:
            head = message_object(self.mid, self.model, "", None, None, usage_of(None, prompt_tokens, 0))
            first = event("message_start", {"type": "message_start", "message": head}, eid)
            if held is None:
                first += start_text
                text_open = True
            await resp.write(first + event("ping", {"type": "ping"}, eid))
        text, ids = [], []
        async for msg in stream:
            if isinstance(msg, api.Tokens):
                count += len(msg.ids)
                ids.extend(msg.ids)
                text.append(msg.text)
                piece = held.feed(msg.text) if held is not None else msg.text
                if piece:
                    delta = {"type": "text_delta", "text": piece}
                    data = {"type": "content_block_delta", "index": 0, "delta": delta}
                    out = b"" if text_open else start_text
                    text_open = True
                    await resp.write(out + event("content_block_delta", data, f"{self.mid}:{count}"))
            elif isinstance(msg, api.Done):
                eid = f"{self.mid}:{count}"
                calls, rest = held.finish() if held is not None else (None, "")
                stop = None
                if calls:
                    pass
                elif after == 0:
                    stop = await self.owner.stop_string(self.model_req, msg, "".join(text), ids, self.stops)
                elif msg.finish_reason == "stop" and len(self.stops) == 1:
                    stop = self.stops[0]
                usage = usage_of(msg, prompt_tokens, count)
                delta = {"stop_reason": stop_reason(msg, stop, calls), "stop_sequence": stop}
                out = b""
                if calls:
                    out += self.tool_use_events(calls, eid)
                else:
                    if not text_open:
                        out += start_text
                    if rest:
                        data = {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": rest},
                        }
                        out += event("content_block_delta", data, eid)
                    out += event("content_block_stop", {"type": "content_block_stop", "index": 0}, eid)
                await resp.write(
                    out
                    + event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}, eid)
                    + event("message_stop", {"type": "message_stop"}, eid)
                )
            elif isinstance(msg, api.Error):
                body = error_body(from_code(msg.code, msg.message))
                await resp.write(event("error", body, f"{self.mid}:{count}"))
                return resp
            elif isinstance(msg, api.Queued):
                await resp.write(event("ping", {"type": "ping"}))
        return resp

    @staticmethod
    def tool_use_events(calls: list[dict[str, Any]], eid: str) -> bytes:
        """The events of complete calls: per call a ``tool_use`` block start with an empty
        input, one ``input_json_delta`` with the whole input, the block stop."""
        out = b""
        for k, block in enumerate(tool_use_blocks(calls)):
            partial = json.dumps(block["input"], ensure_ascii=False)
            start = {"type": "content_block_start", "index": k, "content_block": {**block, "input": {}}}
            delta = {
                "type": "content_block_delta",
                "index": k,
                "delta": {"type": "input_json_delta", "partial_json": partial},
            }
            out += (
                event("content_block_start", start, eid)
                + event("content_block_delta", delta, eid)
                + event("content_block_stop", {"type": "content_block_stop", "index": k}, eid)
            )
        return out
