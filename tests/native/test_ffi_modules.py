"""The precompiled FFI modules (native/build_tick_ffi.py) against cffi's in-line parse of the same
declarations: ``tick_ffi`` hands out a precompiled module for each set of declarations a
``BasertLib`` opens with, and it has the same types, struct layouts and constants as the parsed
one; declarations no module was built for are parsed in-line, so a header edited since the build
is never served by a stale module (ABI rule 11: one layout, C and Python alike)."""

from __future__ import annotations

import re

import cffi
import pytest

from basertd.native._cdef import ffi_module_name, ffi_source
from basertd.native._layout import record_dtype, tick_ffi
from basertd.native.basert_api import basert_h_cdef
from basertd.native.ref import ref_cdef

VARIANTS = {
    "tick": lambda: "",
    "tick+ref": ref_cdef,
    "tick+baseRT.h": basert_h_cdef,
    "tick+baseRT.h+ref": lambda: basert_h_cdef() + ref_cdef(),
}
"""The declarations each ``BasertLib`` of the package opens with (``extra_cdef``)."""


def _layout(ffi, name: str) -> object:
    """What a type is, in terms both FFIs name alike (a field's struct type is ``struct X`` in one
    and ``X`` in the other): kind, size, alignment, fields with offsets, enum values, and for a
    struct the numpy record dtype the binding reads and writes it with."""
    t = ffi.typeof(name)
    if t.kind == "struct":
        fields = [(f, c.offset, c.type.kind, ffi.sizeof(c.type)) for f, c in t.fields]
        try:
            dtype = record_dtype(ffi, name)
        except KeyError as exc:  # baseRT.h's size_t fields: the tick binding never reads those as records
            dtype = f"no dtype: {exc}"
        return ("struct", ffi.sizeof(name), ffi.alignof(name), fields, dtype)
    if t.kind == "enum":
        return ("enum", sorted(t.elements.items()))
    if t.kind == "primitive":
        return ("primitive", t.cname)
    return (t.kind, ffi.sizeof(name) if t.kind != "function" else None)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_librarys_declarations_come_precompiled_and_match_the_parsed_ones(variant):
    extra = VARIANTS[variant]()
    fast = tick_ffi(extra)
    assert not isinstance(fast, cffi.FFI), "no precompiled module: run `make native`"
    assert type(fast).__module__ == "_cffi_backend"
    parsed = cffi.FFI()
    parsed.cdef(ffi_source(extra))
    typedefs, structs, unions = parsed.list_types()
    assert fast.list_types() == (typedefs, structs, unions)
    assert typedefs, "the tick header declares types"
    for name in typedefs:
        assert _layout(fast, name) == _layout(parsed, name), name
    fast_lib, parsed_lib = fast.dlopen(None), parsed.dlopen(None)
    names = re.findall(r"^#define ([A-Za-z_]\w*) ", ffi_source(extra), flags=re.M)
    assert names, "the tick header defines integer constants"
    for name in names:
        assert getattr(fast_lib, name) == getattr(parsed_lib, name), name


def test_declarations_without_a_module_are_parsed_in_line():
    extra = "int basertd_probe_only_in_this_test(int x);"
    assert ffi_module_name(ffi_source(extra)) != ffi_module_name(ffi_source(""))
    ffi = tick_ffi(extra)
    assert isinstance(ffi, cffi.FFI)
    assert ffi.typeof("int(*)(int)").kind == "function"
    assert ffi.sizeof("BaseRTTickPlan") == tick_ffi("").sizeof("BaseRTTickPlan")
