"""Why a GGUF model file cannot be served: a cheap check of the file itself, used to turn a bare
"cannot load" from llama.cpp into a reason an operator can act on (DESIGN.md "Operators").

``diagnose_gguf(path)`` looks, in order, for: a missing path, a path that is not a regular file, an
unreadable file, a file that is not GGUF (magic), a GGUF version llama.cpp does not read, a header
(metadata and tensor table) that runs past the end of the file, tensor data that ends beyond it,
and an architecture the engines refuse (recurrent, hybrid, encoder-decoder, diffusion or
embedding-only models, whose state cannot be shared, truncated or decoded token by token) or that
the installed ``gguf`` library does not know. It reads the header only (bounded: the file is
memory-mapped and each length is checked against what is left of it), never the weights.

The GGUF layout (``gguf`` package constants): magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count, the metadata key/value pairs, the tensor infos (name, dims, ggml type, offset),
then the tensor data from the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import functools
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
"""GGUF versions llama.cpp reads."""

REFUSED_ARCHITECTURES: dict[str, str] = {
    **dict.fromkeys(("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"), "recurrent"),
    **dict.fromkeys(
        (
            "jamba",
            "falcon-h1",
            "plamo2",
            "granitehybrid",
            "lfm2",
            "lfm2moe",
            "nemotron_h",
            "nemotron_h_moe",
            "qwen3next",
            "kimi-linear",
        ),
        "hybrid recurrent",
    ),
    **dict.fromkeys(("t5", "t5encoder"), "encoder-decoder"),
    **dict.fromkeys(("dream", "llada", "llada-moe", "rnd1"), "diffusion"),
    **dict.fromkeys(
        (
            "bert",
            "nomic-bert",
            "nomic-bert-moe",
            "jina-bert-v2",
            "jina-bert-v3",
            "modern-bert",
            "neo-bert",
            "eurobert",
            "gemma-embedding",
            "llama-embed",
        ),
        "embedding-only",
    ),
    **dict.fromkeys(("clip", "wavtokenizer-dec"), "not a language model"),
}
"""Architectures no engine serves, with the kind of model each is: the engines serve decoder-only
models with a KV cache (per-token state that prefix sharing and truncation rely on)."""


def _gguf() -> ModuleType:
    """``gguf.constants``, imported on first use: importing the gguf package adds 50-250 ms to the
    start of every process that imports this module (the coordinator's tokenizer, the llama.cpp
    worker), and a file is only diagnosed after a load failed."""
    from gguf import constants

    return constants


@functools.cache
def _scalars() -> dict[int, int]:
    """Bytes of each scalar GGUF value type, by type code."""
    t = _gguf().GGUFValueType
    sizes = {t.UINT8: 1, t.INT8: 1, t.UINT16: 2, t.INT16: 2, t.UINT32: 4, t.INT32: 4, t.FLOAT32: 4}
    sizes.update({t.BOOL: 1, t.UINT64: 8, t.INT64: 8, t.FLOAT64: 8})
    return {int(k): v for k, v in sizes.items()}


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GgufProblem:
    """What is wrong with a model file. ``kind``: ``missing``, ``not_a_file``, ``unreadable``,
    ``not_gguf``, ``bad_version``, ``truncated``, ``corrupt``, ``unsupported_architecture`` or
    ``unknown_architecture``; ``message``: one sentence naming the path and the evidence."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


class _Bad(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.problem_kind = kind


class _Cursor:
    """Bounded little-endian reads over the mapped file; running past its end raises ``_Bad``."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def need(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise _Bad(
                "truncated",
                f"the header is cut short: {what} needs {n} bytes at offset {self.pos}, "
                f"but the file ends at {self.size}",
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.need(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.need(8, what))[0]

    def string(self, what: str) -> bytes:
        n = self.u64(what)
        start = self.need(n, what)
        return self.buf[start : start + n]

    def skip_value(self, vtype: int, what: str) -> None:
        value_type = _gguf().GGUFValueType
        scalars = _scalars()
        if vtype == value_type.STRING:
            self.need(self.u64(what), what)
        elif vtype == value_type.ARRAY:
            item = self.u32(what)
            count = self.u64(what)
            if item == value_type.STRING:
                if count * 8 > self.size - self.pos:
                    self.need(count * 8, what)  # raises: not even the lengths fit
                for _ in range(count):
                    self.need(self.u64(what), what)
            elif item in scalars:
                self.need(count * scalars[item], what)
            else:
                raise _Bad("corrupt", f"{what} is an array of unknown type {item}")
        elif vtype in scalars:
            self.need(scalars[vtype], what)
        else:
            raise _Bad("corrupt", f"{what} has unknown value type {vtype}")


def diagnose_gguf(path: str | os.PathLike[str]) -> GgufProblem | None:
    """The first problem found with the GGUF file at ``path`` (module docstring), or None when its
    header, size and architecture look servable (llama.cpp's own log then has the reason)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return GgufProblem("missing", f"model file {p} does not exist")
    except OSError as exc:
        return GgufProblem("unreadable", f"model file {p} cannot be examined: {exc.strerror or exc}")
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        return GgufProblem("not_a_file", f"model path {p} is {kind}")
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4 or f.read(4) != GGUF_MAGIC:
                f.seek(0)
                head = f.read(4)
                return GgufProblem(
                    "not_gguf", f"model file {p} is not a GGUF file (it starts with {head!r}, not b'GGUF')"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _check(p, buf, size)
    except OSError as exc:
        return GgufProblem("unreadable", f"model file {p} cannot be read: {exc.strerror or exc}")


def _check(p: Path, buf: mmap.mmap, size: int) -> GgufProblem | None:
    g = _gguf()
    cur = _Cursor(buf, size)
    cur.pos = 4
    arch = ""
    try:
        version = cur.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            return GgufProblem(
                "bad_version", f"model file {p} is GGUF version {version}; llama.cpp reads versions 2 and 3"
            )
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the metadata count")
        alignment = g.GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}").decode("utf-8", "replace")
            vtype = cur.u32(f"the type of {key}")
            if key == "general.architecture" and vtype == g.GGUFValueType.STRING:
                arch = cur.string(key).decode("utf-8", "replace")
            elif key == "general.alignment" and vtype == g.GGUFValueType.UINT32:
                alignment = cur.u32(key)
                if alignment == 0 or alignment & (alignment - 1):
                    raise _Bad("corrupt", f"general.alignment is {alignment}, not a power of two")
            else:
                cur.skip_value(vtype, key)
        data_end = 0
        tensors = []
        for i in range(n_tensors):
            name = cur.string(f"tensor info {i}").decode("utf-8", "replace")
            n_dims = cur.u32(f"the dimensions of tensor {name}")
            if n_dims > 8:
                raise _Bad("corrupt", f"tensor {name} has {n_dims} dimensions")
            elements = 1
            for _ in range(n_dims):
                elements *= cur.u64(f"the shape of tensor {name}")
            ggml_type = cur.u32(f"the type of tensor {name}")
            offset = cur.u64(f"the offset of tensor {name}")
            tensors.append((name, elements, ggml_type, offset))
        data_start = -(-cur.pos // alignment) * alignment
        for name, elements, ggml_type, offset in tensors:
            sizes = g.GGML_QUANT_SIZES.get(ggml_type)
            if sizes is None:
                raise _Bad("corrupt", f"tensor {name} has unknown ggml type {ggml_type}")
            block, type_bytes = sizes
            data_end = max(data_end, data_start + offset + elements // block * type_bytes)
        if data_end > size:
            return GgufProblem(
                "truncated",
                f"model file {p} is truncated: its tensor data ends at byte {data_end}, "
                f"but the file has {size} bytes",
            )
    except _Bad as bad:
        return GgufProblem(bad.problem_kind, f"model file {p} is {bad.problem_kind}: {bad}")
    return _architecture(p, arch)


def _architecture(p: Path, arch: str) -> GgufProblem | None:
    if not arch:
        return GgufProblem("corrupt", f"model file {p} has no general.architecture")
    refused = REFUSED_ARCHITECTURES.get(arch)
    if refused is not None:
        return GgufProblem(
            "unsupported_architecture",
            f"model file {p} has the unsupported architecture {arch!r} ({refused} model); the engines "
            "serve decoder-only models with a KV cache",
        )
    if arch not in _gguf().MODEL_ARCH_NAMES.values():
        return GgufProblem(
            "unknown_architecture",
            f"model file {p} has the architecture {arch!r}, which this build of the gguf library "
            "(and so probably llama.cpp) does not know",
        )
    return None


def load_failure(path: str | os.PathLike[str], what: str) -> str:
    """The message for a model that failed to load: ``what`` (e.g. "cannot load the vocabulary
    of PATH") and the reason ``diagnose_gguf`` finds, or a pointer to llama.cpp's log."""
    problem = diagnose_gguf(path)
    if problem is None:
        return f"{what}: the file looks like a servable GGUF; llama.cpp's reason is in the log"
    return f"{what}: {problem.message}"
