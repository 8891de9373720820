"""Structured outputs and tool calls in the coordinator: request fields to one grammar spec.

A request constrains its output with at most one of: ``response_format`` (OpenAI:
``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}``), ``grammar`` (a Lark grammar, llguidance's dialect) or ``regex``;
or, on chat requests, with the tool-call grammar ``tool_grammar`` builds from ``tools`` and
``tool_choice``. The result is a ``GrammarSpec`` (kind + text) that the Link W GRAMMAR_CREATE
message carries (``to_message``); the worker answers a grammar handle for ``LaneAdmit.
grammar_handle`` (DESIGN.md "Link W", ABI rules 74 and 113).

Building a spec here costs no compilation: only the cheap checks run (field shapes, JSON text,
the schema's depth with its ``$ref``s followed, ``schema_depth``), then ``spec_compiler.
SpecCompiler`` compiles it once, after admission's queue caps, in a child process with the
worker's compiler (``basertd.grammar_compile``), so an invalid schema, grammar or regex is a
``GrammarRequestError`` carrying the library's message (an HTTP 400) and never reaches a worker,
and a spec that crashes llguidance kills only that child. ``tools`` are bounded in count and bytes
(``check_tool_caps``).

Tool calls are JSON: one call is ``{"name": <function name>, "arguments": {...}}``; parallel calls
(when allowed) are a JSON array of calls. ``parse_tool_calls`` turns generated text into OpenAI
``tool_calls`` (id, type, function.name, function.arguments as a JSON string).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from basertd.grammar_compile import JSON_OPTIONS
from basertd.json_bounds import bound_numbers
from basertd.schema import link
from basertd.schema.client import ErrorCode
from basertd.server.request.schema_depth import MAX_REF_DEPTH, ref_depth
from basertd.server.request.strict_schema import close_objects

KINDS = ("json_schema", "lark", "regex")
"""Spec kinds a GRAMMAR_CREATE carries."""

_FN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarRequestError(ValueError):
    """A request's structured-output or tool fields are invalid; ``code`` is the client error code
    (INVALID_REQUEST, an HTTP 400), ``str()`` says why (llguidance's message for a spec that does
    not compile)."""

    code = ErrorCode.INVALID_REQUEST


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar: ``kind`` in KINDS and its ``text`` (JSON-schema text, Lark or regex).
    ``fallback``: a spec to use instead when this one does not compile (the tool grammar of
    ``tool_choice="auto"`` with the tool schemas as given, when their bounded numbers do not
    compile); ``label``: what a compile error names (e.g. the request field). Neither goes to
    the worker nor takes part in equality."""

    kind: str
    text: str
    fallback: GrammarSpec | None = field(default=None, compare=False)
    label: str = field(default="", compare=False)

    def candidates(self) -> list[tuple[str, str]]:
        """``(kind, text)`` of this spec then of each fallback, in the order they are tried."""
        out, spec = [], self
        while spec is not None:
            out.append((spec.kind, spec.text))
            spec = spec.fallback
        return out

    def to_message(self) -> link.GrammarCreate:
        """The Link W GRAMMAR_CREATE carrying this spec."""
        return link.GrammarCreate(json_schema=self.text, kind=self.kind)


def validate_spec(kind: str, text: str, label: str = "") -> GrammarSpec:
    """The spec of ``text`` of ``kind`` after the checks that cost no compilation; llguidance
    compiles it later, in a child process (``spec_compiler.SpecCompiler``). Raises
    GrammarRequestError for an unknown kind, schema text that is not a JSON object or boolean, or
    a schema deeper than ``MAX_REF_DEPTH`` levels once its ``$ref``s are followed
    (``schema_depth``)."""
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise GrammarRequestError(f"JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarRequestError("a JSON schema is an object or a boolean")
        _check_depth(schema)
    elif kind not in KINDS:
        raise GrammarRequestError(f"unknown grammar kind {kind!r}")
    return GrammarSpec(kind, text, label=label)


def _check_depth(schema: Any) -> None:
    if ref_depth(schema) > MAX_REF_DEPTH:
        raise GrammarRequestError(
            f"JSON schema too deep: more than {MAX_REF_DEPTH} levels of nesting and $ref"
        )


def schema_spec(schema: dict[str, Any] | bool, label: str = "") -> GrammarSpec:
    """The json_schema spec of a schema value (GrammarRequestError when too deep, ``validate_spec``)."""
    _check_depth(schema)
    return GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")), label=label)


def spec_from_request(
    response_format: Any = None, grammar: Any = None, regex: Any = None
) -> GrammarSpec | None:
    """The one grammar a request's ``response_format`` / ``grammar`` / ``regex`` ask for, or None.

    ``response_format`` ``{"type": "text"}`` (or None) asks for nothing; ``json_object`` is any
    JSON object; ``json_schema`` needs ``json_schema.schema`` (an object; ``name`` is accepted;
    ``strict: true`` reads it as OpenAI does, every object closed unless it says otherwise, and
    without it the objects that list ``properties`` are closed, as llama.cpp and xgrammar read
    them: ``strict_schema.close_objects``; every output meets the schema either way). Raises
    GrammarRequestError for more than one of the three, an unknown or malformed
    ``response_format``, a non-string ``grammar`` / ``regex``, or a schema too deep
    (``validate_spec``); whether the spec compiles is ``SpecCompiler``'s to say."""
    given = [x for x in (response_format, grammar, regex) if x is not None]
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        given.remove(response_format)
        response_format = None
    if len(given) > 1:
        raise GrammarRequestError("at most one of response_format, grammar and regex")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarRequestError("grammar must be a non-empty Lark grammar string")
        return validate_spec("lark", grammar)
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise GrammarRequestError("regex must be a non-empty string")
        return validate_spec("regex", regex)
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarRequestError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "json_object":
        return schema_spec(_ANY_OBJECT)
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarRequestError("response_format.json_schema must be an object")
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not _FN_NAME.match(name)):
            raise GrammarRequestError("response_format.json_schema.name must match [A-Za-z0-9_-]{1,64}")
        if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
            raise GrammarRequestError("response_format.json_schema.strict must be a boolean")
        schema = js.get("schema", _ANY_OBJECT)
        if not isinstance(schema, (dict, bool)):
            raise GrammarRequestError("response_format.json_schema.schema must be an object")
        # strict: OpenAI's reading, every object closed; else the objects that name their keys
        return schema_spec(close_objects(schema, named_only=js.get("strict") is not True))
    raise GrammarRequestError(f"unknown response_format type {kind!r} (text, json_object, json_schema)")


# --- tools -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One function tool: ``name``, ``description`` ("" when none), ``parameters`` (a JSON schema
    of the arguments object)."""

    name: str
    description: str
    parameters: dict[str, Any]


MAX_TOOLS = 128
"""Most function tools one request may offer (``[compile] max_tools``' default)."""
MAX_TOOLS_BYTES = 1 << 20
"""Largest ``tools`` array, as compact JSON (bytes; ``[compile] max_tools_bytes``' default)."""


def check_tool_caps(tools: Any, max_tools: int = MAX_TOOLS, max_bytes: int = MAX_TOOLS_BYTES) -> None:
    """Refuse a ``tools`` list longer than ``max_tools`` entries or larger than ``max_bytes`` as
    compact JSON: GrammarRequestError naming the cap. Anything else passes (``parse_tools`` says
    what is malformed)."""
    if not isinstance(tools, list):
        return
    if len(tools) > max_tools:
        raise GrammarRequestError(f"tools: at most {max_tools} tools per request, got {len(tools)}")
    size = len(json.dumps(tools, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise GrammarRequestError(f"tools: at most {max_bytes} bytes of tools as JSON, got {size}")


def parse_tools(tools: Any) -> list[Tool]:
    """The function tools of an OpenAI ``tools`` array (``[{"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}}]``; ``strict: true`` closes the
    parameters' objects, and without it those that list ``properties``: ``strict_schema``).
    Raises GrammarRequestError for anything else: not a list, a non-function tool, a bad or
    duplicate name, parameters that are not an object schema or too deep (``validate_spec``);
    they are compiled with the tool grammar."""
    if not isinstance(tools, list) or not tools:
        raise GrammarRequestError("tools must be a non-empty array")
    out: list[Tool] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise GrammarRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _FN_NAME.match(name):
            raise GrammarRequestError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}")
        if name in seen:
            raise GrammarRequestError(f"tools[{i}]: duplicate function name {name!r}")
        seen.add(name)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise GrammarRequestError(f"tools[{i}].function.description must be a string")
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise GrammarRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarRequestError(f"tools[{i}].function.strict must be a boolean")
        params = close_objects(params, named_only=not strict)  # as for response_format
        try:
            _check_depth(params)
        except GrammarRequestError as exc:
            raise GrammarRequestError(f"tools[{i}].function.parameters: {exc}") from None
        out.append(Tool(name, desc, params))
    return out


def tool_choice_mode(tool_choice: Any, tools: list[Tool]) -> tuple[str, str | None]:
    """(mode, function name) of an OpenAI ``tool_choice``: ("none"|"auto"|"required", None) or
    ("function", name). None means "auto" when there are tools, "none" otherwise. Raises
    GrammarRequestError for an unknown value or a function name not in ``tools``."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise GrammarRequestError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise GrammarRequestError("tool_choice.function.name must be a string")
        if name not in {t.name for t in tools}:
            raise GrammarRequestError(f"tool_choice names an unknown function {name!r}")
        return "function", name
    raise GrammarRequestError("tool_choice must be 'none', 'auto', 'required' or a named function")


def call_schema(tools: list[Tool], parallel: bool, max_calls: int | None = None) -> dict[str, Any]:
    """JSON schema of the tool-call output: one ``{"name", "arguments"}`` object per tool (anyOf
    when several), or with ``parallel`` a non-empty array of them (at most ``max_calls``)."""
    one = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    call: dict[str, Any] = one[0] if len(one) == 1 else {"anyOf": one}
    if parallel:
        arr: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if max_calls is not None:
            arr["maxItems"] = max(1, max_calls)
        return arr
    return call


def tool_grammar(
    tools: Any, tool_choice: Any = None, parallel_tool_calls: bool = True, max_calls: int | None = None
) -> GrammarSpec | None:
    """The grammar of a chat request's tool fields, or None when the output is free.

    ``tools`` None or empty with ``tool_choice`` None/"none": None. "required": the output is
    tool-call JSON (``call_schema`` over all tools); a named function: one call of that function
    (never an array); parallel calls are an array of at most ``max_calls`` (None: no bound);
    "auto": a Lark grammar accepting either a call (its output starts with ``{``,
    or ``[`` for parallel calls) or free text that does not start with ``{``, ``[`` or whitespace,
    its numbers bounded as in every JSON-schema grammar (``basertd.json_bounds``) with the schemas
    as given for its ``fallback``. The spec is not compiled here (``SpecCompiler``); its ``label``
    names the tools. Raises GrammarRequestError for malformed ``tools`` or ``tool_choice``."""
    if tools is None or tools == []:
        tool_choice_mode(tool_choice, [])
        return None
    parsed = parse_tools(tools)
    mode, name = tool_choice_mode(tool_choice, parsed)
    if mode == "none":
        return None
    label = "tools (function.parameters)"
    if mode == "function":
        return schema_spec(call_schema([t for t in parsed if t.name == name], parallel=False), label)
    schema = call_schema(parsed, parallel=bool(parallel_tool_calls), max_calls=max_calls)
    if mode == "required":
        return schema_spec(schema, label)
    _check_depth(schema)
    as_given = GrammarSpec("lark", _auto_lark(schema), label=label)
    return GrammarSpec("lark", _auto_lark(bound_numbers(schema)), fallback=as_given, label=label)


def _auto_lark(schema: dict[str, Any]) -> str:
    """The Lark text of ``tool_choice="auto"``: a tool call (compact JSON) or free text."""
    schema = {**schema, "x-guidance": dict(JSON_OPTIONS)}  # compact JSON inside Lark too
    return (
        "start: call | TEXT\n"
        "TEXT: /[^{\\[ \\t\\r\\n][\\s\\S]*/\n"
        f"call: %json {json.dumps(schema, separators=(',', ':'))}\n"
    )


def tools_preamble(tools: list[Tool], mode: str, name: str | None = None) -> str:
    """The system-prompt text that offers ``tools`` when the chat template has no ``tools``
    variable: the function list as JSON and the call format ``tool_grammar`` enforces."""
    listing = json.dumps(
        [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools],
        separators=(",", ":"),
    )
    how = 'To call a function, reply with only JSON: {"name": <function name>, "arguments": {...}}'
    if mode == "required":
        how += " (you must call a function)"
    elif mode == "function":
        how += f" (you must call {name})"
    else:
        how += "; otherwise reply with text"
    return f"You can call these functions:\n{listing}\n{how}."


def new_call_id() -> str:
    """An OpenAI-style tool-call id: ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def parse_tool_calls(text: str, tool_names: set[str] | None = None) -> list[dict[str, Any]] | None:
    """OpenAI ``tool_calls`` from generated text, or None when the text is not a tool call.

    A call is the JSON object ``{"name": str, "arguments": object}``; text that is one call or a
    non-empty JSON array of calls (after surrounding whitespace) gives one entry per call:
    ``{"id": "call_...", "type": "function", "function": {"name", "arguments": <JSON string>}}``.
    With ``tool_names``, a call of another name makes the whole text not a call (None)."""
    s = text.strip()
    if not s or s[0] not in "{[":
        return None
    try:
        value = json.loads(s)
    except ValueError:
        return None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        return None
    out = []
    for c in calls:
        if not isinstance(c, dict) or set(c) != {"name", "arguments"}:
            return None
        name, args = c["name"], c["arguments"]
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
        if tool_names is not None and name not in tool_names:
            return None
        out.append(
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    return out
