"""The ``basert`` engine loaded by path: baseRT.h's ``baseRT_load_model_ex`` (DESIGN.md "Engines").

``open_path_loaded(options)`` serves a real libbaseRT and the C reference engine alike (see
``basertd.worker.engines.basert`` for the contract). Everything opened is released on failure:
the bundle (``baseRT_free_model``) and the tokenizer-only handle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import xxhash

from basertd.native import abi as nabi
from basertd.native import basert_api as api
from basertd.native import ref_engine_path
from basertd.worker.engines import EngineLoadError, EngineOptionError, EngineOptions
from basertd.worker.engines.base import EngineInfo, TokenizerSpec
from basertd.worker.engines.basert import BasertEngine, encode_with_bos

_HASH_CONTENT_LIMIT = 16 << 20
"""Bundle files up to this many bytes are hashed whole for ``model_id``; larger ones by path,
size and modification time (hashing gigabytes of weights at every start is not worth it)."""


def prefix_cache_verdict(caps: int, descriptor: dict[str, Any]) -> tuple[bool, str]:
    """Whether a bundle with capability bits ``caps`` can serve the prefix-cache policy (paged KV
    and prefix cache both present) and, when not, why (the descriptor's reason when it gives one)."""
    if caps & api.CAP_PAGED_KV and caps & api.CAP_PREFIX_CACHE:
        return True, ""
    state = descriptor.get("state") if isinstance(descriptor.get("state"), dict) else {}
    for key, bit in (("paged_kv", api.CAP_PAGED_KV), ("prefix_cache", api.CAP_PREFIX_CACHE)):
        if not caps & bit:
            reason = state.get(key)
            if isinstance(reason, str) and reason:
                return False, f"no {key}: {reason}"
            return False, f"the bundle reports no BASERT_CAP_{key.upper()}"
    return False, "the bundle reports no prefix cache"  # pragma: no cover - covered by the loop


def _model_id(path: str) -> str:
    st = os.stat(path)
    if st.st_size <= _HASH_CONTENT_LIMIT:
        with open(path, "rb") as f:
            return xxhash.xxh3_128_hexdigest(f.read())
    key = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}"
    return xxhash.xxh3_128_hexdigest(key.encode())


def _open_lib(lib_path: str) -> tuple[nabi.BasertLib, bool]:
    """The library with the tick ABI and baseRT.h declared, plus the reference engine's test
    surface when it exports it (for its counters). Returns (lib, is_reference)."""
    from basertd.native.ref import ref_cdef

    try:
        return api.open_basert_lib(lib_path, extra_cdef=ref_cdef()), True
    except nabi.MissingSymbols as exc:
        if not all(n.startswith("baseRT_ref_") for n in exc.missing):
            raise
    return api.open_basert_lib(lib_path), False


def open_path_loaded(options: EngineOptions) -> BasertEngine:
    """Load ``options.model`` with ``baseRT_load_model_ex`` from ``options.lib`` (default: the
    reference engine). Raises ``EngineOptionError`` (``--ref-config`` with a bundle file) or
    ``EngineLoadError`` (one line saying why; the worker exits 3)."""
    if options.ref_config:
        raise EngineOptionError(
            "--ref-config", "applies to the reference engine's built-in config; a bundle file carries its own"
        )
    model = str(options.model)
    try:
        lib_path = options.lib or ref_engine_path()
    except FileNotFoundError as exc:
        raise EngineLoadError(str(exc)) from None
    try:
        lib, is_ref = _open_lib(lib_path)
    except nabi.MissingSymbols as exc:
        raise EngineLoadError(
            f"{lib_path} lacks {len(exc.missing)} function(s) basertd needs: {', '.join(exc.missing)}"
        ) from None
    except (FileNotFoundError, nabi.LibraryError) as exc:
        raise EngineLoadError(str(exc)) from None
    opts = api.LoadOptions(paged_kv=1, prefix_cache=1, max_batch_size=options.lanes or 0)
    try:
        loaded = api.load_model(lib, model, options.kernel_library, options.context_length or 0, opts)
    except api.LoadError as exc:
        raise EngineLoadError(str(exc)) from None
    bundle: nabi.Bundle | None = None
    tok: api.TokenizerHandle | None = None
    try:
        if is_ref:
            from basertd.native.ref import RefBundle

            bundle = loaded.bundle(RefBundle)
        else:
            bundle = loaded.bundle()
        try:
            tok = api.TokenizerHandle(lib_path, model)
        except (api.LoadError, nabi.LibraryError) as exc:
            raise EngineLoadError(f"the bundle loaded but its tokenizer did not: {exc}") from None
        info = _info(options, lib, loaded, bundle, tok, model)
    except BaseException:
        if tok is not None:
            tok.close()
        if bundle is not None:
            bundle.close()
        else:
            loaded.free()
        raise
    stats = bundle.stats if is_ref else None
    return BasertEngine(bundle, info, stats=stats, keepalive=(lib, loaded), tokenizer=tok)


def _int(serving: dict[str, Any], key: str) -> int | None:
    v = serving.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _info(
    options: EngineOptions,
    lib: nabi.BasertLib,
    loaded: api.LoadedModel,
    bundle: nabi.Bundle,
    tok: api.TokenizerHandle,
    model: str,
) -> EngineInfo:
    serving = loaded.descriptor.get("serving")
    serving = serving if isinstance(serving, dict) else {}
    page = _int(serving, "page_size_tokens")
    if page is None:
        paged = [d.page_size_tokens for d in bundle.state_spaces() if d.page_size_tokens]
        page = paged[0] if paged else 0
    context = _int(serving, "context_length") or options.context_length
    if context is None:
        context = int(lib.lib.baseRT_suggest_max_context(model.encode(), options.lanes or 1, 0, 1)) or 4096
    lanes = _int(serving, "max_lanes") or options.lanes or 1
    usable, why = prefix_cache_verdict(loaded.caps, loaded.descriptor)
    version = lib.ffi.string(lib.lib.baseRT_version_string()).decode()
    return EngineInfo(
        engine="basert",
        engine_version=f"baseRT {version}",
        model=model,
        model_id=_model_id(model),
        vocab_size=_int(serving, "vocab_size") or tok.vocab_size,
        context_length=context,
        max_lanes=lanes,
        max_batch_size=_int(serving, "max_batch_size") or lanes,
        page_size_tokens=page,
        pool_bytes=_int(serving, "pool_bytes") or 0,
        seed_lease_ticks=bundle.seed_lease_ticks(),
        eos_token_ids=(tok.eos_id,),
        bos_token_id=tok.bos_id,
        add_bos=bool(encode_with_bos(tok, "", False) != tok.encode("")),
        tokenizer=TokenizerSpec("basert", path=model),
        extra={
            "library": lib.path,
            "kernel_library": options.kernel_library or "",
            "basert_caps": str(loaded.caps),
            "capability_descriptor": loaded.descriptor_text,
            "prefix_cache": "1" if usable else "0",
            "prefix_cache_reason": why,
            "chat_template": tok.chat_template,
            "device": options.device,
            "model_file": Path(model).name,
        },
    )
