"""cffi out-of-line ABI-mode builds of the tick header's declarations: one generated Python module
per set of declarations a ``BasertLib`` opens with (the tick header alone; with the reference
engine's test surface; with baseRT.h; with both), named by ``_cdef.ffi_module_name``.

In-line ABI mode (``cffi.FFI().cdef(...)``) parses the declarations with pycparser in every
process that opens a library, and again for every distinct type string the binding names
(``ffi.new("BaseRTTickPlan *")``): about 0.3-0.5 s of each reference-engine worker's start on a
2-core box. A generated module holds the parsed types, so its ``ffi`` imports in milliseconds and
resolves type strings in C. ``basertd.native._layout.tick_ffi`` uses the module whose name
matches the declarations it is asked for and parses in-line when there is none (a header edited
since the build, an unforeseen ``extra_cdef``): never a stale module.

setup.py lists each builder below as ``cffi_modules``; ``make native`` regenerates them in place.
This file runs at build time, before the package is importable, so it loads ``_cdef.py`` by path.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import cffi

_HERE = Path(os.path.dirname(os.path.abspath(__file__)))


def _load_cdef():
    spec = importlib.util.spec_from_file_location("_basertd_build_cdef", _HERE / "_cdef.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_cdef = _load_cdef()
BASERT_H = _cdef.header_to_cdef((_HERE / "basert_h.h").read_text())
"""Declarations of baseRT.h (``basertd.native.basert_api.basert_h_cdef``)."""
REF = _cdef.header_to_cdef((_HERE / "ref_engine" / "basert_ref.h").read_text())
"""Declarations of the reference engine's test surface (``basertd.native.ref.ref_cdef``)."""


def _builder(extra_cdef: str) -> cffi.FFI:
    source = _cdef.ffi_source(extra_cdef)
    builder = cffi.FFI()
    builder.cdef(source)
    builder.set_source(f"basertd.native.{_cdef.ffi_module_name(source)}", None)
    return builder


tick = _builder("")
tick_ref = _builder(REF)
tick_basert = _builder(BASERT_H)
tick_basert_ref = _builder(BASERT_H + REF)
