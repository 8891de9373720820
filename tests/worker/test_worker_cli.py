"""``basertd-worker``'s command line and exit codes: 2 for a bad command line with
the flag named, 3 when the engine or model cannot load with the reason, as real processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from proc_testutil import log_lines

from basertd.native import header_path
from basertd.server.workers.process import WorkerStartError
from basertd.server.workers.sync_worker import SyncWorker

ROOT = Path(__file__).resolve().parents[2]


def run_worker(*args: str, tmp_path: Path) -> tuple[int, str, list[dict]]:
    """Run the worker with ``args`` (a link nobody listens on); (exit code, plain stderr text,
    JSON log lines)."""
    proc = subprocess.run(
        [sys.executable, "-m", "basertd.worker.main", "--link", f"ipc://{tmp_path}/none.sock", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    plain, lines = [], []
    for line in proc.stderr.splitlines():
        (lines if line.startswith("{") else plain).append(line)
    return proc.returncode, "\n".join(plain), [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--lanes", "0"], "--lanes"),
        (["--context-length", "many"], "--context-length"),
        (["--ring", "1:prompt:99:4:24"], "--ring"),
        (["--ring", "1:inbox:99:4:24"], "--ring"),
        (["--ring", "1:prompt:99"], "--ring"),
        (["--engine", "nosuch"], "--engine"),
        (["--ref-config", '{"vocab": 5}'], "--ref-config"),
        (["--ref-config", "vocab_size"], "--ref-config"),
        (["--ref-config", "[1, 2]"], "--ref-config"),
        (["--log-level", "loud"], "--log-level"),
        (["--lib", "/a.so", "--model", "/b.so"], "--model"),
    ],
)
def test_bad_command_line_exits_2_naming_the_flag(args, flag, tmp_path):
    code, text, _ = run_worker(*args, tmp_path=tmp_path)
    assert code == 2, text
    assert f"argument {flag}" in text


def test_missing_link_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "basertd.worker.main"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "--link" in proc.stderr


def test_unknown_engine_names_the_engine(tmp_path):
    code, text, _ = run_worker("--engine", "tpu9000", tmp_path=tmp_path)
    assert code == 2 and "tpu9000" in text


def test_engine_refusing_its_config_exits_3_with_the_reason(tmp_path):
    code, text, lines = run_worker("--ref-config", "vocab_size=1", tmp_path=tmp_path)
    assert code == 3
    assert "refused the config" in text and "REJECT_BOUNDS" in text
    assert [x["event"] for x in lines if x["level"] == "error"] == ["model_load_failed"]


def test_missing_library_exits_3(tmp_path):
    code, text, _ = run_worker("--lib", str(tmp_path / "libnothere.so"), tmp_path=tmp_path)
    assert code == 3 and "no tick-ABI library" in text


def test_library_without_the_tick_abi_exits_3(tmp_path):
    ringc = next((ROOT / "native").glob("_ringc*.so"))
    code, text, _ = run_worker("--lib", str(ringc), tmp_path=tmp_path)
    assert code == 3 and "is not a tick-ABI library" in text


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build a tick-ABI-only library")
def test_tick_abi_library_without_a_loader_exits_3(tmp_path):
    # A library exporting the whole tick ABI but no way to create a bundle (a real libbaseRT
    # loads models through baseRT.h): refused clearly, not crashed.
    lib = tmp_path / "libtickonly.so"
    src = ROOT / "tests" / "native" / "scripted_lib.c"
    inc = Path(header_path()).parent
    subprocess.run(["cc", "-std=c11", "-shared", "-fPIC", f"-I{inc}", str(src), "-o", str(lib)], check=True)
    code, text, _ = run_worker("--lib", str(lib), tmp_path=tmp_path)
    assert code == 3 and "no way to create a bundle" in text


def test_start_failure_is_a_typed_error_and_leaves_nothing(make_spec, worker_log):
    with pytest.raises(WorkerStartError) as err:
        SyncWorker(make_spec(ref_config={"vocab_size": 1}))
    assert err.value.returncode == 3
    assert any(x["event"] == "model_load_failed" for x in log_lines(worker_log, plain_ok=True))
