"""The rolling windows behind ``basertctl top`` and the page at ``/`` (``observe.windows``), on a
clock the test moves: quantiles of the last minute only, per-second sums that roll over, rates that
leave out the second still filling, and the metrics helpers feeding them."""

from __future__ import annotations

import threading
import time

from basertd.server.observe.metrics import Metrics
from basertd.server.observe.windows import PerSecond, Samples, Windows


def test_samples_quantiles_cover_the_horizon_only():
    s = Samples(horizon_s=60.0)
    assert s.quantiles(0.0).count == 0
    for i in range(100):  # 0.01 .. 1.00 s at t = 1000
        s.add(1000.0, (i + 1) / 100)
    q = s.quantiles(1000.0)
    assert (q.count, q.p50, q.p95) == (100, 0.5, 0.95)
    s.add(1050.0, 9.0, count=5)
    assert s.quantiles(1050.0).count == 105 and s.quantiles(1050.0).p95 == 1.0
    q = s.quantiles(1061.0)  # the first hundred are older than 60 s now
    assert (q.count, q.p50, q.p95) == (5, 9.0, 9.0)
    assert s.quantiles(1200.0).count == 0


def test_samples_keep_at_most_max_samples():
    s = Samples(horizon_s=60.0, max_samples=10)
    s.add(5.0, 1.0, count=25)
    s.add(5.0, 2.0, count=3)
    q = s.quantiles(5.0)
    assert q.count == 10 and q.p95 == 2.0 and q.p50 == 1.0


def test_per_second_sums_roll_over():
    p = PerSecond(horizon_s=5)
    p.add(100.2, 3)
    p.add(100.9, 4)
    p.add(102.5, 1)
    assert p.series(102.7, 4) == [0.0, 7.0, 0.0, 1.0]
    assert p.total(103.1, 3) == 8.0  # 100, 101, 102: the filling second 103 left out
    assert p.series(106.0, 5) == [1.0, 0.0, 0.0, 0.0, 0.0]  # seconds 102 .. 106
    assert p.series(200.0, 5) == [0.0] * 5  # a gap longer than the horizon clears it
    p.add(150.0, 1)  # older than the horizon at the newest second: dropped
    assert sum(p.series(200.0, 5)) == 0.0


def test_windows_rates_ratio_and_the_metrics_helpers_feed_them():
    w = Windows()
    for t in range(10):
        w.delivered(1000.0 + t, 20, 0.05)
    assert w.rate(w.tokens_out, 1010.0) == 20.0
    w.first_token(1010.0, 0.2, prompt_tokens=100, cached_tokens=75)
    w.first_token(1010.5, 0.4, prompt_tokens=100, cached_tokens=25)
    assert w.cache_hit_ratio(1010.9) == 0.5
    assert w.tokens_in.series(1010.9, 1) == [100.0]
    q = w.ttft.quantiles(1011.0)
    assert (q.count, q.p50, q.p95) == (2, 0.2, 0.4)

    m = Metrics()
    threads = [threading.Thread(target=m.wal_commit, args=(100, 0.002)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.tokens("interactive", 4, 0.2)
    now = time.monotonic()
    assert m.windows.wal_fsync.quantiles(now).count == 8
    itl = m.windows.itl.quantiles(now)
    assert itl.count == 4 and abs(itl.p50 - 0.05) < 1e-9
    assert sum(m.windows.tokens_out.series(now, 2)) == 4
