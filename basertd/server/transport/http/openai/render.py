"""vLLM's render endpoints, and the templating every chat request shares: what a request becomes
after templating and tokenizing, without running it (docs/scale-out.md).

``POST /v1/chat/completions/render`` answers a chat request's body with one vLLM
``GenerateRequest`` object; ``POST /v1/completions/render`` a completions body with a list of
them, one per prompt: ``request_id``, ``token_ids`` (the prompt as the worker would prefill it:
chat template and BOS applied), ``sampling_params`` (the values the request would run with,
vLLM's names: ``n``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (0 = off),
``min_p``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``ignore_eos``, ``logprobs``), ``model``, ``stream``, ``features``
null, ``cache_salt`` null, ``priority`` 0. vllm-router's cache-aware and kv-aware policies call
them on each worker to get a request's token ids. The body is checked like the generation
endpoints' (an unknown field, a value out of range: 400); nothing is queued.

``chat_prompt`` is the chat path shared with ``routes.OpenAiApi.chat``: messages rendered with
the worker's template (tools as ``tool_calls`` says) and tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from basertd.schema import client as api
from basertd.schema.client import QosClass
from basertd.server.frontend.limits import check_generate
from basertd.server.transport.http import body, literal, tool_calls
from basertd.server.transport.http.chat_template import ChatTemplateError
from basertd.server.transport.http.errors import PARAM_ALIASES, bad_request
from basertd.server.transport.http.openai import translate as tr
from basertd.server.transport.http.openai import wire
from basertd.server.transport.http.port import FrontendPort
from basertd.server.transport.http.router_api import served_model
from basertd.server.transport.http.templates import Templates


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request after templating: the worker handle it routes to, its prompt token ids and
    its tool plan (None without tools)."""

    worker: int
    tokens: list[int]
    plan: tool_calls.ToolPlan | None


async def chat_prompt(
    frontend: FrontendPort, templates: Templates, req: wire.ChatRequest, qos: QosClass
) -> ChatPrompt:
    """Render ``req``'s messages with its worker's chat template (off the loop, ``Templates``)
    and tokenize them; its tools compile at ``qos`` (``Templates.tool_plan``). Raises 400 (no
    template, a template that refuses the messages or runs past its limits, too many messages,
    bad tools) or ``AdmissionError``."""
    templates.check_messages(len(req.messages))
    messages = tr.message_dicts(req.messages)
    plan = await templates.tool_plan(req.model, qos, req.tools, req.tool_choice, req.parallel_tool_calls)
    try:
        wid, template = templates.for_model(req.model)
        tokens = await literal.encode_chat(  # the client's control-token text stays plain text
            frontend,
            req.model,
            messages,
            lambda m: templates.render_chat(template, m, plan),
            template.needs_bos,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages", code="chat_template") from None
    return ChatPrompt(wid, tokens, plan)


def name_sent_fields(request: web.Request, req: wire.ChatRequest) -> None:
    """Make a refusal of ``req`` name ``max_completion_tokens`` when that is the field the client
    sent (``errors.PARAM_ALIASES``)."""
    if req.max_completion_tokens is not None:
        request[PARAM_ALIASES] = {"max_tokens": "max_completion_tokens"}


def chat_max_tokens(frontend: FrontendPort, req: wire.ChatRequest, prompt: ChatPrompt) -> int:
    """``max_completion_tokens``, else ``max_tokens``, else the rest of the context."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, frontend.context_length(prompt.worker) - len(prompt.tokens))
    return max_tokens


class RenderApi:
    """The two render endpoints over ``frontend`` (module docstring)."""

    def __init__(self, frontend: FrontendPort, templates: Templates) -> None:
        self.frontend = frontend
        self.templates = templates

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions/render", self.completions),
            web.post("/v1/chat/completions/render", self.chat),
        ]

    async def completions(self, request: web.Request) -> web.Response:
        req = body.decode(await body.read(request), wire.CompletionRequest)
        req.model = served_model(self.frontend, req.model)
        tr.check_fields(req)
        max_tokens = tr.COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        out = []
        for prompt in tr.prompts_of(req.prompt):
            tokens = (
                prompt
                if isinstance(prompt, list)
                else await self.frontend.tokenize(req.model, prompt, add_special=True)
            )
            out.append(self._generate_request(req, tokens, max_tokens, "cmpl"))
        return body.json_response(out)

    async def chat(self, request: web.Request) -> web.Response:
        req = body.decode(await body.read(request), wire.ChatRequest)
        name_sent_fields(request, req)
        req.model = served_model(self.frontend, req.model)
        tr.check_fields(req)
        prompt = await chat_prompt(self.frontend, self.templates, req, QosClass.INTERACTIVE)
        max_tokens = chat_max_tokens(self.frontend, req, prompt)
        return body.json_response(self._generate_request(req, prompt.tokens, max_tokens, "chatcmpl"))

    def _generate_request(
        self, req: wire.Common, tokens: list[int], max_tokens: int, kind: str
    ) -> dict[str, Any]:
        rid = body.new_id(kind)
        gen = tr.generate_of(req, rid, prompt=tokens, max_tokens=max_tokens, qos="interactive", stream=False)
        model = self.frontend.model_name(self.frontend.route(req.model))
        return generate_request(gen, model, bool(req.stream), req.n or 1)


def generate_request(gen: api.Generate, model: str, stream: bool, n: int = 1) -> dict[str, Any]:
    """``gen`` (its ``prompt_tokens`` set) as vLLM's render endpoints answer: a ``GenerateRequest``
    of ``model`` with ``n`` choices. Raises ``AdmissionError`` for what admission would refuse
    (``check_generate``: a render never shows a request that could not run)."""
    check_generate(gen)
    return {
        "request_id": gen.request_id,
        "token_ids": list(gen.prompt_tokens or []),
        "features": None,
        "sampling_params": _sampling_params(gen, n),
        "model": model,
        "stream": stream,
        "cache_salt": None,
        "priority": 0,
    }


def _sampling_params(gen: api.Generate, n: int) -> dict[str, Any]:
    """``gen``'s sampling as vLLM's ``SamplingParams`` names them."""
    return {
        "n": n,
        "max_tokens": gen.max_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "min_p": gen.min_p,
        "seed": gen.seed,
        "stop": list(gen.stop),
        "presence_penalty": gen.presence_penalty,
        "frequency_penalty": gen.frequency_penalty,
        "repetition_penalty": gen.repeat_penalty,
        "ignore_eos": gen.ignore_eos,
        "logprobs": gen.logprobs,
    }
