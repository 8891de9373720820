"""Engine adapters behind one protocol mirroring the tick ABI (DESIGN.md "Engines"), and the
registry the worker picks them from by name.

``ENGINES`` maps a name to the import path of a factory ``open_engine(options) -> Engine``; the
module is imported only when that engine is asked for, so the worker starts without llama.cpp
installed when it runs the reference engine. ``open_engine`` raises:

- ``UnknownEngine`` (not in the registry, or its module cannot be imported: the worker exits 2
  naming the engine),
- ``EngineOptionError`` (an option the engine cannot use: exit 2 naming the flag),
- ``EngineLoadError`` (the engine or model could not be loaded: exit 3, the message says why).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from basertd.worker.engines.base import Capability, Engine

__all__ = [
    "ENGINES",
    "Capability",
    "Engine",
    "EngineLoadError",
    "EngineOptionError",
    "EngineOptions",
    "UnknownEngine",
    "engine_factory",
    "open_engine",
]

ENGINES: dict[str, str] = {
    "basert": "basertd.worker.engines.basert:open_engine",
    "llamacpp": "basertd.worker.engines.llamacpp:open_engine",
}
"""Engine name -> ``module:function`` of its factory."""


class UnknownEngine(LookupError):
    """No engine of that name, or its adapter module is not importable (``reason``)."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"engine {name!r} is not available: {reason}")


class EngineOptionError(ValueError):
    """An engine option that cannot be used (``flag`` names the command-line flag, e.g.
    ``--ref-config``); the worker exits 2 with the message. Nothing was loaded."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        super().__init__(f"argument {flag}: {message}")


class EngineLoadError(RuntimeError):
    """The engine or its model could not be loaded; nothing is left open. The message says why."""


@dataclass(frozen=True)
class EngineOptions:
    """What the worker's command line says about the engine (``basertd-worker --help``).

    ``lib``: a tick-ABI library path (basert; None = the C reference engine). ``ref_config``: fields
    of the reference engine's built-in config (``basertd.native.ref``). ``model``: a GGUF path
    (llamacpp); for basert a bundle file loaded with baseRT.h's ``baseRT_load_model_ex`` (a ``.base``
    bundle, or a reference bundle file for the reference engine), or, as before, the library itself
    when it is a shared object and ``lib`` is unset. ``kernel_library``: basert's GPU kernel library
    (None: the library's auto-detection). ``device``: e.g. "cpu", "cuda:0". ``lanes``,
    ``context_length`` (tokens) and ``threads``: None leaves the engine's default. ``host_bytes``:
    the llama.cpp engine's host tier of evicted prefixes (bytes; None: off); ``kv_layout``: its KV
    layout ("unified" or "per-lane", ``llamacpp.context.KV_LAYOUTS``; None: unified); other engines
    ignore both."""

    lib: str | None = None
    kernel_library: str | None = None
    ref_config: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    device: str = "cpu"
    lanes: int | None = None
    context_length: int | None = None
    threads: int | None = None
    host_bytes: int | None = None
    kv_layout: str | None = None


def engine_factory(name: str) -> Any:
    """The factory of engine ``name``; raises ``UnknownEngine``."""
    target = ENGINES.get(name)
    if target is None:
        raise UnknownEngine(name, f"known engines: {', '.join(sorted(ENGINES))}")
    module_name, func = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownEngine(name, f"cannot import {module_name}: {exc}") from None
    factory = getattr(module, func, None)
    if factory is None:
        raise UnknownEngine(name, f"{module_name} has no {func}()")
    return factory


def open_engine(name: str, options: EngineOptions) -> Engine:
    """Load engine ``name`` with ``options``. Raises ``UnknownEngine``, ``EngineOptionError`` or
    ``EngineLoadError``."""
    return engine_factory(name)(options)
