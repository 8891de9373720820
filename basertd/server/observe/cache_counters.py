"""Per-worker prefix-cache counters, owned by the object that counts them (DESIGN.md "Operators").

``CacheCounters`` keeps, per worker, what every request's first admission asked of the prefix
cache: prompt tokens looked up, hits (requests that reused cached tokens), misses, and cached
tokens (prompt tokens not prefilled because a seed covered them). ``Metrics.first_token`` records
into it once per request; it is itself the prometheus-client collector that exports the
``basertd_*`` series, and the ``vllm:prefix_cache_*`` series and the operator's cache stats read the
same numbers from it, so nothing reads a value back out of the Prometheus registry.

Counts only grow; a re-admission after a preemption is never counted again (the caller records
at the first token). Written on the daemon's event loop; a scrape from the metrics HTTP thread
reads a snapshot.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CacheCounters", "WorkerCacheCounts"]


@dataclass
class WorkerCacheCounts:
    """One worker's counts since the daemon started (across worker respawns): ``query_tokens``
    and ``cached_tokens`` in tokens, ``hits`` and ``misses`` in requests."""

    query_tokens: int = 0
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0


_SERIES: dict[str, tuple[str, str]] = {
    # exported name (without ``_total``) -> (field, help)
    "basertd_cached_tokens": (
        "cached_tokens",
        "Prompt tokens served from the prefix cache (first admission only; tokens recomputed "
        "after a preemption are not counted).",
    ),
    "basertd_prefix_cache_hits": ("hits", "Requests whose first admission reused cached prefix tokens."),
    "basertd_prefix_cache_misses": ("misses", "Requests whose first admission reused no cached tokens."),
    "basertd_prefix_cache_query_tokens": (
        "query_tokens",
        "Prompt tokens of requests at their first admission (the tokens a prefix-cache lookup "
        "was asked for; re-admissions after a preemption are not counted).",
    ),
}


class CacheCounters(Collector):
    """The prefix-cache counts of every worker, keyed by the worker label (``str(worker_id)``;
    ``""`` for a request that never reached a worker). A collector: register it on a registry to
    export the counters."""

    def __init__(self) -> None:
        self._by_worker: dict[str, WorkerCacheCounts] = {}

    def first_admission(self, worker: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first admission on ``worker`` looked up ``prompt_tokens`` prompt tokens
        and reused ``cached_tokens`` of them (0: a miss)."""
        counts = self._by_worker.get(worker)
        if counts is None:
            counts = self._by_worker[worker] = WorkerCacheCounts()
        counts.query_tokens += prompt_tokens
        if cached_tokens > 0:
            counts.hits += 1
            counts.cached_tokens += cached_tokens
        else:
            counts.misses += 1

    def of(self, worker_id: int | str) -> WorkerCacheCounts:
        """A copy of one worker's counts (zeros for a worker that counted nothing yet)."""
        counts = self._by_worker.get(str(worker_id))
        return WorkerCacheCounts() if counts is None else WorkerCacheCounts(**vars(counts))

    def counter(self, name: str, worker_id: int) -> int:
        """The value of exported series ``name`` (e.g. ``basertd_prefix_cache_hits_total``) for
        ``worker_id``: the ``counter(name, worker_id)`` the operator's cache verbs are given.
        Raises ``KeyError`` for a name this object does not export."""
        field_name, _ = _SERIES[name.removesuffix("_total")]
        return int(getattr(self.of(worker_id), field_name))

    def collect(self) -> Iterator[Metric]:
        snapshot = [(worker, WorkerCacheCounts(**vars(c))) for worker, c in list(self._by_worker.items())]
        for name, (field_name, doc) in _SERIES.items():
            family = CounterMetricFamily(name, doc, labels=["worker"])
            for worker, counts in snapshot:
                family.add_metric([worker], float(getattr(counts, field_name)))
            yield family
