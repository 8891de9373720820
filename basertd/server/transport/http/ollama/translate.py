"""Ollama requests to the front end's ``Generate`` (DESIGN.md "Client API").

``/api/chat`` renders ``messages`` with the worker's chat template; ``/api/generate`` renders
``system`` + ``prompt`` as one user turn the same way, or sends ``prompt`` as is with
``raw: true``. ``options``: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``num_predict`` (max tokens; -1 or absent: the rest of the context), ``stop``, ``repeat_penalty``,
``presence_penalty``, ``frequency_penalty``, with Ollama's defaults, and our extension
``speculation`` (``Generate.speculation``: "auto", "off" or a strategy name; a value the daemon
cannot honour is a 400 naming it, before anything is queued); model-loading options
(``num_ctx``, ``num_gpu``, ``num_thread``, ...) are ignored (the daemon's configuration decides
them), as is ``keep_alive``; ``format`` ``"json"`` (any JSON object) or a JSON schema constrains
the output (``basertd.server.request.grammar``; an invalid schema is a 400 with llguidance's
message); ``tools`` are served as on the OpenAI API with ``tool_choice`` "auto" (Ollama has no
choice field): an assistant turn's ``tool_calls`` (``{"function": {"name", "arguments": {...}}}``)
and ``role: "tool"`` turns (``tool_name``) go back into the template (``tool_calls.render``), and
a reply that is a call comes back as ``message.tool_calls`` with ``arguments`` an object;
``images``, ``suffix``, ``template``, ``context`` and ``think`` are a 400 naming the field. ``qos``
(or the header ``X-Basertd-QoS``) is our extension.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from basertd.schema import client as api
from basertd.schema.client import QosClass
from basertd.server.request.grammar import GrammarRequestError, GrammarSpec, spec_from_request
from basertd.server.transport.http.errors import bad_request
from basertd.server.transport.http.ollama.wire import ChatRequest, Common, GenerateRequest, Options


def refuse(req: Common, fields: tuple[str, ...]) -> None:
    for name in fields:
        if getattr(req, name):
            raise bad_request(f"{name} is not supported by this server yet", name)


def response_format_of(fmt: Any) -> tuple[dict[str, Any] | None, GrammarSpec | None]:
    """``Generate.response_format`` of Ollama's ``format`` (``"json"`` any JSON object, an
    object a JSON schema, ``""`` / null nothing) and its spec labelled ``format``, not compiled
    yet. Raises 400 for anything else, or a schema that fails the cheap checks."""
    if fmt is None or fmt == "":
        return None, None
    if fmt == "json":
        rf = {"type": "json_object"}
        return rf, spec_from_request(rf)
    if not isinstance(fmt, (dict, bool)):
        raise bad_request('format must be "json" or a JSON schema object', "format")
    rf = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    try:
        spec = spec_from_request(rf)
    except GrammarRequestError as exc:
        raise bad_request(f"format: {exc}", "format") from None
    return rf, None if spec is None else dataclasses.replace(spec, label="format")


def generate_messages(req: GenerateRequest) -> list[dict[str, Any]]:
    """The chat-template messages of a non-raw ``/api/generate``: ``system`` (when given) and
    ``prompt`` as one user turn."""
    return ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}
    ]


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The chat-template messages of ``/api/chat``, in the OpenAI shape ``tool_calls.render``
    reads (an assistant turn's calls as ``{"id", "type": "function", "function": {"name",
    "arguments"}}``, the call's ``id`` kept when it has one; a tool turn's ``tool_name`` as
    ``name``, its ``tool_call_id`` (sent by litellm's ``ollama_chat/``) as ``tool_call_id``). Raises
    400 for images or a malformed call."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages or []):
        if m.images:
            raise bad_request(f"messages[{i}].images is not supported yet", f"messages[{i}].images")
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [_openai_call(i, k, c) for k, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_name:
            d["name"] = m.tool_name
        if m.role == "tool" and m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _openai_call(i: int, k: int, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            f"messages[{i}].tool_calls[{k}] must be {{'function': {{'name': ..., 'arguments': {{...}}}}}}",
            f"messages[{i}].tool_calls",
        )
    cid = call.get("id")
    return {
        "id": cid if isinstance(cid, str) and cid else f"call_{i}_{k}",
        "type": "function",
        "function": {"name": fn["name"], "arguments": fn.get("arguments", {})},
    }


def tool_calls_of(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's ``message.tool_calls`` of OpenAI ``tool_calls``: ``arguments`` an object."""
    return [
        {"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in calls
    ]


def max_tokens_of(o: Options, context_length: int, prompt_len: int) -> int:
    """``num_predict``, or the rest of the context for -1 / absent. Raises 400 for 0."""
    if o.num_predict is None or o.num_predict < 0:
        return max(1, context_length - prompt_len)
    if o.num_predict == 0:
        raise bad_request("options.num_predict must be > 0 (or -1: the rest of the context)", "options")
    return o.num_predict


def generate_of(
    req: Common,
    request_id: str,
    *,
    model: str,
    prompt: list[int],
    max_tokens: int,
    qos: QosClass,
    response_format: dict[str, Any] | None,
    grammar: str | None = None,
) -> api.Generate:
    """The ``Generate`` of a request with its rendered ``prompt`` tokens; a request streams unless
    ``stream`` is false (the limits table checks the values at admission)."""
    o = req.options or Options()
    return api.Generate(
        request_id=request_id,
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
        qos=qos,
        speculation=o.speculation or "auto",
        stream=req.stream is None or req.stream,
        model=model,
        response_format=response_format,
        grammar=grammar,
    )
