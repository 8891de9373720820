"""The shipped systemd files: the units pass ``systemd-analyze verify`` without a
single warning, carry the options the operators issue asks for, agree with the daemon's defaults,
and the sysusers.d / tmpfiles.d files apply to an empty root; the example configuration passes
``basertctl config check`` and a broken one is refused naming the key."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from basertd.server.config import load_config
from basertd.server.config_sections import OperatorsConfig
from basertd.server.fleet import WORKER_CLOSE_GRACE_S
from basertd.server.ops.control import check_config_text
from basertd.server.paths import SOCKET_NAME, SYSTEM_RUNTIME_DIR

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
SHIPPED_EXEC = "/opt/basertd/bin/basertd"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install systemd)")
    return path


def unit_options(path: Path) -> dict[str, list[str]]:
    """``Section.Key`` -> values, in order (systemd allows a key several times)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, val = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(val.strip())
    return out


def test_units_pass_systemd_analyze_verify_without_warnings(tmp_path):
    analyze = _tool("systemd-analyze")
    service = (SYSTEMD / "basertd.service").read_text()
    assert service.count(f"ExecStart={SHIPPED_EXEC} ") == 1
    # verify checks that ExecStart's binary exists: point it at this checkout's entry point
    basertd = Path(sys.executable).parent / "basertd"
    assert basertd.exists()
    (tmp_path / "basertd.service").write_text(service.replace(SHIPPED_EXEC, str(basertd)))
    shutil.copy(SYSTEMD / "basertd.socket", tmp_path / "basertd.socket")
    r = subprocess.run(
        [analyze, "verify", "--man=no", "basertd.service", "basertd.socket"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "" and r.stdout.strip() == "", r.stderr + r.stdout
    # and verify does catch a broken unit (this check can fail)
    (tmp_path / "basertd.service").write_text(service.replace("WatchdogSec=", "WatchdogSecs="))
    r = subprocess.run(
        [analyze, "verify", "--man=no", "basertd.service", "basertd.socket"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Unknown key" in r.stderr


def test_units_carry_the_operators_options_and_agree_with_the_daemon():
    svc = unit_options(SYSTEMD / "basertd.service")
    sock = unit_options(SYSTEMD / "basertd.socket")
    one = {k: v[-1] for k, v in svc.items()}
    assert one["Service.Type"] == "notify" and one["Service.NotifyAccess"] == "main"
    assert one["Service.User"] == "basertd" and one["Service.Group"] == "basertd"
    assert one["Service.RuntimeDirectory"] == "basertd" and one["Service.StateDirectory"] == "basertd"
    assert one["Service.Restart"] == "on-failure" and one["Service.KillMode"] == "mixed"
    assert int(one["Service.WatchdogSec"]) >= 10
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert one[f"Service.{key}"] == "yes", key
    assert one["Service.ProtectSystem"] == "strict"
    assert one["Service.DevicePolicy"] == "closed"
    assert {"char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-kfd rw", "char-drm rw"} <= set(
        svc["Service.DeviceAllow"]
    )
    assert one["Service.ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert "--config /etc/basertd/basertd.toml" in one["Service.ExecStart"]
    # the stop timeout covers a default drain plus the workers' stop grace
    drain = OperatorsConfig().drain_timeout_s
    assert int(one["Service.TimeoutStopSec"]) > drain + WORKER_CLOSE_GRACE_S
    # the socket unit serves the path clients look for by default
    s = {k: v[-1] for k, v in sock.items()}
    assert s["Socket.ListenStream"] == f"{SYSTEM_RUNTIME_DIR}/{SOCKET_NAME}"
    assert s["Socket.SocketMode"] == "0660" and s["Socket.SocketGroup"] == "basertd"
    assert s["Socket.Service"] == "basertd.service"
    assert one["Unit.Requires"] == "basertd.socket"


def test_sysusers_and_tmpfiles_apply_to_an_empty_root(tmp_path):
    sysusers = _tool("systemd-sysusers")
    tmpfiles = _tool("systemd-tmpfiles")
    (tmp_path / "etc").mkdir()
    r = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(SYSTEMD / "basertd.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    passwd = {
        line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {
        line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    assert passwd["basertd"][5] == "/var/lib/basertd" and passwd["basertd"][6].endswith("nologin")
    assert "basertd" in groups and "basertd-operators" in groups
    assert "basertd" in groups["video"][3].split(",") and "basertd" in groups["render"][3].split(",")
    r = subprocess.run(
        [tmpfiles, f"--root={tmp_path}", "--create", str(SYSTEMD / "basertd.tmpfiles.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    for d in ("run/basertd", "var/lib/basertd", "etc/basertd"):
        assert stat.S_IMODE((tmp_path / d).stat().st_mode) == 0o750, d


def test_example_config_passes_config_check_and_a_broken_one_names_the_key(tmp_path):
    example = SYSTEMD / "basertd.toml.example"
    cfg = load_config(example)
    assert cfg.operators.operator_group == "basertd-operators" and cfg.operators.metrics_address()
    assert cfg.operators.drain_timeout_s + WORKER_CLOSE_GRACE_S < 90
    assert (cfg.durability.mode, cfg.durability.sync_interval_ms) == ("write", 1000)
    ctl = [sys.executable, "-m", "basertd.ctl", "--socket", str(tmp_path / "none.sock")]
    r = subprocess.run(
        [*ctl, "config", "check", "--json", str(example)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    bad = tmp_path / "bad.toml"
    bad.write_text(
        example.read_text()
        .replace("decode_grant = 8", "decode_grnt = 8")
        .replace('log_level = "info"', 'log_level = "loud"')
    )
    r = subprocess.run([*ctl, "config", "check", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "scheduler.decode_grnt" in r.stdout, r
    assert "at log_level" in r.stdout and r.stdout.count("error: ") == 2, r.stdout  # every error
    bad.write_text("[scheduler\n")
    r = subprocess.run(
        [*ctl, "config", "check", "--json", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "invalid TOML" in json.loads(r.stdout)["errors"][0]


def test_config_check_warns_of_model_and_draft_model_files_that_do_not_exist(tmp_path):
    gone = tmp_path / "gone"
    text = (
        f'[[workers]]\nmodel = "{gone}/m.gguf"\ndraft_model = "{gone}/own-draft.gguf"\n'
        f'[speculation]\nstrategies = ["draft-model"]\ndraft_model = "{gone}/draft.gguf"\n'
    )
    r = check_config_text(text, "t.toml")
    assert r.ok, r.errors
    assert f"workers[0].model: {gone}/m.gguf does not exist (here)" in r.warnings
    assert f"workers[0].draft_model: {gone}/own-draft.gguf does not exist (here)" in r.warnings
    assert f"speculation.draft_model: {gone}/draft.gguf does not exist (here)" in r.warnings
    here = tmp_path / "d.gguf"
    here.write_bytes(b"")
    r = check_config_text(text.replace(f"{gone}/draft.gguf", str(here)), "t.toml")
    assert not any(w.startswith("speculation.") for w in r.warnings)
