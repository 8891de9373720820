"""``open_engine``: the worker registry's factory of the llama.cpp engine (typed option and load
errors, options reaching the engine)."""

from __future__ import annotations

import pytest

from basertd.worker.engines import EngineLoadError, EngineOptionError, EngineOptions, open_engine
from basertd.worker.engines.llamacpp import LlamaCppEngine


def test_options_reach_the_engine(tiny_gguf):
    eng = open_engine("llamacpp", EngineOptions(model=str(tiny_gguf), lanes=3, context_length=64, threads=1))
    try:
        assert isinstance(eng, LlamaCppEngine)
        info = eng.info()
        assert (info.max_lanes, info.context_length, info.engine) == (3, 64, "llamacpp")
        assert eng.context_params()["n_threads"] == 1
    finally:
        eng.close()
        eng.close()  # idempotent


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (EngineOptions(), "--model"),
        (EngineOptions(model="x.gguf", lib="/lib.so"), "--lib"),
        (EngineOptions(model="x.gguf", ref_config={"vocab_size": 5}), "--ref-config"),
        (EngineOptions(model="x.gguf", device="tpu"), "--device"),
        (EngineOptions(model="x.gguf", threads=0), "--threads"),
    ],
)
def test_bad_options_name_their_flag(options, flag):
    with pytest.raises(EngineOptionError) as ex:
        open_engine("llamacpp", options)
    assert ex.value.flag == flag


def test_bad_sizes_and_missing_files(tiny_gguf, tmp_path):
    with pytest.raises(EngineOptionError):
        open_engine("llamacpp", EngineOptions(model=str(tiny_gguf), lanes=300, threads=1))
    with pytest.raises(EngineLoadError, match="does not exist"):
        open_engine("llamacpp", EngineOptions(model=str(tmp_path / "missing.gguf"), threads=1))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(EngineLoadError, match="cannot load"):
        open_engine("llamacpp", EngineOptions(model=str(junk), threads=1))
