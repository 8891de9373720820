"""Anthropic Messages requests to the front end's ``Generate`` (DESIGN.md "Client API").

``system`` (a string or text blocks) and ``messages`` (``user`` / ``assistant``, content a string
or text blocks) become chat-template messages (``conversation``); a last ``assistant`` message is
a prefill the reply continues. ``max_tokens`` is required; ``temperature`` (0..1 in Anthropic's
API, our limits table allows more), ``top_p``, ``top_k``, ``stop_sequences``, ``stream`` and
``metadata.user_id`` (logged nowhere, accepted) are served; ``qos`` (or the header
``X-Basertd-QoS``) and ``speculation`` (``Generate.speculation``: "auto", "off" or a strategy
name; a value the daemon cannot honour is a 400 naming it, before anything is queued) are our
extensions. ``cache_control`` on a block is accepted and has no effect:
the prefix cache is automatic. Images, documents and extended thinking are a 400 naming the field.

Tools (``basertd.server.transport.http.tool_calls``): ``tools`` (``name``, ``description``,
``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool`` with ``name``, ``none``;
``disable_parallel_tool_use``) map to OpenAI's function tools, ``tool_choice`` and
``parallel_tool_calls`` (``tool_fields``); ``any`` and ``tool`` constrain the reply to calls,
``auto`` to text or calls. ``tool_use`` blocks of assistant turns and ``tool_result`` blocks of
user turns go back into the template as tool calls and tool results.
"""

from __future__ import annotations

import json
from typing import Any

from basertd.schema import client as api
from basertd.schema.client import QosClass
from basertd.server.transport.http import tool_calls
from basertd.server.transport.http.anthropic.wire import Block, CountRequest, Message, MessagesRequest
from basertd.server.transport.http.errors import bad_request


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


def tool_fields(req: CountRequest) -> tuple[Any, Any, bool]:
    """``(tools, tool_choice, parallel_tool_calls)`` in OpenAI's terms (module docstring), for
    ``templates.Templates.tool_plan``. Raises 400 for malformed tools or choices."""
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
    return tools, tc, parallel


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
    we do not serve, an empty conversation, or one that is only an assistant prefill (nothing for
    the chat template to render it after)."""
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
        if not out:
            raise bad_request(
                "messages: a final assistant message is a prefill the reply continues; give a user "
                "message (or a system prompt) before it",
                "messages",
            )
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


def check_max_tokens(req: MessagesRequest) -> None:
    """400 for ``max_tokens`` < 1 (Anthropic requires a positive one)."""
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens: must be >= 1, got {req.max_tokens}", "max_tokens")


def generate_of(
    req: MessagesRequest, mid: str, prompt: list[int], qos: QosClass, plan: tool_calls.ToolPlan | None
) -> api.Generate:
    """The ``Generate`` of a Messages request with its rendered ``prompt`` tokens (the limits
    table checks the values at admission)."""
    return api.Generate(
        request_id=mid,
        prompt_tokens=prompt,
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        stop=list(req.stop_sequences or []),
        qos=qos,
        speculation=req.speculation or "auto",
        stream=bool(req.stream),
        model=req.model,
        **(tool_calls.generate_fields(plan.spec) if plan is not None else {}),
    )
