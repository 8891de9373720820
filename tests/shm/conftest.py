"""Fixtures of the shared-memory tests: the helper processes (``shm_ring_peer.py``, a Python peer;
``shm_ring_peer.c``, a C peer linked with native/brt_ring.c). The /dev/shm, memfd and child-process
leak check is ``no_leaks`` of tests/conftest.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY_PEER = HERE / "shm_ring_peer.py"
C_PEER_SRC = HERE / "shm_ring_peer.c"


@pytest.fixture
def py_peer():
    """argv prefix that runs the Python peer process."""
    return [sys.executable, str(PY_PEER)]


@pytest.fixture(scope="session")
def c_peer(tmp_path_factory) -> Path:
    """The C peer, compiled once per session from shm_ring_peer.c and native/brt_ring.c with the
    package's warning flags (-Werror: the ring code must stay -Wall -Wextra clean)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    if shutil.which(cc[0]) is None:
        cc = ["cc"]
    exe = tmp_path_factory.mktemp("cpeer") / "shm_ring_peer"
    cmd = [
        *cc,
        "-std=c11",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-I",
        str(ROOT / "native"),
        "-o",
        str(exe),
        str(C_PEER_SRC),
        str(ROOT / "native" / "brt_ring.c"),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe
