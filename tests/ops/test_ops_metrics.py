"""Metrics and logs: the Prometheus values move while traffic runs, the gauges
settle at exactly zero afterwards (also scraped over the loopback HTTP port), refusals are counted
by code, and the log holds one content-free access line per request."""

from __future__ import annotations

import time
import urllib.request

import pytest
from daemon_harness import Daemon
from ops_harness import ref_worker
from proc_testutil import wait_until
from prometheus_client.parser import text_string_to_metric_families

from basertd.client import ClientError, ErrorCode
from basertd.schema import control
from basertd.server.config import ConfigError, parse_config

CONFIG = ref_worker(lanes=2, delay_us=20000) + (
    '[scheduler]\ndecode_grant = 2\ndecode_tick_s = 0\n[operators]\nmetrics_listen = "127.0.0.1:0"\n'
)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} of an exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def daemon():
    with Daemon(CONFIG) as d:
        yield d


def scrape_http(d: Daemon) -> dict:
    port = next(e["port"] for e in d.log_events() if e.get("event") == "metrics_http_listening")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return samples(r.read().decode())


def scrape(d: Daemon) -> dict:
    with d.client() as c:
        return samples(c.request(control.Metrics()).text)


def test_metrics_move_with_traffic_and_gauges_settle_at_zero(daemon):
    d = daemon
    before = scrape_http(d)
    assert value(before, "basertd_build_info", version="0.1.0") == 1
    assert value(before, "basertd_worker_ready", worker="0") == 1
    clients = [d.client() for _ in range(6)]
    streams = [c.stream(f"metrics {i}", max_tokens=40, temperature=0) for i, c in enumerate(clients)]
    busy = scrape_http(d)  # 2 lanes, 6 requests: some run, the rest wait
    assert value(busy, "basertd_requests_in_flight") == 6
    assert value(busy, "basertd_queue_depth", qos="interactive") >= 1
    assert value(busy, "basertd_lanes_active", worker="0") >= 1
    assert value(busy, "basertd_kv_reserved_tokens", worker="0") > 0
    assert 0 < value(busy, "basertd_kv_pool_usage_ratio", worker="0") <= 1
    # one client goes away mid-stream: its request ends cancelled and leaves no gauge behind
    next(iter(streams[-1]))
    clients[-1].close()
    for s in streams[:-1]:
        for _ in s:
            pass
        assert s.done.usage.completion_tokens == 40
    for c in clients[:-1]:
        c.close()
    for bad, code in (("x" * 400, "context_length_exceeded"), ("", "empty_prompt")):
        with d.client() as c, pytest.raises(ClientError) as refused:
            c.generate(bad, max_tokens=8)
        assert refused.value.code == code
    d.wait_idle()
    deadline = time.monotonic() + 10
    while value(after := scrape_http(d), "basertd_requests_in_flight") or value(
        after, "basertd_lanes_active", worker="0"
    ):
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    for name, labels in (
        ("basertd_queue_depth", {"qos": "interactive"}),
        ("basertd_queue_depth", {"qos": "batch"}),
        ("basertd_queue_depth", {"qos": "background"}),
        ("basertd_lanes_active", {"worker": "0"}),
        ("basertd_requests_in_flight", {}),
        ("basertd_kv_reserved_tokens", {"worker": "0"}),
        ("basertd_kv_pool_usage_ratio", {"worker": "0"}),
        ("basertd_draining", {}),
    ):
        assert (name, tuple(sorted(labels.items()))) in after, name
        assert value(after, name, **labels) == 0, (name, labels)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("basertd_ttft_seconds_count", qos="interactive") == 6
    assert moved("basertd_queue_time_seconds_count", qos="interactive") == 6
    assert moved("basertd_inter_token_latency_seconds_count", qos="interactive") > 100
    assert moved("basertd_requests_total", qos="interactive", finish_reason="length") == 5
    assert moved("basertd_requests_total", qos="interactive", finish_reason="cancelled") == 1
    assert moved("basertd_request_errors_total", code="cancelled") == 1
    assert moved("basertd_completion_tokens_total", qos="interactive") >= 5 * 40 + 1
    assert moved("basertd_prompt_tokens_total", qos="interactive") > 0
    assert moved("basertd_decode_tokens_total", worker="0") >= 5 * 40
    assert moved("basertd_prefill_tokens_total", worker="0") > 0
    assert moved("basertd_ticks_total", worker="0") >= 5 * 40 // (2 * 2)  # 2 lanes, 2 tokens each per tick
    assert moved("basertd_tick_seconds_count", worker="0") == moved("basertd_ticks_total", worker="0")
    assert moved("basertd_prefix_cache_misses_total", worker="0") == 6  # no prefix-cache policy yet
    assert moved("basertd_prefix_cache_hits_total", worker="0") == 0
    assert moved("basertd_admission_errors_total", code="context_length_exceeded") == 1
    assert moved("basertd_admission_errors_total", code="empty_prompt") == 1
    assert value(after, "basertd_worker_respawns_total", worker="0") == 0
    # the control verb serves the same registry
    ctl = scrape(d)
    assert value(ctl, "basertd_ttft_seconds_count", qos="interactive") == value(
        after, "basertd_ttft_seconds_count", qos="interactive"
    )
    # the operator's cache stats read the same counts, from the object that counts them
    with d.client() as c:
        row = next(r for r in c.request(control.CacheStats()).workers if r.worker_id == 0)
    assert row.misses == value(after, "basertd_prefix_cache_misses_total", worker="0") >= 6
    assert row.hits == value(after, "basertd_prefix_cache_hits_total", worker="0")
    assert row.cached_tokens == value(after, "basertd_cached_tokens_total", worker="0")


def test_engine_pool_gauges_keep_the_last_ticks_counters_while_idle(daemon):
    d = daemon
    with d.client() as c:
        assert c.generate("pool gauges", max_tokens=6, temperature=0).usage.completion_tokens == 6
    d.wait_idle()

    def idle_scrape() -> dict | None:
        m = scrape_http(d)
        return None if value(m, "basertd_lanes_active", worker="0") else m

    idle = wait_until(idle_scrape, what="worker 0 idle")
    pages = next(
        int(labels["num_gpu_blocks"])
        for (name, items), _ in idle.items()
        if name == "vllm:cache_config_info" and (labels := dict(items))
    )
    # the engine's own pool count, from the last tick's MemCounters, long after the loop read them
    assert value(idle, "basertd_engine_pool_blocks_total", worker="0") == pages > 0
    assert 0 <= value(idle, "basertd_engine_pool_blocks_used", worker="0") <= pages
    again = scrape(d)  # and on every later scrape, not only the one right after a tick
    assert value(again, "basertd_engine_pool_blocks_total", worker="0") == pages


def test_access_log_is_one_content_free_line_per_request(daemon):
    d = daemon
    secret = "the password is xylophone-4242"
    with d.client() as c:
        prompt_ids = c.tokenize(secret)
        outs = [c.generate(secret, max_tokens=24, temperature=0, request_id=f"acc-{i}") for i in range(3)]
        with pytest.raises(ClientError) as ended:
            s = c.stream(secret, max_tokens=200, temperature=0, request_id="acc-cancel")
            next(iter(s))
            s.cancel()
            for _ in s:
                pass
        assert ended.value.code == ErrorCode.CANCELLED
    d.wait_idle()
    texts = [o.text for o in outs if len(o.text) >= 6]
    assert texts, "the reference engine produced no text to look for"
    access = {}
    for event in d.log_events():
        for v in _values(event):
            if isinstance(v, str):
                assert "xylophone" not in v, event
                assert not any(t in v for t in texts), event
            elif isinstance(v, list):
                assert v != prompt_ids, event
        if event.get("event") == "access" and str(event.get("request_id", "")).startswith("acc-"):
            assert event["request_id"] not in access, "two access lines for one request"
            access[event["request_id"]] = event
    assert set(access) == {"acc-0", "acc-1", "acc-2", "acc-cancel"}
    line = access["acc-0"]
    for key in ("qos", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "tokens_per_s"):
        assert key in line, key
    assert line["finish_reason"] == "length" and line["completion_tokens"] == 24
    assert line["prompt_tokens"] == len(prompt_ids) and line["cached_tokens"] == 0
    assert line["ttft_s"] > 0 and line["tokens_per_s"] > 0 and line["level"] == "info"
    assert access["acc-cancel"]["finish_reason"] == "cancelled"
    assert access["acc-cancel"]["error_code"] == "cancelled"


def _values(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _values(v)
    elif isinstance(obj, list):
        yield obj
        for v in obj:
            yield from _values(v)
    else:
        yield obj


def test_metrics_http_stays_on_loopback():
    for addr in ("0.0.0.0:9464", "192.168.1.1:9464", "[::]:9464", "nohost"):
        with pytest.raises(ConfigError, match="metrics_listen"):
            parse_config({"operators": {"metrics_listen": addr}})
    assert parse_config({"operators": {"metrics_listen": "[::1]:9464"}}).operators.metrics_address() == (
        "::1",
        9464,
    )
