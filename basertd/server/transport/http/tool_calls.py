"""Tool calls over the HTTP APIs: a chat request's ``tools`` / ``tool_choice`` to a prompt and a
grammar, and the generated text back to calls (DESIGN.md "Client API"; the grammar side is
``basertd.server.request.grammar``).

Prompt: when the chat template reads the ``tools`` variable it gets OpenAI's ``tools`` array and
the conversation as is (assistant turns with ``tool_calls``, ``role: tool`` turns with
``tool_call_id``). Otherwise, or when the template refuses those turns, the conversation is
rendered in the text form: ``grammar.tools_preamble`` joined to the system message (one is added
when there is none); an assistant turn's calls become its content, the call JSON the grammar
enforces (``{"name": ..., "arguments": {...}}``, an array for several); a tool turn becomes a
user turn ``Result of <name> (call <id>):\\n<content>``, merged with an adjacent user turn so
templates that insist on alternating roles accept it.

Output: ``required`` and named choices constrain it to the call JSON, ``auto`` to a call or free
text (``grammar.tool_grammar``); ``ToolStream`` buffers a call while it streams and lets text
through, and ``parse`` turns the finished text into OpenAI ``tool_calls``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from basertd.server.request import grammar
from basertd.server.request.grammar import GrammarRequestError, GrammarSpec, Tool
from basertd.server.transport.http.chat_template import ChatTemplate, ChatTemplateError
from basertd.server.transport.http.errors import bad_request

MAX_PARALLEL_CALLS = 8
"""Most calls one reply may make when ``parallel_tool_calls`` allows several; a reply makes at
most as many calls as it is offered tools, and one call when it is offered one tool (the call
list closes where the grammar ends it, never running on to ``max_tokens``)."""
TOOL_RESULT = "Result of {name} (call {id}):\n{content}"
"""The text form of a ``role: tool`` turn."""


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools: the OpenAI array ``raw``, its parsed ``tools``, the ``mode``
    (auto / required / function) and ``name`` of a named choice, whether ``parallel`` calls are
    allowed, and the ``spec`` constraining the output."""

    raw: list[dict[str, Any]]
    tools: list[Tool]
    mode: str
    name: str | None
    parallel: bool
    spec: GrammarSpec

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    @property
    def calls_only(self) -> bool:
        """The output can only be a call (``required`` or a named function): text that is no
        complete call is a call cut short, never content."""
        return self.mode != "auto"

    def with_spec(self, spec: GrammarSpec) -> ToolPlan:
        """This plan constraining the output with ``spec`` (the candidate that compiled)."""
        return dataclasses.replace(self, spec=spec)


class Renderer(Protocol):
    """Renders a chat with a template (``templates.Templates.render``, off the event loop)."""

    def __call__(
        self,
        template: ChatTemplate,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> Awaitable[str]: ...


def plan_of(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The plan of a request's tool fields; None when they ask for no tool call (no tools, or
    ``tool_choice: "none"``). Its spec is not compiled yet (``templates.Templates.tool_plan``
    compiles it). Raises a 400 ``HttpError`` with the reason for malformed ``tools``, an unknown
    ``tool_choice`` or a function name it does not offer."""
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tools is not None and not tools:
        raise bad_request("tools must be a non-empty array (leave it out for no tools)", "tools")
    try:
        offered = len(tools) if isinstance(tools, list) else 0
        max_calls = min(MAX_PARALLEL_CALLS, offered)
        spec = grammar.tool_grammar(tools, tool_choice, parallel and max_calls > 1, max_calls=max_calls)
        if spec is None:
            return None
        parsed = grammar.parse_tools(tools)
        mode, name = grammar.tool_choice_mode(tool_choice, parsed)
    except GrammarRequestError as exc:
        param = "tool_choice" if "tool_choice" in str(exc) else "tools"
        raise bad_request(str(exc), param) from None
    return ToolPlan(list(tools), parsed, mode, name, parallel and mode != "function" and max_calls > 1, spec)


def generate_fields(spec: GrammarSpec) -> dict[str, Any]:
    """``Generate`` fields (``response_format`` or ``grammar``) carrying ``spec``."""
    if spec.kind == "json_schema":
        schema = json.loads(spec.text)
        return {
            "response_format": {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}
        }
    if spec.kind == "lark":
        return {"grammar": spec.text}
    return {"regex": spec.text}


def _call_json(calls: list[dict[str, Any]]) -> str:
    out = []
    for c in calls:
        fn = c.get("function") or {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append({"name": fn.get("name", ""), "arguments": args})
    return json.dumps(out[0] if len(out) == 1 else out, ensure_ascii=False, separators=(",", ":"))


def text_form(messages: list[dict[str, Any]], preamble: str | None) -> list[dict[str, Any]]:
    """``messages`` in the text form (module docstring): only roles system / user / assistant,
    every content a string."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            for c in m["tool_calls"]:
                names[str(c.get("id", ""))] = str((c.get("function") or {}).get("name", ""))
            call = _call_json(m["tool_calls"])
            content = f"{content}\n{call}" if content else call
        elif role == "tool":
            cid = str(m.get("tool_call_id") or "")
            name = m.get("name") or names.get(cid, "a function")
            role, content = "user", TOOL_RESULT.format(name=name, id=cid, content=content)
        if out and out[-1]["role"] == role == "user" and (m["role"] == "tool" or out[-1].get("_tool")):
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + content, "_tool": True}
            continue
        d: dict[str, Any] = {"role": role, "content": content}
        if m["role"] == "tool":
            d["_tool"] = True
        out.append(d)
    for d in out:
        d.pop("_tool", None)
    if preamble:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


async def render(
    renderer: Renderer, template: ChatTemplate, messages: list[dict[str, Any]], plan: ToolPlan | None
) -> str:
    """The prompt text of a chat with tools (module docstring), each rendering by ``renderer``.
    Raises ``ChatTemplateError``."""
    if template.uses_tools:
        try:
            return await renderer(template, messages, tools=plan.raw if plan else None)
        except ChatTemplateError:
            if not _has_tool_turns(messages):
                raise
        return await renderer(template, text_form(messages, None), tools=plan.raw if plan else None)
    if plan is None and not _has_tool_turns(messages):
        return await renderer(template, messages)
    preamble = grammar.tools_preamble(plan.tools, plan.mode, plan.name) if plan else None
    return await renderer(template, text_form(messages, preamble))


def parse(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """OpenAI ``tool_calls`` of a finished output, or None when it is text (or an unfinished call)."""
    return grammar.parse_tool_calls(text, plan.names)


def content_of(plan: ToolPlan | None, text: str) -> str:
    """The content a finished output that holds no complete call shows: ``text``, except under a
    choice that only allows calls, where it is a call cut short (``max_tokens``) and shows ""."""
    return "" if plan is not None and plan.calls_only else text


class ToolStream:
    """Streams one choice of a request with tools: ``feed(text)`` returns the text to send now
    (nothing while the output may be a call: it starts with ``{`` or ``[`` after optional
    whitespace), ``finish()`` returns ``(tool_calls or None, text still held)``."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held: list[str] = []
        self.passing = False

    def feed(self, text: str) -> str:
        if self.passing:
            return text
        self.held.append(text)
        start = "".join(self.held).lstrip()
        if not start:
            return ""
        if self.plan.mode == "auto" and start[0] not in "{[":
            self.passing = True
            out, self.held = "".join(self.held), []
            return out
        return ""

    def finish(self) -> tuple[list[dict[str, Any]] | None, str]:
        text, self.held = "".join(self.held), []
        if self.passing or not text:
            return None, text
        calls = parse(self.plan, text)
        return (calls, "") if calls else (None, content_of(self.plan, text))
