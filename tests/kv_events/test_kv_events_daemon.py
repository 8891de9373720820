"""KV-cache events of a real daemon (two reference-engine workers), read by a subscriber written
only from vLLM's documented event types (``vllm_subscriber``): every batch decodes, and replaying
the stream reconstructs exactly the pages ``basertctl cache ls`` shows after a shared-prefix burst,
an eviction under pool pressure, a pin, ``cache evict`` and a worker restart; the replay socket
returns what a subscriber missed while it was away (docs/scale-out.md,
``basertd.server.observe.kv_events``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from collections import Counter

import numpy as np
import pytest
import xxhash
from daemon_harness import Daemon
from proc_testutil import wait_until
from serving_harness import ref_toml
from vllm_subscriber import BlockStored, Subscriber

from basertd.client import AsyncClient

PAGE = 16  # the reference engine's page
POOL_BLOCKS = 48
SHARED = "A long system prompt shared by a burst of requests, many pages of byte tokens long. " * 2


@pytest.fixture(scope="module")
def setup():
    ipc = tempfile.mkdtemp(prefix="brt-kv-", dir="/tmp")
    ev, rp = f"ipc://{ipc}/ev", f"ipc://{ipc}/rp"
    subs = [Subscriber(ev, rp), Subscriber(f"{ev}_dp1", f"{rp}_dp1")]  # worker i: suffix _dp<i>
    cfg = (
        ref_toml(
            lanes=2,
            context=256,
            grant=4,
            workers=2,
            ref={"pool_bytes": POOL_BLOCKS * PAGE * 64},
            cache="high_watermark = 0.8\nlow_watermark = 0.5\ncoalesce_min_tokens = 32",
        )
        + f'[kv_events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\ntopic = "kv@test@ref"\n'
        + "include_token_ids = true\n"  # chain_ok checks each page hash against its tokens
    )
    try:
        with Daemon(cfg) as d:
            yield d, subs
    finally:
        for s in subs:
            s.close()
        shutil.rmtree(ipc, ignore_errors=True)


def chain_ok(pages) -> None:
    """Every page's hash is the index's chained hash of its tokens (xxh3_64, seeded by the parent)."""
    for h, (parent, toks) in pages.pages.items():
        want = xxhash.xxh3_64_intdigest(np.asarray(toks, dtype="<u4").tobytes(), seed=parent or 0)
        assert h == want, "a page hash does not name its tokens"
        assert parent is None or parent in pages.pages, "a page whose parent is not cached"


def assert_events_match_ls(d: Daemon, sub: Subscriber, worker: int) -> list[dict]:
    """``cache ls`` (which checks every entry against space_match) and the subscriber's pages agree:
    each listed prefix is a chain of pages, and each chain end is a listed prefix."""
    d.wait_idle()
    r = d.ctl("--json", "cache", "ls", "--worker", str(worker), "--limit", "10000")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    sub.drain()
    ps = sub.pages()
    chain_ok(ps)
    listed = Counter((row["prefix_tokens"], tuple(row["head"])) for row in rows)
    chains = {}
    for h in ps.pages:
        full = ps.prefix(h)
        chains.setdefault((len(full), tuple(full[:8])), []).append(h)
    for key, n in listed.items():
        assert len(chains.get(key, ())) >= n, f"worker {worker}: listed {key} is not in the events"
    leaves = Counter((len(ps.prefix(h)), tuple(ps.prefix(h)[:8])) for h in ps.leaves())
    for key, n in leaves.items():
        assert listed.get(key, 0) >= n, f"worker {worker}: the events hold {key}, cache ls does not"
    # every page of the events lies on a listed prefix and every listed page is in the events
    listed_pages = sum(row["prefix_tokens"] // PAGE for row in rows if not _is_prefix(row, rows))
    assert len(ps.pages) <= listed_pages or not rows
    assert all(s == PAGE for s in [ps.block_size] if ps.pages)
    return rows


def _is_prefix(row: dict, rows: list[dict]) -> bool:
    """Whether ``row`` may be a strict prefix of another listed entry (same head, longer)."""
    return any(o["prefix_tokens"] > row["prefix_tokens"] and o["head"] == row["head"] for o in rows)


async def burst(socket, prompts: list[str], max_tokens: int = 8) -> None:
    async with await AsyncClient.connect(socket) as c:
        await asyncio.gather(
            *(
                c.generate(p, request_id=f"kv-{i}", max_tokens=max_tokens, temperature=0.0)
                for i, p in enumerate(prompts)
            )
        )


def test_every_batch_decodes_and_a_shared_prefix_burst_matches_cache_ls(setup):
    d, subs = setup
    asyncio.run(burst(d.socket, [SHARED + f"question {i}?" for i in range(6)]))
    for w, sub in enumerate(subs):
        rows = assert_events_match_ls(d, sub, w)
        seqs = [s for s, _ in sub.batches]
        assert seqs == list(range(len(seqs))), "batches missing or out of order"
        assert all(b.data_parallel_rank == w for _, b in sub.batches)
        assert sub.topics <= {b"kv@test@ref"}
        if rows:
            assert any(isinstance(e, BlockStored) for _, b in sub.batches for e in b.events)
    shared_pages = len(SHARED) // PAGE
    assert sum(len(s.pages().pages) for s in subs) > shared_pages
    # the first batch of each worker is its incarnation starting empty
    assert all(type(s.batches[0][1].events[0]).__name__ == "AllBlocksCleared" for s in subs)


def test_eviction_under_pressure_a_pin_and_cache_evict_match_cache_ls(setup):
    d, subs = setup
    pinned = "PINNED: " + "keep this prefix cached please. " * 3
    r = d.ctl("--json", "cache", "pin", "--text", pinned, "--worker", "0")
    assert r.returncode == 0, r.stderr
    pin = json.loads(r.stdout)
    with d.client() as c:
        for i in range(10):
            c.generate(f"filler {i} " + "y" * (90 + i), max_tokens=30, temperature=0.0)
        pin_tokens = c.tokenize(pinned)[: pin["tokens"]]
    evicted = sum(int(w.engine_stats.get("evictions_total", 0)) for w in d.workers())
    assert evicted > 0, "the pool was never under pressure"
    for w, sub in enumerate(subs):
        assert_events_match_ls(d, sub, w)
    names = Counter(type(e).__name__ for s in subs for _, b in s.batches for e in b.events)
    assert names["BlockRemoved"] > 0, names  # evicted pages left the index, and said so
    assert d.ctl("--json", "cache", "evict").returncode == 0
    for w, sub in enumerate(subs):
        rows = assert_events_match_ls(d, sub, w)
        ps = sub.pages()
        if w == 0:  # only the pin is left, page for page
            assert [row["pin_id"] for row in rows] == [pin["pin_id"]]
            leaf = ps.leaves()
            assert len(leaf) == 1 and ps.prefix(leaf[0]) == pin_tokens
            assert len(ps.pages) == pin["tokens"] // PAGE
        else:
            assert rows == [] and ps.pages == {}
    assert d.ctl("--json", "cache", "unpin", str(pin["pin_id"])).returncode == 0


def test_a_worker_restart_clears_its_pages_and_replay_returns_missed_batches(setup):
    d, subs = setup
    asyncio.run(burst(d.socket, [SHARED + f"again {i}" for i in range(4)]))
    for w, sub in enumerate(subs):
        assert_events_match_ls(d, sub, w)
    # worker 1's subscriber goes away; traffic and a restart happen meanwhile
    away = subs[1]
    seen = away.next_seq
    endpoint, replay = f"{away.replay_endpoint.replace('rp_dp1', 'ev_dp1')}", away.replay_endpoint
    kept = list(away.batches)
    away.close()
    r = d.ctl("--json", "restart-worker", "1")
    assert r.returncode == 0, r.stderr
    d.track_children()
    d.wait_ready(60)
    asyncio.run(burst(d.socket, [SHARED + f"after restart {i}" for i in range(4)]))
    d.wait_idle()
    back = Subscriber(endpoint, replay)
    subs[1] = back  # closed by the fixture
    back.batches, back.next_seq = kept, seen
    got = back.replay(seen)
    assert got and got[0] == seen and got == list(range(seen, seen + len(got))), got
    names = [type(e).__name__ for s, b in back.batches if s >= seen for e in b.events]
    assert "AllBlocksCleared" in names, "the restart did not clear worker 1's pages"
    assert_events_match_ls(d, back, 1)
    assert_events_match_ls(d, subs[0], 0)


def _reload(d: Daemon, config: str) -> dict:
    """Rewrite the daemon's file to ``config`` (its runtime and state lines kept), SIGHUP, and
    return the next ``reloaded`` log line."""
    lines = d.config_path.read_text().splitlines(keepends=True)
    head = "".join(ln for ln in lines if ln.startswith(("runtime_dir", "state_dir")))

    def reloads() -> list[dict]:
        return [e for e in d.log_events() if e.get("event") == "reloaded"]

    seen = len(reloads())
    d.config_path.write_text(head + config + "\n[http]\nlisten = []\n")
    d.proc.send_signal(signal.SIGHUP)
    return wait_until(lambda: reloads()[seen:], 120, what="reloaded")[0]


def test_a_worker_added_by_a_reload_publishes_on_its_own_endpoints_until_it_is_removed():
    ipc = tempfile.mkdtemp(prefix="brt-kv-", dir="/tmp")
    ev, rp = f"ipc://{ipc}/ev", f"ipc://{ipc}/rp"
    events = f'[kv_events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\ninclude_token_ids = true\n'
    one, two = (ref_toml(lanes=2, context=256, grant=4, workers=n) + events for n in (1, 2))
    sub = None
    try:
        with Daemon(one) as d:
            assert not os.path.exists(f"{ipc}/ev_dp1")
            assert _reload(d, two)["workers"] == ["worker 1 added"]
            assert os.path.exists(f"{ipc}/ev_dp1") and os.path.exists(f"{ipc}/rp_dp1")
            sub = Subscriber(f"{ev}_dp1", f"{rp}_dp1")
            pinned = "PINNED on the added worker: " + "a prefix to keep. " * 4
            r = d.ctl("--json", "cache", "pin", "--text", pinned, "--worker", "1")
            assert r.returncode == 0, r.stderr
            rows = assert_events_match_ls(d, sub, 1)
            assert [row["pin_id"] for row in rows] == [json.loads(r.stdout)["pin_id"]]
            names = [type(e).__name__ for _, b in sub.batches for e in b.events]
            assert names[0] == "AllBlocksCleared" and "BlockStored" in names, names  # replayed from seq 0
            assert all(b.data_parallel_rank == 1 for _, b in sub.batches)
            assert 'basertd_kv_events_batches_total{worker="1"}' in d.ctl("metrics").stdout
            assert d.ctl("--json", "cache", "unpin", str(rows[0]["pin_id"])).returncode == 0
            assert _reload(d, one)["workers"] == ["worker 1 removed"]
            # its publisher is closed: the socket files are gone, its counters left the metrics
            gone = [f"{ipc}/ev_dp1", f"{ipc}/rp_dp1"]
            wait_until(
                lambda: not any(map(os.path.exists, gone)), 10, what="the removed worker's endpoints closed"
            )
            metrics = d.ctl("metrics").stdout
            assert 'basertd_kv_events_batches_total{worker="0"}' in metrics
            assert 'kv_events_batches_total{worker="1"}' not in metrics
            assert os.path.exists(f"{ipc}/ev")  # worker 0 publishes on
    finally:
        if sub is not None:
            sub.close()
        shutil.rmtree(ipc, ignore_errors=True)
