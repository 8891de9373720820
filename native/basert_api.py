"""baseRT's public C API (the ``baseRT.h`` 0.3.0 subset in ``native/basert_h.h``) through cffi.

Loading a bundle: ``open_basert_lib(path)`` opens a library exporting the tick ABI *and* the
baseRT.h entry points (``MissingSymbols`` lists every absent function), checks
``baseRT_version_string`` (``VersionMismatch`` unless 0.3.x), and ``load_model(lib, model_path,
kernel_library, max_context, LoadOptions(...))`` calls ``baseRT_load_model_ex`` with a
``BaseRTLoadOptions`` whose ``struct_size`` is our ``sizeof`` (the layout guard). A NULL return
raises ``LoadError`` carrying ``baseRT_get_error_code()`` and ``baseRT_get_error()``. The result
(``LoadedModel``) has the capability bits (``BASERT_CAP_*``), the parsed capability descriptor and
``bundle()``: an ``abi.Bundle`` whose ``close()`` calls ``baseRT_free_model``.

Tokenizing: ``TokenizerHandle.open(path, model_path)`` opens the library with only the tokenizer
surface required and calls ``baseRT_load_tokenizer_only``; ``encode`` (``baseRT_encode``),
``piece`` (``baseRT_decode_token_raw``, exact bytes), ``token_count``, the BOS/EOS ids and strings
and ``chat_template`` (``baseRT_chat_template_jinja``). A handle is single-owner (baseRT.h
threading model): every call here takes the handle's lock. ``vocab_size`` is found from the
documented contract of ``baseRT_decode_token_raw`` (< 0 for an id outside the vocabulary).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from basertd.native._cdef import header_to_cdef
from basertd.native._errors import BindingError, LibraryError, LibraryNotFound, MissingSymbols
from basertd.native._layout import has_symbol, tick_ffi
from basertd.native.abi import BasertLib, Bundle

BASERT_H = Path(__file__).resolve().with_name("basert_h.h")
"""Our declarations of the bound baseRT.h subset (installed as package data)."""

SUPPORTED_VERSION = (0, 3)
"""baseRT major.minor this binding matches (pre-1.0: a minor release may change layouts)."""

CAP_PAGED_KV, CAP_SEQUENCES, CAP_HOST_LOGITS, CAP_PREFIX_CACHE, CAP_GDN_SNAPSHOT = 1, 2, 4, 8, 16
"""``BASERT_CAP_*`` bits of ``baseRT_capabilities``."""

ERROR_NAMES = {
    0: "OK",
    1: "UNKNOWN",
    2: "INVALID_ARGUMENT",
    3: "FILE_NOT_FOUND",
    4: "INVALID_FORMAT",
    5: "UNSUPPORTED",
    6: "OUT_OF_MEMORY",
    7: "GPU",
    8: "GENERATION_FAILED",
}
"""``BaseRTErrorCode`` values -> names."""

TOKENIZER_FUNCTIONS = (
    "baseRT_version_string",
    "baseRT_load_tokenizer_only",
    "baseRT_free_model",
    "baseRT_get_error",
    "baseRT_get_error_code",
    "baseRT_encode",
    "baseRT_decode_token_raw",
    "baseRT_token_count",
    "baseRT_bos_id",
    "baseRT_eos_token_id",
    "baseRT_bos_token",
    "baseRT_eos_token",
    "baseRT_chat_template_jinja",
)
"""What a tokenizer-only process needs of the library."""


class VersionMismatch(LibraryError):
    """``baseRT_version_string`` names a release this binding does not match."""


class LoadError(BindingError):
    """``baseRT_load_model_ex`` / ``baseRT_load_tokenizer_only`` returned NULL. ``code`` is the
    ``BaseRTErrorCode``, ``message`` what ``baseRT_get_error`` said."""

    def __init__(self, what: str, code: int, message: str) -> None:
        self.code = code
        self.message = message
        name = ERROR_NAMES.get(code, str(code))
        super().__init__(f"{what} failed ({name}): {message or 'no message'}")


@functools.cache
def basert_h_cdef() -> str:
    """cffi declarations of ``basert_h.h`` (to follow the tick header's)."""
    return header_to_cdef(BASERT_H.read_text())


def check_version(text: str) -> str:
    """Raise ``VersionMismatch`` unless ``text`` (``baseRT_version_string``) is 0.3.x."""
    m = re.match(r"(\d+)\.(\d+)", text)
    if not m or (int(m.group(1)), int(m.group(2))) != SUPPORTED_VERSION:
        want = ".".join(map(str, SUPPORTED_VERSION))
        raise VersionMismatch(f"library reports baseRT {text!r}; basertd binds baseRT {want}.x")
    return text


def _string(ffi: Any, p: Any) -> str:
    return "" if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")


def last_error(lib: BasertLib | TokenizerHandle) -> tuple[int, str]:
    """``(baseRT_get_error_code(), baseRT_get_error())`` of the calling thread."""
    return int(lib.lib.baseRT_get_error_code()), _string(lib.ffi, lib.lib.baseRT_get_error())


def open_basert_lib(path: str | Path, extra_cdef: str = "") -> BasertLib:
    """The library at ``path`` with the tick ABI and the baseRT.h subset declared (plus
    ``extra_cdef``). Raises ``LibraryNotFound``, ``LibraryError``, ``MissingSymbols`` (every
    absent function named) and ``VersionMismatch``."""
    lib = BasertLib(path, extra_cdef=basert_h_cdef() + extra_cdef)
    check_version(_string(lib.ffi, lib.lib.baseRT_version_string()))
    return lib


@dataclass(frozen=True)
class LoadOptions:
    """``BaseRTLoadOptions`` fields (0 = the library's default)."""

    paged_kv: int = 1
    prefix_cache: int = 1
    max_batch_size: int = 0
    kv_bits: int = 0
    prefill_chunk: int = 0
    paged_weights_mode: int = 0


class LoadedModel:
    """A bundle loaded with ``baseRT_load_model_ex``: ``handle``, ``caps`` (``BASERT_CAP_*``),
    ``descriptor`` (the capability descriptor, parsed; {} when it is not JSON) and
    ``descriptor_text``. ``bundle()`` wraps it for the tick ABI (its close frees the model);
    ``free()`` frees it when no bundle was made. Idempotent."""

    def __init__(self, lib: BasertLib, handle: Any) -> None:
        self.lib = lib
        self.handle = handle
        self.caps = int(lib.lib.baseRT_capabilities(handle))
        self.descriptor_text = _string(lib.ffi, lib.lib.baseRT_capability_descriptor(handle))
        try:
            parsed = json.loads(self.descriptor_text) if self.descriptor_text else {}
        except ValueError:
            parsed = {}
        self.descriptor: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
        self._owned = True

    def bundle(self, cls: type[Bundle] = Bundle) -> Bundle:
        """The tick-ABI ``Bundle`` of this model (``cls`` may be a subclass); it now owns the
        model and frees it with ``baseRT_free_model`` on close."""
        self._owned = False
        return cls(self.lib, self.handle, self.lib.lib.baseRT_free_model)

    def free(self) -> None:
        """``baseRT_free_model`` unless a bundle took the model over; idempotent."""
        if self._owned:
            self._owned = False
            self.lib.lib.baseRT_free_model(self.handle)


def load_model(
    lib: BasertLib,
    model_path: str | Path,
    kernel_library: str | Path | None = None,
    max_context: int = 0,
    options: LoadOptions | None = None,
) -> LoadedModel:
    """``baseRT_load_model_ex(model_path, kernel_library or NULL, max_context, &opts)``.
    ``max_context`` in tokens (0: the library's choice). Raises ``LoadError``."""
    ffi = lib.ffi
    o = options or LoadOptions()
    opts = ffi.new("BaseRTLoadOptions *")
    opts.struct_size = ffi.sizeof("BaseRTLoadOptions")
    names = ("kv_bits", "paged_kv", "max_batch_size", "prefix_cache", "prefill_chunk", "paged_weights_mode")
    for name in names:
        setattr(opts, name, int(getattr(o, name)))
    kl = str(kernel_library).encode() if kernel_library else ffi.NULL
    handle = lib.lib.baseRT_load_model_ex(str(model_path).encode(), kl, int(max_context), opts)
    if handle == ffi.NULL:
        raise LoadError(f"baseRT_load_model_ex({model_path})", *last_error(lib))
    return LoadedModel(lib, handle)


class TokenizerHandle:
    """A tokenizer-only handle (``baseRT_load_tokenizer_only``) of one bundle. Thread-safe (one
    lock per handle); ``close()`` frees it (idempotent). Raises ``LoadError`` on open."""

    def __init__(self, path: str | Path, model_path: str | Path) -> None:
        p = Path(path)
        if not p.is_file():
            raise LibraryNotFound(f"no library at {p}")
        self.path = str(p)
        self.ffi = ffi = tick_ffi(basert_h_cdef())
        try:
            self.lib = ffi.dlopen(self.path)
        except OSError as e:
            raise LibraryError(f"cannot open {p}: {e}") from e
        missing = [n for n in TOKENIZER_FUNCTIONS if not has_symbol(self.lib, n)]
        if missing:
            raise MissingSymbols(self.path, missing)
        self.version = check_version(_string(ffi, self.lib.baseRT_version_string()))
        self._lock = threading.Lock()
        handle = self.lib.baseRT_load_tokenizer_only(str(model_path).encode())
        if handle == ffi.NULL:
            raise LoadError(f"baseRT_load_tokenizer_only({model_path})", *last_error(self))
        self._handle = handle
        self.model_path = str(model_path)
        self.bos_id = int(self.lib.baseRT_bos_id(handle))
        self.eos_id = int(self.lib.baseRT_eos_token_id(handle))
        self.bos_token = _string(ffi, self.lib.baseRT_bos_token(handle))
        self.eos_token = _string(ffi, self.lib.baseRT_eos_token(handle))
        self.chat_template = _string(ffi, self.lib.baseRT_chat_template_jinja(handle))
        self.vocab_size = self._probe_vocab_size()

    def _h(self) -> Any:
        if self._handle is None:
            raise BindingError("tokenizer handle is closed")
        return self._handle

    def _valid(self, token: int) -> bool:
        return int(self.lib.baseRT_decode_token_raw(self._h(), token, self.ffi.NULL, 0)) >= 0

    def _probe_vocab_size(self) -> int:
        lo, hi = 0, 1
        while hi < 1 << 31 and self._valid(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # lo valid, hi invalid
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._valid(mid) else (lo, mid)
        return hi

    def encode(self, text: str) -> list[int]:
        """``baseRT_encode``: special-token strings become their ids; the library decides BOS.
        Raises ``ValueError`` for text with a NUL or lone surrogates."""
        data = text.encode("utf-8")
        if b"\0" in data:
            raise ValueError("text contains a NUL character")
        with self._lock:
            h = self._h()
            cap = len(data) + 8
            while True:
                buf = self.ffi.new("uint32_t[]", cap)
                n = int(self.lib.baseRT_encode(h, data, buf, cap))
                if n < cap:
                    return list(buf[0:n])
                need = int(self.lib.baseRT_token_count(h, data))
                if need < cap:
                    return list(buf[0:n])
                cap = need + 1

    def token_count(self, text: str) -> int:
        """``baseRT_token_count``."""
        with self._lock:
            return int(self.lib.baseRT_token_count(self._h(), text.encode("utf-8")))

    def piece(self, token: int) -> bytes:
        """The token's exact bytes (``baseRT_decode_token_raw``); b"" for control tokens and ids
        outside the vocabulary."""
        if not 0 <= token < self.vocab_size:
            return b""
        with self._lock:
            h = self._h()
            buf = self.ffi.new("char[]", 64)
            n = int(self.lib.baseRT_decode_token_raw(h, token, buf, 64))
            if n > 64:
                buf = self.ffi.new("char[]", n)
                n = int(self.lib.baseRT_decode_token_raw(h, token, buf, n))
        return self.ffi.buffer(buf, n)[:] if n > 0 else b""

    def close(self) -> None:
        """``baseRT_free_model``; idempotent."""
        with self._lock:
            if self._handle is not None:
                self.lib.baseRT_free_model(self._handle)
                self._handle = None


__all__ = [
    "BASERT_H",
    "CAP_GDN_SNAPSHOT",
    "CAP_HOST_LOGITS",
    "CAP_PAGED_KV",
    "CAP_PREFIX_CACHE",
    "CAP_SEQUENCES",
    "LoadError",
    "LoadOptions",
    "LoadedModel",
    "TokenizerHandle",
    "VersionMismatch",
    "basert_h_cdef",
    "check_version",
    "last_error",
    "load_model",
    "open_basert_lib",
]
