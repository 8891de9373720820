"""A GGUF model loaded through llama-cpp-python 0.3.36's low-level API, and its static facts.

Everything the engine needs to know about the weights lives here: vocabulary size, the
end-of-generation set (every token ``llama_vocab_is_eog`` marks), BOS, the sliding window
(``n_swa``, 0 when none), KV bytes per token, and ``model_id``, a cheap digest that identifies the
file (xxh3-128 over its size, its first 4 MiB, which hold the GGUF header and metadata, and 16
sampled 64 KiB blocks) without reading all of a multi-hundred-megabyte file.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from pathlib import Path

import llama_cpp as L
import numpy as np
import xxhash

from basertd.model_files import load_failure
from basertd.native._ringc import ffi as _ffi
from basertd.native._ringc import lib as _ringc
from basertd.schema.abi import Status
from basertd.worker.engines.base import EngineError

_init_lock = threading.Lock()
_initialised = False
_log = logging.getLogger("basertd.llamacpp")
# ggml_log_level of the vendored ggml (llama-cpp-python's _logger.py still maps the old numbering).
_GGML_WARN, _GGML_ERROR = 3, 4

_HEAD_BYTES = 4 << 20
_SAMPLE_BYTES = 64 << 10
_SAMPLES = 16


_ABORTED = re.compile(r"(failed with error 1|compute status: 1|failed to decode, ret = 2)$")
"""The lines llama.cpp logs as errors when the abort callback ended a ``llama_decode`` (ggml status
1 is GGML_STATUS_ABORTED, llama_decode's 2 is "aborted"): an asked-for yield, not a failure."""

_EXPECTED = re.compile(
    r"^(llama_kv_cache_iswa: using full-size SWA cache|decode: removing memory module entries)"
)
"""Warnings llama.cpp logs for what this engine asks for: the full-size sliding-window cache it
creates (``swa_full``, a prefix servable at any page), and the positions a cut ``llama_decode``
drops (a yield's abort; a real failure is followed by its own error line). Logged at info."""


@L.llama_log_callback
def _log_sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp / ggml log sink: warnings and errors go to the ``basertd.llamacpp`` logger (an
    abort's error lines at debug level, ``_EXPECTED`` warnings at info), the rest (model-load
    chatter, debug) is dropped instead of going straight to the worker's stderr."""
    if level == _GGML_ERROR:
        line = text.decode("utf-8", "replace").rstrip()
        if _ABORTED.search(line):
            _log.debug("%s", line)
        else:
            _log.error("%s", line)
    elif level == _GGML_WARN:
        line = text.decode("utf-8", "replace").rstrip()
        if _EXPECTED.search(line):
            _log.info("%s", line)
        else:
            _log.warning("%s", line)


def init_backend() -> None:
    """Initialise llama.cpp once per process and route its log to ``_log_sink`` (llama-cpp-python
    installs a callback printing to stderr at import)."""
    global _initialised
    with _init_lock:
        if not _initialised:
            L.llama_log_set(_log_sink, ctypes.c_void_p(0))
            L.llama_backend_init()
            _initialised = True


def model_digest(path: str | os.PathLike[str]) -> str:
    """Hex xxh3-128 identifying a model file: its size in bytes, its first 4 MiB and 16 evenly
    spaced 64 KiB blocks. Reads at most about 5 MiB. Raises OSError if the file cannot be read."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        h.update(f.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            step = (size - _HEAD_BYTES) // _SAMPLES
            for i in range(_SAMPLES):
                f.seek(_HEAD_BYTES + i * step)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def token_mask(pred: object, vocab: int, n_vocab: int) -> np.ndarray:
    """bool per token id of ``vocab``: llama.cpp's per-token predicate ``pred`` (a llama-cpp-python
    function such as ``llama_vocab_is_eog``) called on every id by one C loop
    (``native/brt_scan.c``): a few milliseconds for a 262,144-token vocabulary, where a Python
    loop of ctypes calls takes 0.1-0.4 s of the worker's start."""
    mask = np.zeros(n_vocab, np.uint8)
    if n_vocab:
        fn = ctypes.cast(pred, ctypes.c_void_p).value
        _ringc.brt_token_mask(
            _ffi.cast("void *", fn), _ffi.cast("void *", vocab), n_vocab, _ffi.from_buffer(mask)
        )
    return mask.view(bool)


FILE_TYPES: dict[int, str] = {
    int(getattr(L, name)): name.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
    for name in dir(L)
    if name.startswith("LLAMA_FTYPE_") and name != "LLAMA_FTYPE_GUESSED"
}
"""llama.cpp's ``llama_ftype`` values (a GGUF's ``general.file_type``) by their quantization name
(``15`` -> ``Q4_K_M``), read from llama-cpp-python's constants."""


def _meta(model: L.llama_model_p, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return None if n < 0 else buf.value.decode("utf-8", "replace")


class LlamaModel:
    """One loaded GGUF (weights on the CPU; ``n_gpu_layers`` offloads on a GPU build).

    Facts are in tokens and bytes: ``n_vocab``, ``n_ctx_train``, ``n_swa`` (sliding window in
    tokens, 0 = none), ``n_embd`` (the hidden size: a pooled embedding's dimensions),
    ``kv_bytes_per_token`` (K+V of every layer at F16), ``eog_ids`` (sorted), ``n_params``
    (weights), ``file_bytes`` (the GGUF's size), ``quantization`` (``FILE_TYPES``' name),
    ``bos_id`` (-1 when none), ``add_bos``. ``repack`` False keeps llama.cpp from repacking CPU
    weights into its batched GEMM layouts (``use_extra_bufts``), so every batch size runs the same
    dot-product kernels. Raises EngineError(ERR_FATAL) when the file is missing
    or llama.cpp cannot load it, and EngineError(ERR_OP_UNSUPPORTED) for recurrent, hybrid,
    encoder-decoder or diffusion models, whose state this engine cannot share or truncate."""

    def __init__(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, repack: bool = True) -> None:
        init_backend()
        self.path = Path(path)
        if not self.path.is_file():
            raise EngineError(Status.ERR_FATAL, load_failure(self.path, f"cannot load {self.path}"))
        self.model_id = model_digest(self.path)
        params = L.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = repack  # CPU weight repacking: GEMM kernels for >= 4-row batches
        self.ptr = L.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise EngineError(Status.ERR_FATAL, load_failure(self.path, f"llama.cpp cannot load {self.path}"))
        m = self.ptr
        if (
            L.llama_model_is_recurrent(m)
            or L.llama_model_is_hybrid(m)
            or L.llama_model_has_encoder(m)
            or L.llama_model_is_diffusion(m)
        ):
            arch = _meta(m, "general.architecture")
            self.close()
            raise EngineError(
                Status.ERR_OP_UNSUPPORTED, f"{self.path}: architecture {arch!r}: only decoder-only KV models"
            )
        self.vocab = L.llama_model_get_vocab(m)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(m))
        self.n_swa = int(L.llama_model_n_swa(m))
        self.n_layer = int(L.llama_model_n_layer(m))
        self.n_embd = n_embd = int(L.llama_model_n_embd(m))
        n_head = int(L.llama_model_n_head(m))
        n_head_kv = int(L.llama_model_n_head_kv(m))
        arch = _meta(m, "general.architecture") or "llama"
        k_len = _meta(m, f"{arch}.attention.key_length")
        v_len = _meta(m, f"{arch}.attention.value_length")
        head_k = int(k_len) if k_len else n_embd // n_head
        head_v = int(v_len) if v_len else n_embd // n_head
        self.arch = arch
        self.kv_bytes_per_token = self.n_layer * n_head_kv * (head_k + head_v) * 2  # F16 K and V
        bos = int(L.llama_vocab_bos(self.vocab))
        self.bos_id = bos if 0 <= bos < self.n_vocab else -1
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        desc = ctypes.create_string_buffer(256)
        L.llama_model_desc(m, desc, len(desc))
        self.description = desc.value.decode("utf-8", "replace")
        self.n_params = int(L.llama_model_n_params(m))
        self.file_bytes = self.path.stat().st_size
        file_type = _meta(m, "general.file_type") or ""
        self.quantization = FILE_TYPES.get(int(file_type), "") if file_type.isdigit() else ""
        """The weights' quantization by llama.cpp's name (``Q4_K_M``, ``F16``; "" when unknown)."""
        self.eog_mask = token_mask(L.llama_vocab_is_eog, self.vocab, self.n_vocab)
        """bool per token id: every token ``llama_vocab_is_eog`` marks."""
        self.eog_ids: tuple[int, ...] = tuple(int(t) for t in np.flatnonzero(self.eog_mask))
        """``eog_mask``'s ids, ascending."""

    def tokenize(self, text: bytes, add_special: bool) -> list[int]:
        """Token ids of ``text`` (UTF-8 bytes); ``add_special`` adds BOS where the model wants it.
        Special-token text (e.g. ``<start_of_turn>``) is parsed as the special token."""
        n_max = len(text) + 8
        while True:
            buf = (ctypes.c_int32 * n_max)()
            n = L.llama_tokenize(self.vocab, text, len(text), buf, n_max, add_special, True)
            if n >= 0:
                return list(buf[:n])
            n_max = -n

    def detokenize(self, tokens: list[int] | np.ndarray) -> bytes:
        """The bytes of ``tokens``, special tokens rendered as text. Ids outside the vocabulary
        raise EngineError(REJECT_BOUNDS)."""
        out = bytearray()
        buf = ctypes.create_string_buffer(64)
        for t in tokens:
            t = int(t)
            if not 0 <= t < self.n_vocab:
                raise EngineError(Status.REJECT_BOUNDS, f"token {t} outside the vocabulary")
            n = L.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, True)
            if n < 0:
                big = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self.vocab, t, big, len(big), 0, True)
                out += big.raw[:n]
            else:
                out += buf.raw[:n]
        return bytes(out)

    def close(self) -> None:
        """Free the weights. Idempotent."""
        if getattr(self, "ptr", None):
            L.llama_model_free(self.ptr)
            self.ptr = None
