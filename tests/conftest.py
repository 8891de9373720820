"""Session fixtures shared by every test folder. Add fixtures here; never remove other people's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight ``llama`` GGUF (293-token SPM vocabulary, EOS id 2; tests/tinymodel.py)."""
    from tinymodel import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", "llama")


@pytest.fixture(scope="session")
def tiny_gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight ``gemma3`` GGUF with a 32-token sliding window on layer 0."""
    from tinymodel import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-gemma3.gguf", "gemma3", n_swa=32)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model (Gemma 3 270M Q4_K_M), assembled once (``basertd.models``); tests using it
    are marked ``realmodel``."""
    from basertd.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def conformance_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``llama`` GGUF shaped like the reference engine's default bundle, for running the
    conformance suite on the llama.cpp engine (tests/llamacpp_bundle.py): a 512-token vocabulary,
    one layer with one 16-wide KV head (64 KV bytes per token), and an EOS that is never drawn."""
    from tinymodel import write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny") / "tiny-conformance.gguf"
    return write_tiny_gguf(path, "llama", n_vocab=512, n_layer=1, n_head_kv=1, quiet_eos=True)


@pytest.fixture
def no_leaks():
    """After the test: /dev/shm exactly as before, no child process of ours alive or unreaped, no
    memfd descriptor added to this process (tests/proc_testutil.py)."""
    from proc_testutil import children_of, devshm_listing, memfds_of

    shm_before = devshm_listing()
    fds_before = len(memfds_of())
    yield
    shm_after = devshm_listing()
    assert shm_after == shm_before, f"/dev/shm changed: +{shm_after - shm_before} -{shm_before - shm_after}"
    assert children_of(os.getpid()) == set(), f"child processes remain: {children_of(os.getpid())}"
    assert len(memfds_of()) == fds_before, f"memfd descriptors leaked: {memfds_of()}"
