"""Anthropic's Messages API over a ``FrontendPort``: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

A request becomes one ``Generate`` (``translate``), its prompt rendered with the worker's chat
template (``templates``); the replies become a ``message`` object (``wire``) or Anthropic's named
SSE events: ``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``
(``text_delta``; ``input_json_delta`` for a complete tool call), ``content_block_stop``,
``message_delta`` (stop reason and usage), ``message_stop``; each carries
``id: <request id>:<tokens so far>`` (a resume point, ``basertd.server.transport.http.resume``).
A failure is Anthropic's error object with the statuses of ``errors.STATUS_OF`` (an ``error``
event once a stream began).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from basertd.schema import client as api
from basertd.server.transport.http import body, resume, sse, tool_calls
from basertd.server.transport.http.anthropic import translate as tr
from basertd.server.transport.http.anthropic.wire import (
    TEXT_BLOCK,
    CountRequest,
    MessagesRequest,
    error_body,
    event,
    message_object,
    new_id,
    tool_use_blocks,
    usage_of,
)
from basertd.server.transport.http.chat_template import ChatTemplateError
from basertd.server.transport.http.errors import HttpError, bad_request, from_code
from basertd.server.transport.http.port import FrontendPort, StreamPort
from basertd.server.transport.http.templates import Templates

API_NAME = "anthropic"


class AnthropicApi:
    """The Messages endpoints over ``frontend`` (module docstring); ``templates`` renders chats,
    ``resumes`` remembers resumable streams, ``releaser`` closes streams when a handler ends."""

    def __init__(
        self,
        frontend: FrontendPort,
        templates: Templates,
        resumes: resume.ResumeIndex,
        releaser: resume.Releaser,
    ) -> None:
        self.frontend = frontend
        self.templates = templates
        self.resumes = resumes
        self.releaser = releaser

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages), web.post("/v1/messages/count_tokens", self.count)]

    async def _prompt(self, req: CountRequest, plan: tool_calls.ToolPlan | None) -> tuple[int, list[int]]:
        self.templates.check_messages(len(req.messages))
        messages, prefill = tr.conversation(req)
        if prefill and plan is not None:
            raise bad_request("a final assistant message (prefill) cannot be combined with tools", "messages")
        try:
            wid, template = self.templates.for_model(req.model)
            text = await self.templates.render_chat(template, messages, plan) + prefill
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        tokens = await self.frontend.tokenize(req.model, text, add_special=template.needs_bos(text))
        return wid, tokens

    async def count(self, request: web.Request) -> web.Response:
        req = body.decode(await body.read(request), CountRequest)
        qos = body.qos_of(None, request.headers.get(body.QOS_HEADER))
        plan = await self.templates.tool_plan(req.model, qos, *tr.tool_fields(req))
        _, tokens = await self._prompt(req, plan)
        return web.json_response({"input_tokens": len(tokens)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        if resume.HEADER in request.headers:
            mid, entry, after = self.resumes.lookup(request.headers[resume.HEADER], API_NAME)
            st = entry.state
            shape = StreamShape(self, mid, st["model"], st["stops"], st["model_req"])
            async with self.frontend.follow(entry.resume_id, after) as followed:
                return await shape.write(request, followed, followed.accepted.prompt_tokens, after)
        req = body.decode(await body.read(request), MessagesRequest)
        qos = body.qos_of(req.qos, request.headers.get(body.QOS_HEADER))
        tr.check_max_tokens(req)
        plan = await self.templates.tool_plan(req.model, qos, *tr.tool_fields(req))
        wid, prompt = await self._prompt(req, plan)
        mid = new_id()
        gen = tr.generate_of(req, mid, prompt, qos, plan)
        model = self.frontend.model_name(wid)
        stream = await self.frontend.stream(gen, api_name=API_NAME)
        if req.stream:
            resume_id = stream.accepted.resume_id if stream.accepted is not None else ""
            shape = StreamShape(self, mid, model, gen.stop, req.model, plan)
            if plan is not None:  # a held tool call cannot be resumed mid-way
                resume_id = ""
            self.resumes.remember(mid, API_NAME, shape.state(), resume_id)
            try:
                return await shape.write(request, stream, len(prompt), 0)
            finally:
                await self.releaser.release([stream], bool(resume_id))
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
            reason = tr.stop_reason(done, stop, calls)
            shown = out if calls else tool_calls.content_of(plan, out)
            return web.json_response(message_object(mid, model, shown, reason, stop, usage, calls))

    async def stop_string(
        self, model: str, done: api.Done, text: str, ids: list[int], stops: list[str]
    ) -> str | None:
        if done.finish_reason != "stop" or not stops:
            return None
        return tr.matched_stop(await self.frontend.detokenize(model, ids), text, stops)


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
        self, request: web.Request, stream: StreamPort, prompt_tokens: int, after: int
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
                delta = {"stop_reason": tr.stop_reason(msg, stop, calls), "stop_sequence": stop}
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
