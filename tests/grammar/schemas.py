"""100 JSON schemas for the structured-output tests: objects, arrays, enums, nested objects,
``required`` subsets, numeric and string bounds, drawn deterministically from a seed.

Every string has a ``maxLength`` and every array a ``maxItems`` and objects forbid additional
properties, so a random-weight model under the grammar finishes in a bounded number of tokens."""

from __future__ import annotations

import random
from typing import Any

_NAMES = ["id", "name", "tags", "score", "ok", "kind", "meta", "items", "x", "y"]


def _leaf(r: random.Random) -> dict[str, Any]:
    kind = r.choice(["integer", "number", "string", "boolean", "enum", "pattern", "const", "null"])
    if kind == "integer":
        lo = r.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 200)}
    if kind == "number":
        lo = r.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + r.randint(1, 100)}
    if kind == "string":
        lo = r.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + r.randint(0, 8)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": r.sample(["red", "green", "blue", "cyan", 1, 2.5, True, None], r.randint(1, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": r.choice(["^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"])}
    if kind == "const":
        return {"const": r.choice(["fixed", 42, False])}
    return {"type": "null"}


def _node(r: random.Random, depth: int) -> dict[str, Any]:
    roll = r.random()
    if depth < 2 and roll < 0.25:
        return _object(r, depth + 1)
    if depth < 2 and roll < 0.45:
        lo = r.randint(0, 2)
        hi = lo + r.randint(0, 3)
        return {"type": "array", "items": _node(r, depth + 1), "minItems": lo, "maxItems": hi}
    return _leaf(r)


def _object(r: random.Random, depth: int) -> dict[str, Any]:
    names = r.sample(_NAMES, r.randint(1, 5))
    props = {n: _node(r, depth) for n in names}
    required = [n for n in names if r.random() < 0.7]
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def schemas(n: int = 100, seed: int = 18) -> list[dict[str, Any]]:
    """``n`` schemas: mostly objects (some nested), and top-level arrays, enums and bounded leaves."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        if i % 10 == 7:
            out.append({"type": "array", "items": _object(r, 1), "minItems": 1, "maxItems": 3})
        elif i % 10 == 9:
            out.append(_leaf(r))
        else:
            out.append(_object(r, 0))
    return out
