"""``basertd-worker --error-file``: a worker that exits 2 (bad command line) or 3 (the engine or
model cannot load) writes its one-line reason there, and ``WorkerProcess.start`` turns it into a
``WorkerStartError`` whose ``reason`` is that line and which is ``permanent`` (the supervisor gives
up at once; real worker processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from basertd.server.workers.process import WorkerStartError, read_error_line
from basertd.worker.main import ERROR_LINE_MAX, write_error_line


def run_worker(tmp_path: Path, *args: str) -> tuple[int, list[str], Path]:
    err = tmp_path / "error"
    argv = [sys.executable, "-m", "basertd.worker.main", "--link", f"ipc://{tmp_path}/none.sock"]
    proc = subprocess.run(
        [*argv, "--error-file", str(err), *args], capture_output=True, text=True, timeout=60
    )
    return proc.returncode, [ln for ln in proc.stderr.splitlines() if ln and not ln.startswith("{")], err


def test_usage_error_exit_2_writes_the_flag_named(tmp_path):
    code, lines, err = run_worker(tmp_path, "--lanes", "0")
    assert code == 2 and "argument --lanes" in lines[-1]
    assert err.read_text() == f"basertd-worker: {lines[-1].partition(': error: ')[2]}\n"
    assert (err.stat().st_mode & 0o777) == 0o600


def test_load_failure_exit_3_writes_the_same_line_as_stderr(tmp_path):
    code, lines, err = run_worker(tmp_path, "--model", str(tmp_path / "absent.ref"))
    assert code == 3 and len(lines) == 1
    assert err.read_text() == lines[0] + "\n" and "baseRT_load_model_ex" in lines[0]
    assert read_error_line(str(tmp_path)) == lines[0]


def test_error_line_is_one_bounded_line(tmp_path):
    path = tmp_path / "e"
    write_error_line(str(path), "a\nb\tc " + "x" * (2 * ERROR_LINE_MAX))
    text = path.read_text()
    assert text.count("\n") == 1 and text.startswith("a b c x") and len(text) == ERROR_LINE_MAX + 1
    write_error_line(str(tmp_path / "no" / "such" / "dir"), "never raises")
    assert read_error_line(str(tmp_path / "no")) == ""


@pytest.mark.parametrize(
    ("fields", "code", "needle"),
    [
        (dict(extra_args=("--threads", "0")), 2, "argument --threads"),
        (dict(host_bytes=-1), 2, "argument --host-bytes"),
        (dict(model="/nonexistent/bundle.ref"), 3, "/nonexistent/bundle.ref"),
    ],
)
def test_start_error_carries_the_workers_line(make_spec, fields, code, needle):
    from basertd.server.workers.sync_worker import SyncWorker

    with pytest.raises(WorkerStartError) as info:
        SyncWorker(make_spec(**fields))
    exc = info.value
    assert exc.returncode == code and exc.permanent
    assert needle in exc.reason and "\n" not in exc.reason and exc.reason in str(exc)
