"""RULES.md section F: replay and resume, rules 71-74.

A preempted lane comes back with its generated tokens appended to its prompt, decode_replay set
to their number and its RNG counter moved past them (rng_counter_base = original base + k); its
continuation must be the one the uninterrupted lane produced (rule 73).
"""

from __future__ import annotations

import pytest
from lanekit import D, P, R

from basertd.schema.abi import Sampling, Status

ILLEGAL = Status.REJECT_ILLEGAL_COMBINATION


@pytest.mark.parametrize("extra", [0, 1, 10])
# ABI rule 71
def test_rule_071_replay_as_long_as_the_prompt(rig, extra):
    prompt = list(range(20, 28))
    span = rig.put(prompt)
    bad = rig.admit(1, span, decode_replay=len(prompt) + extra)
    rig.rejects(Status.REJECT_BOUNDS, [bad])
    rig.tick([rig.admit(1, span, decode_replay=len(prompt) - 1)], prefills=[P(1, 0, 1)])


# ABI rule 72
def test_rule_072_decode_units_consume_the_replay_tail_first(rig):
    prompt = list(range(20, 30))  # the last 3 were generated before a preemption
    rig.tick([rig.admit(1, rig.put(prompt), decode_replay=3)], prefills=[P(1, 0, 7)])
    events = rig.tick(decodes=[D(1, 2)])
    assert rig.emit_of(events, 1).n_tokens == 0  # both units inside the tail
    events = rig.tick(decodes=[D(1, 1)])
    assert rig.emit_of(events, 1).n_tokens == 0  # the last replay token
    events = rig.tick(decodes=[D(1, 2)])
    assert rig.emit_of(events, 1).n_tokens == 2
    # A grant that crosses the end of the tail emits only what lies past it.
    rig.tick([rig.admit(2, rig.put(prompt), decode_replay=3)], prefills=[P(2, 0, 7)])
    crossing = rig.tick(decodes=[D(2, 5)])
    assert rig.emit_of(crossing, 2).n_tokens == 2
    assert rig.emitted(crossing, 2) == rig.emitted(events, 1)
    if rig.state() is not None:
        info = rig.ref.lane_info(2)
        assert (info.prefilled, info.committed, info.generated) == (10, 12, 2)


def _uninterrupted(rig, tag, prompt, n, **admit):
    events = rig.start(tag, prompt, decode=n, **admit)
    out = rig.emitted(events, tag)
    assert len(out) == n
    return out


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("sampling", [Sampling.GPU_GREEDY, Sampling.GPU_GUMBEL], ids=["greedy", "gumbel"])
# ABI rule 73
def test_rule_073_resumed_lane_continues_exactly(make_rig, sampling, k):
    rig = make_rig()
    prompt, n, base = list(range(60, 80)), 12, 4242
    admit = dict(sampling=sampling, temperature=0.7, rng_counter_base=base)
    full = _uninterrupted(rig, 1, prompt, n, **admit)
    rig.tick(retires=[R(1)])
    # Resume on the same bundle and on a fresh one.
    for where in (rig, make_rig()):
        resumed = prompt + full[:k]
        admit_r = dict(admit, rng_counter_base=base + k, decode_replay=k)
        where.tick([where.admit(2, where.put(resumed), **admit_r)], prefills=[P(2, 0, len(prompt))])
        events = where.tick(decodes=[D(2, n)])  # k units replay, n - k generate
        assert where.emitted(events, 2) == full[k:]
    # The counter matters for sampled lanes: a resume at the original base draws differently.
    if sampling == Sampling.GPU_GUMBEL:
        other = make_rig()
        bad = dict(admit, decode_replay=k)
        other.tick([other.admit(3, other.put(prompt + full[:k]), **bad)], prefills=[P(3, 0, len(prompt))])
        assert other.emitted(other.tick(decodes=[D(3, n)]), 3) != full[k:]


# ABI rule 73
def test_rule_073_resume_seeded_from_the_preempted_lanes_cache(rig):
    prompt, n = list(range(100, 130)), 10  # 30 tokens
    full = _uninterrupted(rig, 1, prompt, 6)  # history 36 tokens: 2 whole blocks published
    rig.tick(retires=[R(1, publish=True)])
    resumed = prompt + full
    span = rig.put(resumed)
    seed = rig.bundle.seed_acquire(span, 32, 0)  # covers 2 of the 6 generated tokens
    events = rig.tick([rig.admit(2, span, seed_handle=seed, decode_replay=6)], decodes=[D(2, 4 + n)])
    tail = rig.emitted(events, 2)
    assert len(tail) == n
    # The uninterrupted lane, decoded further, agrees.
    longer = _uninterrupted(rig, 3, prompt, 6 + n)
    assert tail == longer[6:]


@pytest.mark.parametrize("case", ["no grammar", "unknown grammar", "replay over prompt"])
# ABI rule 74
def test_rule_074_grammar_replay_needs_a_grammar_within_the_prompt(rig, case):
    grammar = rig.bundle.grammar_create('{"type": "object"}')
    assert grammar
    prompt = list(range(20, 28))
    span = rig.put(prompt)
    fields = {
        "no grammar": dict(grammar_handle=0, grammar_replay=2),
        "unknown grammar": dict(grammar_handle=grammar + 100, grammar_replay=2),
        "replay over prompt": dict(grammar_handle=grammar, grammar_replay=len(prompt) + 1),
    }[case]
    rig.rejects(ILLEGAL, [rig.admit(1, span, **fields)], prefills=[P(1, 0, 8)])
    ok = rig.admit(1, span, grammar_handle=grammar, grammar_replay=len(prompt))
    events = rig.tick([ok], prefills=[P(1, 0, 8)], decodes=[D(1, 1)])
    assert events.admit_results[0].status == 1
