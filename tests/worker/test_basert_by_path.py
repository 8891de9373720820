"""The basert engine loaded by path through baseRT.h's ``baseRT_load_model_ex`` (real worker
processes): a library lacking a symbol, a wrong BaseRTLoadOptions size and a bundle that does not
load each exit 3 with one clear line; a loaded bundle reports its capabilities and tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from basertd.native import header_path, ref_engine_path
from basertd.native.ref import write_ref_bundle
from basertd.server.request.tokenizer import BaseRTTokenizer, TokenizerError
from basertd.server.workers.process import WorkerStartError
from basertd.server.workers.sync_worker import SyncWorker

ROOT = Path(__file__).resolve().parents[2]

WRONG_SIZE_SHIM = r"""
#include <stdio.h>
#include "basert_h.h"
static _Thread_local char err[256];
static _Thread_local BaseRTErrorCode code;
/* A library built against a baseRT.h whose BaseRTLoadOptions grew by 8 bytes. */
baseRT_model_t baseRT_load_model_ex(const char *m, const char *k, int c, const BaseRTLoadOptions *o) {
    (void)m; (void)k; (void)c;
    snprintf(err, sizeof err, "BaseRTLoadOptions.struct_size %zu, expected %zu",
             o ? o->struct_size : 0, sizeof(BaseRTLoadOptions) + 8);
    code = BASERT_ERR_INVALID_ARGUMENT;
    return NULL;
}
const char *baseRT_get_error(void) { return err; }
BaseRTErrorCode baseRT_get_error_code(void) { return code; }
"""


def run_worker(tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-m", "basertd.worker.main", "--link", f"ipc://{tmp_path}/none.sock", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, [ln for ln in proc.stderr.splitlines() if not ln.startswith("{")]


def test_missing_symbols_exit_3_listing_them(tmp_path):
    lib = tmp_path / "libtickonly.so"
    src = ROOT / "tests" / "native" / "scripted_lib.c"
    inc = Path(header_path()).parent
    subprocess.run(["cc", "-std=c11", "-shared", "-fPIC", f"-I{inc}", str(src), "-o", str(lib)], check=True)
    model = write_ref_bundle(tmp_path / "m.ref")
    code, lines = run_worker(tmp_path, "--lib", str(lib), "--model", str(model))
    assert code == 3 and len(lines) == 1
    assert "baseRT_load_model_ex" in lines[0] and "baseRT_load_tokenizer_only" in lines[0]


def test_wrong_struct_size_exit_3(tmp_path):
    src = tmp_path / "shim.c"
    src.write_text(WRONG_SIZE_SHIM)
    lib = tmp_path / "libshim.so"
    ref_dir = str(Path(ref_engine_path()).parent)
    link = [f"-L{ref_dir}", "-Wl,--no-as-needed", "-l:libbasert_ref.so", f"-Wl,-rpath,{ref_dir}"]
    cmd = ["cc", "-std=c11", "-shared", "-fPIC", f"-I{ref_dir}", str(src), *link, "-o", str(lib)]
    subprocess.run(cmd, check=True)
    model = write_ref_bundle(tmp_path / "m.ref")
    code, lines = run_worker(tmp_path, "--lib", str(lib), "--model", str(model))
    assert code == 3 and len(lines) == 1
    assert "INVALID_ARGUMENT" in lines[0] and "struct_size" in lines[0]


@pytest.mark.parametrize("content", [None, "basertd-ref-bundle 1\nvocab_size = 1\n", "garbage\n"])
def test_unloadable_model_exit_3(tmp_path, content):
    model = tmp_path / "m.ref"
    if content is not None:
        model.write_text(content)
    code, lines = run_worker(tmp_path, "--model", str(model))
    assert code == 3 and len(lines) == 1 and "baseRT_load_model_ex" in lines[0]


def test_worker_serves_a_bundle_loaded_by_path(make_spec, tmp_path):
    model = write_ref_bundle(tmp_path / "m.ref", prefix_cache=False, chat_template="{{ x }}")
    with SyncWorker(make_spec(model=str(model), lanes=4, context_length=128)) as w:
        caps = w.capabilities
        assert caps.engine == "basert" and caps.tokenizer.kind == "basert"
        assert (caps.max_lanes, caps.context_length) == (4, 128)
        assert caps.extra["prefix_cache"] == "0" and "prefix cache" in caps.extra["prefix_cache_reason"]
        assert caps.extra["chat_template"] == "{{ x }}"


def test_start_failure_of_a_bundle_is_typed(make_spec, tmp_path):
    with pytest.raises(WorkerStartError) as err:
        SyncWorker(make_spec(model=str(tmp_path / "absent.ref")))
    assert err.value.returncode == 3


def test_coordinator_tokenizer_process_round_trip(tmp_path):
    model = write_ref_bundle(tmp_path / "m.ref", add_bos=True, chat_template="T")
    tok = BaseRTTokenizer("", str(model))
    try:
        assert (tok.vocab_size, tok.add_bos, tok.chat_template) == (512, True, "T")
        ids = tok.encode("ünïcode", add_bos=False)
        assert ids and ids[0] != tok.bos_id
        assert b"".join(tok.piece(i) for i in ids).decode() == "ünïcode"
        assert tok.encode("x", add_bos=True)[0] == tok.bos_id
    finally:
        tok.close()
    with pytest.raises(TokenizerError, match="absent"):
        BaseRTTokenizer("", str(tmp_path / "absent.ref"))
