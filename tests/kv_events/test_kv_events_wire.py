"""The publisher's endpoints and wire without a daemon: vLLM's bind-or-connect rule, per-worker
addresses, every worker's batches tagged with its rank and the expanded topic, and a PrefixIndex
observer reporting runs of new pages (``basertd.server.observe.kv_events``)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time

import numpy as np
import pytest
from vllm_subscriber import Subscriber

from basertd.server.cache.prefix_index import PrefixIndex, page_hashes
from basertd.server.config import ConfigError, parse_config
from basertd.server.config_sections import KvEventsConfig
from basertd.server.observe.kv_events import binds, offset_endpoint, start_kv_events


def test_endpoint_rules():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("ipc:///tmp/ev", 2) == "ipc:///tmp/ev_dp2"
    with pytest.raises(ValueError):
        offset_endpoint("tcp://*", 1)
    assert binds("tcp://*:5557") and binds("ipc:///x") and binds("tcp://[::]:1")
    assert not binds("tcp://indexer.svc:5557")
    for bad in ({"endpoint": "http://x:1"}, {"replay_endpoint": "tcp://*:1"}, {"topic": 3}):
        with pytest.raises(ConfigError):
            parse_config({"kv_events": bad})
    assert start_kv_events(KvEventsConfig(), ["cpu"]) is None  # off by default


def test_every_worker_publishes_tagged_with_its_rank_and_index_runs_are_reported(monkeypatch):
    d = tempfile.mkdtemp(prefix="brt-kvw-", dir="/tmp")
    monkeypatch.setenv("KV19_POD", "10.0.0.7")
    cfg = KvEventsConfig(endpoint=f"ipc://{d}/ev", topic="kv@${KV19_POD}@m", include_token_ids=True)
    assert offset_endpoint(cfg.endpoint, 1) == f"ipc://{d}/ev_dp1"
    hub = start_kv_events(cfg, ["cpu", "cuda:1"])
    subs = [Subscriber(p.endpoint, None, b"kv@") for p in hub.publishers]
    try:
        assert [p.endpoint for p in hub.publishers] == [cfg.endpoint, f"{cfg.endpoint}_dp1"]
        idx = [PrefixIndex(4, observer=p) for p in hub.publishers]
        time.sleep(0.5)  # the connections and subscriptions settle
        a = np.arange(12, dtype=np.uint32)
        b = np.concatenate([a[:4], np.arange(50, 58, dtype=np.uint32)])
        idx[0].insert(a, page_hashes(a, 4), 0.0)
        e = idx[1].insert(b, page_hashes(b, 4), 0.0)
        idx[1].insert(a, page_hashes(a, 4), 1.0)  # shares b's first page: only pages 2-3 are new
        idx[1].remove(e)
        by_rank: dict[int, list] = {}
        for sub in subs:
            sub.drain(0.5)
            assert sub.topics == {b"kv@10.0.0.7@m"}
            for _, batch in sub.batches:
                by_rank.setdefault(batch.data_parallel_rank, []).extend(batch.events)
        assert set(by_rank) == {0, 1}
        r1 = by_rank[1]
        h = page_hashes(a, 4)
        hb = page_hashes(b, 4)
        assert r1[0].block_hashes == hb and r1[0].parent_block_hash is None and r1[0].medium == "GPU"
        assert r1[1].block_hashes == h[1:] and r1[1].parent_block_hash == h[0]
        assert r1[1].token_ids == [int(t) for t in a[4:]] and r1[1].block_size == 4
        assert r1[2].block_hashes == hb[1:]  # the shared first page stays
        assert by_rank[0][0].medium == "CPU" and by_rank[0][0].block_hashes == h
    finally:
        hub.close()
        for sub in subs:
            sub.close()
        shutil.rmtree(d, ignore_errors=True)


def test_by_default_only_hashes_leave_and_ipc_sockets_are_private(monkeypatch):
    """``include_token_ids`` off (the default): BlockStored carries the page hashes, no token ids;
    the ipc socket files (PUB and replay ROUTER, every worker) are mode 0600 whatever the umask,
    and ``replay_endpoint`` expands ``$VARS`` like the topic."""
    d = tempfile.mkdtemp(prefix="brt-kvp-", dir="/tmp")
    monkeypatch.setenv("KV_REPLAY_DIR", d)
    cfg = KvEventsConfig(endpoint=f"ipc://{d}/ev", replay_endpoint="ipc://${KV_REPLAY_DIR}/rp")
    assert not cfg.include_token_ids
    old = os.umask(0o022)  # the umask that made them 0755
    try:
        hub = start_kv_events(cfg, ["cpu", "cpu"])
    finally:
        os.umask(old)
    sub = Subscriber(hub.publishers[0].endpoint, None, b"")
    try:
        assert hub.publishers[1].replay_endpoint == f"ipc://{d}/rp_dp1"
        for name in ("ev", "ev_dp1", "rp", "rp_dp1"):
            assert stat.S_IMODE(os.stat(f"{d}/{name}").st_mode) == 0o600, name
        idx = PrefixIndex(4, observer=hub.publishers[0])
        time.sleep(0.5)  # the subscription settles
        a = np.arange(100, 112, dtype=np.uint32)
        idx.insert(a, page_hashes(a, 4), 0.0)
        sub.drain(0.5)
        events = [e for _, batch in sub.batches for e in batch.events]
        assert events and events[0].block_hashes == page_hashes(a, 4)
        assert events[0].token_ids == [] and events[0].block_size == 4
    finally:
        hub.close()
        sub.close()
        shutil.rmtree(d, ignore_errors=True)
