"""SIGHUP: the daemon re-reads its configuration file, applies what can change at
run time (log level, scheduler and cache knobs), names what needs a restart, and keeps running
unchanged when the new file does not validate."""

from __future__ import annotations

import signal
import time

import pytest
from daemon_harness import Daemon
from ops_harness import ref_worker

from basertd.client import ClientError, ErrorCode
from basertd.schema import control
from basertd.server.config import parse_config
from basertd.server.ops.reload import config_changes, effective_config


def _wait_event(d: Daemon, name: str, count: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in d.log_events() if e.get("event") == name]
        if len(found) >= count:
            return found[count - 1]
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.05)


def test_sighup_applies_runtime_knobs_and_names_the_rest():
    config = (
        ref_worker(lanes=2, delay_us=20000)
        + "[scheduler]\nqueue_limit = 64\ndecode_grant = 1\ndecode_tick_s = 0\n"
    )
    with Daemon(config) as d:
        original = d.config_path.read_text()
        with d.client() as c:
            c.generate("before", max_tokens=2, temperature=0)
        d.wait_idle()
        assert len([e for e in d.log_events() if e.get("event") == "access"]) == 1
        # queue_limit 1 and log level warning apply; a changed [limits] table needs a restart
        text = (
            'log_level = "warning"\n'
            + original.replace("queue_limit = 64", "queue_limit = 1")
            + ("[limits]\nmax_connections = 999\n")
        )
        d.config_path.write_text(text)
        d.proc.send_signal(signal.SIGHUP)
        report = _wait_event(d, "reloaded", 1)
        assert report["applied"] == ["log_level", "scheduler.queue_limit"]
        assert report["not_reloaded"] == ["limits.max_connections"] and "restart" in report["note"]
        assert report["workers"] == []
        with d.client() as c:
            c.generate("after", max_tokens=2, temperature=0)  # access lines are info: now filtered
            workers = c.request(control.Workers()).workers
        assert workers[0].lanes_max == 2
        # queue_limit 1 is in force: two lanes busy, one request queued, the next one refused
        clients = [d.client() for _ in range(4)]
        try:
            for i, c in enumerate(clients[:2]):
                next(iter(c.stream(f"busy {i}", max_tokens=100, temperature=0)))
            clients[2].stream("queued", max_tokens=100, temperature=0)
            with pytest.raises(ClientError) as full:
                clients[3].stream("one too many", max_tokens=100, temperature=0)
            assert full.value.code == ErrorCode.QUEUE_FULL
        finally:
            for c in clients:
                c.close()
        d.wait_idle()
        assert len([e for e in d.log_events() if e.get("event") == "access"]) == 1
        # a file that does not validate changes nothing and says so
        d.config_path.write_text(text + "[scheduler]\nbogus = 1\n")
        d.proc.send_signal(signal.SIGHUP)
        failed = _wait_event(d, "reload_failed", 1)
        assert "bogus" in failed["error"] or "scheduler" in failed["error"]
        assert d.proc.poll() is None
        with d.client() as c:
            assert c.health().status == "ok"


def test_config_changes_split_reloadable_and_restart_keys():
    old = parse_config({"workers": [{"engine": "basert"}]})
    new = parse_config(
        {
            "log_level": "debug",
            "socket": "/tmp/other.sock",
            "workers": [{"engine": "basert", "lanes": 4}, {"engine": "basert"}],
            "scheduler": {"decode_grant": 2},
            "cache": {"publish_on_retire": False, "host_bytes": 0},
            "operators": {"drain_timeout_s": 5, "metrics_listen": "127.0.0.1:9464"},
        }
    )
    report = config_changes(old, new)
    assert report.applied == [
        "cache.publish_on_retire",
        "log_level",
        "operators.drain_timeout_s",
        "scheduler.decode_grant",
        "workers.0",
        "workers.1",
    ]
    # a worker reads [cache] host_bytes on its command line: a restart applies it
    assert report.needs_restart == ["cache.host_bytes", "operators.metrics_listen", "socket"]
    running = effective_config(old, new)
    assert running.cache.host_bytes == old.cache.host_bytes == 1 << 30
    assert running.scheduler.decode_grant == 2 and running.operators.drain_timeout_s == 5
    assert running.socket == "" and running.workers == new.workers and running.operators.metrics_listen == ""
    assert config_changes(running, running) == config_changes(old, old)
