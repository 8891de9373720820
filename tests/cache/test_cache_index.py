"""The prefix-cache policy's pure parts: page hash paths, the radix index, coalescing, routing,
watermarks and the choice among match candidates (DESIGN.md "Prefix cache policy";
ABI rules 87, 88)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.schema.tick import MatchCandidate, MatchResult, SpaceMatch
from basertd.server.cache.coalescing import PrefillingLane, QueuedPrompt, coalesce
from basertd.server.cache.policy import best_candidate, eviction_target, route
from basertd.server.cache.prefix_index import PrefixIndex, lcp_pages, page_hashes

PAGE = 4


@given(st.lists(st.integers(0, 300), max_size=40), st.lists(st.integers(0, 300), max_size=40))
@settings(max_examples=300, deadline=None)
def test_shared_pages_are_exactly_the_common_whole_pages(a, b):
    ha, hb = page_hashes(a, PAGE), page_hashes(b, PAGE)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert lcp_pages(ha, hb) == min(common // PAGE, len(ha), len(hb))
    assert len(ha) == len(a) // PAGE
    assert page_hashes(a, PAGE, ha[:2]) == ha  # known hashes are reused


def test_page_hashes_refuse_a_zero_page():
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)


def test_index_longest_insert_refresh_prune_and_forgetting():
    idx = PrefixIndex(PAGE, max_entries=2)
    a = list(range(12))  # 3 pages
    b = [*range(8), 99, 98, 97, 96]  # shares 2 pages with a
    ha, hb = page_hashes(a, PAGE), page_hashes(b, PAGE)
    assert idx.longest(ha) == 0
    e = idx.insert(np.array(a), ha, now=1.0)
    assert e is not None and e.length == 12 and idx.longest(ha) == 3 and idx.longest(hb) == 2
    assert idx.insert(np.array(a), ha, now=2.0) is e and e.last_used == 2.0 and len(idx) == 1
    assert idx.insert(np.array(a[:3]), [], now=3.0) is None  # under a page: nothing
    idx.insert(np.array(b), hb, now=3.0)
    assert idx.longest(hb) == 3 and idx.find(hb, 2) is not None
    # the engine serves only 2 pages of a: the entries claiming more of a's path are cut to them
    assert idx.prune(ha, 2) == 1 and idx.longest(ha) == 2 and idx.longest(hb) == 3
    cut = idx.find(ha, 2)
    assert cut is not None and cut.length == 8 and cut.last_used == 2.0 and ha[-1] not in idx.entries
    assert idx.prune(ha, 0) == 1 and list(idx.entries) == [hb[-1]]  # nothing served: forgotten
    assert idx.longest(hb) == 3  # b leaves a's path: the engine said nothing about it
    assert idx.prune(ha[:1], 0) == 0 and idx.longest(hb) == 3  # nor about what goes on past it
    # a third entry beyond max_entries forgets the least recently used unpinned one
    c = [7] * 8
    idx.entries[hb[-1]].pin_id = 5
    idx.insert(np.array(c), page_hashes(c, PAGE), now=4.0)
    idx.insert(np.array(a), ha, now=5.0)
    assert idx.longest(hb) == 3  # pinned: kept
    assert idx.longest(page_hashes(c, PAGE)) == 0 and idx.longest(ha) == 3
    idx.clear()
    assert list(idx.entries) == [hb[-1]]
    idx.clear(keep_pinned=False)
    assert not idx.entries and not idx.nodes


def q(key, tokens, cached=0, rank=0, can_lead=True):
    return QueuedPrompt(key, page_hashes(tokens, PAGE), cached, len(tokens), can_lead, rank)


SHARED = list(range(100, 120))  # 5 pages


def test_followers_wait_for_the_first_request_sharing_a_long_prefix():
    reqs = [q(1, [*SHARED, 1, 2, 3]), q(2, [*SHARED, 4, 5]), q(3, SHARED[:12] + [9] * 8), q(4, [5] * 30)]
    out = coalesce(reqs, [], PAGE, min_tokens=8)
    assert out.blocked == {2, 3}
    assert out.leader_checkpoints == {1: 20}  # the longest prefix any follower shares
    assert not out.lane_checkpoints


def test_no_waiting_for_a_prefix_already_cached_or_too_short():
    reqs = [q(1, [*SHARED, 1]), q(2, [*SHARED, 2], cached=5)]
    assert not coalesce(reqs, [], PAGE, min_tokens=8).blocked
    reqs = [q(1, SHARED[:4] + [1] * 8), q(2, SHARED[:4] + [2] * 8)]  # share 1 page < 2 pages
    assert not coalesce(reqs, [], PAGE, min_tokens=8).blocked
    assert not coalesce([q(1, SHARED), q(2, SHARED)], [], PAGE, min_tokens=0).blocked  # off


def test_followers_wait_for_a_prefilling_lane_which_gets_a_checkpoint():
    lane = PrefillingLane(9, page_hashes(SHARED + [7] * 8, PAGE), prefilled=6, prefill_end=28)
    out = coalesce([q(1, [*SHARED, 1]), q(2, [*SHARED, 2])], [lane], PAGE, min_tokens=8)
    assert out.blocked == {1, 2} and out.lane_checkpoints == {9: 20}
    # a decoding lane leads too: its checkpoint is behind it, so it retires (and resumes) at once
    done = PrefillingLane(9, lane.hashes, prefilled=28, prefill_end=28)
    out = coalesce([q(1, [*SHARED, 1])], [done], PAGE, min_tokens=8)
    assert out.blocked == {1} and out.lane_checkpoints == {9: 20}


def test_a_request_never_waits_for_a_lower_class_or_a_spent_leader():
    lane = PrefillingLane(9, page_hashes(SHARED, PAGE), 0, 20, rank=2)
    assert not coalesce([q(1, [*SHARED, 1], rank=0)], [lane], PAGE, 8).blocked
    out = coalesce([q(1, [*SHARED, 1], rank=1), q(2, [*SHARED, 2], rank=0)], [], PAGE, 8)
    assert not out.blocked
    spent = PrefillingLane(9, page_hashes(SHARED, PAGE), 0, 20, can_lead=False)
    out = coalesce([q(1, [*SHARED, 1], can_lead=False), q(2, [*SHARED, 2])], [spent], PAGE, 8)
    assert not out.blocked and not out.leader_checkpoints  # q2 leads nobody: nobody follows it


def test_routing_prefers_the_worker_holding_the_prefix_unless_it_is_much_busier():
    assert route([(0, 0, 0.0), (1, 64, 0.5)], slack=1.0) == 1
    assert route([(0, 0, 0.0), (1, 64, 2.0)], slack=1.0) == 0
    assert route([(0, 0, 0.5), (1, 0, 0.0)], slack=1.0) == 1
    with pytest.raises(ValueError):
        route([], 1.0)


def test_eviction_target_between_watermarks():
    assert eviction_target(80, 100, 1024, 10**9, 0.9, 0.75) == 0
    assert eviction_target(95, 100, 1024, 10**9, 0.9, 0.75) == 20 * 1024
    assert eviction_target(95, 100, 1024, 3000, 0.9, 0.75) == 3000  # only what is evictable
    assert eviction_target(95, 100, 1024, 0, 0.9, 0.75) == 0
    assert eviction_target(5, 0, 1024, 10, 0.9, 0.75) == 0


def test_best_candidate_is_the_longest_untainted_page_multiple_all_spaces_offer():
    m = MatchResult(
        spaces=[
            SpaceMatch(
                space_id=0,
                candidates=[
                    MatchCandidate(prefix_len=48, taint_bits=1),
                    MatchCandidate(prefix_len=32),
                    MatchCandidate(prefix_len=16),
                ],
            )
        ]
    )
    assert best_candidate(m, 100, 16) == 32
    assert best_candidate(m, 20, 16) == 16
    assert best_candidate(MatchResult(), 100, 16) == 0
    two = MatchResult(
        spaces=[m.spaces[0], SpaceMatch(space_id=1, candidates=[MatchCandidate(prefix_len=16)])]
    )
    assert best_candidate(two, 100, 16) == 16


def test_a_decoding_lane_is_paused_only_for_a_follower_of_its_own_class():
    decoding = PrefillingLane(9, page_hashes(SHARED, PAGE), prefilled=20, prefill_end=20, rank=0)
    assert not coalesce([q(1, [*SHARED, 1], rank=1)], [decoding], PAGE, 8).blocked
    assert coalesce([q(1, [*SHARED, 1], rank=0)], [decoding], PAGE, 8).blocked == {1}
    prefilling = PrefillingLane(9, page_hashes([*SHARED, 5, 5], PAGE), prefilled=4, prefill_end=22, rank=0)
    assert coalesce([q(1, [*SHARED, 1], rank=1)], [prefilling], PAGE, 8).blocked == {1}


def test_a_lane_retiring_with_publish_leads_every_class_for_one_plan():
    retiring = PrefillingLane(9, page_hashes(SHARED, PAGE), 20, 20, can_lead=True, rank=2, retiring=True)
    out = coalesce([q(1, [*SHARED, 1], rank=0)], [retiring], PAGE, 8)
    assert out.blocked == {1}


def test_cutting_an_entry_to_a_held_one_never_makes_that_one_look_older():
    idx = PrefixIndex(PAGE)
    a = list(range(12))
    ha = page_hashes(a, PAGE)
    held = idx.insert(np.array(a[:8]), ha[:2], now=9.0)
    idx.insert(np.array(a), ha, now=1.5)
    assert idx.prune(ha, 2) == 1 and list(idx.entries.values()) == [held] and held.last_used == 9.0
