"""basertd.server.config and basertd.server.paths: defaults, unknown keys, ranges, runtime directory rule."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from basertd.server import paths as cfg
from basertd.server.config import Config, ConfigError, config_errors, load_config, parse_config


def test_no_config_serves_the_default_model_on_llamacpp_cpu():
    c = load_config(None)
    assert len(c.workers) == 1
    w = c.workers[0]
    assert (w.engine, w.model, w.device) == ("llamacpp", "", "cpu")
    assert c.socket_mode == 0o660
    assert c.scheduler.prefill_budget > 0 and c.scheduler.decode_grant > 0


def test_file_round_trip(tmp_path: Path):
    path = tmp_path / "basertd.toml"
    path.write_text(
        'runtime_dir = "/x/rt"\nsocket_mode = "0600"\n'
        '[[workers]]\nengine = "basert"\nlanes = 4\nengine_args = ["--ref-config", "a=1"]\n'
        "[[workers]]\nthreads = 1\n"
        "[scheduler]\ndecode_grant = 4\ntick_target_s = 0.02\n"
        "[cache]\npublish_on_retire = false\n"
    )
    c = load_config(path)
    assert c.runtime_dir == "/x/rt" and c.socket_mode == 0o600
    assert [w.engine for w in c.workers] == ["basert", "llamacpp"]
    assert c.workers[0].engine_args == ["--ref-config", "a=1"] and c.workers[1].threads == 1
    assert c.scheduler.decode_grant == 4 and c.scheduler.tick_target_s == 0.02
    assert c.cache.publish_on_retire is False


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"sockt": "/x"}, "'sockt'"),
        ({"workers": [{"lanse": 3}]}, "'workers[0].lanse'"),
        ({"workers": [{}, {"engine": "llamacpp", "threds": 1}]}, "'workers[1].threds'"),
        ({"scheduler": {"budget": 1}}, "'scheduler.budget'"),
        ({"cache": {"size": 1}}, "'cache.size'"),
    ],
)
def test_unknown_key_is_an_error_naming_it(data, names):
    with pytest.raises(ConfigError, match="unknown key") as info:
        parse_config(data)
    assert names in str(info.value)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"scheduler": {"decode_grant": 0}}, "scheduler.decode_grant"),
        ({"scheduler": {"decode_grant": 70000}}, "scheduler.decode_grant"),
        ({"scheduler": {"tick_target_s": "fast"}}, "scheduler.tick_target_s"),
        ({"workers": []}, "workers"),
        ({"workers": [{"engine": "vllm"}]}, "workers[0].engine"),
        ({"workers": [{"lanes": 0}]}, "workers[0].lanes"),
        ({"workers": [{"lanes": "8"}]}, "workers[0].lanes"),
        ({"workers": [{"kv_layout": "paged"}]}, "(one of 'unified', 'per-lane') - at workers[0].kv_layout"),
        ({"workers": [{"engine": "basert", "kv_layout": "per-lane"}]}, "KV layout - at workers[0].kv_layout"),
        ({"socket_mode": "rw-rw----"}, "socket_mode"),
        ({"socket_mode": 0o1777}, "socket_mode"),
        ({"log_level": "loud"}, "log_level"),
        ({"http": {"listen": ["127.0.0.1:8080", "localhost:http"]}}, "- at http.listen[1]"),
        ({"speculation": {"strategies": ["draft-model"]}}, "- at speculation"),
    ],
)
def test_bad_values_are_errors_naming_the_key(data, where):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert where in str(info.value)


def test_unreadable_and_invalid_toml(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = [\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_runtime_dir_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    explicit = tmp_path / "explicit"
    c = Config(runtime_dir=str(explicit))
    assert cfg.resolve_runtime_dir(c) == explicit and explicit.is_dir()
    assert cfg.socket_path(c, explicit) == explicit / "basertd.sock"
    assert cfg.socket_path(Config(socket=str(tmp_path / "s.sock")), explicit) == tmp_path / "s.sock"

    env_dir = tmp_path / "from-systemd"
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{env_dir}:/other")
    assert cfg.resolve_runtime_dir(Config(), create=False) == env_dir
    assert not env_dir.exists()  # create=False changes nothing on disk
    assert cfg.resolve_runtime_dir(Config()) == env_dir and env_dir.is_dir()

    monkeypatch.setenv(cfg.SOCKET_ENV, str(tmp_path / "env.sock"))
    assert cfg.default_socket_path() == tmp_path / "env.sock"
    monkeypatch.delenv(cfg.SOCKET_ENV)
    assert cfg.default_socket_path() == env_dir / "basertd.sock"


def test_runtime_dir_falls_back_to_a_user_dir_when_the_system_one_is_not_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir()
    monkeypatch.setattr(cfg, "SYSTEM_RUNTIME_DIR", str(locked / "basertd"))
    if os.access(locked, os.W_OK):  # root ignores permission bits: make the parent a file instead
        locked.rmdir()
        locked.write_text("not a directory")
    got = cfg.resolve_runtime_dir(Config())
    assert got == tmp_path / "xdg" / "basertd" and got.is_dir()


def test_a_squatted_per_user_runtime_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir(mode=0o777)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    (tmp_path / "system").write_text("not a directory")  # /run/basertd not usable
    monkeypatch.setattr(cfg, "SYSTEM_RUNTIME_DIR", str(tmp_path / "system" / "basertd"))
    squat = shared_tmp / f"basertd-{os.getuid()}"
    squat.mkdir(mode=0o700)
    os.chown(squat, 65534, 65534)  # made first by another user (nobody)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        cfg.resolve_runtime_dir(Config())
    os.chown(squat, os.geteuid(), os.getegid())
    os.chmod(squat, 0o777)
    with pytest.raises(ConfigError, match="others may write"):
        cfg.resolve_runtime_dir(Config())
    squat.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    squat.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="not a directory"):
        cfg.resolve_runtime_dir(Config())
    squat.unlink()
    got = cfg.resolve_runtime_dir(Config())  # absent: created private, and used
    assert got == squat and stat.S_IMODE(got.stat().st_mode) == 0o700


def test_every_error_is_listed_not_only_the_first():
    data = {
        "log_level": "loud",
        "socket_mode": "999",
        "workers": [{"lanes": 0, "lanse": 3}, {"threads": "two"}],
        "scheduler": {"prefill_budget": -5, "decode_grant": "x"},
        "bogus": {"a": 1},
    }
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="t.toml")
    errors = info.value.errors
    expected = [
        "log_level",
        "workers[0].lanes",
        "'workers[0].lanse'",
        "workers[1].threads",
        "scheduler.prefill_budget",
        "scheduler.decode_grant",
        "'bogus'",
        "socket_mode must be an octal mode",  # the check across keys, over the keys that passed
    ]
    assert len(errors) == len(expected), errors
    for error, where in zip(errors, expected, strict=True):
        assert error.startswith("t.toml: ") and where in error, (error, where)
    assert str(info.value) == "\n".join(errors)


def test_one_error_is_one_line_and_a_good_config_has_none():
    with pytest.raises(ConfigError) as info:
        parse_config({"scheduler": {"decode_grant": 0}}, source="t.toml")
    assert info.value.errors == [str(info.value)] and "\n" not in str(info.value)
    assert config_errors({"workers": [{"lanes": 2}], "scheduler": {"decode_grant": 4}}) == []
