"""The tick-ABI header, its cffi binding, the C reference engine and the ring atomics."""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent

REF_ENGINE_LIBRARY = "libbasert_ref.so"
"""File name of the built reference engine inside this package directory (setup.py)."""


def header_path() -> str:
    """Path of ``basert_tick.h``, our header of the tick ABI (installed as package data)."""
    return str(_HERE / "basert_tick.h")


def ref_engine_path() -> str:
    """Path of the built C reference engine (``libbasert_ref.so`` in the basertd.native package).

    The library exports the tick ABI and is opened by path like a real libbaseRT
    (DESIGN.md "Engines"). ``$BASERT_REF_ENGINE`` names another build of it (``make memcheck``
    uses a sanitizer build that way). Raises FileNotFoundError, saying to run ``make native``, when it has
    not been built."""
    override = os.environ.get("BASERT_REF_ENGINE")
    path = Path(override) if override else _HERE / REF_ENGINE_LIBRARY
    if not path.is_file():
        raise FileNotFoundError(
            f"reference engine not built: {path} is missing; run `make native` "
            "(or `python setup.py build_ext --inplace`) in the checkout"
        )
    return str(path)
