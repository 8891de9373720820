"""Value generators for every schema Struct, derived from the Structs' own type information.

Two flavours over one walk of ``msgspec.inspect``: hypothesis strategies (round-trip tests) and a
seeded ``random.Random`` generator (the fuzz corpus). Array fields (``_arrays`` of the Link W
bodies) get numpy arrays of their kind, sized across the side-buffer threshold. ``normalize``
turns a message into plain comparable values (numpy arrays are not ``==``-comparable).
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # everything msgpack can carry
ARRAY_MAX = 150  # crosses the 64-element side-buffer threshold
_DTYPES = {"u1": np.dtype("<u1"), "u4": np.dtype("<u4"), "f4": np.dtype("<f4")}


def _array_kind(cls: type, name: str) -> str:
    return getattr(cls, "_arrays", {})[name]


# --- hypothesis -----------------------------------------------------------------------------


def _array_strategy(kind: str) -> st.SearchStrategy:
    dtype = _DTYPES[kind]
    elements = st.floats(width=32, allow_nan=False) if kind == "f4" else None
    return st.integers(0, ARRAY_MAX).flatmap(lambda n: hnp.arrays(dtype, n, elements=elements))


def strategy(t: mi.Type, kind: str | None = None) -> st.SearchStrategy:
    """A hypothesis strategy for the msgspec type ``t`` (``kind`` for an array field)."""
    if isinstance(t, mi.IntType):
        return st.integers(INT_MIN, INT_MAX)
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=False)
    if isinstance(t, mi.StrType):
        return st.text(max_size=20)
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=40)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(strategy(t.item_type), max_size=4)
    if isinstance(t, mi.DictType):
        return st.dictionaries(strategy(t.key_type), strategy(t.value_type), max_size=3)
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    if isinstance(t, mi.UnionType):
        return st.one_of([strategy(m, kind) for m in t.types])
    if isinstance(t, mi.CustomType) and t.cls is np.ndarray:
        assert kind is not None, "an array field outside _arrays"
        return _array_strategy(kind)
    if isinstance(t, mi.StructType):
        return struct_strategy(t.cls)
    if isinstance(t, mi.AnyType):  # JSON values (an OpenAI-shaped response_format)
        scalars = st.none() | st.booleans() | st.integers(INT_MIN, INT_MAX) | st.text(max_size=10)
        return st.recursive(
            scalars,
            lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
            max_leaves=6,
        )
    raise AssertionError(f"no strategy for {t!r}")


def struct_strategy(cls: type) -> st.SearchStrategy:
    """Instances of the Struct ``cls`` with every field drawn (nested Structs too)."""
    info = mi.type_info(cls)
    kwargs = {}
    for f in info.fields:
        kind = getattr(cls, "_arrays", {}).get(f.name)
        kwargs[f.name] = strategy(f.type, kind)
    return st.builds(cls, **kwargs)


# --- seeded random (fuzz corpus) ------------------------------------------------------------


def random_value(t: mi.Type, rng: random.Random, kind: str | None = None) -> Any:
    """A random value of msgspec type ``t`` from ``rng`` (deterministic for a seed)."""
    if isinstance(t, mi.IntType):
        return rng.choice([0, 1, rng.randrange(256), rng.randrange(2**32), rng.randrange(2**64), -1])
    if isinstance(t, mi.FloatType):
        return rng.choice([0.0, 1.0, rng.uniform(-1e6, 1e6)])
    if isinstance(t, mi.StrType):
        return "".join(rng.choice("abcé€ 🙂") for _ in range(rng.randrange(8)))
    if isinstance(t, mi.BytesType):
        return rng.randbytes(rng.randrange(12))
    if isinstance(t, mi.BoolType):
        return rng.random() < 0.5
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.ListType):
        return [random_value(t.item_type, rng) for _ in range(rng.randrange(4))]
    if isinstance(t, mi.DictType):
        return {
            random_value(t.key_type, rng): random_value(t.value_type, rng) for _ in range(rng.randrange(3))
        }
    if isinstance(t, mi.LiteralType):
        return rng.choice(t.values)
    if isinstance(t, mi.EnumType):
        return rng.choice(list(t.cls))
    if isinstance(t, mi.UnionType):
        return random_value(rng.choice(t.types), rng, kind)
    if isinstance(t, mi.CustomType) and t.cls is np.ndarray:
        n = rng.choice([0, 3, 64, 65, ARRAY_MAX])
        dtype = _DTYPES[kind]
        if kind == "f4":
            return np.array([rng.uniform(-10, 10) for _ in range(n)], dtype=dtype)
        hi = 256 if kind == "u1" else 2**32
        return np.array([rng.randrange(hi) for _ in range(n)], dtype=dtype)
    if isinstance(t, mi.StructType):
        return random_struct(t.cls, rng)
    if isinstance(t, mi.AnyType):  # a JSON value (an OpenAI-shaped response_format)
        return rng.choice([None, True, rng.randrange(-5, 5), "x", [1, "a"], {"type": "json_object"}])
    raise AssertionError(f"no generator for {t!r}")


def random_struct(cls: type, rng: random.Random) -> Any:
    """A random instance of the Struct ``cls``."""
    info = mi.type_info(cls)
    kwargs = {f.name: random_value(f.type, rng, getattr(cls, "_arrays", {}).get(f.name)) for f in info.fields}
    return cls(**kwargs)


# --- comparison -----------------------------------------------------------------------------


def normalize(obj: Any) -> Any:
    """Plain, ``==``-comparable form of a message: Structs become (class name, fields), arrays
    (dtype, values), enums their values."""
    if isinstance(obj, msgspec.Struct):
        return (type(obj).__name__, tuple(normalize(getattr(obj, f)) for f in obj.__struct_fields__))
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, obj.tolist())
    if isinstance(obj, (list, tuple)):
        return [normalize(x) for x in obj]
    if isinstance(obj, dict):
        return {k: normalize(v) for k, v in obj.items()}
    return obj
