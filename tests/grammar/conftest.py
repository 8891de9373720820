"""Fixtures of the grammar tests: llama.cpp engines on the tiny GGUF (tests/llamacpp/lc_harness.py
plays the coordinator's side of the rings)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llamacpp"))

from lc_harness import Coordinator

from basertd.worker.engines.llamacpp import LlamaCppEngine


@pytest.fixture
def make_engine(tiny_gguf):
    """``make(**engine_kw) -> (engine, coordinator)``, closed after the test; 8 lanes of 512
    tokens, one thread."""
    made = []

    def make(**kw):
        kw.setdefault("lanes", 8)
        kw.setdefault("context_length", 512)
        kw.setdefault("n_threads", 1)
        eng = LlamaCppEngine(tiny_gguf, **kw)
        coord = Coordinator(eng)
        made.append((eng, coord))
        return eng, coord

    yield make
    for eng, coord in made:
        eng.close()
        coord.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_gguf):
    """The tiny GGUF's llguidance tokenizer (one engine per module, for its loaded model)."""
    from basertd.worker.engines.llamacpp.grammar import tokenizer_for

    eng = LlamaCppEngine(tiny_gguf, lanes=1, context_length=64, n_threads=1)
    yield tokenizer_for(eng.model)
    eng.close()
