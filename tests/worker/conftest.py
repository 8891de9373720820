"""Fixtures of the worker tests: a short private runtime directory, a worker log file and a spec
factory whose workers every test checks for leaks (``no_leaks`` of tests/conftest.py: /dev/shm
unchanged, no child process, no memfd; and nothing left in the runtime directory)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from basertd.server.workers.process import WorkerSpec


@pytest.fixture
def rundir():
    """A short runtime directory (ipc socket paths must stay under ~100 bytes); asserted empty at
    the end, then removed."""
    path = Path(tempfile.mkdtemp(prefix="brtw-", dir="/tmp"))
    yield path
    left = sorted(os.listdir(path))
    shutil.rmtree(path, ignore_errors=True)
    assert left == [], f"left behind in the runtime directory: {left}"


@pytest.fixture
def worker_log(tmp_path: Path) -> Path:
    """File that receives the worker's stderr (its JSON log lines)."""
    return tmp_path / "worker.log"


@pytest.fixture
def make_spec(rundir: Path, worker_log: Path, no_leaks):
    """``make_spec(**fields)``: a ``WorkerSpec`` for the reference engine whose runtime directory
    is ``rundir`` and whose stderr goes to ``worker_log``."""
    files = []

    def make(**fields) -> WorkerSpec:
        f = open(worker_log, "ab")  # noqa: SIM115 - closed by the fixture
        files.append(f)
        fields.setdefault("runtime_dir", str(rundir))
        fields.setdefault("stderr", f)
        fields.setdefault("start_timeout", 30.0)
        return WorkerSpec(**fields)

    yield make
    for f in files:
        f.close()
