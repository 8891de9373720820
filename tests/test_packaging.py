"""Packaging: every import lives under the one ``basertd`` namespace (DESIGN.md "Layout")."""

import importlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name", ["basertd", "basertd.schema", "basertd.shm", "basertd.worker", "basertd.native"]
)
def test_namespace_imports(name):
    mod = importlib.import_module(name)
    assert mod.__doc__, f"{name} has no docstring"


@pytest.mark.parametrize("name", ["schema", "worker", "shm", "native"])
def test_no_generic_top_level_module(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # keep the checkout itself off sys.path
    code = (
        "import importlib.util, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
        f"print(importlib.util.find_spec({name!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None", f"a top-level {name!r} module is importable: {out}"


@pytest.mark.slow
def test_wheel_installs_only_basertd(tmp_path):
    """A built wheel holds one top-level package, ``basertd``, and the data files the daemon serves
    (the operator's page at ``/``)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("basertd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    tops = {t for t in tops if not t.endswith(".dist-info")}
    assert tops == {"basertd"}, tops
    static = "basertd/server/transport/http/static/"
    assert {static + f for f in ("index.html", "opsview.js", "opsview.css")} <= set(names)
