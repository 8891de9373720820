"""The vLLM-named metrics the Inference Extension's endpoint picker reads (``[metrics]
vllm_compat``, ``basertd.server.observe.metrics_vllm``): under load they equal the daemon's own queue,
lane and KV counts in the same scrape, they read 0 when idle, ``cache_config_info`` names the
engine's page size and pool, the prefix-cache counters count each request's prompt once (a
coalescing checkpoint's re-admission is not counted again), and ``vllm_compat = false`` hides
them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from daemon_harness import Daemon
from prometheus_client.parser import text_string_to_metric_families
from serving_harness import ref_toml

from basertd.client import AsyncClient
from basertd.schema import control

PAGE = 16
POOL_BLOCKS = 96
MODEL = "reference"


def scrape(d: Daemon) -> list:
    """Every sample of one exposition (taken on the daemon's loop in one pass: one moment)."""
    with d.client() as c:
        text = c.request(control.Metrics()).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def total(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


@pytest.fixture(scope="module")
def daemon():
    cfg = ref_toml(lanes=2, grant=2, ref={"pool_bytes": POOL_BLOCKS * PAGE * 64})
    with Daemon(cfg) as d:
        yield d


def model_name(samples: list) -> str:
    names = {s.labels["model_name"] for s in samples if s.name == "vllm:num_requests_waiting"}
    assert len(names) == 1, names
    return names.pop()


def test_vllm_gauges_equal_the_daemons_counts_under_load_and_read_zero_idle(daemon):
    d = daemon
    idle = scrape(d)
    m = model_name(idle)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert total(idle, name, model_name=m) == 0.0, name
    seen_busy = []
    stop = threading.Event()

    def load() -> None:
        async def go() -> None:
            async with await AsyncClient.connect(d.socket) as c:
                await asyncio.gather(
                    *(c.generate(f"load {i} " + "z" * 40, max_tokens=24, temperature=0.0) for i in range(8))
                )

        asyncio.run(go())
        stop.set()

    t = threading.Thread(target=load)
    t.start()
    try:
        while not stop.is_set():
            s = scrape(d)
            waiting = total(s, "vllm:num_requests_waiting", model_name=m)
            running = total(s, "vllm:num_requests_running", model_name=m)
            usage = total(s, "vllm:kv_cache_usage_perc", model_name=m)
            assert waiting == total(s, "basertd_queue_depth")
            assert running == total(s, "basertd_lanes_active")
            reserved, cap = total(s, "basertd_kv_reserved_tokens"), total(s, "basertd_kv_capacity_tokens")
            assert usage == pytest.approx(reserved / cap) and 0.0 <= usage <= 1.0
            if waiting and running:
                seen_busy.append((waiting, running, usage))
            time.sleep(0.02)
    finally:
        t.join(120)
    assert seen_busy, "never scraped the daemon with requests both queued and running"
    d.wait_idle()
    after = scrape(d)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert total(after, name, model_name=m) == 0.0, name


def test_cache_config_info_names_the_page_and_the_pool(daemon):
    s = scrape(daemon)
    info = [x for x in s if x.name == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1.0
    assert info[0].labels["block_size"] == str(PAGE)  # the reference engine's page_size_tokens
    assert info[0].labels["num_gpu_blocks"] == str(POOL_BLOCKS)  # pool_bytes / (64 B/token * page)
    assert info[0].labels["enable_prefix_caching"] == "True"


def test_prefix_cache_counters_count_each_prompt_once_in_tokens(daemon):
    d = daemon
    before = scrape(d)
    m = model_name(before)
    shared = "Shared system prompt for the counters, several pages of byte tokens long. " * 2
    prompts = [shared + f"q{i}" for i in range(5)]
    with d.client() as c:
        lengths = [len(c.tokenize(p)) for p in prompts]

    async def go() -> list:
        async with await AsyncClient.connect(d.socket) as c:
            return await asyncio.gather(*(c.generate(p, max_tokens=4, temperature=0.0) for p in prompts))

    outs = asyncio.run(go())
    d.wait_idle()
    after = scrape(d)
    queries = total(after, "vllm:prefix_cache_queries_total", model_name=m) - total(
        before, "vllm:prefix_cache_queries_total", model_name=m
    )
    hits = total(after, "vllm:prefix_cache_hits_total", model_name=m) - total(
        before, "vllm:prefix_cache_hits_total", model_name=m
    )
    assert queries == sum(lengths)  # the leader's checkpoint re-admission is not counted again
    assert hits == sum(o.usage.cached_tokens for o in outs) > 0
    assert hits == total(after, "basertd_cached_tokens_total") - total(before, "basertd_cached_tokens_total")


def test_vllm_compat_false_exports_no_vllm_series():
    with Daemon(ref_toml(lanes=1) + "[metrics]\nvllm_compat = false\n") as d:
        s = scrape(d)
    assert not [x for x in s if x.name.startswith("vllm:")]
    assert any(x.name == "basertd_lanes_active" for x in s)
