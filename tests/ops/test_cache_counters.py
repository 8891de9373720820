"""The prefix-cache counts live on ``CacheCounters`` and are exported by it (no registry reads)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from basertd.server.observe.cache_counters import CacheCounters, WorkerCacheCounts
from basertd.server.observe.metrics import Metrics


def test_first_admissions_count_hits_misses_and_tokens_per_worker():
    c = CacheCounters()
    c.first_admission("0", 40, 32)  # a hit: 32 of 40 prompt tokens came from the prefix cache
    c.first_admission("0", 10, 0)  # a miss
    c.first_admission("1", 7, 0)
    assert c.of(0) == WorkerCacheCounts(query_tokens=50, hits=1, misses=1, cached_tokens=32)
    assert c.of("1") == WorkerCacheCounts(query_tokens=7, hits=0, misses=1, cached_tokens=0)
    assert c.of(5) == WorkerCacheCounts()
    c.of(0).hits = 99  # a copy: the caller cannot change the counts
    assert c.of(0).hits == 1


def test_counter_answers_the_exported_series_names():
    c = CacheCounters()
    c.first_admission("2", 16, 16)
    assert c.counter("basertd_prefix_cache_hits_total", 2) == 1
    assert c.counter("basertd_prefix_cache_misses_total", 2) == 0
    assert c.counter("basertd_cached_tokens_total", 2) == 16
    assert c.counter("basertd_prefix_cache_query_tokens_total", 2) == 16
    with pytest.raises(KeyError):
        c.counter("basertd_ticks_total", 2)


def test_collector_exports_what_it_counts():
    registry = CollectorRegistry()
    c = CacheCounters()
    registry.register(c)
    c.first_admission("3", 20, 8)
    c.first_admission("3", 4, 0)
    text = generate_latest(registry).decode()
    assert 'basertd_prefix_cache_hits_total{worker="3"} 1.0' in text
    assert 'basertd_prefix_cache_misses_total{worker="3"} 1.0' in text
    assert 'basertd_cached_tokens_total{worker="3"} 8.0' in text
    assert 'basertd_prefix_cache_query_tokens_total{worker="3"} 24.0' in text
    assert "# TYPE basertd_prefix_cache_hits_total counter" in text


def test_metrics_registry_carries_the_cache_counters_once():
    m = Metrics()
    m.cache_counters.first_admission("0", 5, 0)
    text = m.exposition()
    assert text.count("# TYPE basertd_prefix_cache_misses_total counter") == 1
    assert 'basertd_prefix_cache_misses_total{worker="0"} 1.0' in text
    m.close()
