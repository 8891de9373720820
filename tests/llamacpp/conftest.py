"""Fixtures of the llama.cpp engine tests: engines on the tiny GGUFs (one thread, small pools),
each with a ``Coordinator`` playing the other side of its rings (lc_harness.py).

Every test that makes an engine runs in each KV layout (``kv_layout``: the unified cache and
per-lane streams, ``context.KV_LAYOUTS``) unless it is marked ``kv_layouts(...)`` with the ones it
is about: ``kv_layouts("unified")`` on tests of what only the unified cache does (cells shared
between sequences, a pool smaller than the lanes, windows pruned by other sequences' traffic)."""

from __future__ import annotations

import pytest
from lc_harness import BareLlama, Coordinator

from basertd.shm import ControlBlock
from basertd.worker.engines.llamacpp import LlamaCppEngine
from basertd.worker.engines.llamacpp.context import KV_LAYOUTS


def pytest_generate_tests(metafunc):
    if "kv_layout" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("kv_layouts")
        metafunc.parametrize("kv_layout", list(marker.args if marker else KV_LAYOUTS))


@pytest.fixture
def make_engine(tiny_gguf, kv_layout):
    """``make(path=None, coord_kw=None, **engine_kw) -> (engine, coordinator)``; closed after the
    test. Defaults: the tiny llama model, 8 lanes of 256 tokens, n_threads 1, the test's
    ``kv_layout``."""
    made = []

    def make(path=None, coord_kw=None, **kw):
        kw.setdefault("lanes", 8)
        kw.setdefault("context_length", 256)
        kw.setdefault("n_threads", 1)
        kw.setdefault("kv_layout", kv_layout)
        eng = LlamaCppEngine(path or tiny_gguf, **kw)
        coord = Coordinator(eng, **(coord_kw or {}))
        made.append((eng, coord))
        return eng, coord

    yield make
    for eng, coord in made:
        eng.close()
        coord.close()


@pytest.fixture
def lc(make_engine):
    """One default tiny-llama engine and its coordinator."""
    return make_engine()


@pytest.fixture
def control():
    """A control segment (``basertd.shm.ControlBlock``) for the yield tests; closed after the test."""
    block = ControlBlock.create()
    yield block
    block.close()


@pytest.fixture
def bare(lc):
    """A plain llama.cpp loop with the default engine's model and context parameters."""
    eng, _ = lc
    b = BareLlama(eng.model.path, eng.context_params())
    yield b
    b.close()
