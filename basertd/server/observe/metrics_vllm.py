"""vLLM-named metrics for routers that read them (docs/scale-out.md, ``[metrics] vllm_compat``).

The Gateway API Inference Extension's endpoint picker (and llm-d on top of it) scores a model
server by the metrics of its model-server protocol under vLLM's names. They are exported beside
ours, on the same registry, one series per served model (``model_name``), summed over the
workers serving it, and read at scrape time like the live gauges (exactly 0 once idle):

- ``vllm:num_requests_waiting`` (gauge): requests queued, every QoS class.
- ``vllm:num_requests_running`` (gauge): requests in lanes (``basertd_lanes_active``).
- ``vllm:kv_cache_usage_perc`` (gauge, 0..1): KV tokens reserved by live lanes over the KV
  capacity of the pool (prefix-cache entries that no lane uses are reclaimable, as in vLLM,
  where cached blocks with no reference count as free).
- ``vllm:cache_config_info`` (gauge 1): labels ``block_size`` (the engine's page, tokens),
  ``num_gpu_blocks`` (pages of the pool), ``enable_prefix_caching``.
- ``vllm:lora_requests_info`` (gauge, the scrape time in seconds since the epoch, as vLLM sets
  it): labels ``max_lora`` "0", ``running_lora_adapters`` and ``waiting_lora_adapters`` "" (no
  adapters are served; the endpoint picker reads the series to learn that).
- ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (counters, tokens): prompt tokens
  at each request's first admission, and those of them served from the prefix cache
  (``basertd_prefix_cache_query_tokens`` / ``basertd_cached_tokens``; a re-admission after a
  preemption or a coalescing checkpoint is never counted again).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from basertd.server.observe.metrics import LiveState, Metrics, _LiveCollector


class VllmCollector(_LiveCollector):
    """Yields the ``vllm:*`` series (module docstring) from ``source()`` (the ``LiveState`` the
    live gauges read: each worker's snapshot and model), taken on the daemon's loop; the two
    counters come from ``metrics.cache_counters``."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        if state is None:
            return
        workers = state.workers
        model_of = state.model_names
        labels = ["model_name"]
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting to be processed (queued).", labels=labels
        )
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in lanes (running).", labels=labels
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: 1 means the KV tokens of every page are reserved by live lanes.",
            labels=labels,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV cache: page size (block_size, tokens) and pool pages.",
            labels=[*labels, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (first admission of each request).",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels=labels
        )
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (no adapters are served here).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], time.time())
        drafts = CounterMetricFamily(
            "vllm:spec_decode_num_draft_tokens",
            "Draft tokens proposed by speculative decoding.",
            labels=labels,
        )
        accepted = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the target model's verification.",
            labels=labels,
        )
        counts = self.metrics.cache_counters
        for model in dict.fromkeys(model_of[w.worker_id] for w in workers):
            mine = [w for w in workers if model_of[w.worker_id] == model]
            waiting.add_metric([model], float(sum(w.queued for w in mine)))
            running.add_metric([model], float(sum(w.lanes_busy for w in mine)))
            cap = sum(w.limits.kv_tokens for w in mine)
            used = sum(w.kv_reserved_tokens for w in mine)
            usage.add_metric([model], min(1.0, used / cap) if cap else 0.0)
            ready = [w for w in mine if w.ready]
            for block in dict.fromkeys(w.limits.page_tokens for w in ready):
                same = [w for w in ready if w.limits.page_tokens == block]
                caching = str(all(w.prefix_caching for w in same))
                pages = sum(w.limits.kv_tokens // max(1, block) for w in same)
                info.add_metric([model, str(block), str(pages), caching], 1.0)
            queries.add_metric([model], float(sum(counts.of(w.worker_id).query_tokens for w in mine)))
            hits.add_metric([model], float(sum(counts.of(w.worker_id).cached_tokens for w in mine)))
            drafts.add_metric([model], float(sum(d for w in mine for _, d, _ in w.speculation)))
            accepted.add_metric([model], float(sum(a for w in mine for _, _, a in w.speculation)))
        yield waiting
        yield running
        yield usage
        yield info
        yield queries
        yield hits
        yield lora
        yield drafts
        yield accepted


def bind_vllm(metrics: Metrics, source: Callable[[], LiveState]) -> VllmCollector:
    """Also export the ``vllm:*`` series on ``metrics``' registry, read from ``source()`` on the
    running event loop at scrape time (``[metrics] vllm_compat``). Returns the collector."""
    collector = VllmCollector(metrics)
    metrics.registry.register(collector)
    metrics.extra_collectors.append(collector)
    collector.source = source
    collector.loop = asyncio.get_running_loop()
    collector.loop_thread = threading.get_ident()
    return collector
