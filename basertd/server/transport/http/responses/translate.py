"""A ``POST /v1/responses`` body to the chat the template renders and the ``Generate`` it becomes
(DESIGN.md "Client API"), and the generated text back to output items.

Input: ``input`` a string (one user message) or a list of items: ``message`` (role user / system /
developer / assistant; content a string or ``input_text`` / ``output_text`` parts), ``function_call``
(an assistant turn's call, merged into the assistant turn before it) and ``function_call_output``
(a ``role: tool`` turn), the chat shape ``tool_calls.render`` takes; ``instructions`` is a system
message in front. A ``previous_response_id``'s conversation (``store``) goes before the input.

Tools: function tools ``{"type": "function", "name", "description", "parameters", "strict"}`` in
the chat dialect's shape (``tool_calls.plan_of``); ``strict`` (true unless false, as the API
reads it) closes the parameters' objects (``strict_schema.close_objects``). ``tool_choice`` none /
auto / required / ``{"type": "function", "name"}``. ``text.format`` json_object / json_schema
(``strict: true`` closes its objects too) constrains a message; with tools under ``auto`` the
output is a call or the formatted answer (``answer_or_call``); under ``required`` or a named
function the output is calls and the format waits for a later turn.

What is not served is a 400 naming the field: another tool type (``web_search``, ...), another
``tool_choice`` type, ``reasoning.effort`` other than none, ``background: true``, ``include``
values other than ``reasoning.encrypted_content`` (there is no reasoning to include),
``truncation: "auto"``, ``top_logprobs`` above 0, ``max_tool_calls``, ``text.verbosity`` other
than medium, ``service_tier`` other than auto / default, ``prompt``, ``conversation``,
``context_management``. The same fields at their no-op values are accepted.

Extensions: ``seed``, ``top_k`` (-1 is off, as vLLM and SGLang send it), ``min_p``,
``repetition_penalty``, ``qos`` and ``speculation`` (``Generate.speculation``: "auto", "off" or a
strategy name; a value the daemon cannot honour is a 400 naming it, before anything is queued);
``priority`` at 0, as SGLang's gateway forwards it.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from basertd.json_bounds import bound_numbers
from basertd.schema import client as api
from basertd.server.request import grammar, strict_schema
from basertd.server.request.grammar import GrammarRequestError, GrammarSpec
from basertd.server.transport.http import tool_calls
from basertd.server.transport.http.errors import bad_request
from basertd.server.transport.http.extensions import top_k_of
from basertd.server.transport.http.responses import wire

_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
"""llguidance's JSON options inside Lark, the compact JSON every JSON-schema grammar writes."""
_INCLUDE_NOOP = ("reasoning.encrypted_content",)


def check_fields(req: wire.ResponsesRequest) -> None:
    """Refuse (400 naming the field) what is not served; accept the same fields at their no-op
    values (module docstring)."""
    if req.background:
        raise bad_request("background responses are not served (background: true)", "background")
    if req.reasoning is not None and req.reasoning.effort not in (None, "none"):
        raise bad_request(
            f"reasoning.effort {req.reasoning.effort!r} is not served: the models here do not reason "
            "(leave it out or send 'none')",
            "reasoning.effort",
        )
    for value in req.include or []:
        if value not in _INCLUDE_NOOP:
            raise bad_request(f"include {value!r} is not served", "include")
    if req.truncation not in (None, "disabled"):
        raise bad_request(f"truncation {req.truncation!r} is not served (only 'disabled')", "truncation")
    if req.top_logprobs not in (None, 0):
        raise bad_request("top_logprobs is not served on /v1/responses", "top_logprobs")
    if req.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not served", "max_tool_calls")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise bad_request(f"text.verbosity {req.text.verbosity!r} is not served", "text.verbosity")
    if req.service_tier not in (None, "auto", "default"):
        raise bad_request(f"service_tier {req.service_tier!r} is not served", "service_tier")
    if req.priority not in (None, 0) or isinstance(req.priority, bool):
        raise bad_request(f"priority {req.priority!r} is not served (only 0)", "priority")
    for name in ("prompt", "conversation", "context_management"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not served", name)
    if req.input is None or req.input == [] or req.input == "":
        raise bad_request("input is required (a string or a non-empty list of items)", "input")


# --- input ---------------------------------------------------------------------------------------


def _convert(raw: Any, kind: type[msgspec.Struct], where: str) -> Any:
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = text.rsplit(" - at `$", 1)
        param = where + at[1].rstrip("`") if len(at) == 2 else where
        raise bad_request(f"{where}: {at[0]}", param) from None


def _text_of(content: str | list[wire.TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _check_parts(raw: Any, where: str) -> None:
    """A 400 for a content part that is not text (images, files, audio)."""
    if isinstance(raw, list):
        for j, part in enumerate(raw):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in wire.TEXT_PART_TYPES:
                raise bad_request(
                    f"{where}[{j}]: only input_text and output_text parts are served, got type {kind!r}",
                    f"{where}[{j}].type",
                )


def conversation_of(input_value: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages of ``input`` (module docstring). Raises a 400 naming the item and field
    for an item or part type not served or a malformed item."""
    if isinstance(input_value, str):
        return [{"role": "user", "content": input_value}]
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, raw in enumerate(input_value):
        where = f"input[{i}]"
        if not isinstance(raw, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = raw.get("type", "message")
        spec = wire.ITEM_TYPES.get(kind)
        if spec is None:
            served = ", ".join(wire.ITEM_TYPES)
            raise bad_request(f"{where}: item type {kind!r} is not served ({served})", f"{where}.type")
        _check_parts(raw.get("content") if kind == "message" else raw.get("output"), f"{where}.content")
        item = _convert(raw, spec, where)
        if isinstance(item, wire.MessageItem):
            out.append({"role": item.role, "content": _text_of(item.content)})
        elif isinstance(item, wire.FunctionCallItem):
            names[item.call_id] = item.name
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            d = {"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output)}
            if item.call_id in names:
                d["name"] = names[item.call_id]
            out.append(d)
    return out


# --- tools and format ----------------------------------------------------------------------------


def chat_tools_of(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The Responses function tools in the chat dialect's shape (``strict`` closes the
    parameters' objects); None for none (``[]`` as clients send it is none). Raises a 400 naming
    ``tools[i]`` for another tool type or a malformed one."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: tool type {kind!r} is not served (only function tools)", f"tools[{i}].type"
            )
        extra = set(t) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            field = sorted(extra)[0]
            raise bad_request(f"unsupported field 'tools[{i}].{field}'", f"tools[{i}].{field}")
        params = t.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if t.get("strict", True) is not False and isinstance(params, dict):
            params = strict_schema.close_objects(params)
        fn = {"name": t.get("name"), "parameters": params}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice_of(choice: Any) -> Any:
    """``tool_choice`` in the chat dialect's shape. Raises a 400 for a type not served."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if set(choice) - {"type", "name"}:
            raise bad_request("tool_choice: a function choice is {'type': 'function', 'name'}", "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise bad_request(f"tool_choice type {kind!r} is not served", "tool_choice")


def response_format_of(text: wire.TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as the chat dialect's ``response_format`` (None for plain text); a strict
    json_schema has its objects closed. Raises a 400 for an unknown or malformed format."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise bad_request(f"unsupported field 'text.format.{sorted(extra)[0]}'", "text.format")
        schema = fmt.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format.schema")
        if fmt.get("strict") is True:
            schema = strict_schema.close_objects(schema)
        js = {"name": fmt.get("name", "output"), "schema": schema, "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": js}
    raise bad_request(
        f"text.format type {kind!r} is not served (text, json_object, json_schema)", "text.format"
    )


def answer_or_call(plan: tool_calls.ToolPlan, response_format: dict[str, Any]) -> GrammarSpec:
    """The grammar of ``auto`` tools with a formatted answer: a call (as ``tool_calls`` parses it)
    or the JSON the format asks for; numbers bounded as in every JSON grammar
    (``basertd.json_bounds``), with the schemas as given as the fallback should that not compile.
    Not compiled yet (``FrontendPort.compile_spec`` compiles it)."""
    call = grammar.call_schema(plan.tools, plan.parallel, min(tool_calls.MAX_PARALLEL_CALLS, len(plan.tools)))
    answer: Any = {"type": "object"}
    if response_format["type"] == "json_schema":
        answer = response_format["json_schema"]["schema"]

    def lark(bound: bool) -> str:
        parts = []
        for name, schema in (("call", call), ("answer", answer)):
            if isinstance(schema, dict):
                schema = {**(bound_numbers(schema) if bound else schema), "x-guidance": _COMPACT}
            parts.append(f"{name}: %json {json.dumps(schema, separators=(',', ':'))}\n")
        return "start: call | answer\n" + "".join(parts)

    try:
        fallback = grammar.validate_spec("lark", lark(False), label="text.format")
        return GrammarSpec("lark", lark(True), fallback=fallback, label="text.format")
    except GrammarRequestError as exc:
        raise bad_request(str(exc), "text.format") from None


def structured_fields(
    plan: tool_calls.ToolPlan | None, response_format: dict[str, Any] | None, combined: GrammarSpec | None
) -> dict[str, Any]:
    """The ``Generate`` fields constraining the output: the format, the tools' grammar (compiled),
    or ``combined`` (``answer_or_call``, compiled) when both apply."""
    if plan is None:
        return {"response_format": response_format}
    return tool_calls.generate_fields(combined if combined is not None else plan.spec)


def generate_of(
    req: wire.ResponsesRequest,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    qos: str,
    structured: dict[str, Any],
) -> api.Generate:
    """The ``Generate`` of a response (the limits table checks the values at admission)."""
    return api.Generate(
        request_id=request_id,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k_of(req.top_k),
        min_p=req.min_p or 0.0,
        repeat_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        qos=qos,  # type: ignore[arg-type]
        speculation=req.speculation or "auto",
        stream=bool(req.stream),
        model=req.model,
        **structured,
    )


# --- output --------------------------------------------------------------------------------------


def output_messages(text: str | None, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The chat messages of a response's output, as a later ``previous_response_id`` replays them."""
    if calls:
        return [{"role": "assistant", "content": text or "", "tool_calls": calls}]
    if text is None:
        return []
    return [{"role": "assistant", "content": text}]
