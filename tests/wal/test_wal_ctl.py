"""``basertctl wal check`` (a real process, no daemon), ``basertd serve --wal-recover`` and the
``state_dir`` / ``[durability]`` configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from basertd.server.config import ConfigError, parse_config
from basertd.server.durability.wal_disk import open_journal
from basertd.server.durability.wal_format import WAL_DIR, RequestRecord, list_segments
from basertd.server.paths import resolve_state_dir

BIN = Path(sys.executable).parent


def _check(state_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BIN / "basertctl", "wal", "check", str(state_dir), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _log(state_dir: Path) -> Path:
    with open_journal(state_dir) as j:
        j.accepted(RequestRecord(request_id="a", prompt=[1, 2], max_tokens=8, seed=3))
        for i in range(4):
            j.tokens("a", i, [i])
            j.commit()
    return list_segments(state_dir / WAL_DIR)[-1][1]


def test_wal_check_exit_codes(tmp_path: Path) -> None:
    empty = _check(tmp_path)
    assert empty.returncode == 0 and "empty" in empty.stdout

    seg = _log(tmp_path)
    clean = _check(tmp_path, "--json")
    assert clean.returncode == 0, clean.stderr
    data = json.loads(clean.stdout)
    assert (data["status"], data["unfinished"], data["epoch"], data["ok"]) == ("clean", 1, 1, True)

    good = seg.read_bytes()
    seg.write_bytes(good[:-3])  # a crash during the last write
    torn = _check(tmp_path)
    assert torn.returncode == 0 and "torn" in torn.stdout and "warning:" in torn.stdout

    bad = bytearray(good)
    bad[60] ^= 0x10  # an early frame; valid frames follow
    seg.write_bytes(bytes(bad))
    corrupt = _check(tmp_path)
    assert corrupt.returncode == 1
    assert "corrupt" in corrupt.stdout and "--wal-recover=truncate" in corrupt.stdout
    assert seg.read_bytes() == bytes(bad)  # checking changes nothing

    assert _check(tmp_path / "missing").returncode == 2


def test_wal_check_without_a_state_dir_is_no_empty_log(tmp_path: Path) -> None:
    # Without STATE_DIR the daemon's default is read; a directory that does not exist is an
    # error naming it, not an "empty" log that exits 0.
    missing = tmp_path / "never-ran"
    out = subprocess.run(
        [BIN / "basertctl", "wal", "check"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STATE_DIRECTORY": str(missing)},
    )
    assert out.returncode == 1, out.stdout
    assert f"no state directory at {missing}" in out.stderr and "empty" not in out.stdout


def test_serve_knows_wal_recover() -> None:
    out = subprocess.run(
        [BIN / "basertd", "serve", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "--wal-recover [refuse|truncate]" in out
    bad = subprocess.run(
        [BIN / "basertd", "serve", "--wal-recover=maybe"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2


def test_durability_config() -> None:
    cfg = parse_config({"state_dir": "/x", "durability": {"mode": "off", "result_ttl_s": 5}})
    assert (cfg.state_dir, cfg.durability.mode, cfg.durability.result_ttl_s) == ("/x", "off", 5.0)
    default = parse_config({})
    assert (default.durability.mode, default.durability.result_ttl_s) == ("write", 600.0)
    assert default.durability.sync_interval_ms == 1000
    for mode in ("write", "tick"):
        assert parse_config({"durability": {"mode": mode}}).durability.mode == mode
    assert parse_config({"durability": {"sync_interval_ms": 250}}).durability.sync_interval_ms == 250
    for bad in (
        {"mode": "fsync"},
        {"result_ttl_s": -1},
        {"ttl": 3},
        {"sync_interval_ms": 0},
        {"sync_interval_ms": 60_001},
        {"sync_interval_ms": 0.5},
    ):
        with pytest.raises(ConfigError, match="durability"):
            parse_config({"durability": bad})


def test_state_dir_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config({"state_dir": str(tmp_path / "cfg")})
    assert resolve_state_dir(cfg) == tmp_path / "cfg" and (tmp_path / "cfg").is_dir()
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path / 'sd'}:{tmp_path / 'other'}")
    assert resolve_state_dir(None, create=False) == tmp_path / "sd"
    assert not (tmp_path / "sd").exists()  # create=False changes nothing
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    system_ok = os.access("/var/lib/basertd" if os.path.isdir("/var/lib/basertd") else "/var/lib", os.W_OK)
    expected = Path("/var/lib/basertd") if system_ok else tmp_path / "xdg" / "basertd"
    assert resolve_state_dir(None, create=False) == expected
