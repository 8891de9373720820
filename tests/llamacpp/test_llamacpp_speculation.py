"""Prompt-lookup speculation on the llama.cpp engine (``speculation``, ``strategies``; tick ABI §2,
rules 36, 37, 114-122, ``LaneDecode.overshoot``, ``SpecStats``).

Greedy verification must commit exactly the tokens a non-speculative greedy run commits, up to
near-ties the batch shape may flip (the margin rule of test_llamacpp_exact). The tiny random model
rarely repeats itself, so most tests draft with an oracle (``Speculator.override``): the
reference continuation, whole or with its last draft token wrong, so every round accepts some
drafts and rejects others; the KV ledger must then hold exactly the committed tokens' cells.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from lc_harness import BareLlama, admit, first_divergence, generate, ignore_eos, make_prompt

from basertd.native.abi import StrategyRegistration
from basertd.schema.abi import AdmitStatus, CertDomain, CertMode, Exactness, Sampling, Status
from basertd.schema.tick import LaneDecode, LanePrefill, LaneRetire, SamplingParams
from basertd.worker.engines.base import EngineError, PlanRejected
from basertd.worker.engines.llamacpp.speculation import LaneSpec, lookup, pays
from basertd.worker.engines.lookup import LookupConfig, lookup_registration

MARGIN_TOL = 1e-3
CERT_UNMATCHED_BITS = int(Status.REJECT_CERT_UNMATCHED) & 0xFFFFFFFF


def references(bare: BareLlama, prompts: dict[int, list[int]], n_new: int) -> dict[int, tuple[list, list]]:
    """Solo greedy tokens and top-2 margins of each prompt (the uninterrupted reference)."""
    import llama_cpp as L

    out = {}
    for tag, p in prompts.items():
        toks, margins = bare.greedy([p], n_new)
        out[tag] = (toks[0], margins[0])
        L.llama_memory_clear(L.llama_get_memory(bare.ctx), True)
    return out


def register(eng, **cfg) -> int:
    """Register prompt-lookup with ``cfg``: the greedy and the sampled certificate, in that order."""
    grant = eng.strategy_register(lookup_registration(LookupConfig(**cfg)))
    greedy, sampled = grant.certificates
    assert (greedy.sampling_modes, greedy.param_domain) == (
        CertMode.GREEDY | CertMode.GUMBEL,
        CertDomain.GREEDY_ONLY,
    )
    assert (sampled.sampling_modes, sampled.param_domain) == (CertMode.GUMBEL, CertDomain.ANY)
    assert greedy.exactness == sampled.exactness == Exactness.DISTRIBUTION_EXACT
    return grant.strategy_slot


def oracle(eng, refs: dict[int, list[int]], prompt_len: dict[int, int], wrong_last: set[int] = frozenset()):
    """Draft the reference continuation; for lanes in ``wrong_last`` the last draft is wrong."""

    def drafts(lane, k):
        g = lane.n_tokens - prompt_len[lane.tag]
        d = np.array(refs[lane.tag][g : g + k], np.int32)
        if lane.tag in wrong_last and d.size >= 2:
            d[-1] = (d[-1] + 1) % eng.n_vocab
        return d

    eng.rounds.speculator.override = drafts


def check_ledger(eng) -> None:
    """Every live lane holds the KV of its committed tokens but the last, in llama.cpp and the
    ledger alike: rejected drafts left no cell behind."""
    for lane in eng.lanes.values():
        if lane.finished:
            continue
        assert lane.kv_len == lane.produced - 1 == lane.n_tokens - 1
        assert eng.ledger.length(lane.seq) == lane.kv_len
        assert eng.cells.pos_range(lane.seq) == (0, lane.kv_len - 1)


def run(coord, prompts, n_new, *, per_tick, admit_kw, eng=None, overshoot=0):
    """Like lc_harness.generate, checking the ledger after every tick and collecting SpecStats;
    returns (tokens per lane, (drafted, accepted) per lane, tokens per emit)."""
    out = {t: [] for t in prompts}
    stats = {t: [0, 0] for t in prompts}
    per_emit = []
    admits = [admit(t, coord.prompt(p), **admit_kw.get(t, {})) for t, p in prompts.items()]
    prefills = [LanePrefill(lane_tag=t, token_offset=0, token_count=len(p)) for t, p in prompts.items()]
    live = set(prompts)
    first = True
    while live:
        decodes = [
            LaneDecode(
                lane_tag=t,
                max_new_tokens=min(per_tick, n_new - len(out[t])),
                overshoot=min(overshoot, max(0, n_new - len(out[t]) - per_tick)),
            )
            for t in sorted(live)
        ]
        ev = coord.tick(admits=admits if first else [], prefills=prefills if first else [], decodes=decodes)
        first = False
        for e in ev.emits:
            got = coord.read(e.token_ref) if e.n_tokens else []
            out[e.lane_tag] += got
            per_emit.append((e.lane_tag, len(got), e.spec))
            stats[e.lane_tag][0] += e.spec.proposed
            stats[e.lane_tag][1] += e.spec.accepted
            if e.finish or len(out[e.lane_tag]) >= n_new:
                live.discard(e.lane_tag)
        if eng is not None:
            check_ledger(eng)
    coord.tick(retires=[LaneRetire(lane_tag=t) for t in prompts])
    return out, stats, per_emit


# --------------------------------------------------------------------------- the drafter


def test_lookup_takes_the_most_recent_longest_match():
    t = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3], np.int32)
    # suffix (2, 3): most recent earlier occurrence starts at 5 -> continuation 5, 6, 7, 2
    assert lookup(t, len(t), 4, 1, 3).tolist() == [5, 6, 7, 2]
    # a 3-gram (7, 2, 3) occurs nowhere earlier; with ngram_min 3 there is no draft
    assert lookup(t, len(t), 4, 3, 3).tolist() == []
    # the continuation stops at the lane's end
    assert lookup(t, len(t), 40, 1, 2).tolist() == [5, 6, 7, 2, 3]
    assert lookup(np.array([5, 6, 5], np.int32), 3, 2, 1, 3).tolist() == [6, 5]
    assert lookup(t, 1, 4, 1, 3).tolist() == [] and lookup(t, len(t), 0, 1, 3).tolist() == []


def test_lookup_config_round_trips_and_checks_bounds():
    cfg = LookupConfig(draft_min=2, draft_max=5, ngram_min=2, ngram_max=4, max_batch_lanes=3)
    assert LookupConfig.from_params(cfg.params()) == cfg
    assert cfg.config_hash() != LookupConfig().config_hash()
    for bad in (
        dict(draft_min=0),
        dict(draft_min=9, draft_max=8),
        dict(ngram_max=17),
        dict(max_batch_lanes=0),
    ):
        with pytest.raises(ValueError):
            LookupConfig(**bad)


# --------------------------------------------------------------------------- greedy exactness


@pytest.mark.parametrize("per_tick", [1, 8])
def test_greedy_speculation_commits_the_reference_tokens(lc, bare, per_tick):
    """Four lanes batched, drafts right or with their last token wrong: every lane's tokens are the
    solo reference's up to a near-tie, drafts are accepted and rejected, the ledger stays exact."""
    eng, coord = lc
    slot = register(eng, max_batch_lanes=8)
    prompts = {t: make_prompt(70 + t, 5 + 3 * t) for t in range(1, 5)}
    refs = references(bare, prompts, 40)
    oracle(
        eng, {t: r[0] for t, r in refs.items()}, {t: len(p) for t, p in prompts.items()}, wrong_last={2, 4}
    )
    kw = {t: dict(params=ignore_eos(), strategy_slot=slot) for t in prompts}
    got, stats, per_emit = run(coord, prompts, 40, per_tick=per_tick, admit_kw=kw, eng=eng)
    for t in prompts:
        assert len(got[t]) == 40
        first_divergence(got[t], *refs[t], MARGIN_TOL)
    if per_tick > 1:  # a grant of one token leaves no room to draft
        assert all(d > 0 and 0 < a <= d for d, a in stats.values())
        assert stats[1][1] > stats[2][1]  # the lane whose last draft is always wrong accepts less
        # a round commits at most the grant without overshoot
        assert all(n <= per_tick for _, n, _ in per_emit)
    else:
        assert all(d == 0 for d, _ in stats.values())
    assert {s.cert_id_in_effect for _, _, s in per_emit} == {1}
    s = eng.stats()
    assert s["spec_accepted_total"] == sum(a for _, a in stats.values())
    assert s["spec_drafted_total"] == sum(d for d, _ in stats.values())


def test_overshoot_lets_a_round_commit_past_the_grant(lc, bare):
    """With overshoot, a round that starts inside the grant may commit drafts past it; the total
    stays exact and no emit exceeds grant + overshoot."""
    eng, coord = lc
    slot = register(eng)
    prompts = {1: make_prompt(91, 11)}
    refs = references(bare, prompts, 48)
    oracle(eng, {1: refs[1][0]}, {1: 11})
    kw = {1: dict(params=ignore_eos(), strategy_slot=slot)}
    got, _, per_emit = run(coord, prompts, 48, per_tick=4, admit_kw=kw, eng=eng, overshoot=8)
    first_divergence(got[1], *refs[1], MARGIN_TOL)
    assert len(got[1]) == 48
    assert all(n <= 12 for _, n, _ in per_emit)
    assert any(n > 4 for _, n, _ in per_emit)


def test_partial_emits_carry_the_drafts_so_far_this_tick(lc, bare):
    """Before each partial emit the engine tells the callback's ``spec`` the lane's drafts proposed
    and accepted so far this tick (cumulative, never decreasing); the last counts equal the tick's
    SpecStats: what a request that ends on a partial emit reports in its usage."""
    eng, coord = lc
    slot = register(eng)
    prompts = {1: make_prompt(93, 11)}
    refs = references(bare, prompts, 24)
    oracle(eng, {1: refs[1][0]}, {1: 11}, wrong_last={1})
    seen: list[tuple[list[int], int, int]] = []
    so_far = [(0, 0)]

    class OnPartial:  # a partial-emit callback with the optional ``spec`` (``base.PartialEmit``)
        def __call__(self, tag, toks):
            seen.append((toks.tolist(), *so_far[-1]))

        def spec(self, tag, proposed, accepted):
            so_far.append((proposed, accepted))

    ev = coord.tick(
        on_partial_emit=OnPartial(),
        admits=[admit(1, coord.prompt(prompts[1]), params=ignore_eos(), strategy_slot=slot)],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=11)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=24)],
    )
    (e,) = ev.emits
    assert [t for toks, _, _ in seen for t in toks] == coord.read(e.token_ref)
    counts = [(p, a) for _, p, a in seen]
    assert counts == sorted(counts) and all(a <= p for p, a in counts)
    assert counts[-1] == (e.spec.proposed, e.spec.accepted) and e.spec.proposed > 0
    assert len({c for c in counts}) > 1  # the counts grew round by round, not only at the end
    coord.tick(retires=[LaneRetire(lane_tag=1)])


def test_wrong_drafts_cost_nothing_but_rows(lc, bare):
    """Drafts that are always wrong: no draft accepted, one token per round, tokens exact, no cell
    leaked (the ledger check after every tick)."""
    eng, coord = lc
    slot = register(eng, min_accept_permille=0)
    prompts = {1: make_prompt(5, 9), 2: make_prompt(6, 14)}
    refs = references(bare, prompts, 24)
    eng.rounds.speculator.override = lambda lane, k: (
        (np.array(refs[lane.tag][0][lane.n_tokens - len(prompts[lane.tag]) :][:k], np.int32) + 1)
        % eng.n_vocab
    )
    kw = {t: dict(params=ignore_eos(), strategy_slot=slot) for t in prompts}
    got, stats, _ = run(coord, prompts, 24, per_tick=6, admit_kw=kw, eng=eng)
    for t in prompts:
        first_divergence(got[t], *refs[t], MARGIN_TOL)
        assert stats[t][0] > 0 and stats[t][1] == 0


def test_acceptance_that_does_not_pay_pauses_the_lane(lc):
    """A lane whose drafts are always rejected stops drafting for a while (``LaneSpec.note``)."""
    eng, coord = lc
    slot = register(eng, min_accept_permille=500)
    eng.rounds.speculator.override = lambda lane, k: np.full(k, 7, np.int32)
    prompts = {1: make_prompt(8, 10)}
    _, stats, _ = run(
        coord, prompts, 64, per_tick=16, admit_kw={1: dict(params=ignore_eos(), strategy_slot=slot)}
    )
    rounds = eng.stats()["spec_rounds_total"]
    assert 0 < rounds < 63 - 32  # paused for PAUSE_ROUNDS after the first few failed rounds
    assert stats[1][1] <= 2


def test_penalties_logprobs_and_bias_stay_exact(lc):
    """A temperature-0 GUMBEL lane with repetition and frequency penalties, logprobs and a logit
    bias: the speculative run (drafts from the plain run) commits the plain run's tokens and
    logprobs up to near-ties."""
    eng, coord = lc
    slot = register(eng)
    bias = eng.logit_bias_create([17, 40], [2.5, -1.0])
    params = SamplingParams(temperature=0.0, repeat_penalty=1.3, freq_penalty=0.4, flags=ignore_eos().flags)
    base = dict(sampling=Sampling.GPU_GUMBEL, params=params, logit_bias_handle=bias, want_logprobs=3)
    prompts = {1: make_prompt(12, 13)}
    plain = generate(coord, prompts, 32, per_tick=8, admit_kw={1: base})
    eng.rounds.speculator.override = lambda lane, k: np.array(plain[1][lane.n_tokens - 13 :][:k], np.int32)
    got, stats, _ = run(coord, {2: prompts[1]}, 32, per_tick=8, admit_kw={2: {**base, "strategy_slot": slot}})
    assert got[2] == plain[1]  # same engine, same grants: the plain run's rounds as reference
    assert stats[2][1] > 0


def test_a_resumed_speculative_lane_continues_exactly(lc, bare):
    """Preemption: 20 tokens, retire, re-admit prompt + those tokens with decode_replay = 20 on
    the slot: the continuation is the uninterrupted reference's (replay units never draft)."""
    eng, coord = lc
    slot = register(eng)
    p = make_prompt(33, 12)
    refs = references(bare, {1: p}, 40)
    ref = refs[1][0]
    oracle(eng, {1: ref, 2: ref}, {1: 12, 2: 12})
    kw = dict(params=ignore_eos(), strategy_slot=slot)
    first, _, _ = run(coord, {1: p}, 20, per_tick=8, admit_kw={1: kw}, eng=eng)
    first_divergence(first[1], *refs[1], MARGIN_TOL)
    ev = coord.tick(
        admits=[admit(2, coord.prompt(p + first[1]), decode_replay=20, **kw)],
        prefills=[LanePrefill(lane_tag=2, token_offset=0, token_count=12)],
        decodes=[LaneDecode(lane_tag=2, max_new_tokens=20)],
    )
    assert coord.emitted(ev, 2) == [] and ev.emits[0].spec.proposed == 0  # the replay tail: ABI rule 72
    rest, drafted, accepted = [], 0, 0
    while len(rest) < 20:
        ev = coord.tick(decodes=[LaneDecode(lane_tag=2, max_new_tokens=min(8, 20 - len(rest)))])
        rest += coord.emitted(ev, 2)
        drafted += ev.emits[0].spec.proposed
        accepted += ev.emits[0].spec.accepted
        check_ledger(eng)
    first_divergence(first[1] + rest, *refs[1], MARGIN_TOL)
    assert len(rest) == 20 and accepted > 0


# --------------------------------------------------------------------------- registration, admission


def test_certificates_only_for_the_tested_combination(lc):
    eng, _ = lc
    assert eng.strategy_register(StrategyRegistration("prompt-lookup")).certificates == []  # no impl hash
    reg = lookup_registration(LookupConfig())
    other = StrategyRegistration(
        "prompt-lookup",
        impl_version=reg.impl_version,
        impl_hash=reg.impl_hash,
        config_hash=LookupConfig(draft_max=4).config_hash(),  # not the config it carries
        capabilities=reg.capabilities,
    )
    assert eng.strategy_register(other).certificates == []
    g1, g2 = eng.strategy_register(reg), eng.strategy_register(reg)
    assert g1.strategy_slot != g2.strategy_slot and g1.certificates[0].cert_id != g2.certificates[0].cert_id
    with pytest.raises(EngineError) as info:
        eng.strategy_register(
            StrategyRegistration("prompt-lookup", capabilities=[reg.capabilities[0].__class__(1, b"x", 1)])
        )
    assert info.value.status == Status.ERR_REGISTRATION_REFUSED


def test_admission_grants_greedy_lanes_one_certificate_and_sampled_lanes_the_other(lc):
    """Greedy and temperature-0 lanes get the greedy certificate (1), sampled lanes, with or
    without penalties, the sampled one (2); a sampled lane that requires the greedy certificate,
    a grammar lane or a floor above the certificates' class is REJECTED (CERT_UNMATCHED); on a
    slot without certificates a lane that allows approximation is APPROXIMATE and decodes without
    drafting; a HOST lane on a strategy without HOST_COMPATIBLE is HOST_RULES; an unregistered slot
    is refused."""
    eng, coord = lc
    slot = register(eng)
    bare_slot = eng.strategy_register(StrategyRegistration("prompt-lookup")).strategy_slot  # no impl hash
    eng.rounds.speculator.override = lambda lane, k: np.full(k, 3, np.int32)
    p = coord.prompt(make_prompt(2, 8))
    sampled = SamplingParams(temperature=0.8, flags=ignore_eos().flags)
    penalised = SamplingParams(
        temperature=0.8, repeat_penalty=1.2, freq_penalty=0.5, flags=ignore_eos().flags
    )
    grammar = eng.grammar_create('{"type": "object"}')
    gumbel = Sampling.GPU_GUMBEL
    admits = [
        admit(1, p, strategy_slot=slot, params=ignore_eos()),
        admit(2, p, strategy_slot=slot, sampling=gumbel, params=SamplingParams(temperature=0.0)),
        admit(3, p, strategy_slot=slot, sampling=gumbel, params=sampled),
        admit(4, p, strategy_slot=bare_slot, sampling=gumbel, params=sampled, allow_approximate=1),
        admit(5, p, strategy_slot=slot, grammar_handle=grammar),
        admit(6, p, strategy_slot=slot, minimum_exactness=Exactness.SEED_PATH_INVARIANT),
        admit(7, p, strategy_slot=slot, sampling=gumbel, params=penalised),
        admit(
            8, p, strategy_slot=slot, sampling=gumbel, params=sampled, required_cert_id=1
        ),  # rules 119, 120
    ]
    ev = coord.tick(admits=admits)
    res = {r.lane_tag: r for r in ev.admit_results}
    for tag, cert in ((1, 1), (2, 1), (3, 2), (7, 2)):
        assert (res[tag].status, res[tag].cert_id, res[tag].granted_class) == (
            AdmitStatus.ADMITTED,
            cert,
            Exactness.DISTRIBUTION_EXACT,
        )
    for tag in (5, 6, 8):
        assert (res[tag].status, res[tag].reject_code) == (AdmitStatus.REJECTED, CERT_UNMATCHED_BITS)
    assert (res[4].status, res[4].cert_id, res[4].granted_class) == (
        AdmitStatus.ADMITTED,
        0,
        Exactness.APPROXIMATE,
    )
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=4, token_offset=0, token_count=8)],
        decodes=[LaneDecode(lane_tag=4, max_new_tokens=6)],
    )
    (e,) = ev.emits
    assert e.n_tokens == 6 and e.spec.proposed == 0 and e.spec.cert_id_in_effect == 0
    for bad, status in (
        (admit(9, p, strategy_slot=slot + 5), Status.REJECT_ILLEGAL_COMBINATION),
        (
            admit(10, p, strategy_slot=slot, sampling=Sampling.HOST, allow_approximate=1),
            Status.REJECT_HOST_RULES,
        ),
    ):
        with pytest.raises(PlanRejected) as info:
            coord.tick(admits=[bad])
        assert info.value.status == status


# --------------------------------------------------------------------------- sampled verification

LIKELY = (40, 41)  # token ids a logit bias makes the tiny model's likely choices (with 7, 250)
N_SEEDS = 320  # seeds per side of each comparison
N_NEW = 6  # tokens per lane: the first comes from the prefill, the rest from speculative rounds


def sampled_runs(coord, prompt, seeds, params, slot, bias):
    """Each RNG seed in ``seeds`` as one sampled lane (8 lanes a batch, a grant of N_NEW in one
    tick): returns ({seed: tokens}, drafted, accepted)."""
    out, drafted, accepted = {}, 0, 0
    ref = coord.prompt(prompt)
    for i in range(0, len(seeds), 8):
        group = dict(enumerate(seeds[i : i + 8], start=1))
        kw = dict(sampling=Sampling.GPU_GUMBEL, params=params, strategy_slot=slot, logit_bias_handle=bias)
        admits = [admit(t, ref, rng_counter_base=s << 32, **kw) for t, s in group.items()]
        prefills = [LanePrefill(lane_tag=t, token_offset=0, token_count=len(prompt)) for t in group]
        ev = coord.tick(
            admits=admits,
            prefills=prefills,
            decodes=[LaneDecode(lane_tag=t, max_new_tokens=N_NEW) for t in group],
        )
        got = coord.tokens_of(ev)
        for e in ev.emits:
            drafted += e.spec.proposed
            accepted += e.spec.accepted
        coord.tick(retires=[LaneRetire(lane_tag=t) for t in group])
        out.update({s: got[t] for t, s in group.items()})
    assert all(len(t) == N_NEW for t in out.values())
    return out, drafted, accepted


def chi2_same_law(a: list[int], b: list[int]) -> tuple[float, float]:
    """Two-sample chi-square statistic of the token counts ``a`` and ``b`` (equal sizes; tokens
    rarer than 5 in both pooled into one cell) and its critical value at alpha = 0.001
    (Wilson-Hilferty's approximation of the chi-square quantile)."""
    ca, cb = Counter(a), Counter(b)
    cells = [t for t in ca.keys() | cb.keys() if ca[t] + cb[t] >= 10]
    rare = [t for t in ca.keys() | cb.keys() if t not in cells]
    pairs = [(ca[t], cb[t]) for t in cells] + [(sum(ca[t] for t in rare), sum(cb[t] for t in rare))]
    pairs = [(x, y) for x, y in pairs if x + y]
    stat = sum((x - y) ** 2 / (x + y) for x, y in pairs)
    df = max(1, len(pairs) - 1)
    z = 3.0902  # the standard normal's 0.999 quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def same_law_on_and_off(coord, prompt, params, slot, bias) -> tuple[int, int, int, int]:
    """Sampled runs of ``prompt`` over N_SEEDS seeds on ``slot`` and over N_SEEDS other seeds with
    speculation off: the token at each of the N_NEW positions must have the same histogram
    (``chi2_same_law``), and the speculative run's seeds rerun off must give the same tokens for
    at least 90 % of them (a check the test can fail: accepting every draft gives another law than
    the plain sampler). Returns (drafted, accepted, drafted with speculation off, same seeds)."""
    on, drafted, accepted = sampled_runs(coord, prompt, list(range(N_SEEDS)), params, slot, bias)
    off, d_off, _ = sampled_runs(coord, prompt, list(range(N_SEEDS, 2 * N_SEEDS)), params, 0, bias)
    same_seeds, _, _ = sampled_runs(coord, prompt, list(range(N_SEEDS)), params, 0, bias)
    for pos in range(N_NEW):
        a = [t[pos] for t in on.values()]
        b = [t[pos] for t in off.values()]
        stat, crit = chi2_same_law(a, b)
        assert stat < crit, (pos, stat, crit, Counter(a).most_common(8), Counter(b).most_common(8))
    same = sum(on[s] == same_seeds[s] for s in on)
    assert same >= 0.9 * N_SEEDS
    return drafted, accepted, d_off, same


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_k=6, top_p=0.97, min_p=0.02),
        dict(temperature=0.8, top_k=12, repeat_penalty=1.15, freq_penalty=0.3, presence_penalty=0.2),
    ],
    ids=["truncated", "penalised"],
)
def test_sampled_speculation_keeps_the_sampling_distribution(lc, params):
    """The rejection rule (``speculation``): over fixed RNG seeds, the token at each of the first
    N_NEW positions has the same histogram with speculation on (seeds 0..N-1) and off (seeds
    N..2N-1, independent draws), by a two-sample chi-square test at alpha 0.001 (deterministic:
    the seeds are fixed). A logit bias makes five tokens likely and the prompt is made of them, so
    prompt lookup drafts at every round and many drafts are accepted, many rejected. The same
    seeds with speculation off give the same tokens for nearly every seed (one uniform per
    position decides acceptance and the draw alike; only the verification batch's last bits
    differ)."""
    eng, coord = lc
    slot = register(eng, ngram_min=1, max_batch_lanes=8, min_accept_permille=0)
    bias = eng.logit_bias_create(list(LIKELY), [8.0, 12.0])
    rng = np.random.default_rng(5)
    prompt = [1, *rng.choice(LIKELY, 40, p=[0.6, 0.4]).tolist()]
    sp = ignore_eos(**params)
    drafted, accepted, d_off, same = same_law_on_and_off(coord, prompt, sp, slot, bias)
    assert d_off == 0
    # the speculative run really verified drafts, accepting some and rejecting others
    assert drafted >= N_SEEDS and N_SEEDS // 8 <= accepted < 0.9 * drafted, (drafted, accepted)
    print(f"sampled acceptance {accepted}/{drafted} = {accepted / drafted:.3f}, same tokens {same}/{N_SEEDS}")


# --------------------------------------------------------------------------- strategy faults


@pytest.mark.parametrize(
    "bad",
    [[5, 293], [-1, 4], [2**32 + 5], [[5, 6]], [0.5, 1.0]],
    ids=["past-vocab", "negative", "wraps-in-int32", "two-rows", "floats"],
)
def test_a_draft_outside_the_vocabulary_is_a_strategy_fault_and_the_lane_goes_on(lc, bad):
    """A drafter proposing what the engine cannot verify (``speculation.StrategyFault``,
    FaultCode.STRATEGY): the draft is discarded and counted, the lane's speculation is turned off
    (no more drafts asked for, ``cert_id_in_effect`` 0), no lane fault stops it (ABI rules 60-62),
    and its tokens, greedy and sampled, are those of a plain run."""
    eng, coord = lc
    slot = register(eng)
    prompts = {1: make_prompt(44, 12), 2: make_prompt(45, 15)}
    sampled = dict(
        sampling=Sampling.GPU_GUMBEL, params=ignore_eos(temperature=0.9, top_k=20), rng_counter_base=7 << 32
    )
    kw = {1: dict(params=ignore_eos()), 2: sampled}
    plain = generate(coord, prompts, 24, per_tick=8, admit_kw=kw)
    asked: list[int] = []

    def drafter(lane, k):
        asked.append(lane.tag)
        return np.array(bad)

    eng.rounds.speculator.override = drafter
    spec_kw = {t: {**a, "strategy_slot": slot} for t, a in kw.items()}
    got, stats, per_emit = run(coord, prompts, 24, per_tick=8, admit_kw=spec_kw, eng=eng)
    assert got == plain
    assert sorted(asked) == [1, 2]  # asked once per lane, never again
    assert stats == {1: [0, 0], 2: [0, 0]}
    assert {s.cert_id_in_effect for _, _, s in per_emit} == {0}
    s = eng.stats()
    assert (s["spec_faults_total"], s["faults_total"], s["spec_rounds_total"]) == (2, 0, 0)


def test_drafts_that_do_not_pay_for_their_verification_pause_the_lane():
    """``pays``: a draft row costs part of a decode step, so below some conditional acceptance no
    draft length pays; a lane at that acceptance pauses (its share of accepted drafts, 20 %, is
    above ``min_accept_permille``), one at a copy run's keeps doubling, and ``min_accept_permille``
    0 never pauses."""
    assert not pays(0.5, 64) and not pays(0.6, 64)  # 1.6 tokens for 1.645 steps at best
    assert pays(0.65, 1) and pays(0.8, 64) and pays(0.99, 2)
    weak = LaneSpec(LookupConfig(min_accept_permille=150), 1)
    rounds = 0
    while not weak.pause:
        weak.note(5, 1)  # each round: 1 of 5 accepted, then a rejection
        rounds += 1
        assert rounds <= 4 and weak.k == 1 and weak.risk_seen == 0.0
    copy = LaneSpec(LookupConfig(draft_max=16), 1)
    for _ in range(6):
        copy.note(copy.k, copy.k)
    copy.note(16, 9)
    assert not copy.pause and copy.k == 10
    never = LaneSpec(LookupConfig(min_accept_permille=0), 1)
    for _ in range(20):
        never.note(never.k, 0)
    assert never.pause == 0
