"""Prefix routing across workers and pins across a worker restart, on two reference-engine
workers (DESIGN.md "Prefix cache policy": "a request goes to the worker holding its
longest prefix unless that worker is much busier"; pins are held again by a new incarnation)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from daemon_harness import Daemon
from proc_testutil import wait_until
from serving_harness import access_lines, engine_stats, ref_toml

SYSTEM = "Routing test. A system prompt long enough to fill several pages of the byte vocabulary. " * 2


@pytest.fixture(scope="module")
def daemon():
    with Daemon(ref_toml(lanes=2, workers=2)) as d:
        yield d


def test_a_request_goes_to_the_worker_holding_its_prefix_unless_much_busier(daemon):
    with daemon.client() as c:
        c.generate(SYSTEM + "first", request_id="route-a", max_tokens=4, temperature=0.0)
    daemon.wait_idle()
    holder = access_lines(daemon)["route-a"]["worker_id"]
    done = threading.Event()

    def long_running() -> None:  # keeps one lane of the holder busy (both idle: the holder gets it)
        with daemon.client() as c:
            c.generate("x" * 20, request_id="route-x", max_tokens=150, temperature=0.0)
        done.set()

    t = threading.Thread(target=long_running)
    t.start()
    try:
        wait_until(lambda: daemon.status().lanes_busy >= 1, what="route-x decoding on a lane")
        assert access_lines(daemon).get("route-x") is None
        with daemon.client() as c:
            out = c.generate(SYSTEM + "second", request_id="route-b", max_tokens=4, temperature=0.0)
    finally:
        t.join(60)
    lines = access_lines(daemon)
    assert lines["route-x"]["worker_id"] == holder  # the holder was the busier worker
    assert lines["route-b"]["worker_id"] == holder and out.usage.cached_tokens >= 4 * 16
    # a prompt nobody holds goes to the least loaded worker, as before
    with daemon.client() as c:
        c.generate("nothing shared here", request_id="route-c", max_tokens=4, temperature=0.0)
    daemon.wait_idle()


def test_a_pin_is_held_again_after_its_worker_restarts(daemon):
    r = daemon.ctl("--json", "cache", "pin", "--text", SYSTEM + "pinned", "--worker", "1")
    assert r.returncode == 0, r.stderr
    pin = json.loads(r.stdout)
    assert engine_stats(daemon)[1]["live_seed_leases"] == 1
    old_pid = next(w for w in daemon.workers() if w.worker_id == 1).pid
    r = daemon.ctl("--json", "restart-worker", "1")
    assert r.returncode == 0, r.stderr
    daemon.track_children()
    deadline = time.monotonic() + 30
    while True:
        rows = {w.worker_id: w for w in daemon.workers()}
        entries = json.loads(daemon.ctl("--json", "cache", "ls", "--worker", "1").stdout)
        held = [e for e in entries if e["pin_id"] == pin["pin_id"]]
        if rows[1].pid != old_pid and rows[1].seed_leases == 1 and held:
            break
        assert time.monotonic() < deadline, (rows[1], entries)
        time.sleep(0.1)
    assert held[0]["prefix_tokens"] == pin["tokens"]
    assert daemon.ctl("--json", "cache", "unpin", str(pin["pin_id"])).returncode == 0
    assert engine_stats(daemon)[1]["live_seed_leases"] == 0
