"""Shared fixtures of the tick-ABI conformance suite (RULES.md sections A-J).

Every test names its rule (``# ABI rule N``). Tests that need a library run against:

- ``ref``: the C reference engine, its bundles made by its private factory
  (``basertd.native.ref.create_ref_bundle``); a missing build fails with "run make native";
- ``libbasert``: a library loaded the way a real libbaseRT is, bundles made by path with
  ``baseRT_load_model_ex`` (``basertd.native.basert_api``). By default it is the reference engine
  again, each bundle written as a reference bundle file (``write_ref_bundle``) and loaded from it.
  Set ``$BASERT_LIB`` to a real libbaseRT build and ``$BASERT_MODEL`` to a ``.base`` bundle
  (``$BASERT_KERNEL_LIB`` optionally names the kernel library) to run the very same tests on it;
  tests that ask for a reference-engine config then skip with the reason.

Fixtures here: ``tick_ffi`` (cffi view of our header), ``abi_lib`` (a ``BasertLib`` per engine),
``make_bundle`` (a factory of fresh bundles per engine, closed after the test). The reference
engine's own bundle factory is ``ref_bundle_factory``, provided by ``basertd.native.ref``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from basertd.native import ref_engine_path
from basertd.native._layout import tick_ffi as _tick_ffi
from basertd.native.abi import BasertLib, Bundle

ENGINES = ["ref", "libbasert"]
BASERT_LIB_ENV = "BASERT_LIB"
BASERT_MODEL_ENV = "BASERT_MODEL"
BASERT_KERNEL_LIB_ENV = "BASERT_KERNEL_LIB"
_REF_SOURCES = Path(__file__).resolve().parents[2] / "native" / "ref_engine"


def pytest_collection_modifyitems(config, items) -> None:
    """Skip, with the reason, the tests that cannot run on the llama.cpp engine (RULES.md sections
    that exist only at the C layer, features it does not have); tests/llamacpp_bundle.py lists them."""
    from llamacpp_bundle import not_applicable

    for item in items:
        reason = not_applicable(item.nodeid)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"llamacpp: {reason}"))


def pytest_report_header(config) -> str:
    lib = os.environ.get(BASERT_LIB_ENV)
    shown = lib or "(unset: libbasert runs the reference engine loaded by path)"
    return f"tick-ABI conformance: reference engine always; ${BASERT_LIB_ENV}={shown}"


@pytest.fixture(scope="session")
def tick_ffi():
    """The cffi FFI holding every declaration of native/basert_tick.h."""
    return _tick_ffi()


def _ref_lib_path() -> str:
    if not any(_REF_SOURCES.glob("*.c")):
        pytest.skip("native/ref_engine has no sources yet: the reference engine is not written")
    return ref_engine_path()  # FileNotFoundError ("run make native") when sources exist unbuilt


@pytest.fixture(scope="session")
def ref_lib() -> BasertLib:
    """The reference engine opened through the binding (tick-ABI declarations only)."""
    return BasertLib(_ref_lib_path())


@pytest.fixture(scope="session")
def real_lib() -> BasertLib:
    """``$BASERT_LIB`` (else the reference engine) opened with the tick ABI and the baseRT.h
    subset declared (``basertd.native.basert_api.open_basert_lib``)."""
    path = os.environ.get(BASERT_LIB_ENV)
    if not path:
        from basertd.native.ref import open_ref_api_lib

        return open_ref_api_lib(_ref_lib_path())
    from basertd.native.basert_api import open_basert_lib

    return open_basert_lib(path)


@pytest.fixture(params=ENGINES)
def abi_lib(request) -> BasertLib:
    """The library under test: the reference engine, then ``$BASERT_LIB`` when set."""
    return request.getfixturevalue("ref_lib" if request.param == "ref" else "real_lib")


@pytest.fixture(params=[*ENGINES, "llamacpp"])
def make_bundle(request) -> Iterator[Callable[..., Bundle]]:
    """``make_bundle(**config) -> Bundle``: fresh bundles of the engine under test, closed at
    teardown. Keyword config is the reference engine's (``basertd.native.ref``); a real
    libbaseRT's factory gets none and must skip tests whose config it cannot honour. ``llamacpp``
    is the llama.cpp engine on a tiny GGUF behind the Bundle surface (tests/llamacpp_bundle.py)."""
    if request.param == "ref":
        factory = request.getfixturevalue("ref_bundle_factory")
    elif request.param == "llamacpp":
        from llamacpp_bundle import make_llamacpp_bundle

        model = request.getfixturevalue("conformance_gguf")

        def factory(**config):
            return make_llamacpp_bundle(model, **config)

    else:
        factory = _path_loaded_factory(request.getfixturevalue("real_lib"), request)

    made: list[Bundle] = []

    def make_one(**config) -> Bundle:
        b = factory(**config)
        made.append(b)
        return b

    yield make_one
    for b in made:
        b.close()


def _path_loaded_factory(lib: BasertLib, request) -> Callable[..., Bundle]:
    """Bundles loaded by path with ``baseRT_load_model_ex`` (paged KV and prefix cache on)."""
    from basertd.native.basert_api import load_model

    real = os.environ.get(BASERT_LIB_ENV)
    if real:
        model = os.environ.get(BASERT_MODEL_ENV)
        if not model:
            pytest.skip(f"${BASERT_MODEL_ENV} is unset: no .base bundle to load into {real}")

        def factory(**config):
            if config:
                pytest.skip(f"reference-engine config {sorted(config)} has no real-libbaseRT equivalent")
            return load_model(lib, model, os.environ.get(BASERT_KERNEL_LIB_ENV) or None).bundle()

        return factory

    from basertd.native.ref import RefBundle, RefConfig, write_ref_bundle

    tmp = request.getfixturevalue("tmp_path")
    counter = iter(range(1 << 30))

    def factory(**config):
        cfg = RefConfig(**config)
        path = write_ref_bundle(tmp / f"bundle{next(counter)}.ref", cfg)
        b = load_model(lib, path).bundle(RefBundle)
        b.config = cfg
        return b

    return factory


# -- sections C-G and J: reference bundles and bundles with rings (lanekit.Rig) ----------------


@pytest.fixture
def ref_bundle_factory() -> Iterator[Callable[..., Bundle]]:
    """``factory(**config) -> RefBundle``: fresh reference bundles (keywords of
    ``basertd.native.ref.RefConfig``), driven through ``basertd.native.abi``; closed at teardown."""
    from basertd.native.ref import create_ref_bundle

    made: list[Bundle] = []

    def factory(**config) -> Bundle:
        _ref_lib_path()
        b = create_ref_bundle(**config)
        made.append(b)
        return b

    yield factory
    for b in made:
        b.close()


@pytest.fixture
def make_rig(make_bundle):
    """``make_rig(rig_kw=None, **config) -> lanekit.Rig``: a bundle of the engine under test with
    its prompt, emit and logits rings attached. Rigs are closed (bundle, then ring segments) at
    teardown."""
    from lanekit import Rig

    from basertd.native.ref import RefBundle

    rigs = []

    def factory(rig_kw: dict | None = None, **config):
        b = make_bundle(**config)
        vocab = b.config.vocab_size if isinstance(b, RefBundle) else 512
        r = Rig(b, vocab=vocab, **(rig_kw or {}))
        rigs.append(r)
        return r

    yield factory
    for r in rigs:
        r.close()


@pytest.fixture
def rig(make_rig):
    """A default-config ``lanekit.Rig`` of the engine under test."""
    return make_rig()
