"""OpenAI's endpoints (and llama-server's / vLLM's tokenizer endpoints) over a ``FrontendPort``:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize`` (llama-server's and vLLM's
field names both accepted; vLLM's chat form of ``/tokenize``: ``messages``,
``add_generation_prompt``). A body whose ``model`` is ``"unknown"`` (what SGLang's gateway writes
for a request without one) goes to the default model (``router_api.served_model``).

Each generation request becomes one ``Generate`` per prompt and choice (``translate``); the
replies become OpenAI's objects (``wire.Shape``), a JSON body or SSE chunks (``sse``) ending with
``data: [DONE]``. Every failure is an OpenAI error object (``errors``); after an SSE stream began
it is one ``error`` event, then ``[DONE]``. A streamed request with one choice and no tools can be
resumed with ``Last-Event-ID`` (``resume``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from basertd.schema import client as api
from basertd.server.transport.http import body, resume, sse, tool_calls
from basertd.server.transport.http.auth import requester_of
from basertd.server.transport.http.chat_template import ChatTemplateError
from basertd.server.transport.http.errors import HttpError, bad_request, from_code
from basertd.server.transport.http.openai import echo, wire
from basertd.server.transport.http.openai import translate as tr
from basertd.server.transport.http.openai.render import chat_max_tokens, chat_prompt, name_sent_fields
from basertd.server.transport.http.port import FrontendPort, StreamPort
from basertd.server.transport.http.router_api import served_model
from basertd.server.transport.http.templates import Templates

API_NAME = "openai"


class OpenAiApi:
    """OpenAI's endpoints over ``frontend`` (module docstring); ``templates`` renders chats,
    ``releaser`` closes streams when a handler ends."""

    def __init__(self, frontend: FrontendPort, templates: Templates, releaser: resume.Releaser) -> None:
        self.frontend = frontend
        self.templates = templates
        self.releaser = releaser

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{id:.+}", self.model),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/tokenizer_info", self.tokenizer_info),
        ]

    # --- models and tokenizer --------------------------------------------------------------------

    def _model_objects(self) -> list[dict[str, Any]]:
        return [
            {
                "id": m.id,
                "object": "model",
                "created": 0,
                "owned_by": "basertd",
                "max_model_len": m.context_length,
            }
            for m in self.frontend.models()
        ]

    async def models(self, request: web.Request) -> web.Response:
        return body.json_response({"object": "list", "data": self._model_objects()})

    async def model(self, request: web.Request) -> web.Response:
        wanted = request.match_info["id"]
        for m in self._model_objects():
            if m["id"] == wanted:
                return body.json_response(m)
        raise HttpError(404, f"model {wanted!r} is not served here", param="model", code="model_not_found")

    async def tokenize(self, request: web.Request) -> web.Response:
        req = body.decode(await body.read(request), wire.TokenizeBody)
        req.model = served_model(self.frontend, req.model)
        add = req.add_special if req.add_special is not None else req.add_special_tokens
        if req.messages is not None:
            tokens = await self._tokenize_chat(req, add)
        else:
            text = req.content if req.content is not None else req.prompt
            if text is None:
                raise bad_request("give content (or prompt, or messages)", "content")
            if (
                add is None
            ):  # each server's own default: llama-server's content adds no BOS, vLLM's prompt does
                add = req.content is None
            tokens = await self.frontend.tokenize(req.model, text, add_special=add)
        ctx = self.frontend.context_length(self.frontend.route(req.model))
        return body.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": ctx})

    async def _tokenize_chat(self, req: wire.TokenizeBody, add_special: bool | None) -> list[int]:
        """vLLM's chat form of ``/tokenize``: ``messages`` rendered with the worker's template
        (``add_generation_prompt``, default true), then tokenized (BOS unless the template wrote
        it, or as ``add_special_tokens`` says). ``continue_final_message`` is served as false only
        (400 otherwise, ``extensions``)."""
        if req.continue_final_message:
            raise bad_request(
                "continue_final_message = true is not served here: this server accepts it only as false",
                "continue_final_message",
                code="unsupported_value",
            )
        self.templates.check_messages(len(req.messages or []))
        messages = tr.message_dicts(req.messages or [])
        try:
            _, template = self.templates.for_model(req.model)
            gen_prompt = req.add_generation_prompt is not False
            text = await self.templates.render(template, messages, add_generation_prompt=gen_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages", code="chat_template") from None
        add = template.needs_bos(text) if add_special is None else add_special
        return await self.frontend.tokenize(req.model, text, add_special=add)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /tokenizer_info`` (what lm-eval's ``tokenizer_backend=remote`` reads before
        it tokenizes through ``/tokenize``): the model's (``?model=``, default the first) BOS,
        EOS and pad texts (null when the vocabulary has none), its chat template's source (null
        without one), ``model_max_length`` (tokens per lane) and ``tokenizer_class``."""
        model = served_model(self.frontend, request.query.get("model", ""))
        wid = self.frontend.route(model)
        inputs = self.frontend.template_inputs(wid)
        try:
            template: str | None = self.templates.for_model(model)[1].source
        except ChatTemplateError:
            template = None
        return body.json_response(
            {
                "tokenizer_class": "llama.cpp",
                "bos_token": inputs.bos_token or None,
                "eos_token": inputs.eos_token or None,
                "pad_token": None,
                "chat_template": template,
                "model_max_length": self.frontend.context_length(wid),
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        req = body.decode(await body.read(request), wire.DetokenizeBody)
        text = await self.frontend.detokenize(req.model, req.tokens)
        return body.json_response({"content": text, "prompt": text})

    # --- generation ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if resume.HEADER in request.headers:
            return await self._resume(request, chat=False)
        req = body.decode(await body.read(request), wire.CompletionRequest)
        req.model = served_model(self.frontend, req.model)
        tr.check_fields(req)
        prompts = tr.prompts_of(req.prompt)
        max_tokens = tr.COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if not req.echo:
            return await self._generate(request, req, [(p, max_tokens) for p in prompts], chat=False)
        k = tr.logprobs_of(req)
        echoes = [await echo.echo_of(self.frontend, req.model, p, k) for p in prompts]
        if max_tokens == 0:  # the prompts alone (vLLM's answer)
            return await self._echo_only(request, req, echoes)
        jobs = [(e.tokens, max_tokens) for e in echoes]
        return await self._generate(request, req, jobs, chat=False, echoes=echoes)

    async def _echo_only(
        self, request: web.Request, req: wire.CompletionRequest, echoes: list[echo.Echo]
    ) -> web.StreamResponse:
        """``echo`` with ``max_tokens: 0``: each prompt (n times) with ``finish_reason`` "length"."""
        n = req.n or 1
        shape = wire.Shape(
            False, body.new_id("cmpl"), self.frontend.model_name(self.frontend.route(req.model))
        )
        usage = wire.usage_of(sum(len(e.tokens) for e in echoes), 0, 0)
        choices = [(e.text, "length", e.logprobs) for e in echoes for _ in range(n)]
        if not req.stream:
            return body.json_response(shape.full(choices, usage))
        resp = web.StreamResponse(headers=sse.HEADERS)
        await resp.prepare(request)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        for i, (text, finish, lp) in enumerate(choices):
            await resp.write(
                sse.event(shape.chunk(i, text, finish, include_usage=include_usage, logprobs=lp))
            )
        if include_usage:
            await resp.write(sse.event(shape.usage_chunk(usage)))
        await resp.write(sse.DONE)
        return resp

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if resume.HEADER in request.headers:
            return await self._resume(request, chat=True)
        req = body.decode(await body.read(request), wire.ChatRequest)
        name_sent_fields(request, req)
        req.model = served_model(self.frontend, req.model)
        tr.check_fields(req)
        qos = body.qos_of(req.qos, request.headers.get(body.QOS_HEADER))
        prompt = await chat_prompt(self.frontend, self.templates, req, qos)
        max_tokens = chat_max_tokens(self.frontend, req, prompt)
        return await self._generate(request, req, [(prompt.tokens, max_tokens)], chat=True, tools=prompt.plan)

    async def _generate(
        self,
        request: web.Request,
        req: wire.Common,
        prompts: list[tuple[str | list[int], int]],
        *,
        chat: bool,
        tools: tool_calls.ToolPlan | None = None,
        echoes: list[echo.Echo] | None = None,
    ) -> web.StreamResponse:
        """One ``Generate`` per prompt and choice, answered whole or as SSE; ``echoes`` (one per
        prompt, ``echo: true``) start each choice."""
        qos = body.qos_of(req.qos, request.headers.get(body.QOS_HEADER))
        stream = bool(req.stream)
        if req.stream_options is not None and not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        n = req.n or 1
        rid = body.new_id("chatcmpl" if chat else "cmpl")
        gens = [
            tr.generate_of(
                req,
                f"{rid}-{i * n + j}",
                prompt=prompt,
                max_tokens=max_tokens,
                qos=qos,
                stream=stream,
                tool_spec=tools.spec if tools else None,
                choice=j,
            )
            for i, (prompt, max_tokens) in enumerate(prompts)
            for j in range(n)
        ]
        model_name = self.frontend.model_name(self.frontend.route(req.model))
        shape = wire.Shape(chat, rid, model_name, tools)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        context = None
        if stream and len(gens) == 1 and tools is None and echoes is None:  # one id to resume
            context = resume.context_of(
                _kind(chat), response_id=rid, model=model_name, include_usage=include_usage
            )
        requester = requester_of(request)
        streams: list[StreamPort] = []
        resumable = False
        try:
            for gen in gens:
                streams.append(
                    await self.frontend.stream(gen, api_name=API_NAME, requester=requester, context=context)
                )
            if stream:
                continuous = include_usage and bool(req.stream_options.continuous_usage_stats)  # type: ignore[union-attr]
                key = resume.key_of(streams[0]) if context is not None else ""
                resumable = bool(key)
                ids = [key] if resumable else None
                return await self._sse(
                    request, shape, streams, n, include_usage, ids=ids, continuous=continuous, echoes=echoes
                )
            return await self._collect(shape, streams, n, echoes)
        finally:
            await self.releaser.release(streams, resumable)

    async def _resume(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        """The rest of a stream after ``Last-Event-ID`` (``basertd.server.transport.http.resume``)."""
        key, followed, after = await resume.follow(self.frontend, request, _kind(chat))
        ctx = followed.context
        shape = wire.Shape(chat, ctx["response_id"], ctx["model"])
        async with followed:
            usage = ctx["include_usage"]
            return await self._sse(request, shape, [followed], 1, usage, ids=[key], after=after)

    async def _collect(
        self, shape: wire.Shape, streams: list[StreamPort], n: int, echoes: list[echo.Echo] | None = None
    ) -> web.Response:
        async def one(c: int, s: StreamPort) -> tuple[wire.Choice, api.Done]:
            e = echoes[c // n] if echoes else None
            parts = [e.text] if e else []
            lp = wire.Logprobs(shape.chat, s.piece, offset=len(e.text) if e else 0)
            async for msg in s:
                if isinstance(msg, api.Tokens):
                    parts.append(msg.text)
                    lp.add(msg.logprobs)
                elif isinstance(msg, api.Done):
                    lps = echo.join(e.logprobs, lp.take()) if e else lp.take()
                    return ("".join(parts), wire.finish_reason(msg), lps), msg
                elif isinstance(msg, api.Error):
                    raise from_code(msg.code, msg.message)
            raise HttpError(500, "the generation ended without a result", code="internal")

        results = await asyncio.gather(*(one(c, s) for c, s in enumerate(streams)))
        choices = [choice for choice, _ in results]
        return body.json_response(shape.full(choices, tr.usage([d for _, d in results], n)))

    async def _sse(
        self,
        request: web.Request,
        shape: wire.Shape,
        streams: list[StreamPort],
        n: int,
        include_usage: bool,
        *,
        ids: list[str] | None = None,
        after: int = 0,
        continuous: bool = False,
        echoes: list[echo.Echo] | None = None,
    ) -> web.StreamResponse:
        """Stream ``streams`` as SSE, event ids ``<ids[i]>:<tokens so far>`` (``ids``: the resume
        key of a resumable stream, sent as ``resume.KEY_HEADER`` too; else the request ids); a
        resumed stream (``after`` > 0 tokens the client has) gets no role chunk and its ids count
        on from ``after``; ``echoes`` (per prompt) come first. ``continuous`` (vLLM's
        ``stream_options.continuous_usage_stats`` with ``include_usage``): every chunk carries its
        choice's usage so far (prompt tokens, tokens generated up to and with that chunk)."""
        headers = dict(sse.HEADERS)
        if ids:
            headers[resume.KEY_HEADER] = ids[0]
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        counts = [after] * len(streams)
        ids = ids or [s.request_id for s in streams]
        offsets = [0] * len(streams)
        for c in range(len(streams) if echoes else 0):
            e = echoes[c // n]  # type: ignore[index]
            offsets[c] = len(e.text)
            await resp.write(sse.event(shape.chunk(c, e.text, logprobs=e.logprobs), f"{ids[c]}:0"))

        def so_far(i: int) -> dict[str, Any] | None:
            if not continuous:
                return None
            accepted = streams[i].accepted
            prompt = accepted.prompt_tokens if accepted else 0
            return {
                "prompt_tokens": prompt,
                "completion_tokens": counts[i],
                "total_tokens": prompt + counts[i],
            }

        if shape.chat and after == 0:
            first = b"".join(
                sse.event(
                    shape.chunk(i, "", role=True, include_usage=include_usage, usage=so_far(i)), f"{ids[i]}:0"
                )
                for i in range(len(streams))
            )
            await resp.write(first)
        dones: list[api.Done | None] = [None] * len(streams)
        lps = [wire.Logprobs(shape.chat, s.piece, offset=offsets[c]) for c, s in enumerate(streams)]
        held = [shape.tool_stream() for _ in streams]  # tool calls wait until complete
        async for i, msg in _merge(streams):
            if isinstance(msg, api.Tokens):
                counts[i] += len(msg.ids)
                lps[i].add(msg.logprobs)
                text = held[i].feed(msg.text) if held[i] is not None else msg.text  # type: ignore[union-attr]
                if text:
                    chunk = shape.chunk(
                        i, text, include_usage=include_usage, logprobs=lps[i].take(), usage=so_far(i)
                    )
                    await resp.write(sse.event(chunk, f"{ids[i]}:{counts[i]}"))
            elif isinstance(msg, api.Done):
                dones[i] = msg
                finish, calls, rest = wire.finish_reason(msg), None, None
                if held[i] is not None:
                    calls, rest = held[i].finish()  # type: ignore[union-attr]
                    if calls:
                        finish = "tool_calls"
                if calls or rest:
                    chunk = shape.chunk(
                        i,
                        rest,
                        include_usage=include_usage,
                        logprobs=lps[i].take(),
                        calls=calls,
                        usage=so_far(i),
                    )
                    await resp.write(sse.event(chunk, f"{ids[i]}:{counts[i]}"))
                chunk = shape.chunk(
                    i,
                    None if shape.chat else "",
                    finish,
                    include_usage=include_usage,
                    logprobs=lps[i].take(),
                    usage=so_far(i),
                )
                await resp.write(sse.event(chunk, f"{ids[i]}:{counts[i]}"))
            elif isinstance(msg, api.Error):
                await resp.write(sse.event(from_code(msg.code, msg.message).body(), f"{ids[i]}:{counts[i]}"))
                await resp.write(sse.DONE)
                return resp
            elif isinstance(msg, api.Queued):
                await resp.write(sse.comment(f"queued at position {msg.position}"))
        if include_usage:
            usage = tr.usage([d for d in dones if d is not None], n)
            await resp.write(sse.event(shape.usage_chunk(usage), f"{ids[0]}:{sum(counts)}"))
        await resp.write(sse.DONE)
        return resp


async def _merge(streams: list[StreamPort]) -> AsyncIterator[tuple[int, Any]]:
    """``(index, reply)`` of every stream as they arrive, until each has ended."""
    if len(streams) == 1:
        async for msg in streams[0]:
            yield 0, msg
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: StreamPort) -> None:
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
