"""JSON schemas read with their objects closed unless they say otherwise, as the engines of other
servers read them.

With ``strict: true`` (``response_format.json_schema.strict``, a tool's ``function.strict``)
OpenAI's structured outputs treat each object schema as if it said ``"additionalProperties":
false``: the model may write only the properties the schema names. Schemas generated from pydantic
models and dataclasses leave ``additionalProperties`` out, so read as plain JSON Schema (open
objects) they let a small model wander into keys of its own until ``max_tokens`` cuts the JSON.

``close_objects`` returns a copy of a schema in which every object schema (``"type": "object"``
or one with ``properties``) that does not set ``additionalProperties`` sets it to ``false``. It
walks the subschema keywords of JSON Schema 2020-12 (``properties``, ``items``, ``prefixItems``,
``anyOf``, ``oneOf``, ``$defs``, ``definitions``, ``additionalProperties``, ``patternProperties``,
``not``, ``if`` / ``then`` / ``else``, ``dependentSchemas``, ``contains``), iteratively, so depth
costs no stack. Two exceptions keep a valid instance valid: the members of an ``allOf`` stay as
written (closing each member would refuse the properties the other members add), and an object
that sets ``unevaluatedProperties`` is left to it.

Without ``strict`` the same reading applies to objects that list ``properties`` (``named_only``):
llama.cpp's schema-to-grammar converter closes such an object unless ``additionalProperties`` says
otherwise, and vLLM's and SGLang's xgrammar do too (its ``strict_mode``), so a pydantic model sent
without ``strict`` (instructor's JSON_SCHEMA mode, most clients' structured outputs) gets its own
keys and no others. An object schema without ``properties`` stays any object.
"""

from __future__ import annotations

from typing import Any

_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
"""Keywords whose value is one subschema."""
_LIST = ("prefixItems", "anyOf", "oneOf", "items")
"""Keywords whose value is a list of subschemas (``items`` as a list: the tuple form of drafts 4-7)."""
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
"""Keywords whose value maps names to subschemas."""


def _copy(value: Any) -> Any:
    """A deep copy of a parsed JSON value, without recursion (``copy.deepcopy`` recurses)."""
    if not isinstance(value, (dict, list)):
        return value
    root: Any = {} if isinstance(value, dict) else []
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        src, dst = stack.pop()
        for key, v in src.items() if isinstance(src, dict) else enumerate(src):
            new: Any = v
            if isinstance(v, (dict, list)):
                new = {} if isinstance(v, dict) else []
                stack.append((v, new))
            if isinstance(dst, dict):
                dst[key] = new
            else:
                dst.append(new)
    return root


def _is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def close_objects(schema: Any, named_only: bool = False) -> Any:
    """A deep copy of ``schema`` (a parsed JSON schema: dict, or bool) with every object schema
    that leaves ``additionalProperties`` (and ``unevaluatedProperties``) unset closed with
    ``"additionalProperties": false`` (with ``named_only``, only those that list ``properties``);
    members of ``allOf`` are copied unchanged (module docstring). Never raises for a malformed
    schema: what is not a schema is copied as it is, for the compiler to refuse."""
    out = _copy(schema)
    stack: list[Any] = [out]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if (
            (_is_object_schema(node) if not named_only else isinstance(node.get("properties"), dict))
            and "additionalProperties" not in node
            and "unevaluatedProperties" not in node
        ):
            node["additionalProperties"] = False
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend(v for v in node[key] if isinstance(v, dict))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend(v for v in node[key].values() if isinstance(v, dict))
    return out
