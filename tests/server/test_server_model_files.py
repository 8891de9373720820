"""Model-load errors say what is wrong with the file (``basertd.model_files.diagnose_gguf``):
missing, not a regular file, not a GGUF, an unread version, truncated header or tensor data, an
unsupported or unknown architecture; the coordinator's vocabulary load, the worker's llama.cpp load
and ``basertd serve`` itself report it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from tinymodel import tiny_vocab, write_tiny_gguf

from basertd.model_files import diagnose_gguf, load_failure
from basertd.server.request.tokenizer import GgufTokenizer, TokenizerError
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.model import LlamaModel


def arch_gguf(path: Path, arch: str) -> Path:
    """A complete GGUF of architecture ``arch`` with a vocabulary and one tensor (not loadable)."""
    tokens, scores, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")


def cut(src: Path, dst: Path, keep: int) -> Path:
    dst.write_bytes(src.read_bytes()[:keep])
    return dst


def test_a_good_file_has_no_problem(tiny):
    assert diagnose_gguf(tiny) is None
    assert "llama.cpp's reason is in the log" in load_failure(tiny, "cannot load it")


def test_each_problem_is_named(tiny, tmp_path):
    size = tiny.stat().st_size
    version1 = bytearray(tiny.read_bytes())
    version1[4:8] = (1).to_bytes(4, "little")
    (tmp_path / "v1.gguf").write_bytes(bytes(version1))
    (tmp_path / "text.gguf").write_text("hello, not a model\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    cases = {
        tmp_path / "absent.gguf": ("missing", "does not exist"),
        tmp_path: ("not_a_file", "is a directory"),
        tmp_path / "text.gguf": ("not_gguf", "is not a GGUF file"),
        tmp_path / "empty.gguf": ("not_gguf", "is not a GGUF file"),
        tmp_path / "v1.gguf": ("bad_version", "GGUF version 1"),
        cut(tiny, tmp_path / "head.gguf", 200): ("truncated", "the header is cut short"),
        cut(tiny, tmp_path / "half.gguf", size // 2): ("truncated", "tensor data ends at byte"),
        cut(tiny, tmp_path / "short.gguf", size - 1): ("truncated", f"but the file has {size - 1} bytes"),
        arch_gguf(tmp_path / "mamba.gguf", "mamba"): ("unsupported_architecture", "'mamba' (recurrent"),
        arch_gguf(tmp_path / "t5.gguf", "t5"): ("unsupported_architecture", "encoder-decoder"),
        arch_gguf(tmp_path / "odd.gguf", "frobnicator"): ("unknown_architecture", "'frobnicator'"),
    }
    for path, (kind, words) in cases.items():
        problem = diagnose_gguf(path)
        assert problem is not None, path
        assert (problem.kind, words in problem.message) == (kind, True), (path, problem)
        assert str(path) in problem.message


def test_the_coordinator_vocabulary_load_says_why(tiny, tmp_path):
    (tmp_path / "text.gguf").write_text("hello")
    half = cut(tiny, tmp_path / "half.gguf", tiny.stat().st_size // 2)
    odd = arch_gguf(tmp_path / "odd.gguf", "frobnicator")
    for path, words in (
        (tmp_path / "absent.gguf", "does not exist"),
        (tmp_path / "text.gguf", "is not a GGUF file"),
        (half, "is truncated"),
        (odd, "'frobnicator'"),
    ):
        with pytest.raises(TokenizerError) as err:
            GgufTokenizer(str(path))
        assert f"cannot load the vocabulary of {path}" in str(err.value)
        assert words in str(err.value), str(err.value)


def test_the_worker_model_load_says_why(tiny, tmp_path):
    half = cut(tiny, tmp_path / "half.gguf", tiny.stat().st_size // 2)
    mamba = arch_gguf(tmp_path / "mamba.gguf", "mamba")
    for path, words in (
        (tmp_path / "absent.gguf", "does not exist"),
        (half, "is truncated"),
        (mamba, "'mamba'"),
    ):
        with pytest.raises(EngineError) as err:
            LlamaModel(path)
        assert words in str(err.value), str(err.value)


def test_basertd_serve_names_the_problem(tiny, tmp_path):
    half = cut(tiny, tmp_path / "half.gguf", tiny.stat().st_size // 2)
    cfg = tmp_path / "basertd.toml"
    cfg.write_text(f'runtime_dir = "{tmp_path / "rt"}"\n[[workers]]\nmodel = "{half}"\n')
    r = subprocess.run(
        [sys.executable, "-m", "basertd.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "is truncated: its tensor data ends at byte" in out, out
    assert "Traceback" not in out, out
