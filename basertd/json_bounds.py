"""Bounded numbers in JSON-schema grammars (DESIGN.md "Engines": every constrained output finishes).

A JSON-schema ``number`` or ``integer`` with no bounds lets a sampled lane write digits without end
(``8.080808…`` never leaves the number lexeme, so the lane runs into its token cap). Before a schema
is compiled, ``bound_numbers`` narrows every number it types explicitly:

- no lower (upper) bound: ``minimum`` -(2**53 - 1) (``maximum`` 2**53 - 1), the interoperable
  range of I-JSON (RFC 7493 §2.2), so at most 16 integer digits and no exponent;
- a ``number`` without ``multipleOf``: ``multipleOf`` 1e-9, so at most 9 fraction digits.

Only the generated language shrinks: each added keyword is a conjunct of the node it is added to,
and nodes are visited only where a narrower subschema narrows the whole (``properties``,
``patternProperties``, ``additionalProperties``, ``items``, ``prefixItems``, ``anyOf``, ``oneOf``,
``allOf``, ``$defs``, ``definitions``; never ``not``, ``if`` or ``contains``), so every output still
validates against the schema as given. A bound the schema's own range excludes is not added.
Schemas without a ``type`` (any JSON value) keep llguidance's unbounded numbers.
"""

from __future__ import annotations

import copy
from typing import Any

NUMBER_LIMIT = 2**53 - 1
"""The largest magnitude added as a default ``minimum`` / ``maximum``."""

FRACTION_STEP = 1e-9
"""The ``multipleOf`` added to a ``number`` that has none: at most 9 fraction digits."""

_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions")
_ONE_KEYS = ("additionalProperties", "items")
_LIST_KEYS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")


def bound_numbers(schema: Any) -> Any:
    """A copy of ``schema`` (a JSON-schema object or boolean) with its typed numbers bounded as
    the module says; anything that is not an object is returned as is. Never raises."""
    if not isinstance(schema, dict):
        return schema
    out = copy.deepcopy(schema)
    _visit(out)
    return out


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _bound(node: dict[str, Any], types: set[str]) -> None:
    lo = _num(node.get("minimum", node.get("exclusiveMinimum")))
    hi = _num(node.get("maximum", node.get("exclusiveMaximum")))
    if "minimum" not in node and "exclusiveMinimum" not in node and (hi is None or hi >= -NUMBER_LIMIT):
        node["minimum"] = -NUMBER_LIMIT
        lo = -NUMBER_LIMIT
    if "maximum" not in node and "exclusiveMaximum" not in node and (lo is None or lo <= NUMBER_LIMIT):
        node["maximum"] = NUMBER_LIMIT
        hi = NUMBER_LIMIT
    wide = lo is None or hi is None or hi - lo > 2 * FRACTION_STEP
    if "number" in types and "multipleOf" not in node and wide:
        node["multipleOf"] = FRACTION_STEP


def _visit(node: Any) -> None:
    if not isinstance(node, dict):
        return
    t = node.get("type")
    if isinstance(t, str):
        types = {t}
    else:
        types = {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    if types & {"number", "integer"}:
        _bound(node, types)
    for key in _MAP_KEYS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for v in sub.values():
                _visit(v)
    for key in _ONE_KEYS:
        _visit(node.get(key))
    for key in _LIST_KEYS:
        sub = node.get(key)
        if isinstance(sub, list):
            for v in sub:
                _visit(v)
