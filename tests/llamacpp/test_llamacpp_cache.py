"""Prefix cache, seeds and leases of the llama.cpp engine (RULES.md section G), and the sliding-window
rule of prefix sharing on a tiny Gemma 3."""

from __future__ import annotations

import llama_cpp as L
import numpy as np
import pytest
from lc_harness import BareLlama, admit, first_divergence, ignore_eos, make_prompt

from basertd.schema.abi import ALL_SPACES, DeterminismClass, Sampling, ShedKind, Status
from basertd.schema.tick import CacheKey, LaneDecode, LanePrefill, LaneRetire, ShedPolicy
from basertd.worker.engines.base import EngineError, PlanRejected
from basertd.worker.engines.llamacpp.prefix_cache import prefix_digest

U64 = (1 << 64) - 1
EVICT_ALL = ShedPolicy(evictable_cache_classes=1, max_evict_bytes=U64)


def publish(coord, tag, prompt, decode=0):
    """Run a lane over ``prompt`` (+ ``decode`` tokens) and retire it with publish_to_cache."""
    ref = coord.prompt(prompt)
    ev = coord.tick(
        admits=[admit(tag, ref, params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=decode)] if decode else [],
    )
    out = [t for e in ev.emits for t in coord.read(e.token_ref)]
    coord.tick(retires=[LaneRetire(lane_tag=tag, publish_to_cache=1)])
    return out


def seeded(coord, tag, prompt, handle, skip, decode=1, **kw):
    """Admit with a seed, prefill from ``skip``, decode; returns the events."""
    return coord.tick(
        admits=[admit(tag, coord.prompt(prompt), seed_handle=handle, **kw)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=skip, token_count=len(prompt) - skip)],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=decode)] if decode else [],
    )


def candidates(eng, coord, span, space=0):
    (sm,) = eng.space_match(space, coord.prompt(span)).spaces
    return [c.prefix_len for c in sm.candidates]


def test_publish_keeps_whole_pages_and_match_offers_page_multiples(lc):
    # ABI rules 88, 90, 91
    eng, coord = lc
    prompt = make_prompt(1, 30)
    gen = publish(coord, 1, prompt, decode=8)  # 30 + 8 tokens, 37 in KV
    assert eng.stats()["cache_entries"] == 1 and eng.ledger.used == 32
    full = prompt + gen
    assert candidates(eng, coord, [*full, 7, 7]) == [32]
    assert candidates(eng, coord, full[:20] + [5] * 30) == [16]
    assert candidates(eng, coord, [1] + [9] * 40) == []
    assert candidates(eng, coord, full, space=ALL_SPACES) == [32]
    (c,) = eng.space_match(0, coord.prompt(full)).spaces[0].candidates
    assert c.provenance_digest == prefix_digest(eng.model.model_id, np.array(full[:32]))
    with pytest.raises(EngineError) as ex:
        eng.space_match(5, coord.prompt(full))
    assert ex.value.status == Status.ERR_UNKNOWN_HANDLE
    publish(coord, 2, full[:32])  # the same 32 tokens again: one entry, no stranded cells [90]
    assert eng.stats()["cache_entries"] == 1 and eng.ledger.used == 32
    publish(coord, 3, make_prompt(3, 10))  # under one page: nothing published, nothing kept [91]
    assert eng.stats()["cache_entries"] == 1 and eng.ledger.used == 32


def test_seed_acquire_refusals(lc):
    # ABI rules 75, 78, 84
    eng, coord = lc
    prompt = make_prompt(2, 40)
    publish(coord, 1, prompt)  # entry of 32
    span = coord.prompt(prompt)
    for plen, status in (
        (0, Status.REJECT_BOUNDS),
        (41, Status.REJECT_BOUNDS),
        (20, Status.ERR_SEED_UNSERVABLE),
    ):
        with pytest.raises(EngineError) as ex:
            eng.seed_acquire(span, plen, 0)
        assert ex.value.status == status
    with pytest.raises(EngineError) as ex:  # cached only up to 32
        eng.seed_acquire(coord.prompt(prompt + [4] * 10), 48, 0)
    assert ex.value.status == Status.ERR_SEED_UNSERVABLE
    assert eng.stats()["live_seed_leases"] == 0
    assert eng.seed_lease_ticks() == 8 == eng.info().seed_lease_ticks


@pytest.mark.kv_layouts("unified")
def test_seeded_admit_shares_cells_and_prefills_only_the_suffix(lc):
    # ABI rule 45 for a seeded admit
    eng, coord = lc
    prompt = make_prompt(3, 50)
    publish(coord, 1, prompt)  # entry: 48 tokens
    h = eng.seed_acquire(coord.prompt(prompt), 48, 0)
    used, pre = eng.ledger.used, eng.stats()["prefill_tokens_total"]
    with pytest.raises(PlanRejected) as ex:  # the seed's tokens count as prefilled
        seeded(coord, 2, prompt, h, 0)
    assert ex.value.status == Status.REJECT_ILLEGAL_COMBINATION
    ev = seeded(coord, 2, prompt, h, 48, decode=4, params=ignore_eos())
    assert eng.ledger.used == used + 2 + 3  # the suffix and three forwarded tokens; 48 shared
    s = eng.stats()
    assert s["prefill_tokens_total"] == pre + 2 and s["cached_tokens_total"] == 48
    assert eng.lanes[2].seeded_tokens == 48
    seeded_toks = coord.read(ev.emits[0].token_ref)
    bare = BareLlama(eng.model.path, eng.context_params())
    try:
        ref, margins = bare.greedy([prompt], 4)
    finally:
        bare.close()
    first_divergence(seeded_toks, ref[0], margins[0], 1e-3)


@pytest.mark.kv_layouts("unified")
def test_fully_cached_prompt_redecodes_its_last_token(lc):
    """A prompt that is exactly a cached prefix: the lane shares all but the last position and
    decodes that one for its logits."""
    eng, coord = lc
    prompt = make_prompt(4, 32)
    publish(coord, 1, prompt)
    h = eng.seed_acquire(coord.prompt(prompt), 32, 0)
    used = eng.ledger.used
    ev = coord.tick(admits=[admit(2, coord.prompt(prompt), seed_handle=h)], decodes=[LaneDecode(lane_tag=2)])
    assert ev.emits[0].n_tokens == 1
    assert eng.ledger.used == used + 1  # position 31 re-decoded into one fresh cell
    bare = BareLlama(eng.model.path, eng.context_params())
    try:
        ref, margins = bare.greedy([prompt], 1)
    finally:
        bare.close()
    first_divergence(coord.read(ev.emits[0].token_ref), ref[0], margins[0], 1e-3)


def test_seed_handles_are_consumed_once_and_expire(lc):
    # ABI rules 80-83
    eng, coord = lc
    prompt = make_prompt(5, 40)
    publish(coord, 1, prompt)
    span = coord.prompt(prompt)
    h = eng.seed_acquire(span, 32, DeterminismClass.BEST_EFFORT)
    plan = dict(
        admits=[admit(2, coord.prompt(prompt), seed_handle=h), admit(3, coord.prompt(prompt), seed_handle=h)],
    )
    with pytest.raises(PlanRejected) as ex:  # two admits, one seed [82]
        coord.tick(**plan)
    assert ex.value.status == Status.REJECT_STALE_SEED
    for bad in (
        admit(2, coord.prompt(prompt), seed_handle=h, determinism_class=DeterminismClass.DETERMINISTIC),
        admit(2, coord.prompt([1, *prompt[2:]]), seed_handle=h),
        admit(2, coord.prompt(prompt[:20]), seed_handle=h),
    ):
        with pytest.raises(PlanRejected) as ex:  # [80]
            coord.tick(admits=[bad])
        assert ex.value.status == Status.REJECT_STALE_SEED
    coord.tick(admits=[admit(2, coord.prompt(prompt), seed_handle=h)])  # still valid [82]
    with pytest.raises(PlanRejected) as ex:  # consumed [81]
        coord.tick(admits=[admit(3, coord.prompt(prompt), seed_handle=h)])
    assert ex.value.status == Status.REJECT_STALE_SEED
    with pytest.raises(EngineError) as ex:
        eng.seed_release(h)
    assert ex.value.status == Status.ERR_UNKNOWN_HANDLE
    # TTL [83]: acquired at tick index T, usable by ticks T..T+8
    h2 = eng.seed_acquire(span, 32, 0)
    for _ in range(eng.seed_lease_ticks()):
        coord.tick()
    coord.tick(admits=[admit(4, coord.prompt(prompt), seed_handle=h2)])  # tick T+8
    h3 = eng.seed_acquire(span, 32, 0)
    for _ in range(eng.seed_lease_ticks() + 1):
        coord.tick()
    assert eng.stats()["live_seed_leases"] == 0
    with pytest.raises(PlanRejected) as ex:
        coord.tick(admits=[admit(5, coord.prompt(prompt), seed_handle=h3)])
    assert ex.value.status == Status.REJECT_STALE_SEED


def test_leases_pin_entries_and_match_pins_nothing(lc):
    # ABI rules 87, 89
    eng, coord = lc
    publish(coord, 1, make_prompt(6, 40))
    publish(coord, 2, make_prompt(7, 24))
    assert len(eng.cache.entries) == 2
    eng.space_match(0, coord.prompt(make_prompt(6, 40)))
    h = eng.seed_acquire(coord.prompt(make_prompt(7, 24)), 16, 0)
    freed = eng.cache_evict(EVICT_ALL, U64)
    assert freed == 32 * eng.bytes_per_token  # the matched entry went, the leased one stayed
    assert [e.length for e in eng.cache.entries.values()] == [16]
    eng.seed_release(h)
    assert eng.cache_evict(ShedPolicy(evictable_cache_classes=2, max_evict_bytes=U64), U64) == 0  # class
    assert (
        eng.cache_evict(
            ShedPolicy(evictable_cache_classes=1, max_evict_bytes=U64, protected_quota_bytes=U64), U64
        )
        == 0
    )
    assert eng.cache_evict(ShedPolicy(evictable_cache_classes=1, max_evict_bytes=100), U64) == 0  # cap
    assert eng.cache_evict(EVICT_ALL, 1) == 0  # bytes_target caps what may go
    assert eng.cache_evict(EVICT_ALL, U64) == 16 * eng.bytes_per_token
    assert eng.ledger.used == 0 and eng.stats()["evictions_total"] == 2


def test_evict_entries_by_key(lc):
    eng, coord = lc
    prompt = make_prompt(8, 33)
    publish(coord, 1, prompt)
    digest = prefix_digest(eng.model.model_id, np.array(prompt[:32]))
    eng.cache_evict_entries([CacheKey(compat_key=bytes(32), provenance_digest=digest)])
    assert len(eng.cache.entries) == 1  # another engine's key
    eng.cache_evict_entries([CacheKey(compat_key=eng.identity, provenance_digest=digest)])
    assert len(eng.cache.entries) == 0 and eng.ledger.used == 0


def test_a_full_cache_evicts_inside_the_retire_plans_envelope(make_engine):
    eng, coord = make_engine(lanes=2, cache_sequences=2)
    full = eng.cache.max_entries  # cache_sequences; per-lane, the lanes' streams hold entries too
    assert full == (4 if eng.cells.streams else 2)
    for t in range(1, full + 1):
        publish(coord, t, make_prompt(10 + t, 20))
    new = make_prompt(11 + full, 20)
    ref = coord.prompt(new)
    coord.tick(admits=[admit(7, ref)], prefills=[LanePrefill(lane_tag=7, token_offset=0, token_count=20)])
    ev = coord.tick(retires=[LaneRetire(lane_tag=7, publish_to_cache=1)])  # default envelope: no room
    assert len(eng.cache.entries) == full and ev.shed.entries == []
    coord.tick(admits=[admit(8, ref)], prefills=[LanePrefill(lane_tag=8, token_offset=0, token_count=20)])
    ev = coord.tick(retires=[LaneRetire(lane_tag=8, publish_to_cache=1)], shed_policy=EVICT_ALL)
    (s,) = ev.shed.entries
    assert (s.kind, s.reason, s.tokens) == (ShedKind.CACHE_EVICTION, 3, 16)
    assert len(eng.cache.entries) == full
    assert candidates(eng, coord, new) == [16]
    assert candidates(eng, coord, make_prompt(11, 20)) == []  # the least recently used went


# --- sliding window (tiny Gemma 3, n_swa 32) --------------------------------------------------------


@pytest.fixture
def swa(make_engine, tiny_gemma3_gguf):
    """A small tiny-Gemma 3 engine whose sliding-window cache (swa_full off, 256 cells) prunes."""
    return make_engine(
        tiny_gemma3_gguf,
        lanes=2,
        context_length=512,
        cache_sequences=2,
        spare_sequences=0,
        n_ubatch=64,
        swa_full=False,
        pool_tokens=1024,
    )


def host_row(coord, tag, prompt, chunks=None, seed=0):
    """The logits row after ``prompt`` from a HOST lane, prefilled in ``chunks`` (one per tick)."""
    chunks = chunks or [(0, len(prompt))]
    coord.tick(admits=[admit(tag, coord.prompt(prompt), sampling=Sampling.HOST, seed_handle=seed)])
    for off, n in chunks[:-1]:
        coord.tick(prefills=[LanePrefill(lane_tag=tag, token_offset=off, token_count=n)])
    off, n = chunks[-1]
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=tag, token_offset=off, token_count=n)] if n else [],
        decodes=[LaneDecode(lane_tag=tag)],
    )
    row = coord.row(ev.emits[0].logits_row).copy()
    coord.tick(retires=[LaneRetire(lane_tag=tag)])
    return row


LAYOUT_NOISE = 0.02
"""Max |logit difference| allowed between a seeded lane and a cold one. Both hold every key they
attend to; llama.cpp's sums over KV cells still depend on where the cells sit (measured up to
~0.004 on the tiny model with no cache involved), while one missing window key moves logits by
~0.1 (the control below)."""


@pytest.mark.kv_layouts("unified")
def test_a_pruned_entry_still_serves_its_full_length(swa):
    eng, coord = swa
    a = make_prompt(20, 96)
    publish(coord, 1, a)
    (entry,) = eng.cache.entries.values()
    for i in range(3):  # traffic that makes llama.cpp prune the entry's out-of-window cells
        host_row(coord, 2, make_prompt(21 + i, 200))
    pmin, pmax = eng.cells.pos_range(entry.seq)
    assert (pmin, pmax) == (96 - 32 + 1, 95)  # llama.cpp keeps exactly the window a query at 96 needs
    s = a + make_prompt(22, 21)[1:]
    assert candidates(eng, coord, s) == [96]
    cold = host_row(coord, 3, s, chunks=[(0, 96), (96, 20)])
    h = eng.seed_acquire(coord.prompt(s), 96, 0)
    warm = host_row(coord, 4, s, chunks=[(96, 20)], seed=h)
    assert eng.stats()["cold_fallbacks_total"] == 0 and eng.stats()["cached_tokens_total"] == 96
    assert np.abs(warm - cold).max() < LAYOUT_NOISE

    # Control: a copy one position short of the window, decoded at 95, is measurably wrong. This is
    # the shape a fully cached prompt would need, so the engine must not use it...
    x = eng.cells.take_seq()
    L.llama_memory_seq_cp(eng.cells.mem, entry.seq, x, 0, 95)
    b = L.llama_batch_init(1, 0, 1)
    b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0], b.n_tokens = a[95], 95, 1, 1, 1
    b.seq_id[0][0] = x
    assert L.llama_decode(eng.ctx, b) == 0
    broken = np.ctypeslib.as_array(L.llama_get_logits_ith(eng.ctx, 0), (eng.n_vocab,)).copy()
    L.llama_batch_free(b)
    eng.cells.free_seq(x)
    cold_a = host_row(coord, 5, a)
    assert np.abs(broken - cold_a).max() > 5 * LAYOUT_NOISE

    # ... and does not: the fully cached prompt falls back to a cold prefill, output unchanged.
    h = eng.seed_acquire(coord.prompt(a), 96, 0)
    warm_a = host_row(coord, 6, a, chunks=[(96, 0)], seed=h)
    assert eng.stats()["cold_fallbacks_total"] == 1
    assert np.abs(warm_a - cold_a).max() < LAYOUT_NOISE


@pytest.mark.kv_layouts("unified")
def test_match_withholds_prefixes_whose_window_is_gone(swa):
    eng, coord = swa
    a = make_prompt(30, 96)
    publish(coord, 1, a)
    for i in range(3):
        host_row(coord, 2, make_prompt(31 + i, 200))
    (entry,) = eng.cache.entries.values()
    assert eng.cells.pos_range(entry.seq)[0] > 48 - 32 + 1
    span = a[:48] + [7] * 30  # shares 48 tokens, but positions < 65 lost their window cells
    assert candidates(eng, coord, span) == []
    with pytest.raises(EngineError) as ex:
        eng.seed_acquire(coord.prompt(span), 48, 0)
    assert ex.value.status == Status.ERR_SEED_UNSERVABLE


@pytest.mark.kv_layouts("unified")  # per-lane, a full cache leaves no lane to retire
def test_an_entry_a_retires_publish_evicted_is_not_evicted_again_for_the_ticks_kv(make_engine):
    # The cache is full (2 entries) and the pool short: the plan's KV check picks the least
    # recently used entry to evict, and the retire's publish, run first, evicts that same entry to
    # make room. It goes once: one shed entry, its sequence id freed once.
    eng, coord = make_engine(lanes=2, cache_sequences=2, pool_tokens=128)
    for t in (1, 2):
        publish(coord, t, make_prompt(60 + t, 32))
    held = make_prompt(63, 40)
    coord.tick(
        admits=[admit(3, coord.prompt(held))],
        prefills=[LanePrefill(lane_tag=3, token_offset=0, token_count=40)],
    )
    ev = coord.tick(
        retires=[LaneRetire(lane_tag=3, publish_to_cache=1)],
        admits=[admit(4, coord.prompt(make_prompt(64, 40)))],
        prefills=[LanePrefill(lane_tag=4, token_offset=0, token_count=40)],
        shed_policy=EVICT_ALL,
    )
    assert [s.kind for s in ev.shed.entries] == [ShedKind.CACHE_EVICTION], ev.shed.entries
    assert eng.stats()["evictions_total"] == 1 and len(eng.cache.entries) == 2
    free = eng.cells.free_seqs
    assert len(free) == len(set(free)), free
