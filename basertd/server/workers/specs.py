"""From a ``[[workers]]`` table to what the coordinator starts and serves (DESIGN.md "Layout").

``worker_spec`` turns one worker's configuration into the ``WorkerSpec`` its supervisor spawns,
the key of the tokenizer the coordinator builds for it (workers sharing a key share one
tokenizer) and the model name clients address it by; ``daemon_worker_spec`` does it with the
daemon-wide keys of a ``Config`` (the launch's spawn and the fleet use the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from basertd.server.config import Config
from basertd.server.config_sections import DEFAULT_KV_LAYOUT, WorkerConfig
from basertd.server.request.tokenizer import basert_tokenizer_key
from basertd.server.workers.process import WorkerSpec

WORKER_START_TIMEOUT_S = 120.0
"""Seconds a worker may take from spawn to a finished handshake (model loading included)."""


def model_path(worker: WorkerConfig) -> str:
    """The model file a llamacpp worker serves: its ``model`` key, else the default model
    (assembled once; raises ``basertd.models.ModelUnavailable`` when it cannot be)."""
    if worker.model:
        return str(Path(worker.model).expanduser())
    from basertd.models import default_model_path

    return str(default_model_path())


def worker_spec(
    worker_id: int,
    w: WorkerConfig,
    *,
    runtime_dir: str,
    log_level: str,
    host_bytes: int | None = None,
    speculation: Sequence[str] = (),
) -> tuple[WorkerSpec, tuple[str, str] | tuple[str, str, int], str]:
    """The worker spec, the tokenizer it implies as ``(kind, path)`` (``("gguf", path)``) or
    ``("bytes", "", vocab_size)`` (the reference engine's ``vocab_size``, 0 when not configured)
    and the model's served name. ``host_bytes`` (``[cache] host_bytes``) sizes a llama.cpp
    worker's host tier (None: the engine's default, off); other engines have none.
    ``speculation``: the worker's ``--speculation`` flags (``SpeculationConfig.worker_args``).
    Raises ``basertd.models.ModelUnavailable`` when the default model cannot be assembled."""
    common = dict(
        worker_id=worker_id,
        device=w.device,
        lanes=w.lanes,
        context_length=w.context_length,
        threads=w.threads,
        extra_args=(*speculation, *w.engine_args),
        runtime_dir=runtime_dir,
        start_timeout=WORKER_START_TIMEOUT_S,
        log_level=log_level,
    )
    if w.engine == "llamacpp":
        path = model_path(w)
        spec = WorkerSpec(
            engine="llamacpp",
            model=path,
            host_bytes=host_bytes,
            kv_layout=w.kv_layout or DEFAULT_KV_LAYOUT,
            **common,
        )
        return spec, ("gguf", path), Path(path).stem
    model = str(Path(w.model).expanduser()) if w.model else ""
    lib = str(Path(w.lib).expanduser()) if w.lib else ""
    if model and (lib or not _is_shared_object(model)):
        # A bundle loaded with baseRT_load_model_ex; the coordinator tokenizes with its own
        # tokenizer-only handle of the same bundle (basertd.server.request.tokenizer.BaseRTTokenizer).
        if w.kernel_library:
            common["extra_args"] = (
                "--kernel-library",
                str(Path(w.kernel_library).expanduser()),
                *common["extra_args"],
            )
        spec = WorkerSpec(engine="basert", lib=lib or None, model=model, **common)
        return spec, ("basert", basert_tokenizer_key(lib, model)), Path(model).stem
    lib = lib or model or None  # the reference engine's factory (a library named as `model`)
    ref = dict(w.ref_config) if w.ref_config else None
    name = Path(lib).stem if lib else "basert-ref"
    vocab = int((ref or {}).get("vocab_size", 0))  # the byte vocabulary, sized as the engine's
    return WorkerSpec(engine="basert", lib=lib, ref_config=ref, **common), ("bytes", "", vocab), name


def _is_shared_object(path: str) -> bool:
    """An ELF file, or (when it cannot be read) a name that says it is a shared library."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        name = Path(path).name
        return name.endswith(".so") or ".so." in name


def prefix_cache_usable(capabilities) -> tuple[bool, str]:
    """Whether the prefix-cache policy (seeds, coalescing, pins) may run for a worker with this
    capability record (``basertd.schema.link.Capabilities``), and why not. A basert worker loaded
    by path reports ``extra["prefix_cache"]`` "0" when its bundle lacks paged KV or a prefix cache
    (``baseRT_capabilities``), with ``extra["prefix_cache_reason"]``; every other worker can."""
    extra = getattr(capabilities, "extra", None) or {}
    if extra.get("prefix_cache", "1") == "0":
        return False, extra.get("prefix_cache_reason") or "the engine reports no prefix cache"
    return True, ""


def daemon_worker_spec(
    config: Config, worker_id: int, w: WorkerConfig, workers_dir: str
) -> tuple[WorkerSpec, tuple[str, str] | tuple[str, str, int], str]:
    """``worker_spec`` of the table ``w`` as worker ``worker_id`` of a daemon configured by
    ``config`` (its log level, ``[cache] host_bytes`` and ``[speculation]``), with its private
    directory in ``workers_dir``. Raises ``basertd.models.ModelUnavailable``."""
    return worker_spec(
        worker_id,
        w,
        runtime_dir=workers_dir,
        log_level=config.log_level,
        host_bytes=config.cache.host_bytes,
        speculation=config.speculation.worker_args(w),
    )
