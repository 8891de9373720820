"""Rolling windows of what the metrics path sees, for the live views (DESIGN.md "Operators").

Prometheus histograms answer "since start" (a scraper takes rates); ``basertctl top`` and the web
page at ``/`` show "now" without a Prometheus. ``Windows`` keeps that "now", fed by the
``Metrics`` helpers as they observe (``first_token``, ``tokens``, ``wal_commit``, ``wal_fsync``), so
there is one place that sees each event and nothing re-parses the text exposition:

- ``Samples``: raw values (seconds) of the last ``horizon_s`` seconds, at most ``max_samples``
  (oldest dropped first), answering quantiles (TTFT, inter-token latency, WAL fsync time);
- ``PerSecond``: sums per whole second over the last ``horizon_s`` seconds (tokens in and out,
  TTFT sums and counts, prefix-cache looked-up and cached prompt tokens), answering rates and
  per-second series for the page's charts.

Time is ``time.monotonic()`` seconds, passed in by the caller (tests pass their own). Every
method takes a lock: ``wal_commit`` and ``wal_fsync`` are called from the journal's threads.
Costs: O(1) per observation (amortised), a sort of at most ``max_samples`` floats per quantile
query.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0
"""Seconds the quantiles of ``Windows`` cover (TTFT, inter-token latency, WAL fsync)."""
HISTORY_S = 600
"""Seconds of per-second series ``Windows`` keeps (the page's charts show up to this)."""
RATE_S = 10
"""Seconds over which ``Windows`` reports tokens/s."""
MAX_SAMPLES = 50_000
"""Most raw samples one ``Samples`` keeps (a busy box's inter-token latencies of a minute)."""


@dataclass(frozen=True, slots=True)
class Quantiles:
    """``count`` samples of the window and their ``p50`` / ``p95`` (seconds; 0.0 when empty)."""

    count: int
    p50: float
    p95: float


def _quantile(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of the sorted ``ordered`` (non-empty), ``q`` in 0..1."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class Samples:
    """Raw samples of the last ``horizon_s`` seconds, at most ``max_samples`` (module docstring)."""

    def __init__(self, horizon_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.horizon_s = horizon_s
        self._items: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, now: float, value: float, count: int = 1) -> None:
        """Record ``value`` ``count`` times at ``now``."""
        with self._lock:
            for _ in range(min(count, self._items.maxlen or count)):
                self._items.append((now, value))
            self._trim(now)

    def _trim(self, now: float) -> None:
        cut = now - self.horizon_s
        items = self._items
        while items and items[0][0] < cut:
            items.popleft()

    def quantiles(self, now: float) -> Quantiles:
        """p50 and p95 of the samples within ``horizon_s`` of ``now``."""
        with self._lock:
            self._trim(now)
            ordered = sorted(v for _, v in self._items)
        if not ordered:
            return Quantiles(0, 0.0, 0.0)
        return Quantiles(len(ordered), _quantile(ordered, 0.5), _quantile(ordered, 0.95))


class PerSecond:
    """Sums per whole second of the last ``horizon_s`` seconds (module docstring)."""

    def __init__(self, horizon_s: int = HISTORY_S) -> None:
        self.horizon_s = horizon_s
        self._sums = [0.0] * horizon_s
        self._second = 0  # the whole second the newest bucket holds
        self._lock = threading.Lock()

    def _advance(self, second: int) -> None:
        gap = second - self._second
        if gap <= 0:
            return
        if gap >= self.horizon_s:
            self._sums = [0.0] * self.horizon_s
        else:
            for s in range(self._second + 1, second + 1):
                self._sums[s % self.horizon_s] = 0.0
        self._second = second

    def add(self, now: float, amount: float) -> None:
        """Add ``amount`` to the second of ``now`` (a ``now`` older than the horizon is dropped)."""
        second = int(now)
        with self._lock:
            self._advance(second)
            if second > self._second - self.horizon_s:
                self._sums[second % self.horizon_s] += amount

    def series(self, now: float, span_s: int) -> list[float]:
        """The sums of the last ``span_s`` whole seconds (at most ``horizon_s``), oldest first; the
        last is the second of ``now`` (still filling)."""
        span_s = max(0, min(span_s, self.horizon_s))
        second = int(now)
        with self._lock:
            self._advance(second)
            return [self._sums[s % self.horizon_s] for s in range(second - span_s + 1, second + 1)]

    def total(self, now: float, span_s: int) -> float:
        """The sum of the ``span_s`` whole seconds before the second of ``now`` (the filling
        second left out, so a rate is not biased low)."""
        return sum(self.series(now - 1, span_s))


class Windows:
    """The rolling windows the live views read (module docstring). Fed by ``Metrics``; read by
    the overview (``basertd.server.observe.overview``)."""

    def __init__(self) -> None:
        self.ttft = Samples()
        """Seconds from receipt to first token, one sample per request."""
        self.itl = Samples()
        """Seconds between token deliveries, one sample per token."""
        self.wal_fsync = Samples()
        """Seconds of one write-ahead log group commit's fdatasync."""
        self.tokens_in = PerSecond()
        """Prompt tokens prefilled at each request's first admission (cached ones excluded)."""
        self.tokens_out = PerSecond()
        """Tokens delivered to clients."""
        self.ttft_sum = PerSecond()
        self.ttft_count = PerSecond()
        self.cache_query_tokens = PerSecond()
        """Prompt tokens looked up in the prefix cache (first admission of each request)."""
        self.cache_hit_tokens = PerSecond()
        """Of those, tokens served from the prefix cache."""

    def first_token(self, now: float, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first token: its TTFT, its prompt and how much of it the cache served."""
        self.ttft.add(now, ttft_s)
        self.ttft_sum.add(now, ttft_s)
        self.ttft_count.add(now, 1)
        self.tokens_in.add(now, max(0, prompt_tokens - cached_tokens))
        self.cache_query_tokens.add(now, prompt_tokens)
        self.cache_hit_tokens.add(now, cached_tokens)

    def delivered(self, now: float, count: int, gap_s: float | None) -> None:
        """``count`` tokens reached a client; ``gap_s`` after the previous delivery (None for the
        first delivery of a request, whose wait is TTFT)."""
        if count <= 0:
            return
        self.tokens_out.add(now, count)
        if gap_s is not None:
            self.itl.add(now, max(0.0, gap_s) / count, count)

    def fsync(self, now: float, seconds: float) -> None:
        """One write-ahead log fdatasync took ``seconds``."""
        self.wal_fsync.add(now, seconds)

    def rate(self, series: PerSecond, now: float, span_s: int = RATE_S) -> float:
        """``series`` per second over the ``span_s`` whole seconds before now."""
        return series.total(now, span_s) / span_s

    def cache_hit_ratio(self, now: float, span_s: int = int(WINDOW_S)) -> float:
        """Cached over looked-up prompt tokens of the last ``span_s`` seconds (0.0 when none)."""
        queried = sum(self.cache_query_tokens.series(now, span_s))
        return sum(self.cache_hit_tokens.series(now, span_s)) / queried if queried else 0.0
