"""The llama.cpp engine's host tier (``host_tier``): a prefix evicted from the KV pool is captured
into host memory, offered by matches as a HOST candidate and restored by ``seed_acquire``; the
restored lane continues as a cold one does (logits within layout noise), on the tiny llama and on
the tiny Gemma 3 with its 32-token sliding window; the tier stays within its bytes; a snapshot that
is corrupt, of another model or layout, or of another length is refused and counted, never used."""

from __future__ import annotations

import numpy as np
import pytest
from lc_harness import admit, host_row, ignore_eos, make_prompt

from basertd.schema.abi import Status, Tier
from basertd.schema.tick import ENVELOPE_BYTES, LaneDecode, LanePrefill, LaneRetire, ShedPolicy
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.seeds import PROMPT_SNAPSHOT_MIN_TOKENS
from basertd.worker.engines.llamacpp.state import open_sealed, seal

U64 = (1 << 64) - 1
EVICT_ALL = ShedPolicy(evictable_cache_classes=1, max_evict_bytes=U64)
RESTORE_NOISE = 1e-3
"""Max |logit difference| between a lane seeded from a restored snapshot and one seeded from the
same prefix while it was resident: the restored cells sit elsewhere in the cache, which changes
llama.cpp's sums in the last digits (~1e-5 measured); a missing or wrong key moves logits by ~0.1
(``test_llamacpp_cache.LAYOUT_NOISE``). Either seeded lane is as far from a cold one as the
cells' placement makes it (~0.03 on the tiny llama): the resident prefix cache's own tests bound
that, this file bounds what the tier adds."""


def publish(coord, tag, prompt):
    """Prefill ``prompt`` in a lane and retire it with publish_to_cache (a full cache evicts)."""
    ref = coord.prompt(prompt)
    coord.tick(
        admits=[admit(tag, ref, params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))],
    )
    coord.tick(retires=[LaneRetire(lane_tag=tag, publish_to_cache=1)], shed_policy=EVICT_ALL)


def match(eng, coord, span):
    (sm,) = eng.space_match(0, coord.prompt(span)).spaces
    return [(c.prefix_len, Tier(c.resident_tier)) for c in sm.candidates]


def evict_all(eng):
    eng.cache_evict(EVICT_ALL, U64)
    assert not eng.cache.entries and eng.ledger.used == 0


@pytest.fixture
def gemma(make_engine, tiny_gemma3_gguf):
    """A tiny-Gemma 3 engine (32-token window) whose window cache prunes, with a 4 MiB host tier."""
    return make_engine(
        tiny_gemma3_gguf,
        lanes=2,
        context_length=512,
        cache_sequences=2,
        spare_sequences=0,
        n_ubatch=64,
        swa_full=False,
        pool_tokens=1024,
        host_bytes=4 << 20,
    )


def decode(coord, tag, prompt, n):
    """Prefill ``prompt`` in a lane, decode ``n`` tokens and retire it with publish_to_cache."""
    coord.tick(
        admits=[admit(tag, coord.prompt(prompt), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=n)],
    )
    coord.tick(retires=[LaneRetire(lane_tag=tag, publish_to_cache=1)], shed_policy=EVICT_ALL)


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_an_evicted_prefix_is_restored_and_continues_as_the_resident_one(
    make_engine, tiny_gemma3_gguf, model
):
    kw = {"host_bytes": 4 << 20}
    if model == "gemma3":
        kw.update(path=tiny_gemma3_gguf, swa_full=False, n_ubatch=64)
    eng, coord = make_engine(**kw)
    a = make_prompt(40, 100)
    publish(coord, 1, a)  # 96 tokens published
    s = a[:96] + make_prompt(41, 20)
    cold = host_row(coord, 2, s)
    resident = host_row(coord, 3, s, skip=96, seed=eng.seed_acquire(coord.prompt(s), 96, 0))
    evict_all(eng)
    st = eng.stats()
    assert (st["host_entries"], st["host_demotions_total"]) == (1, 1)
    assert 0 < st["host_bytes"] <= st["host_capacity_bytes"]
    assert match(eng, coord, s) == [(96, Tier.HOST)]
    h = eng.seed_acquire(coord.prompt(s), 96, 0)
    st = eng.stats()
    assert (st["host_entries"], st["host_bytes"], st["host_restores_total"]) == (0, 0, 1)
    assert st["host_restored_tokens_total"] == 96 and st["host_restore_ns_total"] > 0
    assert st["cache_entries"] == 1 and match(eng, coord, s) == [(96, Tier.GPU)]
    restored = host_row(coord, 4, s, skip=96, seed=h)
    st = eng.stats()
    assert st["cached_tokens_total"] == 2 * 96 and st["cold_fallbacks_total"] == 0
    assert np.abs(restored - resident).max() < RESTORE_NOISE
    assert np.abs(restored - cold).max() <= np.abs(resident - cold).max() + RESTORE_NOISE
    # A shorter prefix: the restored llama entry serves it; the restored Gemma 3 entry kept only
    # the window of its end, so it serves 96 tokens and nothing shorter.
    s2 = a[:48] + make_prompt(42, 10)
    assert match(eng, coord, s2) == ([(48, Tier.GPU)] if model == "llama" else [])


def test_a_window_model_snapshots_the_prompt_boundary_too(make_engine, tiny_gemma3_gguf):
    eng, coord = make_engine(tiny_gemma3_gguf, host_bytes=4 << 20, swa_full=False, n_ubatch=64)
    a = make_prompt(43, 100)
    decode(coord, 1, a, 40)  # 100 + 40 tokens: an entry of 128, mark 96
    (entry,) = eng.cache.entries.values()
    assert (entry.length, entry.mark) == (128, 96)
    cold = host_row(coord, 2, a)
    resident = host_row(coord, 3, a, skip=96, seed=eng.seed_acquire(coord.prompt(a), 96, 0))
    flushes = eng.stats()["kv_stream_flushes_total"]
    evict_all(eng)
    assert sorted(h.length for h in eng.host) == [96, 128]
    assert eng.stats()["host_demotions_total"] == 2
    # the mark is captured from the evicted entry cut to it, not from a copy (which per-lane
    # streams would have to flush)
    assert eng.stats()["kv_stream_flushes_total"] == flushes
    # the prompt sent again seeds at its boundary and prefills its last 4 tokens
    assert match(eng, coord, a) == [(96, Tier.HOST)]
    restored = host_row(coord, 4, a, skip=96, seed=eng.seed_acquire(coord.prompt(a), 96, 0))
    assert [h.length for h in eng.host] == [128]
    assert np.abs(restored - resident).max() < RESTORE_NOISE
    assert np.abs(restored - cold).max() <= np.abs(resident - cold).max() + RESTORE_NOISE
    assert eng.stats()["cold_fallbacks_total"] == 0


def test_a_boundary_the_tier_holds_is_not_captured_again(make_engine, tiny_gemma3_gguf):
    eng, coord = make_engine(tiny_gemma3_gguf, host_bytes=4 << 20, swa_full=False, n_ubatch=64)
    a = make_prompt(44, 100)
    b = a[:96] + make_prompt(45, 4)  # the same prompt boundary (96), another end
    decode(coord, 1, a, 40)
    evict_all(eng)
    decode(coord, 2, b, 40)
    evict_all(eng)
    assert sorted(h.length for h in eng.host) == [96, 128, 128]
    assert eng.stats()["host_demotions_total"] == 3  # b's boundary was a's: kept once


@pytest.mark.kv_layouts("unified")
def test_a_pruned_entry_is_snapshotted_only_where_its_window_holds(make_engine, tiny_gemma3_gguf):
    eng, coord = make_engine(
        tiny_gemma3_gguf,
        lanes=2,
        context_length=512,
        cache_sequences=2,
        spare_sequences=0,
        n_ubatch=64,
        swa_full=False,
        pool_tokens=1024,
        host_bytes=4 << 20,
    )
    a = make_prompt(20, 96)
    publish(coord, 1, a)  # an entry of 96, mark 80
    (entry,) = eng.cache.entries.values()
    assert entry.mark == 80
    for i in range(3):  # traffic that makes llama.cpp prune the entry's out-of-window cells
        host_row(coord, 2, make_prompt(21 + i, 200))
    assert eng.cells.pos_range(entry.seq)[0] == 96 - 32 + 1
    evict_all(eng)
    assert [h.length for h in eng.host] == [96]  # the window of position 80 was already gone
    span = a[:80] + [7] * 30
    assert match(eng, coord, span) == []
    with pytest.raises(EngineError) as ex:
        eng.seed_acquire(coord.prompt(span), 80, 0)
    assert ex.value.status == Status.ERR_SEED_UNSERVABLE
    assert eng.stats()["host_restores_total"] == 0
    s = a + make_prompt(22, 21)[1:]
    assert match(eng, coord, s) == [(96, Tier.HOST)]
    cold = host_row(coord, 3, s)
    restored = host_row(coord, 4, s, skip=96, seed=eng.seed_acquire(coord.prompt(s), 96, 0))
    st = eng.stats()
    assert st["host_restores_total"] == 1 and st["cold_fallbacks_total"] == 0
    assert np.abs(restored - cold).max() < 0.02  # test_llamacpp_cache.LAYOUT_NOISE on this model


@pytest.mark.kv_layouts("unified")
def test_a_long_prompt_is_snapshotted_as_its_prefill_passes_its_last_page(gemma):
    # By the eviction, decoding and other traffic have made llama.cpp reuse the cells of the
    # prompt boundary's 32-token window (the demotion cannot capture it there); the snapshot taken
    # when the prefill crossed it serves the same prompt sent again.
    eng, coord = gemma
    a = make_prompt(50, 300)  # last page boundary 288 >= PROMPT_SNAPSHOT_MIN_TOKENS
    assert PROMPT_SNAPSHOT_MIN_TOKENS <= 288
    decode(coord, 1, a, 100)
    st = eng.stats()
    assert st["host_snapshots_total"] == 1 and [h.length for h in eng.host] == [288]
    (entry,) = eng.cache.entries.values()
    for i in range(3):  # traffic that makes llama.cpp prune the entry's out-of-window cells
        host_row(coord, 2, make_prompt(52 + i, 200))  # boundary 192: too short for a snapshot
    assert eng.cells.pos_range(entry.seq)[0] > 288 - 32 + 1  # the entry's own mark window is gone
    assert eng.stats()["host_snapshots_total"] == 1
    evict_all(eng)
    assert eng.stats()["host_demotions_total"] == 1  # its end only
    assert (288, Tier.HOST) in match(eng, coord, a)
    cold = host_row(coord, 2, a)
    restored = host_row(coord, 3, a, skip=288, seed=eng.seed_acquire(coord.prompt(a), 288, 0))
    st = eng.stats()
    assert st["host_restores_total"] == 1 and st["cold_fallbacks_total"] == 0
    assert np.abs(restored - cold).max() < 0.02  # test_llamacpp_cache.LAYOUT_NOISE on this model
    assert eng.stats()["host_snapshots_total"] == 1  # a lane seeded at its mark takes none


def test_a_prompt_one_page_past_a_held_prefix_is_not_kept_again(make_engine, tiny_gemma3_gguf):
    # Many requests on one long prefix with short tails: the prefix held once serves each of them
    # sent again with a page or two to prefill, so their own snapshots (each the whole prefix's
    # KV) are not kept (Tiering.near_duplicate: within 1/32 of the prompt).
    eng, coord = make_engine(
        tiny_gemma3_gguf, lanes=2, context_length=1024, n_ubatch=64, swa_full=False, host_bytes=16 << 20
    )
    assert eng.page == 16
    a = make_prompt(60, 520)  # last page boundary 512
    decode(coord, 1, a, 1)  # snapshotted at 512, then published at 512 (the snapshot leaves the tier)
    assert [e.length for e in eng.cache.entries.values()] == [512] and not list(eng.host)
    b = a[:512] + make_prompt(61, 20)  # boundary 528: 512 is within 528 // 32 = 16 of it
    decode(coord, 2, b, 1)  # its snapshot at 528 is not kept: the resident 512 nearly covers it
    st = eng.stats()
    assert st["host_snapshots_total"] == 1 and st["host_near_duplicates_total"] == 1
    evict_all(eng)  # 512 is demoted first (least recently used); 528 then nearly repeats it
    st = eng.stats()
    assert [h.length for h in eng.host] == [512]
    assert st["host_demotions_total"] == 1 and st["host_near_duplicates_total"] == 2
    assert match(eng, coord, b) == [(512, Tier.HOST)]
    cold = host_row(coord, 3, b)
    restored = host_row(coord, 4, b, skip=512, seed=eng.seed_acquire(coord.prompt(b), 512, 0))
    assert np.abs(restored - cold).max() < 0.02  # test_llamacpp_cache.LAYOUT_NOISE on this model
    near = eng.stats()["host_near_duplicates_total"]  # the two lanes on b skipped theirs too
    assert near == 4
    c = a[:512] + make_prompt(62, 60)  # boundary 560: 48 tokens past 512, more than 560 // 32
    decode(coord, 5, c, 1)  # kept (then published at 560, which takes it out of the tier)
    st = eng.stats()
    assert (st["host_snapshots_total"], st["host_near_duplicates_total"]) == (2, near)


def test_the_tier_stays_within_its_bytes_dropping_the_least_recently_used(make_engine):
    probe, pc = make_engine(host_bytes=1 << 30)
    publish(pc, 1, make_prompt(50, 64))
    evict_all(probe)
    one = probe.stats()["host_bytes"]
    cap = 2 * one + one // 2  # room for two 64-token snapshots, not three
    eng, coord = make_engine(host_bytes=cap)
    prompts = [make_prompt(60 + i, 64) for i in range(4)]
    for i, p in enumerate(prompts):
        publish(coord, 10 + i, p)
        evict_all(eng)
        assert eng.stats()["host_bytes"] <= cap
    st = eng.stats()
    assert (st["host_entries"], st["host_bytes"]) == (2, 2 * one)
    assert (st["host_demotions_total"], st["host_dropped_total"]) == (4, 2)
    assert match(eng, coord, prompts[0]) == [] and match(eng, coord, prompts[1]) == []
    assert match(eng, coord, prompts[3]) == [(64, Tier.HOST)]
    tiny, tc = make_engine(host_bytes=one - 1)  # a snapshot larger than the tier is not kept
    publish(tc, 1, prompts[0])
    evict_all(tiny)
    st = tiny.stats()
    assert (st["host_entries"], st["host_bytes"], st["host_dropped_total"]) == (0, 0, 1)


def _demoted(eng, coord, prompt):
    """The host entry of ``prompt`` (whole pages) after publishing and evicting it."""
    publish(coord, 1, prompt)
    evict_all(eng)
    return next(h for h in eng.host if h.length == len(prompt) // 16 * 16)


def _refused(eng, coord, prompt, n):
    before = eng.stats()
    with pytest.raises(EngineError) as ex:
        eng.seed_acquire(coord.prompt(prompt), n, 0)
    assert ex.value.status == Status.ERR_SEED_UNSERVABLE
    st = eng.stats()
    assert st["host_refused_total"] == before["host_refused_total"] + 1
    assert all(h.length != n for h in eng.host)  # dropped, never retried
    assert st["host_entries"] == before["host_entries"] - 1
    assert st["host_bytes"] == sum(h.nbytes for h in eng.host)
    assert st["host_restores_total"] == before["host_restores_total"]
    assert eng.ledger.used == 0 and not eng.cache.entries  # nothing left in the pool
    assert match(eng, coord, prompt) == []


def test_a_corrupt_snapshot_is_refused_and_counted(make_engine):
    eng, coord = make_engine(host_bytes=4 << 20)
    p = make_prompt(70, 64)
    h = _demoted(eng, coord, p)
    h.blob[ENVELOPE_BYTES + len(h.blob) // 3] ^= 0x40  # one flipped payload bit
    _refused(eng, coord, p, 64)
    # the prefix is prefilled cold and published again: it serves from the pool as before
    publish(coord, 2, p)
    assert match(eng, coord, p) == [(64, Tier.GPU)]


def test_a_snapshot_of_another_model_or_layout_is_refused(make_engine, tiny_gemma3_gguf):
    eng, coord = make_engine(host_bytes=4 << 20)
    other, oc = make_engine(tiny_gemma3_gguf, host_bytes=4 << 20)
    p = make_prompt(71, 64)
    foreign = _demoted(other, oc, p)
    # the other model's snapshot as it is: another compat identity (ABI rule 102)
    h = _demoted(eng, coord, p)
    h.blob = foreign.blob
    _refused(eng, coord, p, 64)
    # the other model's payload sealed with this engine's identity: llama.cpp refuses the layout
    h = _demoted(eng, coord, p)
    _, payload = open_sealed(foreign.blob, identity=other.identity)
    h.blob = bytearray(seal(payload, identity=eng.identity, provenance=h.digest, taint=0, n_tokens=64))
    _refused(eng, coord, p, 64)


def test_a_snapshot_of_another_length_is_refused(make_engine):
    eng, coord = make_engine(host_bytes=4 << 20)
    p = make_prompt(72, 80)
    short = _demoted(eng, coord, p[:48])  # 48 tokens
    eng.host.remove(short)
    h = _demoted(eng, coord, p)  # 80 tokens
    assert h.length == 80
    # the 48-token snapshot filed as the 80-token entry: its envelope says 48
    h.blob = short.blob
    _refused(eng, coord, p, 80)
    # resealed to claim 80 tokens: llama.cpp restores 48 positions, not 80
    h = _demoted(eng, coord, p)
    _, payload = open_sealed(short.blob, identity=eng.identity)
    h.blob = bytearray(seal(payload, identity=eng.identity, provenance=h.digest, taint=0, n_tokens=80))
    _refused(eng, coord, p, 80)


def test_restoring_makes_room_by_demoting_and_a_republished_prefix_leaves_the_tier(make_engine, kv_layout):
    # one resident entry: the one cache sequence, or per-lane the one lane's stream
    eng, coord = make_engine(lanes=1, host_bytes=4 << 20, cache_sequences=0 if kv_layout == "per-lane" else 1)
    assert eng.cache.max_entries == 1
    a, b = make_prompt(80, 64), make_prompt(81, 64)
    publish(coord, 1, a)
    evict_all(eng)
    publish(coord, 2, b)
    assert match(eng, coord, a) == [(64, Tier.HOST)] and match(eng, coord, b) == [(64, Tier.GPU)]
    handle = eng.seed_acquire(coord.prompt(a), 64, 0)  # the one cache sequence goes to b's demotion
    assert match(eng, coord, a) == [(64, Tier.GPU)] and match(eng, coord, b) == [(64, Tier.HOST)]
    eng.seed_release(handle)
    publish(coord, 3, b)  # b prefilled again and published: the host copy goes
    assert [x.length for x in eng.host] == [64] and match(eng, coord, b) == [(64, Tier.GPU)]
    assert match(eng, coord, a) == [(64, Tier.HOST)]


def test_a_tier_of_zero_bytes_keeps_nothing(lc):
    eng, coord = lc
    p = make_prompt(90, 64)
    publish(coord, 1, p)
    evict_all(eng)
    st = eng.stats()
    assert (st["host_entries"], st["host_bytes"], st["host_demotions_total"]) == (0, 0, 0)
    assert match(eng, coord, p) == []
