"""The host tier end to end, on the tiny GGUF (``[cache] host_bytes``): a prompt that other traffic
pushed out of the worker's KV pool comes back seeded from host memory instead of prefilled again,
with the same tokens as an uninterrupted run (the llamacpp near-tie rule), and ``basertctl cache
stats`` and the Prometheus metrics show the tier's entries, bytes, restores and restore time."""

from __future__ import annotations

import json
import re
import time

import pytest
from daemon_harness import Daemon
from serving_harness import assert_same_up_to_near_ties, bare_reference, tiny_toml, wait_leases

N_NEW = 8
PAGE = 16
RETURNING = "the world is a hello of the world and " * 5  # ~150 tiny-vocabulary tokens
OTHERS = [f"{w} hello world is the a of and " * 4 for w in ("fog", "mud", "ice", "sun", "sky", "oak")]
"""Traffic that shares no page with ``RETURNING``: six prefixes, more than the worker's four cache
sequences and, with ``RETURNING``'s, more than its 512-cell pool holds."""


@pytest.fixture(scope="module", params=["unified", "per-lane"])
def daemon(tiny_gguf, request):
    # both KV layouts: per-lane, entries leave the pool when its four cache streams are full
    layout = f'kv_layout = "{request.param}"'
    with Daemon(tiny_toml(tiny_gguf, lanes=2, grant=4, cache="host_bytes = 8388608", worker=layout)) as d:
        yield d


def generate(d, prompt, rid):
    with d.client() as c:
        return c.generate(prompt, request_id=rid, max_tokens=N_NEW, temperature=0.0, ignore_eos=True)


def stats_row(d) -> dict:
    (row,) = json.loads(d.ctl("--json", "cache", "stats").stdout)
    return row


def metric(d, name: str) -> float:
    m = re.search(rf'^{name}{{worker="0"}} (\S+)$', d.ctl("metrics").stdout, re.M)
    return float(m.group(1)) if m else -1.0


def test_a_prompt_pushed_out_of_the_pool_is_restored_from_host_memory(daemon, tiny_gguf):
    with daemon.client() as c:
        ids = c.tokenize(RETURNING)
    first = generate(daemon, RETURNING, "r-0")
    assert first.usage.cached_tokens == 0
    for i, p in enumerate(OTHERS):
        generate(daemon, p, f"o-{i}")
    daemon.wait_idle()
    row = stats_row(daemon)
    assert row["evictions"] >= 1 and row["host_entries"] >= 1, row
    assert 0 < row["host_bytes"] <= row["host_capacity_bytes"] == 8 << 20, row
    assert row["host_restores"] == 0 and row["host_refused"] == 0, row
    listed = json.loads(daemon.ctl("--json", "cache", "ls", "--limit", "1000").stdout)
    tiers = {e["tier"] for e in listed if e["head"] == ids[:8]}
    assert tiers == {"host"}, listed  # cache ls says where the pushed-out prompt lives
    assert any(e["tier"] == "pool" for e in listed), listed  # the newer prompts are in the pool

    again = generate(daemon, RETURNING, "r-1")
    assert again.usage.cached_tokens == len(ids) // PAGE * PAGE  # seeded, not prefilled again
    (ref,) = bare_reference(tiny_gguf, [ids], N_NEW)
    assert_same_up_to_near_ties(first.ids, ref, "first run")
    assert_same_up_to_near_ties(again.ids, ref, "restored from the host tier")
    row = stats_row(daemon)
    assert row["host_restores"] == 1 and row["host_restore_s"] > 0 and row["host_refused"] == 0, row

    # the metrics read the same counts (refreshed by the stats call above, or within seconds)
    deadline = time.monotonic() + 15
    while metric(daemon, "basertd_host_tier_restores_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(daemon, "basertd_host_tier_restores_total") == 1
    assert metric(daemon, "basertd_host_tier_restore_seconds_total") > 0
    assert metric(daemon, "basertd_host_tier_entries") == row["host_entries"]
    assert metric(daemon, "basertd_host_tier_bytes") == row["host_bytes"]
    assert metric(daemon, "basertd_host_tier_capacity_bytes") == 8 << 20
    assert metric(daemon, "basertd_host_tier_refused_total") == 0
    daemon.wait_idle()
    wait_leases(daemon, 0)


@pytest.mark.parametrize("layout", ["unified", "per-lane"])
def test_a_long_prompt_on_a_window_model_comes_back_from_its_prefill_snapshot(tiny_gemma3_gguf, layout):
    # A sliding-window model keeps only the window of a snapshot's end, so the prompt sent again
    # needs one taken at its own last page boundary: taken as its prefill passed it
    # (``basertd_host_tier_snapshots``), before decoding moved the window on. Per-lane, the snapshot
    # is of a copy of the lane's stream, performed first (``kv_stream_flushes_total``).
    prompt = "the world is a hello of the world and " * 10  # ~300 tokens: boundary >= 256
    cfg = tiny_toml(
        tiny_gemma3_gguf,
        lanes=2,
        context=512,
        grant=4,
        cache="host_bytes = 16777216",
        worker=f'kv_layout = "{layout}"',
    )
    with Daemon(cfg) as d:
        with d.client() as c:
            ids = c.tokenize(prompt)
        mark = (len(ids) - 1) // PAGE * PAGE
        assert mark >= 256
        first = generate(d, prompt, "g-0")
        for i, p in enumerate(OTHERS):
            generate(d, p, f"g-o-{i}")
        d.wait_idle()
        assert stats_row(d)["host_restores"] == 0
        again = generate(d, prompt, "g-1")
        assert again.usage.cached_tokens == mark
        (ref,) = bare_reference(tiny_gemma3_gguf, [ids], N_NEW)
        assert_same_up_to_near_ties(first.ids, ref, "first run")
        assert_same_up_to_near_ties(again.ids, ref, "restored from its prefill snapshot")
        assert stats_row(d)["host_restores"] >= 1
        assert metric(d, "basertd_host_tier_snapshots_total") >= 1
        if layout == "per-lane":
            (w,) = json.loads(d.ctl("--json", "workers").stdout)
            assert w["kv_layout"] == "per-lane" and w["engine_stats"]["kv_stream_flushes_total"] >= 1
        d.wait_idle()
        wait_leases(d, 0)


def test_cache_ls_keeps_a_prefix_the_tier_serves_shorter_than_its_entry(tiny_gemma3_gguf):
    # A long prompt's entry (its prompt and answer) whose demotion only lengthens the prefill
    # snapshot at its prompt boundary by a page is not captured again (near duplicate). The index
    # entry the coordinator published is then served only up to that boundary: `cache ls` lists it
    # as that, in the host tier, and the prompt sent again is still seeded from it.
    prompt = "the world is a hello of the world and " * 18  # > 512 tokens: a page is 1/32 of it
    cfg = tiny_toml(tiny_gemma3_gguf, lanes=2, context=1024, grant=4, cache="host_bytes = 33554432")
    with Daemon(cfg) as d:
        with d.client() as c:
            ids = c.tokenize(prompt)
        mark = (len(ids) - 1) // PAGE * PAGE
        entry = (len(ids) + N_NEW - 1) // PAGE * PAGE  # its last token's KV is never computed
        assert mark >= 512 and entry - mark <= entry // 32, (mark, entry)
        first = generate(d, prompt, "n-0")
        for i, p in enumerate(OTHERS):
            generate(d, p, f"n-o-{i}")
        d.wait_idle()
        listed = json.loads(d.ctl("--json", "cache", "ls", "--limit", "1000").stdout)
        mine = [(e["prefix_tokens"], e["tier"]) for e in listed if e["head"] == ids[:8]]
        assert mine == [(mark, "host")], listed
        again = generate(d, prompt, "n-1")
        assert again.usage.cached_tokens == mark
        (ref,) = bare_reference(tiny_gemma3_gguf, [ids], N_NEW)
        assert_same_up_to_near_ties(first.ids, ref, "first run")
        assert_same_up_to_near_ties(again.ids, ref, "seeded from the prefill snapshot")
        assert stats_row(d)["host_restores"] == 1
        d.wait_idle()
        wait_leases(d, 0)


def test_a_prompt_sharing_only_a_first_page_does_not_unlist_a_host_prefix(tiny_gemma3_gguf):
    # A window model's host snapshot serves only its own length, so the engine serving nothing of
    # another prompt that shares its first page says nothing about it: the index keeps it, and the
    # prompt itself sent again is still seeded.
    prompt = "the world is a hello of the world and " * 10
    other = prompt[:26] + " fog mud ice" * 30  # its first page only is the prompt's
    cfg = tiny_toml(tiny_gemma3_gguf, lanes=2, context=512, grant=4, cache="host_bytes = 16777216")
    with Daemon(cfg) as d:
        with d.client() as c:
            ids, oids = c.tokenize(prompt), c.tokenize(other)
        mark = (len(ids) - 1) // PAGE * PAGE
        assert ids[:PAGE] == oids[:PAGE] and ids[: 2 * PAGE] != oids[: 2 * PAGE]
        generate(d, prompt, "s-0")
        for i, p in enumerate(OTHERS):
            generate(d, p, f"s-o-{i}")
        assert generate(d, other, "s-other").usage.cached_tokens == 0
        listed = json.loads(d.ctl("--json", "cache", "ls", "--limit", "1000").stdout)
        assert any(e["head"] == ids[:8] and e["tier"] == "host" for e in listed), listed
        assert generate(d, prompt, "s-1").usage.cached_tokens == mark
        d.wait_idle()
        wait_leases(d, 0)
