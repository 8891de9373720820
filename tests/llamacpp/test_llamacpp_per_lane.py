"""The per-lane KV layout (``context.KV_LAYOUTS``, ``cells`` module docstring): lanes in consecutive
stream ids, a published prefix kept in its lane's stream and moved out (or evicted, within the shed
envelope) when an admit needs the stream, a seed copied into the lane's stream (any page multiple
of an entry), and a state read of a stream whose copy llama.cpp has not performed yet flushed
first. Every other engine test also runs in this layout (``conftest.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from lc_harness import BareLlama, admit, first_divergence, host_row, ignore_eos, make_prompt

from basertd.schema.abi import ShedKind, Status
from basertd.schema.tick import LaneDecode, LanePrefill, LaneRetire, ShedPolicy
from basertd.worker.engines.base import PlanRejected

U64 = (1 << 64) - 1
EVICT_ALL = ShedPolicy(evictable_cache_classes=1, max_evict_bytes=U64)
EVICT_NONE = ShedPolicy(evictable_cache_classes=1, max_evict_bytes=U64, protected_quota_bytes=U64)
RESTORE_NOISE = 1e-3
"""Max |logit difference| between a lane seeded from a restored snapshot and one seeded from the
same resident entry (``test_llamacpp_host_tier.RESTORE_NOISE``); a snapshot of a stream read before
its copy (zeros, or another sequence's keys) moves logits by ~0.1 or more."""


pytestmark = pytest.mark.kv_layouts("per-lane")


def prefill(coord, tag, prompt, decode=0):
    """Admit ``prompt`` in lane ``tag``, prefill it and decode ``decode`` tokens (greedy)."""
    return coord.tick(
        admits=[admit(tag, coord.prompt(prompt), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=decode)] if decode else [],
    )


def greedy_ref(eng, prompt, n):
    bare = BareLlama(eng.model.path, eng.context_params())
    try:
        ref, margins = bare.greedy([prompt], n)
    finally:
        bare.close()
    return ref[0], margins[0]


def test_lanes_stay_on_consecutive_streams_and_an_entry_stays_in_its_lanes_stream(make_engine):
    eng, coord = make_engine(lanes=4)
    assert eng.context_params()["kv_unified"] is False and eng.info().extra["kv_layout"] == "per-lane"
    prompts = {t: make_prompt(t, 20) for t in (1, 2, 3)}
    coord.tick(
        admits=[admit(t, coord.prompt(p), params=ignore_eos()) for t, p in prompts.items()],
        prefills=[LanePrefill(lane_tag=t, token_offset=0, token_count=20) for t in prompts],
    )
    assert sorted(eng.lanes[t].seq for t in prompts) == [0, 1, 2]
    (mid,) = (t for t in prompts if eng.lanes[t].seq == 1)
    coord.tick(retires=[LaneRetire(lane_tag=mid, publish_to_cache=1)])
    (entry,) = eng.cache.entries.values()
    assert entry.seq == 1 and entry.length == 16  # kept where the lane computed it: no copy
    assert eng.cache.max_entries == eng.max_lanes + 2 and not eng.cells.pending
    live = [t for t in prompts if t != mid]
    assert eng.stats()["kv_stream_moves_total"] == 0
    ev = coord.tick(decodes=[LaneDecode(lane_tag=t, max_new_tokens=6) for t in live])
    # the decoding lane above the entry traded streams with it: a round's decode rows stay one ubatch
    assert sorted(eng.lanes[t].seq for t in live) == [0, 1] and entry.seq == 2
    assert eng.stats()["kv_stream_moves_total"] == 1
    assert sorted(e.lane_tag for e in ev.emits) == sorted(live) and all(e.n_tokens == 6 for e in ev.emits)
    for e in ev.emits:  # the moved lane continues from the KV it took along
        ref, margins = greedy_ref(eng, prompts[e.lane_tag], 6)
        first_divergence(coord.read(e.token_ref), ref, margins, 1e-3)
    coord.tick(admits=[admit(4, coord.prompt(make_prompt(4, 20)))])
    assert eng.lanes[4].seq == 3  # the lowest free lane stream
    assert eng.state_spaces()[0].fork_cost_class == 2  # forks copy, not share


def test_a_seed_is_copied_into_the_lanes_stream_at_any_page_of_the_entry(lc):
    # ABI rules 45, 75-83 in the per-lane layout
    eng, coord = lc
    prompt = make_prompt(3, 50)
    prefill(coord, 1, prompt)
    coord.tick(retires=[LaneRetire(lane_tag=1, publish_to_cache=1)])  # entry: 48 tokens
    for tag, share in ((2, 48), (3, 32)):  # the whole entry, and a shorter page multiple of it
        h = eng.seed_acquire(coord.prompt(prompt), share, 0)
        used, pre = eng.ledger.used, eng.stats()["prefill_tokens_total"]
        ev = coord.tick(
            admits=[admit(tag, coord.prompt(prompt), seed_handle=h, params=ignore_eos())],
            prefills=[LanePrefill(lane_tag=tag, token_offset=share, token_count=50 - share)],
            decodes=[LaneDecode(lane_tag=tag, max_new_tokens=4)],
        )
        lane = eng.lanes[tag]
        assert lane.seq < eng.max_lanes and lane.seeded_tokens == share
        # the copy is the lane's own: share + the suffix + three forwarded tokens
        assert eng.ledger.used == used + share + (50 - share) + 3
        assert eng.stats()["prefill_tokens_total"] == pre + 50 - share
        ref, margins = greedy_ref(eng, prompt, 4)
        first_divergence(coord.read(ev.emits[0].token_ref), ref, margins, 1e-3)
    assert eng.stats()["kv_stream_flushes_total"] == 0  # a seat is performed by the next decode


def _seeded_row(coord, eng, tag, prompt, share):
    """The HOST logits row after ``prompt`` from a lane seeded with its first ``share`` tokens."""
    return host_row(coord, tag, prompt, share, eng.seed_acquire(coord.prompt(prompt), share, 0))


def test_a_stream_read_before_its_copy_ran_is_flushed_first(make_engine):
    """Admits that need the lane stream an entry holds move the entry to a stream above the lanes';
    llama.cpp performs that copy at the next ``llama_decode``. Evicting the entry before one runs
    captures it into the host tier: the capture must see the copied keys (``Cells.flush``), so the
    restored prefix serves as the resident one did."""
    eng, coord = make_engine(lanes=2, cache_sequences=2, spare_sequences=0, host_bytes=4 << 20)
    prompt = make_prompt(7, 40)
    query = [*prompt, 5, 6, 7]
    prefill(coord, 1, prompt)
    coord.tick(retires=[LaneRetire(lane_tag=1, publish_to_cache=1)], shed_policy=EVICT_ALL)
    assert [e.seq for e in eng.cache.entries.values()] == [0] and not eng.cells.pending
    coord.tick(admits=[admit(t, coord.prompt(make_prompt(t, 8))) for t in (8, 9)])  # no decode
    assert [e.seq for e in eng.cache.entries.values()] == [2]
    assert eng.cells.pending  # the entry's move is still queued
    coord.tick(retires=[LaneRetire(lane_tag=t) for t in (8, 9)])
    eng.cache_evict(EVICT_ALL, U64)  # demoted at once: captured from the entry's new stream
    assert not eng.cache.entries and eng.host.stats()["host_entries"] == 1
    assert eng.stats()["kv_stream_flushes_total"] == 1 and not eng.cells.pending
    restored = _seeded_row(coord, eng, 2, query, 32)
    assert eng.host.stats()["host_restores_total"] == 1

    for e in list(eng.cache.entries.values()):
        eng.seeds.evict(e, None, 0, demote=False)
    for h in list(eng.host):
        eng.host.remove(h)
    assert not eng.cache.entries  # a fresh prefill next, not the restored copy
    prefill(coord, 3, prompt)
    coord.tick(retires=[LaneRetire(lane_tag=3, publish_to_cache=1)], shed_policy=EVICT_ALL)
    resident = _seeded_row(coord, eng, 4, query, 32)  # from the resident entry's stream
    assert eng.host.stats()["host_restores_total"] == 1
    assert np.abs(restored - resident).max() < RESTORE_NOISE


def test_a_decoding_lane_trades_streams_with_a_prefilling_lane_below_it(make_engine):
    eng, coord = make_engine(lanes=4)
    prompts = {1: make_prompt(11, 60), 2: make_prompt(12, 20), 3: make_prompt(13, 20)}
    coord.tick(
        admits=[admit(t, coord.prompt(p), params=ignore_eos()) for t, p in prompts.items()],
        prefills=[LanePrefill(lane_tag=t, token_offset=0, token_count=20) for t in prompts],
    )
    assert [eng.lanes[t].seq for t in (1, 2, 3)] == [0, 1, 2]
    out: dict[int, list[int]] = {t: [] for t in prompts}
    ev = coord.tick(  # lane 1 still prefills: lane 3 (decoding) takes its stream, lane 1 goes up
        prefills=[LanePrefill(lane_tag=1, token_offset=20, token_count=20)],
        decodes=[LaneDecode(lane_tag=t, max_new_tokens=3) for t in (2, 3)],
    )
    assert sorted(eng.lanes[t].seq for t in (2, 3)) == [0, 1] and eng.lanes[1].seq == 2
    assert eng.stats()["kv_stream_moves_total"] == 1
    for e in ev.emits:
        out[e.lane_tag] += coord.read(e.token_ref)
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=1, token_offset=40, token_count=20)],
        decodes=[LaneDecode(lane_tag=t, max_new_tokens=3) for t in prompts],
    )
    for e in ev.emits:
        out[e.lane_tag] += coord.read(e.token_ref)
    assert [len(out[t]) for t in (1, 2, 3)] == [3, 6, 6]
    for t, p in prompts.items():  # every lane continues from the KV it took along
        ref, margins = greedy_ref(eng, p, len(out[t]))
        first_divergence(out[t], ref, margins, 1e-3)


def test_admits_take_the_lane_streams_entries_hold_moving_or_evicting_them(make_engine):
    """Entries in every lane stream: admits move them to free ids above the lanes' (they keep
    serving seeds, token-exact), evict the least recently used one when no id is free (a
    CACHE_EVICTION shed entry, ABI rule 58), and a plan whose envelope allows no eviction is
    NEEDS_REPLAN with nothing changed (rule 51)."""
    eng, coord = make_engine(lanes=2, cache_sequences=1, spare_sequences=0)
    prompts = {1: make_prompt(21, 40), 2: make_prompt(22, 40)}
    coord.tick(
        admits=[admit(t, coord.prompt(p), params=ignore_eos()) for t, p in prompts.items()],
        prefills=[LanePrefill(lane_tag=t, token_offset=0, token_count=40) for t in prompts],
    )
    coord.tick(retires=[LaneRetire(lane_tag=t, publish_to_cache=1) for t in prompts])
    assert sorted(e.seq for e in eng.cache.entries.values()) == [0, 1]
    query = [*prompts[2], 3, 4]

    def state():
        seqs = sorted(e.seq for e in eng.cache.entries.values())
        return eng.ledger.used, eng.stats()["evictions_total"], seqs

    before = state()
    with pytest.raises(PlanRejected) as exc:
        coord.tick(admits=[admit(t, coord.prompt(make_prompt(t, 8))) for t in (5, 6)], shed_policy=EVICT_NONE)
    assert exc.value.status == Status.NEEDS_REPLAN
    assert state() == before and not eng.lanes
    # one admit: the entry in stream 0 moves to the one free id above the lanes
    h = eng.seed_acquire(coord.prompt(query), 32, 0)  # pins prompt 2's entry (stream 1)
    ev = coord.tick(
        admits=[admit(5, coord.prompt(query), seed_handle=h, params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=5, token_offset=32, token_count=len(query) - 32)],
        decodes=[LaneDecode(lane_tag=5, max_new_tokens=4)],
        shed_policy=EVICT_NONE,
    )
    assert eng.lanes[5].seq == 0 and sorted(e.seq for e in eng.cache.entries.values()) == [1, 2]
    ref, margins = greedy_ref(eng, query, 4)
    first_divergence(coord.read(ev.emits[0].token_ref), ref, margins, 1e-3)
    # a second admit: no id is free, the least recently used entry (prompt 1's) is evicted
    ev = coord.tick(admits=[admit(6, coord.prompt(make_prompt(6, 8)))], shed_policy=EVICT_ALL)
    assert eng.lanes[6].seq == 1 and [e.length for e in eng.cache.entries.values()] == [40 // 16 * 16]
    (entry,) = eng.cache.entries.values()
    assert entry.seq == 2 and entry.tokens.tolist() == prompts[2][:32]
    assert [s.kind for s in ev.shed.entries] == [ShedKind.CACHE_EVICTION] and ev.shed.evictions_performed == 1


def test_a_retire_publishes_nothing_when_its_stream_is_the_admits_only_room(make_engine):
    """One lane stream and no other id: a plan that retires the lane with publish_to_cache and
    admits another is not NEEDS_REPLAN; the retire publishes nothing and the admit gets the
    stream (a publish is best effort: ABI rule 91)."""
    eng, coord = make_engine(lanes=1, cache_sequences=0, spare_sequences=0)
    prefill(coord, 1, make_prompt(31, 40))
    prompt = make_prompt(32, 20)
    ev = coord.tick(
        retires=[LaneRetire(lane_tag=1, publish_to_cache=1)],
        admits=[admit(2, coord.prompt(prompt), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=2, token_offset=0, token_count=20)],
        decodes=[LaneDecode(lane_tag=2, max_new_tokens=3)],
        shed_policy=EVICT_NONE,
    )
    assert not eng.cache.entries and eng.lanes[2].seq == 0 and 1 not in eng.lanes
    ref, margins = greedy_ref(eng, prompt, 3)
    first_divergence(coord.read(ev.emits[0].token_ref), ref, margins, 1e-3)
