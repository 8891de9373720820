"""baseRT.h through the binding, on the reference engine loaded by path (native/basert_h.h)."""

from __future__ import annotations

import pytest

from basertd.native import basert_api as api
from basertd.native import ref_engine_path
from basertd.native.ref import open_ref_api_lib, write_ref_bundle


@pytest.fixture
def bundle_file(tmp_path):
    return write_ref_bundle(
        tmp_path / "m.ref", vocab_size=300, chat_template="{{ bos_token }}{{ messages }}\n", add_bos=True
    )


def test_tokenizer_only_round_trip(bundle_file):
    tok = api.TokenizerHandle(ref_engine_path(), bundle_file)
    try:
        assert tok.vocab_size == 300
        assert (tok.bos_id, tok.eos_id, tok.bos_token, tok.eos_token) == (1, 2, "<s>", "</s>")
        assert tok.chat_template == "{{ bos_token }}{{ messages }}\n"
        text = "héllo </s> wörld"
        ids = tok.encode(text)
        assert ids[0] == 1 and 2 in ids  # add_bos, and the EOS string became its id
        assert tok.token_count(text) == len(ids)
        assert b"".join(tok.piece(i) for i in ids) == "héllo  wörld".encode()
        assert tok.piece(299) == b"" and tok.piece(300) == b""
    finally:
        tok.close()
    tok.close()  # idempotent


def test_load_reports_caps_and_descriptor(bundle_file, tmp_path):
    lib = open_ref_api_lib()
    m = api.load_model(lib, bundle_file, None, 64, api.LoadOptions(max_batch_size=4))
    try:
        assert m.caps & api.CAP_PREFIX_CACHE and m.caps & api.CAP_PAGED_KV
        assert m.descriptor["serving"]["max_lanes"] == 4
        assert m.descriptor["serving"]["context_length"] == 64
    finally:
        m.free()
    off = write_ref_bundle(tmp_path / "nocache.ref", prefix_cache=False)
    m = api.load_model(lib, off)
    try:
        assert not m.caps & api.CAP_PREFIX_CACHE
        assert "does not support a prefix cache" in m.descriptor["state"]["prefix_cache"]
    finally:
        m.free()


def test_load_errors_are_typed(tmp_path):
    lib = open_ref_api_lib()
    with pytest.raises(api.LoadError) as e:
        api.load_model(lib, tmp_path / "missing.ref")
    assert e.value.code == 3 and "missing.ref" in str(e.value)
    bad = tmp_path / "bad.ref"
    bad.write_text("not a bundle\n")
    with pytest.raises(api.LoadError) as e:
        api.load_model(lib, bad)
    assert e.value.code == 4
    good = write_ref_bundle(tmp_path / "g.ref")
    opts = lib.ffi.new("BaseRTLoadOptions *")
    opts.struct_size = lib.ffi.sizeof("BaseRTLoadOptions") + 8  # a caller built against another layout
    assert lib.lib.baseRT_load_model_ex(str(good).encode(), lib.ffi.NULL, 0, opts) == lib.ffi.NULL
    code, msg = api.last_error(lib)
    assert code == 2 and "struct_size" in msg
    with pytest.raises(api.LoadError):
        api.TokenizerHandle(ref_engine_path(), bad)


def test_version_check():
    assert api.check_version("0.3.7") == "0.3.7"
    with pytest.raises(api.VersionMismatch):
        api.check_version("0.4.0")
