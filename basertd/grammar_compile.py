"""The one grammar compiler, shared by the engine worker (GRAMMAR_CREATE, DESIGN.md "Link W") and
the coordinator's validation at admission, so a spec validation accepts is a spec the worker
compiles (same code, same llguidance limits).

A spec is a ``kind`` in ``GRAMMAR_KINDS`` and its text: ``json_schema`` (JSON-Schema text),
``lark`` (a Lark grammar in llguidance's dialect) or ``regex``. JSON schemas compile with compact
separators and no free whitespace, so every output is the shortest JSON text of its value, and
with their typed numbers bounded first (``basertd.json_bounds``); a schema whose bounded form does
not compile is compiled as given, so an error is about the user's schema.

llguidance compiles on the native stack: a grammar deep enough (a chain of some 3,000 Lark rules
or ``$ref``s at an 8 MiB stack) overflows it and kills the process with SIGSEGV. The coordinator
therefore compiles only in a child process (``basertd.server.request.spec_check``) on a thread
with ``VALIDATE_STACK_BYTES`` of stack, half of ``COMPILE_STACK_BYTES``, the stack the worker
compiles on: whatever validates cannot overflow the worker.

llguidance (about 0.1 s to import) is imported by ``compile_spec``, on the first compile, not with
this module: the coordinator imports it for its constants and compiles only in its children.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from basertd.json_bounds import bound_numbers

if TYPE_CHECKING:
    import llguidance

GRAMMAR_KINDS = ("json_schema", "lark", "regex")
"""Spec kinds a GRAMMAR_CREATE carries."""

COMPILE_STACK_BYTES = 16 << 20
"""Stack of the worker's grammar-compile thread (bytes)."""
VALIDATE_STACK_BYTES = COMPILE_STACK_BYTES // 2
"""Stack of the coordinator's validation thread (bytes): half the worker's, so a spec that
validates compiles in the worker with room to spare."""

JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
}
"""JSON-Schema compile options: compact output, no free whitespace (overridable by the schema's
``x-guidance``)."""

KIND_NAMES = {"json_schema": "JSON schema", "lark": "grammar", "regex": "regex"}
"""How messages name each kind."""


class GrammarSpecError(ValueError):
    """A grammar spec llguidance refuses; ``str()`` is the library's message."""


def compile_spec(kind: str, text: str) -> str:
    """The llguidance grammar (its JSON form) of a spec, validated without a tokenizer.

    ``kind`` is one of ``GRAMMAR_KINDS``; ``text`` the schema (JSON text), Lark grammar or regex.
    Raises GrammarSpecError with llguidance's message for an unknown kind, text that is not JSON
    (json_schema) or a grammar that does not compile."""
    import llguidance  # here, not at the top (module docstring)

    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise GrammarSpecError(f"JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarSpecError("a JSON schema is an object or a boolean")
        grammar = _bounded_json_grammar(schema)
        if grammar is None:
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise GrammarSpecError(str(exc)) from None
    elif kind == "lark":
        grammar = _from(llguidance.LLMatcher.grammar_from_lark, text)
    elif kind == "regex":
        grammar = _from(llguidance.LLMatcher.grammar_from_regex, text)
    else:
        raise GrammarSpecError(f"unknown grammar kind {kind!r} (one of {', '.join(GRAMMAR_KINDS)})")
    is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarSpecError(msgs[0] if msgs else "invalid grammar")
    return grammar


def _from(make: Any, text: str) -> str:
    try:
        return make(text)
    except ValueError as exc:
        raise GrammarSpecError(str(exc)) from None


def _bounded_json_grammar(schema: dict | bool) -> str | None:
    """The grammar of ``bound_numbers(schema)``, or None when the bounded schema does not compile
    (the caller then compiles the schema as given, so the error, if any, is about the user's
    schema)."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(bound_numbers(schema), defaults=JSON_OPTIONS)
    except (ValueError, RecursionError):
        return None
    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return None if is_error else grammar
