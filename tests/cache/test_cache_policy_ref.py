"""The prefix-cache policy end to end on the reference engine (DESIGN.md "Prefix cache
policy"; ABI rules 45, 75-91): a burst sharing a long prefix prefills it once (the engine's own
prefill counter says so), the cache never changes an output (cache on vs off, token for token),
pins survive eviction under pool pressure, and no seed lease outlives its use."""

from __future__ import annotations

import asyncio
import json

import pytest
from daemon_harness import Daemon
from serving_harness import access_lines, common_prefix, direct_ref, engine_stats, ref_toml, wait_leases

from basertd.client import AsyncClient, ClientError
from basertd.schema import client as api
from basertd.schema import control
from basertd.schema.client import ErrorCode

PAGE = 16  # the reference engine's default page_size_tokens
SHARED = (
    "You are a careful assistant for a shared inference box. Answer briefly, cite nothing, and keep "
    "every reply under fifty words. The user is an engineer measuring how well prefixes are shared. "
)
assert len(SHARED) > 4 * PAGE * 2  # well over 4 pages of byte tokens


def burst_params(i: int) -> dict:
    """Greedy for even requests, seeded sampling for odd ones."""
    if i % 2 == 0:
        return dict(max_tokens=8, temperature=0.0)
    return dict(max_tokens=8, temperature=0.8, seed=100 + i)


async def run_burst(socket, prompts: list[str], qos: str = "interactive") -> list:
    async with await AsyncClient.connect(socket) as c:
        return await asyncio.gather(
            *(
                c.generate(p, request_id=f"burst-{i}", qos=qos, **burst_params(i))
                for i, p in enumerate(prompts)
            )
        )


@pytest.fixture(scope="module")
def direct():
    with direct_ref(lanes=4) as d:
        yield d


@pytest.fixture(scope="module")
def daemon():
    # emit window 0: every token reaches its client mid-tick, so a request's Done can arrive before
    # the plan that retires (and publishes) its lane is built
    with Daemon(ref_toml(lanes=4, grant=4, worker='engine_args = ["--emit-window-ms", "0"]')) as d:
        yield d


def test_sixteen_requests_sharing_a_long_prefix_prefill_it_once(daemon, direct):
    prompts = [SHARED + f"Question {i}: what is {i} times {i + 3}?" for i in range(16)]
    with daemon.client() as c:
        ids = [c.tokenize(p) for p in prompts]
    shared_tokens = len(c_common := common_prefix(ids))
    pages = shared_tokens // PAGE * PAGE
    assert pages > 4 * PAGE and c_common
    before = engine_stats(daemon)[0]
    outs = asyncio.run(run_burst(daemon.socket, prompts))
    daemon.wait_idle()
    after = engine_stats(daemon)[0]
    prefilled = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    suffixes = sum(len(x) - pages for x in ids)
    # every token past the shared pages is prefilled once per request; the shared pages once in all
    assert prefilled <= suffixes + pages, (prefilled, suffixes, pages)
    assert prefilled >= suffixes  # nothing was skipped that no cache could serve
    cached = [o.usage.cached_tokens for o in outs]
    assert sorted(cached)[1:] == [pages] * 15 and sorted(cached)[0] == 0, cached  # the leader: 0
    for i, (o, p) in enumerate(zip(outs, ids, strict=True)):
        want = direct.run(p, api.Generate(request_id="x", prompt="", **burst_params(i)))
        assert o.ids == want, f"request {i}: the seeded generation differs"
    access = access_lines(daemon)
    assert sum(access[f"burst-{i}"]["cached_tokens"] for i in range(16)) == sum(cached)
    wait_leases(daemon, 0)


def test_the_next_turn_sent_the_moment_a_request_ends_is_seeded_from_it(daemon, direct):
    with daemon.client() as c:
        first = c.tokenize("A conversation of its own. " * 6 + "Turn one: say something.")
        one = c.generate(prompt_tokens=first, max_tokens=24, temperature=0.0)
        second = first + one.ids + c.tokenize(" Turn two: and now?", add_special=False)
        two = c.generate(prompt_tokens=second, max_tokens=8, temperature=0.0)  # right after Done
    # the first lane published its prompt and answer, whole pages (all of it, or all but the
    # last token, as the engine keeps the last token's KV or not)
    low, high = (len(first) + len(one.ids) - 1) // PAGE * PAGE, (len(first) + len(one.ids)) // PAGE * PAGE
    assert low <= two.usage.cached_tokens <= high, (two.usage.cached_tokens, low, high)
    assert two.ids == direct.run(
        second, api.Generate(request_id="x", prompt="", max_tokens=8, temperature=0.0)
    )
    daemon.wait_idle()
    wait_leases(daemon, 0)


def test_a_request_that_ends_in_the_tick_that_admits_it_reports_its_cached_tokens(daemon):
    # grant 4, max_tokens 2 and mid-tick emits: the Done goes out before that tick's events apply
    prompt = SHARED + "A short question asked twice."
    with daemon.client() as c:
        c.generate(prompt, request_id="short-1", max_tokens=2, temperature=0.0)
        daemon.wait_idle()
        again = c.generate(prompt, request_id="short-2", max_tokens=2, temperature=0.0)
        pages = len(c.tokenize(prompt)) // PAGE * PAGE
    assert pages >= 4 * PAGE
    assert again.usage.cached_tokens >= pages - PAGE, again.usage
    assert access_lines(daemon)["short-2"]["cached_tokens"] == again.usage.cached_tokens
    daemon.wait_idle()
    wait_leases(daemon, 0)


def test_the_cache_never_changes_an_output(daemon):
    prompts = [SHARED + f"Variant {i % 3}. Item {i}." for i in range(10)] + [
        f"unrelated {i}" for i in range(3)
    ]
    with Daemon(ref_toml(lanes=4, grant=4, cache="enabled = false\npublish_on_retire = false")) as off:
        cold = asyncio.run(run_burst(off.socket, prompts, qos="batch"))
        assert all(o.usage.cached_tokens == 0 for o in cold)
        off_stats = engine_stats(off)[0]
    warm_first = asyncio.run(run_burst(daemon.socket, prompts, qos="batch"))
    warm_again = asyncio.run(run_burst(daemon.socket, prompts, qos="batch"))  # everything cached now
    assert [o.ids for o in warm_first] == [o.ids for o in cold]
    assert [o.ids for o in warm_again] == [o.ids for o in cold]
    assert sum(o.usage.cached_tokens for o in warm_again) > 0
    assert off_stats["cache_entries"] == 0
    daemon.wait_idle()
    wait_leases(daemon, 0)


def test_pinned_prefixes_survive_eviction_under_pool_pressure():
    # 48 blocks of 16 tokens: two lanes of up to 256 tokens fill most of it, every finished request
    # publishes its pages, so the pool stays near full and the watermarks and ticks evict.
    ref = {"pool_bytes": 48 * PAGE * 64}
    with Daemon(
        ref_toml(lanes=2, context=256, grant=4, ref=ref, cache="high_watermark = 0.8\nlow_watermark = 0.5")
    ) as d:
        pinned_text = "PINNED SYSTEM PROMPT: " + "keep me cached. " * 6
        r = d.ctl("--json", "cache", "pin", "--text", pinned_text)
        assert r.returncode == 0, r.stderr
        pin = json.loads(r.stdout)
        assert pin["tokens"] >= 4 * PAGE and pin["tokens"] % PAGE == 0
        wait_leases(d, 1)  # the pin holds one lease, renewed as ticks pass
        with d.client() as c:
            for i in range(24):
                c.generate(f"filler request number {i} " + "x" * (100 + i), max_tokens=40, temperature=0.0)
        d.wait_idle()
        stats = engine_stats(d)[0]
        assert stats["evictions_total"] >= 5, stats  # the pool really was under pressure
        assert stats["live_seed_leases"] == 1
        entries = json.loads(d.ctl("--json", "cache", "ls").stdout)
        pinned = [e for e in entries if e["pin_id"] == pin["pin_id"]]
        assert pinned and pinned[0]["prefix_tokens"] == pin["tokens"], entries
        with d.client() as c:
            out = c.generate(pinned_text + " and a question", max_tokens=4, temperature=0.0)
        assert out.usage.cached_tokens >= pin["tokens"]
        stats_rows = json.loads(d.ctl("--json", "cache", "stats").stdout)
        assert stats_rows[0]["pinned_entries"] == 1 and stats_rows[0]["pinned_bytes"] == pin["tokens"] * 64
        # cache evict (everything unpinned) keeps the pin too
        assert d.ctl("--json", "cache", "evict").returncode == 0
        entries = json.loads(d.ctl("--json", "cache", "ls").stdout)
        assert [e["pin_id"] for e in entries] == [pin["pin_id"]]
        r = d.ctl("--json", "cache", "unpin", str(pin["pin_id"]))
        assert r.returncode == 0, r.stderr
        wait_leases(d, 0)
        with d.client() as c, pytest.raises(ClientError) as gone:
            c.request(control.CacheUnpin(pin_id=pin["pin_id"]))
        assert gone.value.code == ErrorCode.NOT_FOUND
        # a prefix no lane could hold with a token to generate is refused up front, nothing pinned
        r = d.ctl("--json", "cache", "pin", "--tokens", ",".join(["5"] * 256))
        assert r.returncode == 1 and "invalid_request" in r.stderr and "at most 240" in r.stderr, r.stderr
        assert json.loads(d.ctl("--json", "cache", "stats").stdout)[0]["pinned_entries"] == 0
        # the same prefix pinned twice: dropping the later pin leaves the row marked by the earlier
        pins = [d.ctl("--json", "cache", "pin", "--text", pinned_text) for _ in "ab"]
        a, b = (json.loads(r.stdout)["pin_id"] for r in pins)
        assert d.ctl("cache", "unpin", str(b)).returncode == 0
        rows = [e for e in json.loads(d.ctl("--json", "cache", "ls").stdout) if e["pin_id"]]
        assert [e["pin_id"] for e in rows] == [a], rows
        assert d.ctl("cache", "unpin", str(a)).returncode == 0
