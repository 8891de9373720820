"""RULES.md section G, the prefix cache: rules 87-91."""

from __future__ import annotations

import pytest
from gkit import PAGED, U64_MAX, blob, candidates, publish
from lanekit import ALL_EVICTABLE, R

from basertd.native.abi import AbiError
from basertd.schema.abi import DeterminismClass, Status
from basertd.schema.tick import ShedPolicy

BEST = DeterminismClass.BEST_EFFORT
ENTRY = 2 * 16 * 64  # bytes of a 32-token entry (two blocks of 16 tokens, 64 bytes per token)


# ABI rule 87
def test_rule_087_space_match_pins_nothing(rig):
    tokens = list(range(100, 140))
    publish(rig, 1, tokens)
    span = rig.put(tokens)
    assert candidates(rig, span) == [32]
    assert rig.bundle.cache_evict(ALL_EVICTABLE, 2**40) == ENTRY
    assert candidates(rig, span) == []


# ABI rule 88
def test_rule_088_candidates_at_blocks_and_boundaries(make_rig):
    rig = make_rig(spaces=[PAGED, blob(interval=12)])
    tokens = list(range(100, 140))  # 40 tokens: KV blocks to 32, blob boundaries 12, 24, 36
    publish(rig, 1, tokens)
    same = rig.put(tokens)
    assert candidates(rig, same, 0) == [32]
    assert candidates(rig, same, 1) == [36]
    diverging = rig.put([*tokens[:30], 7, 7, 7, 7])  # agrees on 30 tokens
    assert candidates(rig, diverging, 0) == [16]
    assert candidates(rig, diverging, 1) == [24]
    spaces = rig.bundle.space_match(0xFFFFFFFF, diverging).spaces
    assert [s.space_id for s in spaces] == [0, 1]
    for space in spaces:
        for c in space.candidates:
            assert c.prefix_len % 16 == 0 if space.space_id == 0 else c.prefix_len in (12, 24, 36)


def _three_entries(rig):
    """Three 32-token entries (oldest first) and a seed pinning the newest; returns the seed."""
    for i in range(3):
        publish(rig, 1 + i, range(100 + 40 * i, 132 + 40 * i))
    return rig.bundle.seed_acquire(rig.put(range(180, 212)), 32, BEST)


@pytest.mark.parametrize(
    ("case", "target", "policy", "freed"),
    [
        ("pinned stays", 2**40, dict(), 2 * ENTRY),
        ("target caps", ENTRY + ENTRY // 2, dict(), ENTRY),
        ("target below an entry", ENTRY - 1, dict(), 0),
        ("max_evict caps", 2**40, dict(max_evict_bytes=ENTRY), ENTRY),
        ("protected quota", 2**40, dict(protected_quota_bytes=2 * ENTRY), ENTRY),
        ("other classes only", 2**40, dict(evictable_cache_classes=0b110), 0),
    ],
)
# ABI rule 89
def test_rule_089_cache_evict_stays_inside_the_envelope(rig, case, target, policy, freed):
    seed = _three_entries(rig)
    env = dict(evictable_cache_classes=U64_MAX, max_evict_bytes=U64_MAX, protected_quota_bytes=0)
    env.update(policy)
    assert rig.bundle.cache_evict(ShedPolicy(**env), target) == freed
    # The pinned (newest) entry is always still there; the oldest ones went first.
    assert candidates(rig, rig.put(range(180, 212))) == [32]
    if freed:
        assert candidates(rig, rig.put(range(100, 132))) == []
    rig.bundle.seed_release(seed)


@pytest.mark.parametrize("when", ["separate ticks", "one tick"])
# ABI rule 90
def test_rule_090_identical_publish_is_stored_once(rig, when):
    tokens = list(range(100, 132))
    rig.start(1, tokens)
    rig.start(2, tokens)
    if when == "one tick":
        rig.tick(retires=[R(1, publish=True), R(2, publish=True)])
    else:
        rig.tick(retires=[R(1, publish=True)])
        rig.tick(retires=[R(2, publish=True)])
    assert candidates(rig, rig.put(tokens)) == [32]
    stats = rig.ref.stats()
    assert (stats["cache_entries"], stats["cache_bytes"], stats["pool_bytes_used"]) == (1, ENTRY, ENTRY)
    assert rig.bundle.cache_evict(ALL_EVICTABLE, 2**40) == ENTRY
    assert rig.ref.stats()["pool_bytes_used"] == 0  # no block was stranded


def _bare(rig, prompt, decode):
    events = rig.start(1, prompt, decode=decode)
    history = prompt + rig.emitted(events, 1)
    return rig.bundle.seq_fork(rig.bundle.lane_sequence(1)), history


# ABI rule 91
def test_rule_091_sequence_publish_consumes_on_ok(rig):
    seq, history = _bare(rig, list(range(100, 130)), 4)  # 34 tokens
    raw = rig.bundle.sequence_pointer(seq)
    rig.bundle.sequence_publish(seq, history)
    assert candidates(rig, rig.put(history)) == [32]
    # Consumed: the handle is gone.
    assert rig.bundle.lib.baseRT_tick_sequence_free(rig.bundle.handle, raw) == Status.ERR_UNKNOWN_HANDLE


# ABI rule 91
def test_rule_091_sub_block_tail_publishes_nothing(rig):
    seq, history = _bare(rig, list(range(100, 108)), 2)  # 10 tokens: no whole block
    raw = rig.bundle.sequence_pointer(seq)
    rig.bundle.sequence_publish(seq, history)
    assert candidates(rig, rig.put(history)) == []
    assert rig.bundle.lib.baseRT_tick_sequence_free(rig.bundle.handle, raw) == Status.ERR_UNKNOWN_HANDLE


# ABI rule 91
def test_rule_091_failed_publish_leaves_the_sequence(rig):
    seq, history = _bare(rig, list(range(100, 130)), 4)
    with pytest.raises(AbiError):
        rig.bundle.sequence_publish(seq, [*history, 1, 2])  # more tokens than it holds
    assert candidates(rig, rig.put(history)) == []
    rig.bundle.sequence_publish(seq, history)  # still there, still publishable
    assert candidates(rig, rig.put(history)) == [32]
