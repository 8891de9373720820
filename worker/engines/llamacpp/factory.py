"""``open_engine(options)``: the worker registry's factory for the llama.cpp engine
(``basertd.worker.engines.ENGINES``; ``basertd-worker --engine llamacpp``)."""

from __future__ import annotations

import os

from basertd.worker.engines import EngineLoadError, EngineOptionError, EngineOptions
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.context import KV_LAYOUTS
from basertd.worker.engines.llamacpp.engine import LlamaCppEngine


def _gpu_layers(device: str) -> int:
    """``--device``: "cpu" keeps every layer on the CPU; "cuda", "cuda:N" or "gpu" offloads every
    layer (a CPU-only build of llama.cpp then runs on the CPU anyway)."""
    d = device.strip().lower()
    if d == "cpu":
        return 0
    if d in ("gpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit()):
        return -1
    raise EngineOptionError("--device", f"llamacpp runs on 'cpu', 'gpu' or 'cuda[:N]', not {device!r}")


def open_engine(options: EngineOptions) -> LlamaCppEngine:
    """Load ``options.model`` (a GGUF path, required: the worker never picks a default model).
    ``lanes`` / ``context_length`` (tokens) default to the engine's (8 / 2048); ``threads`` to every
    CPU of the machine, for decode and prefill alike; ``host_bytes`` to 0 (no host tier);
    ``kv_layout`` to "unified" (which sizes the cache and spare sequences: ``context.Sizes``). Raises
    EngineOptionError (exit 2: no model, a device or size llama.cpp cannot use,
    ``--lib``/``--ref-config`` given) or EngineLoadError (exit 3: the file is missing or llama.cpp
    cannot load it or create the context)."""
    if options.lib is not None:
        raise EngineOptionError("--lib", "the llamacpp engine loads a GGUF model (--model), not a library")
    if options.ref_config:
        raise EngineOptionError("--ref-config", "only the reference engine takes --ref-config")
    if not options.model:
        raise EngineOptionError("--model", "the llamacpp engine needs a GGUF model path")
    kw: dict[str, int | str] = {"n_gpu_layers": _gpu_layers(options.device)}
    if options.lanes is not None:
        kw["lanes"] = options.lanes
    if options.context_length is not None:
        kw["context_length"] = options.context_length
    threads = options.threads if options.threads is not None else (os.cpu_count() or 1)
    if threads < 1:
        raise EngineOptionError("--threads", f"need at least one thread, got {threads}")
    kw["n_threads"] = kw["n_threads_batch"] = threads
    if options.host_bytes is not None:
        kw["host_bytes"] = options.host_bytes
    if options.kv_layout is not None:
        if options.kv_layout not in KV_LAYOUTS:
            raise EngineOptionError(
                "--kv-layout", f"must be one of {', '.join(KV_LAYOUTS)}, not {options.kv_layout!r}"
            )
        kw["kv_layout"] = options.kv_layout
    try:
        return LlamaCppEngine(options.model, **kw)  # type: ignore[arg-type]
    except ValueError as exc:
        raise EngineOptionError("--lanes", str(exc)) from None
    except EngineError as exc:
        raise EngineLoadError(f"{options.model}: {exc}") from None
