"""How deep a JSON schema goes once its local ``$ref``s are followed, measured without recursion.

llguidance resolves a schema's ``$ref``s recursively on the native stack: a chain of some 2,500
references (``d0 -> d1 -> ... -> dN``, well under any size cap and flat as JSON) overflows it and
the process dies of SIGSEGV. Its own nesting limit (128 levels of JSON text) does not see a chain.
``ref_depth`` is the longest path from the root through nested values and local references
(``#``, ``#/$defs/x``, any JSON pointer into the document); a reference back into a schema still
being walked (a recursive schema: a tree whose children are ``{"$ref": "#"}``) adds nothing, as
llguidance compiles recursion into a grammar rule rather than unrolling it. The grammar module
refuses a schema deeper than ``MAX_REF_DEPTH`` before llguidance sees it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

MAX_REF_DEPTH = 512
"""The deepest schema accepted, in levels (nested objects/arrays and followed references). Deep
enough for any generated schema (pydantic's nest a few dozen); a quarter of the chain that crashed."""

_MISSING = object()


def _resolve(root: Any, ref: str) -> Any:
    """The value a local reference names in ``root`` (``_MISSING`` for a remote or broken one)."""
    if not ref.startswith("#"):
        return _MISSING
    pointer = unquote(ref[1:])
    if pointer == "":
        return root
    if not pointer.startswith("/"):
        return _MISSING  # an anchor name: llguidance answers those itself
    node = root
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _children(root: Any, node: Any) -> list[Any]:
    """The containers ``node`` leads to: its nested values, and the target of its ``$ref``."""
    values = node.values() if isinstance(node, dict) else node
    out = [v for v in values if isinstance(v, (dict, list))]
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        target = _resolve(root, node["$ref"])
        if isinstance(target, (dict, list)):
            out.append(target)
    return out


def ref_depth(schema: Any, limit: int = MAX_REF_DEPTH) -> int:
    """Levels of the deepest path in ``schema`` (a parsed JSON value): 0 for a scalar, 1 for a
    container of scalars, +1 per nested container or followed local reference. The walk stops once
    the depth passes ``limit`` (returning a value > ``limit``), so a hostile schema costs at most
    ``limit`` levels of bookkeeping beyond its size; each container is measured once."""
    if not isinstance(schema, (dict, list)):
        return 0
    depth: dict[int, int] = {}  # id(container) -> levels below and including it, once measured
    walking: set[int] = set()
    stack: list[tuple[Any, list[Any], int]] = [(schema, _children(schema, schema), 0)]
    walking.add(id(schema))
    while stack:
        node, kids, i = stack[-1]
        if i < len(kids):
            stack[-1] = (node, kids, i + 1)
            kid = kids[i]
            if id(kid) in depth or id(kid) in walking:
                continue
            if len(stack) > limit:
                return len(stack) + 1
            walking.add(id(kid))
            stack.append((kid, _children(schema, kid), 0))
            continue
        stack.pop()
        walking.discard(id(node))
        depth[id(node)] = 1 + max((depth.get(id(k), 0) for k in kids), default=0)
    return depth[id(schema)]
