"""basertctl against a real daemon: every verb prints a table by default and JSON
that parses with --json (global or per verb), refusals exit with the documented status and one
line, a daemon that is not there gives one line naming the socket, restart-worker replaces the
process, cache evict frees what finished requests published, shutdown drains and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from daemon_harness import Daemon
from ops_harness import ref_worker
from serving_harness import end_cancelled

from basertd import ctl

CONFIG = ref_worker(lanes=2, delay_us=20000) * 2 + "[scheduler]\ndecode_grant = 1\ndecode_tick_s = 0\n"


@pytest.fixture(scope="module")
def daemon():
    with Daemon(CONFIG) as d:
        yield d


VIEWS = [  # lanes first: the generation it lists runs for a few seconds only
    (
        ["lanes"],
        lambda j: any(r["request_id"] == "ctl-lane" and r["state"] == "decode" for r in j),
        "ctl-lane",
    ),
    (
        ["status"],
        lambda j: j["workers_total"] == 2 and len(j["workers"]) == 2 and len(j["queue"]) == 3,
        "workers",
    ),
    (
        ["workers"],
        lambda j: [w["worker_id"] for w in j] == [0, 1] and all(w["pid"] > 0 for w in j),
        "respawns",
    ),
    (["queue"], lambda j: [q["qos"] for q in j] == ["interactive", "batch", "background"], "oldest wait"),
    (["cache", "stats"], lambda j: [r["worker_id"] for r in j] == [0, 1], "cached tokens"),
    (["metrics"], lambda j: any(f["name"] == "basertd_ttft_seconds" for f in j), "# HELP basertd_"),
]


def test_every_view_prints_a_table_and_json_that_parses(daemon):
    d = daemon
    with d.client() as c:
        stream = c.stream("a lane to list", max_tokens=230, temperature=0, request_id="ctl-lane")
        next(iter(stream))
        for args, check, marker in VIEWS:
            for argv in (["--json", *args], [*args, "--json"]):
                r = d.ctl(*argv)
                assert r.returncode == 0, (argv, r.stderr)
                assert check(json.loads(r.stdout)), (argv, r.stdout)
            r = d.ctl(*args)
            assert r.returncode == 0 and r.stdout[:1] not in "[{", (args, r.stdout)
            assert marker in r.stdout, (args, r.stdout)
        end_cancelled(stream, iter(stream), 230)


def test_generate_json_prints_one_document_with_the_whole_completion(daemon):
    """``generate --json`` (after or before the verb) streams nothing and prints one JSON document
    whose text and ids are the same greedy generation the streaming form prints."""
    d = daemon
    streamed = d.ctl("generate", "--max-tokens", "6", "--temperature", "0", "same prompt")
    assert streamed.returncode == 0, streamed.stderr
    for argv in (
        ["generate", "--max-tokens", "6", "--temperature", "0", "--json", "same prompt"],
        ["--json", "generate", "--max-tokens", "6", "--temperature", "0", "same prompt"],
    ):
        r = d.ctl(*argv)
        assert r.returncode == 0, (argv, r.stderr)
        doc = json.loads(r.stdout)
        assert doc["text"] + "\n" == streamed.stdout, (doc, streamed.stdout)
        assert len(doc["ids"]) == doc["usage"]["completion_tokens"] <= 6
        assert doc["finish_reason"] in ("length", "eos", "stop")
        assert doc["usage"]["prompt_tokens"] > 0 and doc["timings"]["ttft_s"] > 0


def test_generate_refusals_and_an_absent_daemon_give_one_line(daemon, tmp_path):
    d = daemon
    r = d.ctl("generate", "--max-tokens", "5", "--temperature", "0", "--qos", "batch", "hello")
    assert r.returncode == 0 and r.stdout.strip(), r
    env = {**os.environ, "BASERTD_SOCKET": str(d.socket)}
    r = subprocess.run(
        [sys.executable, "-m", "basertd.ctl", "--json", "queue"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 3, r
    cases = [
        (["generate", "--max-tokens", "100000", "hi"], ctl.EXIT_REFUSED, "context_length_exceeded"),
        (["lanes", "--worker", "7"], ctl.EXIT_REFUSED, "not_found"),
        (["restart-worker", "9"], ctl.EXIT_REFUSED, "not_found"),
        (["cache", "pin", "--tokens", "1,2"], ctl.EXIT_REFUSED, "whole pages"),  # the policy
        (["cache", "unpin", "999"], ctl.EXIT_REFUSED, "not_found"),
        (["cache", "pin"], ctl.EXIT_USAGE, "exactly one of --text and --tokens"),
        (["drain", "--timeout", "-1"], ctl.EXIT_USAGE, "--timeout"),
    ]
    for argv, code, text in cases:
        r = d.ctl(*argv)
        assert r.returncode == code, (argv, r)
        assert text in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        if code == ctl.EXIT_REFUSED:
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    gone = str(tmp_path / "basertd.sock")
    for argv in (["status"], ["generate", "hi"], ["drain"]):
        r = subprocess.run(
            [sys.executable, "-m", "basertd.ctl", "--socket", gone, *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == ctl.EXIT_UNREACHABLE, r
        assert r.stderr.count("\n") == 1 and gone in r.stderr and "systemctl start basertd" in r.stderr, (
            r.stderr
        )
    r = d.ctl("--help")
    assert r.returncode == 0
    for code in ctl.EXIT_CODES:
        assert f"  {code}  " in r.stdout


def test_cache_evict_frees_the_prefixes_finished_requests_published(daemon):
    d = daemon
    with d.client() as c:
        for i in range(3):
            c.generate(f"publish me {i}", max_tokens=4, temperature=0)
    d.wait_idle()
    stats = json.loads(d.ctl("--json", "cache", "stats").stdout)
    assert sum(r["entries"] for r in stats) >= 3 and sum(r["bytes"] for r in stats) > 0
    r = d.ctl("--json", "cache", "evict")
    assert r.returncode == 0, r.stderr
    evicted = json.loads(r.stdout)
    assert evicted["bytes_freed"] > 0 and evicted["entries"] >= 3
    after = json.loads(d.ctl("--json", "cache", "stats").stdout)
    assert sum(r["entries"] for r in after) == 0
    assert sum(r["evictions"] for r in after) >= 3
    with d.client() as c:
        c.generate("publish me once", max_tokens=4, temperature=0)
    d.wait_idle()
    r = d.ctl("cache", "evict")  # the text form counts in words
    assert r.returncode == 0 and r.stdout.strip().endswith("(1 entry)"), (r.stdout, r.stderr)


def test_restart_worker_replaces_the_process_and_counts_a_respawn(daemon):
    d = daemon
    before = json.loads(d.ctl("--json", "workers").stdout)
    r = d.ctl("--json", "restart-worker", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["worker_id"] == 1 and out["pid"] not in (0, before[1]["pid"])
    d.track_children()
    after = json.loads(d.ctl("--json", "workers").stdout)
    assert after[1]["pid"] == out["pid"] and after[1]["respawns"] == before[1]["respawns"] + 1
    assert after[0]["pid"] == before[0]["pid"]  # the other worker was not touched
    metrics = d.ctl("metrics").stdout
    assert 'basertd_worker_respawns_total{worker="1"} 1.0' in metrics
    with d.client() as c:
        assert c.generate("after the restart", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_shutdown_verb_drains_then_the_daemon_exits_zero():
    with Daemon(
        ref_worker(lanes=2, delay_us=20000) + "[scheduler]\ndecode_grant = 2\ndecode_tick_s = 0\n"
    ) as d:
        c = d.client()
        stream = c.stream("finish before the stop", max_tokens=30, temperature=0)
        it = iter(stream)
        next(it)
        d.track_children()
        r = d.ctl("shutdown", "--timeout", "20")
        assert r.returncode == 0 and "draining" in r.stdout, r
        for _ in it:
            pass
        assert stream.done is not None and stream.done.usage.completion_tokens == 30
        c.close()
        assert d.proc.wait(30) == 0
        d.assert_released()


def test_the_workers_table_names_a_llamacpp_workers_kv_layout():
    assert ctl._engine_label({"engine": "llamacpp", "kv_layout": "per-lane"}) == "llamacpp (per-lane)"
    assert ctl._engine_label({"engine": "llamacpp", "kv_layout": "unified"}) == "llamacpp (unified)"
    assert ctl._engine_label({"engine": "basert", "kv_layout": ""}) == "basert"  # it has none
