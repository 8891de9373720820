"""Turn a C header into text that ``cffi.FFI.cdef`` accepts, by a small mechanical pass.

The pass keeps the header the single source of the ABI declarations (``native/basert_tick.h``,
CONTRIBUTING.md module map): comments go, conditional blocks are resolved against the macros the
header itself defines (so ``#ifdef __cplusplus`` blocks and the static-assert block vanish),
``#include`` lines go, and integer ``#define`` constants stay (cffi reads them, suffixes
included). Anything else a header might contain that cffi cannot parse raises ``CdefError``
instead of being silently dropped.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

HEADER = Path(__file__).with_name("basert_tick.h")
"""Path of our tick-ABI header, installed next to this module (setup.py package_data)."""

SKIPPED_MACROS = frozenset({"BASERT_TICK_NO_LAYOUT_ASSERTS"})
"""Macros treated as defined while reading a header: the layout asserts use sizeof/offsetof,
which cffi's parser does not evaluate (the layout test checks the same facts at run time)."""

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_DEFINE_INT = re.compile(r"#\s*define\s+([A-Za-z_]\w*)\s+(-?(?:0[xX][0-9A-Fa-f]+|\d+)[uUlL]*)\s*$")
_DEFINE_ANY = re.compile(r"#\s*define\s+([A-Za-z_]\w*)(\([^)]*\))?(\s+.*)?$")
_IF = re.compile(r"#\s*(ifdef|ifndef)\s+([A-Za-z_]\w*)\s*$")
_IF_DEFINED = re.compile(r"#\s*if\s+(!?)\s*defined\s*\(?\s*([A-Za-z_]\w*)\s*\)?\s*$")


class CdefError(ValueError):
    """The header holds a preprocessor construct this pass does not understand (line given)."""


def header_to_cdef(text: str, predefined: frozenset[str] = SKIPPED_MACROS) -> str:
    """Return cffi cdef source for C header ``text``.

    Supported preprocessor forms: ``#ifdef`` / ``#ifndef`` / ``#if [!]defined(X)`` / ``#else`` /
    ``#endif`` (evaluated against ``predefined`` plus the header's own ``#define``s; ``__cplusplus``
    is never defined), ``#include`` (dropped), ``#undef``, and ``#define``: an integer constant is
    kept, other macros are recorded as defined and dropped. Raises ``CdefError`` on anything else
    or on unbalanced conditionals."""
    text = _COMMENT.sub(" ", text)
    defined = set(predefined)
    stack: list[tuple[bool, bool]] = []  # (this branch active, enclosing active)
    out: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        active = all(a for a, _ in stack)
        if not line.startswith("#"):
            if active and line:
                out.append(raw)
            continue
        m = _IF.match(line) or _IF_DEFINED.match(line)
        if m:
            if m.re is _IF:
                cond = (m.group(2) in defined) == (m.group(1) == "ifdef")
            else:
                cond = (m.group(2) in defined) != (m.group(1) == "!")
            stack.append((cond, active))
            continue
        if re.match(r"#\s*else\b", line):
            if not stack:
                raise CdefError(f"line {lineno}: #else without #if")
            cond, outer = stack.pop()
            stack.append((not cond, outer))
            continue
        if re.match(r"#\s*endif\b", line):
            if not stack:
                raise CdefError(f"line {lineno}: #endif without #if")
            stack.pop()
            continue
        if not active:
            continue
        if re.match(r"#\s*include\b", line):
            continue
        m = re.match(r"#\s*undef\s+([A-Za-z_]\w*)\s*$", line)
        if m:
            defined.discard(m.group(1))
            continue
        m = _DEFINE_INT.match(line)
        if m:
            defined.add(m.group(1))
            out.append(f"#define {m.group(1)} {m.group(2)}")
            continue
        m = _DEFINE_ANY.match(line)
        if m:
            defined.add(m.group(1))
            continue
        raise CdefError(f"line {lineno}: unsupported preprocessor line {line!r}")
    if stack:
        raise CdefError("unterminated #if block")
    return "\n".join(out) + "\n"


def tick_cdef() -> str:
    """The cffi cdef source of ``basert_tick.h`` (every type, constant and function of the ABI)."""
    return header_to_cdef(HEADER.read_text())


def ffi_source(extra_cdef: str = "") -> str:
    """The declarations of one FFI: the tick header's, then ``extra_cdef`` (another header's
    ``header_to_cdef`` output, e.g. baseRT.h's or the reference engine's test surface)."""
    return tick_cdef() + "\n" + extra_cdef


def ffi_module_name(source: str) -> str:
    """Name (within ``basertd.native``) of the precompiled FFI module holding exactly the
    declarations ``source``: ``_ffi_`` and the first 16 hex digits of their SHA-256. The name
    certifies the content, so a header edited since the build finds no module instead of a stale
    one (``native/build_tick_ffi.py``)."""
    return "_ffi_" + hashlib.sha256(source.encode()).hexdigest()[:16]


def declared_functions(cdef: str) -> list[str]:
    """Names of the functions ``cdef`` (output of ``header_to_cdef``) declares, in order.

    A top-level statement (struct and enum bodies removed) that has a parameter list and is not
    a typedef declares a function; its name is the identifier before the first ``(``."""
    flat = re.sub(r"^\s*#.*$", "", cdef, flags=re.M)
    depth, top = 0, []
    for ch in flat:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            top.append(ch)
    names = []
    for stmt in "".join(top).split(";"):
        stmt = " ".join(stmt.split())
        if "(" not in stmt or stmt.startswith("typedef"):
            continue
        m = re.search(r"([A-Za-z_]\w*)\s*\($", stmt[: stmt.index("(") + 1])
        if m:
            names.append(m.group(1))
    return names
