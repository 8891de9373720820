"""The cffi view of ``basert_tick.h`` and numpy record types derived from it.

One ``cffi.FFI`` per distinct set of declarations (the tick header, optionally followed by a
library's extra declarations such as the reference engine's test surface) is built once and
cached. ``record_dtype`` turns a C struct into a numpy structured dtype with the C offsets and
size but without the ``_pad`` fields, in C field order, which is also the field order of the
matching ``basertd.schema.tick`` record: a ``tolist()`` row converts with ``msgspec.convert``
and a tuple of schema fields assigns straight into an arena slot (ABI rule 11: one layout, C and
Python alike).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import _cffi_backend
import cffi
import numpy as np

from basertd.native._cdef import ffi_module_name, ffi_source

_PRIMITIVE = {
    "uint8_t": "u1",
    "int8_t": "i1",
    "uint16_t": "<u2",
    "int16_t": "<i2",
    "uint32_t": "<u4",
    "int32_t": "<i4",
    "uint64_t": "<u8",
    "int64_t": "<i8",
    "float": "<f4",
    "double": "<f8",
    "int": "<i4",
}

MIN_PREFIX = {"BaseRTLaneAdmit": 136, "BaseRTTickPlan": 152}
"""Records whose v1 minimum prefix is shorter than today's size (RULES.md rules 17-18, 25); every
other record's minimum is its full size (an older writer never wrote a shorter one)."""


@functools.lru_cache(maxsize=8)
def tick_ffi(extra_cdef: str = "") -> Any:
    """A cffi FFI holding every declaration of ``basert_tick.h`` plus ``extra_cdef``.

    The precompiled module of exactly these declarations when the build made one
    (``native/build_tick_ffi.py``: an out-of-line ABI-mode ``ffi``, no parsing at run time);
    otherwise a ``cffi.FFI`` that parses them here. Either has the same types, layouts, constants
    and ``dlopen``. Cached per ``extra_cdef`` text, so every library opened with the same
    declarations shares one FFI (and cdata of one library is usable with another's helpers).
    Raises ``cffi.CDefError`` when ``extra_cdef`` does not parse."""
    source = ffi_source(extra_cdef)
    try:
        return importlib.import_module(f"basertd.native.{ffi_module_name(source)}").ffi
    except ImportError:
        ffi = cffi.FFI()
        ffi.cdef(source)
        return ffi


def has_symbol(lib: Any, name: str) -> bool:
    """Whether a ``dlopen``-ed ``lib`` resolves its declared function ``name``. A missing symbol
    raises ``AttributeError`` from an in-line FFI's library and ``ffi.error`` from a precompiled
    module's; both mean no."""
    try:
        getattr(lib, name)
    except (AttributeError, _cffi_backend.FFI.error):
        return False
    return True


def struct_names(ffi: cffi.FFI) -> list[str]:
    """Typedef names of every struct the FFI declares (e.g. ``BaseRTTickPlan``), sorted."""
    typedefs = ffi.list_types()[0]
    return sorted(n for n in typedefs if ffi.typeof(n).kind == "struct")


def min_prefix(ffi: cffi.FFI, cname: str) -> int:
    """Smallest ``elem_size`` (bytes) a reader accepts for records of ``cname`` (ABI rule 17)."""
    return MIN_PREFIX.get(cname, ffi.sizeof(cname))


def _field_format(ffi: cffi.FFI, ctype: cffi.FFI.CType) -> object:
    if ctype.kind == "primitive":
        if ctype.cname == "char":
            return "S1"
        return _PRIMITIVE[ctype.cname]
    if ctype.kind in ("pointer", "function"):
        return "<u8"  # an address; the ABI is 64-bit only (ABI rule 11)
    if ctype.kind == "array":
        item = ctype.item
        if item.kind == "primitive" and item.cname in ("uint8_t", "char"):
            return f"V{ctype.length}" if item.cname == "uint8_t" else f"S{ctype.length}"
        return (_field_format(ffi, item), ctype.length)
    if ctype.kind == "struct":
        return _dtype(ffi, ctype.cname)
    raise TypeError(f"no numpy format for C type {ctype.cname}")


@functools.lru_cache(maxsize=256)
def _dtype_cached(ffi: cffi.FFI, cname: str) -> np.dtype:
    ctype = ffi.typeof(cname)
    names, formats, offsets = [], [], []
    for name, field in ctype.fields:
        if name.startswith("_pad"):
            continue
        names.append(name)
        formats.append(_field_format(ffi, field.type))
        offsets.append(field.offset)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": ffi.sizeof(ctype)})


def _dtype(ffi: cffi.FFI, cname: str) -> np.dtype:
    return _dtype_cached(ffi, cname)


def record_dtype(ffi: cffi.FFI, cname: str) -> np.dtype:
    """Numpy structured dtype of C struct ``cname`` (typedef name or ``struct X``): C offsets and
    itemsize, ``_pad`` fields left out (their bytes stay whatever the buffer holds, so writers
    zero the buffer first). Byte arrays are ``V<n>`` (read back as ``bytes`` of exactly n),
    ``char[n]`` is ``S<n>``, pointers are u64 addresses. Raises TypeError for unknown types."""
    return _dtype(ffi, cname)
