"""A subscriber that never reads does not slow ticks, and what it makes the publisher drop is
counted (``basertd_kv_events_dropped_total``; ``basertd.server.observe.kv_events``: bounded queue,
``XPUB_NODROP`` with a high-water mark, the dropped batch stays replayable)."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
import zmq
from daemon_harness import Daemon
from prometheus_client.parser import text_string_to_metric_families
from serving_harness import ref_toml
from vllm_subscriber import Subscriber

from basertd.schema import control

N = 250  # requests per phase; each publishes ~56 new pages (a batch of ~1.5 kB)


def scrape(d: Daemon) -> dict[tuple[str, tuple], float]:
    with d.client() as c:
        text = c.request(control.Metrics()).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def phase(d: Daemon, tag: str) -> tuple[float, int]:
    """Run N short requests with distinct prompts one after another; (mean tick seconds, ticks)."""
    before = scrape(d)
    with d.client() as c:
        for i in range(N):
            c.generate(f"{tag} {i} " + "p" * 880, max_tokens=2, temperature=0.0)
    d.wait_idle()
    after = scrape(d)
    key_s = ("basertd_tick_seconds_sum", (("worker", "0"),))
    key_n = ("basertd_tick_seconds_count", (("worker", "0"),))
    n = int(after[key_n] - before.get(key_n, 0.0))
    return (after[key_s] - before.get(key_s, 0.0)) / max(1, n), n


@pytest.fixture
def ipc():
    path = tempfile.mkdtemp(prefix="brt-kvs-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_subscriber_that_never_reads_does_not_slow_ticks_and_drops_are_counted(ipc):
    ev, rp = f"ipc://{ipc}/ev", f"ipc://{ipc}/rp"
    cfg = ref_toml(lanes=2, context=1024, ref={"tick_delay_us": 0}) + (
        f'[kv_events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\nhwm = 4\n'
    )
    with Daemon(cfg) as d:
        base_tick, base_n = phase(d, "baseline")  # nobody subscribed
        assert scrape(d)[("basertd_kv_events_dropped_total", (("where", "hwm"), ("worker", "0")))] == 0
        ctx = zmq.Context()
        stuck = ctx.socket(zmq.SUB)  # subscribes, then never reads
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 2048)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(ev)
        try:
            time.sleep(0.3)
            slow_tick, slow_n = phase(d, "stuck")
            m = scrape(d)
            dropped = m[("basertd_kv_events_dropped_total", (("where", "hwm"), ("worker", "0")))]
            batches = m[("basertd_kv_events_batches_total", (("worker", "0"),))]
            print(
                f"\nmean tick: {base_tick * 1e3:.3f} ms without a subscriber ({base_n} ticks), "
                f"{slow_tick * 1e3:.3f} ms with a stuck one ({slow_n} ticks); "
                f"batches {batches:.0f}, dropped at hwm {dropped:.0f}"
            )
            assert dropped > 0, "the stuck subscriber never filled its high-water mark"
            assert slow_tick <= 2 * base_tick + 0.002, (base_tick, slow_tick)
            # a dropped batch is still in the replay buffer: a subscriber gets every one of them
            late = Subscriber(ev, rp)
            try:
                got = late.replay(0)
                assert got == list(range(int(batches))), (len(got), batches)
            finally:
                late.close()
        finally:
            stuck.close(0)
            ctx.term()
