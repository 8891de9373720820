"""Draft-model speculation on the llama.cpp engine (``draft_model``, ``strategies``; tick ABI §2,
rules 114-122): a second tiny GGUF with the same vocabulary drafts greedily, the engine's greedy
verification commits the target's own tokens, its sampled verification (the rejection rule) keeps
the sampling distribution.

Greedy tokens with draft-model speculation must be the solo reference's up to a near-tie (the
margin rule of test_llamacpp_exact); the target as its own draft must be accepted (almost) always;
a draft model of another seed and fewer layers is accepted rarely, and still exact. Sampled lanes
are admitted on the sampled certificate and keep the token histograms of plain sampling (prompt
lookup's statistical test, test_llamacpp_speculation). Registration
refuses a draft whose file does not load or whose vocabulary differs, registering nothing; a lane's
draft sequence is released when the lane leaves, so many requests in turn never run out.
"""

from __future__ import annotations

import llama_cpp as L
import numpy as np
import pytest
import tinymodel
from lc_harness import admit, first_divergence, ignore_eos, make_prompt
from test_llamacpp_speculation import (
    CERT_UNMATCHED_BITS,
    MARGIN_TOL,
    N_SEEDS,
    check_ledger,
    references,
    run,
    same_law_on_and_off,
)
from tinymodel import write_tiny_gguf

from basertd.native.abi import Artifact, StrategyRegistration
from basertd.schema.abi import AdmitStatus, ArtifactRole, CertDomain, CertMode, Exactness, Sampling, Status
from basertd.schema.tick import LaneDecode, LanePrefill, LaneRetire
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.draft import DRAFT_MODEL, DraftConfig, draft_registration


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """The target's seed with one layer instead of two: the tiny vocabulary, a weaker model that
    agrees with the target on about one draft in six."""
    path = tmp_path_factory.mktemp("draft") / "tiny-draft.gguf"
    return write_tiny_gguf(path, "llama", seed=0, n_layer=1)


def register_draft(eng, path, **cfg) -> int:
    """Register draft-model with ``cfg``: the greedy and the sampled certificate, in that order
    (prompt lookup's pair), both bound to the one loaded draft model."""
    grant = eng.strategy_register(draft_registration(DraftConfig(**cfg), path))
    greedy, sampled = grant.certificates
    assert (greedy.sampling_modes, greedy.param_domain) == (
        CertMode.GREEDY | CertMode.GUMBEL,
        CertDomain.GREEDY_ONLY,
    )
    assert (sampled.sampling_modes, sampled.param_domain) == (CertMode.GUMBEL, CertDomain.ANY)
    for cert in (greedy, sampled):
        assert cert.exactness == Exactness.DISTRIBUTION_EXACT and cert.grammar_allowed == 0
        assert cert.logit_bias_allowed == 1
    src = eng.drafts.sources
    assert src[greedy.cert_id] is src[sampled.cert_id]
    assert grant.reserved_bytes == path.stat().st_size  # rule 118: est_state_bytes, the weights
    return grant.strategy_slot


def check_drafts(eng, draft_max: int = 8) -> None:
    """Each live lane's draft sequence holds positions 0 .. n - 1 (nothing else) of a prefix of
    the lane's tokens followed by at most ``draft_max - 1`` drafts of its last round (those the
    target rejected are cut at its next round), none is held for a gone lane, and no draft decode
    failed (a failure drafts nothing and would hide a wrong position)."""
    assert eng.stats()["draft_failures_total"] == 0
    for d in set(eng.drafts.sources.values()):
        for tag, st in d.lanes.items():
            assert eng.lanes.get(tag) is st.lane
            assert L.llama_memory_seq_pos_min(d.mem, st.seq) == (0 if st.n else -1)
            assert L.llama_memory_seq_pos_max(d.mem, st.seq) == st.n - 1
            lane = st.lane
            k = min(st.n, lane.n_tokens)
            same = st.toks[:k] == lane.tokens[:k]
            common = k if same.all() else int(np.argmin(same))
            assert st.n - common <= draft_max - 1, (st.n, common)


def run_checked(eng, coord, prompts, n_new, **kw):
    """``run`` with the draft sequences checked after the whole generation."""
    got, stats, per_emit = run(coord, prompts, n_new, eng=eng, **kw)
    check_drafts(eng)
    return got, stats, per_emit


@pytest.mark.parametrize("lanes", [1, 4])
def test_target_as_its_own_draft_is_accepted_and_exact(lc, bare, tiny_gguf, lanes):
    """The target drafting for itself: its drafts are its own argmax chain, so (up to a near-tie
    flipped by the batch shape) every draft is accepted, and the tokens are the reference's."""
    eng, coord = lc
    slot = register_draft(eng, tiny_gguf, max_batch_lanes=8, min_accept_permille=0)
    prompts = {t: make_prompt(40 + t, 6 + 5 * t) for t in range(1, lanes + 1)}
    refs = references(bare, prompts, 40)
    kw = {t: dict(params=ignore_eos(), strategy_slot=slot) for t in prompts}
    got, stats, per_emit = run_checked(eng, coord, prompts, 40, per_tick=8, admit_kw=kw)
    drafted = sum(d for d, _ in stats.values())
    accepted = sum(a for _, a in stats.values())
    for t in prompts:
        assert len(got[t]) == 40
        first_divergence(got[t], *refs[t], MARGIN_TOL)
    print(f"target as draft, {lanes} lanes: drafted {drafted} accepted {accepted}")
    assert drafted > 0 and accepted >= 0.95 * drafted
    assert {s.cert_id_in_effect for _, _, s in per_emit} == {1}
    assert all(n <= 8 for _, n, _ in per_emit)
    s = eng.stats()
    assert s["spec_drafted_total"] == drafted and s["spec_accepted_total"] == accepted
    assert s["draft_models"] == 1 and s["draft_bytes"] > tiny_gguf.stat().st_size
    assert s["draft_sequences"] == 0  # every lane retired: its draft sequence released


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_smaller_draft_model_stays_exact(lc, bare, small_draft, lanes):
    """A weaker draft is accepted sometimes: every lane's tokens are still the reference's
    (verification commits the target's chain), no KV cell leaks in the target's ledger."""
    eng, coord = lc
    slot = register_draft(eng, small_draft, max_batch_lanes=8, min_accept_permille=0)
    prompts = {t: make_prompt(60 + t, 9 + 4 * t) for t in range(1, lanes + 1)}
    refs = references(bare, prompts, 40)
    kw = {t: dict(params=ignore_eos(), strategy_slot=slot) for t in prompts}
    got, stats, _ = run_checked(eng, coord, prompts, 40, per_tick=8, admit_kw=kw)
    for t in prompts:
        assert len(got[t]) == 40
        first_divergence(got[t], *refs[t], MARGIN_TOL)
    drafted = sum(d for d, _ in stats.values())
    accepted = sum(a for _, a in stats.values())
    print(f"smaller draft, {lanes} lanes: drafted {drafted} accepted {accepted}")
    assert all(d > 0 for d, _ in stats.values())
    assert 0 < accepted < drafted


def test_drafting_is_timed_and_counted_in_the_verify_cost(lc, small_draft):
    """Each draft call is timed per llama_decode; over the target's plain step of as many lanes it
    is a drafted token's cost in target steps, which a draft-model lane's verify cost adds per
    draft (``DraftModel.step_ratio``), reported as ``draft_step_permille``."""
    eng, coord = lc
    slot = register_draft(eng, small_draft, max_batch_lanes=8, min_accept_permille=0)
    (drafter,) = set(eng.drafts.sources.values())
    assert drafter.step_ratio(eng.rounds.speculator.cost.plain_ns) == 0.0  # nothing timed yet: free
    prompts = {1: make_prompt(71, 12)}
    kw = {1: dict(params=ignore_eos(), strategy_slot=slot)}
    # a weak draft pays nothing: its lane pauses between tries, whose plain rounds time the step
    run_checked(eng, coord, prompts, 160, per_tick=8, admit_kw=kw)
    ratio = drafter.step_ratio(eng.rounds.speculator.cost.plain_ns)
    assert 0.0 < ratio < 20.0, ratio  # a 1-layer draft of a 2-layer target: some of a step
    assert eng.stats()["draft_step_permille"] == round(ratio * 1000)
    assert drafter.step_ratio(lambda lanes: None) == 0.0  # no plain step known: nothing to scale by


def test_draft_kv_follows_the_committed_tokens(lc, bare, small_draft):
    """Tick by tick, a lane's draft sequence holds a prefix of its tokens plus the round's drafts,
    rejected drafts cut back before the next round (``check_drafts`` after every tick)."""
    eng, coord = lc
    slot = register_draft(eng, small_draft, min_accept_permille=0)
    p = make_prompt(77, 15)
    refs = references(bare, {1: p}, 32)
    ev = coord.tick(
        admits=[admit(1, coord.prompt(p), params=ignore_eos(), strategy_slot=slot)],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=15)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=6)],
    )
    got = coord.emitted(ev, 1)
    while len(got) < 32:
        check_drafts(eng)
        check_ledger(eng)
        (st,) = next(iter(eng.drafts.sources.values())).lanes.values()
        assert st.n >= len(p)  # the prompt was fed on first use
        ev = coord.tick(decodes=[LaneDecode(lane_tag=1, max_new_tokens=min(6, 32 - len(got)))])
        got += coord.emitted(ev, 1)
    first_divergence(got, *refs[1], MARGIN_TOL)
    coord.tick(retires=[LaneRetire(lane_tag=1)])
    assert eng.stats()["draft_sequences"] == 0


def test_draft_sequences_are_reused_over_many_requests(make_engine, tiny_gguf):
    """Two lanes' worth of draft sequences serve twelve requests in turn, some retired mid-way
    (a cancel, a preemption): each one drafts, so none was left holding a sequence."""
    eng, coord = make_engine(lanes=2)
    slot = register_draft(eng, tiny_gguf, min_accept_permille=0)
    tag = 0
    for i in range(6):
        prompts = {tag + 1: make_prompt(300 + i, 8 + i), tag + 2: make_prompt(400 + i, 12)}
        tag += 2
        kw = {t: dict(params=ignore_eos(), strategy_slot=slot) for t in prompts}
        n_new = 6 if i % 2 else 20  # odd rounds retire their lanes while they still decode
        _, stats, _ = run(coord, prompts, n_new, per_tick=6, admit_kw=kw, eng=eng)
        check_drafts(eng)
        assert all(d > 0 for d, _ in stats.values()), (i, stats)
        assert eng.stats()["draft_sequences"] == 0
    assert len(next(iter(eng.drafts.sources.values())).free_seqs) == 2


# --------------------------------------------------------------------------- sampled lanes

SAMPLED = dict(
    temperature=0.8,
    top_k=12,
    top_p=0.95,
    min_p=0.02,
    repeat_penalty=1.15,
    freq_penalty=0.3,
    presence_penalty=0.2,
)


def count_model_drafts(monkeypatch, eng, slot: int) -> list[int]:
    """Spy on the slot's draft model: the list gets the number of tokens each ``draft`` call
    returned, so a test can tell its drafts came from the draft model, not prompt lookup."""
    (src,) = {eng.drafts.sources[c.cert_id] for c in eng.strategies.slots[slot].certificates}
    calls: list[int] = []
    real = src.draft

    def draft(want, live):
        got = real(want, live)
        calls.append(sum(int(d.size) for d in got.values()))
        return got

    monkeypatch.setattr(src, "draft", draft)
    return calls


@pytest.mark.parametrize("draft", ["tiny_gguf", "small_draft"], ids=["self", "smaller"])
def test_sampled_draft_model_lanes_keep_the_sampling_distribution(lc, request, monkeypatch, draft):
    """The rejection rule (``speculation``) with the draft model's greedy drafts, as prompt lookup's
    test checks it (test_llamacpp_speculation's ``sampled_runs``, ``chi2_same_law``): over fixed
    RNG seeds, sampled lanes (temperature, top-k, top-p, min-p, three penalties, a logit bias the
    draft model does not see) give each of the first N_NEW positions the same token histogram with
    speculation on and off (independent seeds), every draft verified came from the draft model,
    some accepted and more rejected; the same seeds with speculation off give the same tokens for
    nearly every seed (a check the test can fail: accepting drafts too often changes them)."""
    eng, coord = lc
    path = request.getfixturevalue(draft)
    slot = register_draft(eng, path, max_batch_lanes=8, min_accept_permille=0)
    calls = count_model_drafts(monkeypatch, eng, slot)
    bias = eng.logit_bias_create([40, 41], [8.0, 8.0])  # about one token in seven is 40 or 41
    prompt = make_prompt(123, 24)
    sp = ignore_eos(**SAMPLED)
    drafted, accepted, d_off, same = same_law_on_and_off(coord, prompt, sp, slot, bias)
    assert d_off == 0 and eng.stats()["draft_failures_total"] == 0
    assert sum(calls) == drafted >= N_SEEDS  # speculation ran, every draft the draft model's
    assert N_SEEDS // 8 <= accepted < 0.9 * drafted, (drafted, accepted)
    print(f"{draft}: sampled acceptance {accepted}/{drafted}, same tokens {same}/{N_SEEDS}")


def test_sampled_lanes_are_admitted_on_the_sampled_certificate(lc, small_draft):
    """Greedy and temperature-0 lanes get the greedy certificate (1), sampled lanes, penalised and
    biased too, the sampled one (2); a sampled lane requiring the greedy certificate and a grammar
    lane are REJECTED (CERT_UNMATCHED). Lanes of both certificates draft with the one draft model
    (a draft sequence each), and their emits name their certificate."""
    eng, coord = lc
    slot = register_draft(eng, small_draft, min_accept_permille=0)
    p = make_prompt(7, 10)
    ref = coord.prompt(p)
    gumbel = Sampling.GPU_GUMBEL
    sampled = ignore_eos(temperature=0.8, top_k=12)
    penalised = ignore_eos(**SAMPLED)
    bias = eng.logit_bias_create([40], [2.0])
    admits = [
        admit(1, ref, strategy_slot=slot, params=ignore_eos()),
        admit(2, ref, strategy_slot=slot, sampling=gumbel, params=ignore_eos(temperature=0.0)),
        admit(3, ref, strategy_slot=slot, sampling=gumbel, params=sampled, rng_counter_base=3 << 32),
        admit(4, ref, strategy_slot=slot, sampling=gumbel, params=penalised, logit_bias_handle=bias),
        admit(5, ref, strategy_slot=slot, sampling=gumbel, params=sampled, required_cert_id=1),
        admit(6, ref, strategy_slot=slot, grammar_handle=eng.grammar_create('{"type": "object"}')),
    ]
    ev = coord.tick(admits=admits)
    res = {r.lane_tag: r for r in ev.admit_results}
    for tag, cert in ((1, 1), (2, 1), (3, 2), (4, 2)):
        assert (res[tag].status, res[tag].cert_id) == (AdmitStatus.ADMITTED, cert), tag
        assert res[tag].granted_class == Exactness.DISTRIBUTION_EXACT
    for tag in (5, 6):
        assert (res[tag].status, res[tag].reject_code) == (AdmitStatus.REJECTED, CERT_UNMATCHED_BITS), tag
    live = (1, 2, 3, 4)
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=t, token_offset=0, token_count=len(p)) for t in live],
        decodes=[LaneDecode(lane_tag=t, max_new_tokens=12) for t in live],
    )
    spec = {t: [e.spec for e in ev.emits if e.lane_tag == t] for t in live}
    for tag, cert in ((1, 1), (2, 1), (3, 2), (4, 2)):
        assert {s.cert_id_in_effect for s in spec[tag]} == {cert}, tag
        assert sum(s.proposed for s in spec[tag]) > 0, tag
    (src,) = set(eng.drafts.sources.values())
    assert set(src.lanes) == set(live)  # one draft model, a sequence per lane of either certificate
    check_drafts(eng)
    coord.tick(retires=[LaneRetire(lane_tag=t) for t in live])


# --------------------------------------------------------------------------- registration


def test_a_draft_with_another_vocabulary_is_refused(lc, tmp_path, monkeypatch):
    """Another vocabulary size, or the same size with one token's text changed: refused with
    ERR_REGISTRATION_REFUSED, nothing registered, nothing kept loaded."""
    eng, _ = lc
    bigger = write_tiny_gguf(tmp_path / "bigger.gguf", "llama", n_vocab=320)
    vocab = tinymodel.tiny_vocab

    def swapped(n_vocab=None):
        tokens, scores, types = vocab(n_vocab)
        tokens = list(tokens)
        tokens[-1], tokens[-2] = tokens[-2], tokens[-1]  # the letters y and z trade ids
        return tokens, scores, types

    monkeypatch.setattr(tinymodel, "tiny_vocab", swapped)
    other_text = write_tiny_gguf(tmp_path / "swapped.gguf", "llama")
    monkeypatch.undo()
    for path, why in ((bigger, "320 tokens"), (other_text, "vocabulary differs")):
        with pytest.raises(EngineError) as info:
            eng.strategy_register(draft_registration(DraftConfig(), path))
        assert info.value.status == Status.ERR_REGISTRATION_REFUSED
        assert why in str(info.value)
    assert eng.strategies.slots == {} and eng.stats()["draft_models"] == 0
    # The engine serves on, and a good draft still registers (slot 1: the refusals took none).
    grant = eng.strategy_register(draft_registration(DraftConfig(), eng.model.path))
    assert grant.strategy_slot == 1 and len(grant.certificates) == 2


def test_a_draft_path_that_does_not_load_is_refused(lc, tmp_path):
    eng, _ = lc
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    for path in (tmp_path / "missing.gguf", junk):
        with pytest.raises(EngineError) as info:
            eng.strategy_register(draft_registration(DraftConfig(), path))
        assert info.value.status == Status.ERR_REGISTRATION_REFUSED
    bad = [
        StrategyRegistration(DRAFT_MODEL),  # no artifact
        StrategyRegistration(DRAFT_MODEL, artifacts=[Artifact(ArtifactRole.AUX_HEAD, str(eng.model.path))]),
        StrategyRegistration(DRAFT_MODEL, artifacts=[Artifact(ArtifactRole.DRAFT_WEIGHTS, None)]),  # rule 116
    ]
    for reg in bad:
        with pytest.raises(EngineError) as info:
            eng.strategy_register(reg)
        assert info.value.status == Status.ERR_REGISTRATION_REFUSED
    assert eng.strategies.slots == {} and eng.stats()["draft_models"] == 0


def test_an_uncertified_draft_registration_keeps_no_model(lc, tiny_gguf):
    """A changed config hash under the same name gets a slot and no certificate (rule 117): the
    draft model is not kept, and a lane that allows approximation decodes plainly (rule 122)."""
    eng, coord = lc
    reg = draft_registration(DraftConfig(), tiny_gguf)
    other = StrategyRegistration(
        DRAFT_MODEL,
        impl_version=reg.impl_version,
        impl_hash=reg.impl_hash,
        config_hash=DraftConfig(draft_max=4).config_hash(),
        artifacts=reg.artifacts,
        capabilities=reg.capabilities,
    )
    grant = eng.strategy_register(other)
    assert grant.certificates == [] and eng.stats()["draft_models"] == 0
    p = coord.prompt(make_prompt(5, 8))
    ev = coord.tick(
        admits=[admit(1, p, strategy_slot=grant.strategy_slot, allow_approximate=1, params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=8)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=6)],
    )
    (res,) = ev.admit_results
    assert (res.status, res.cert_id) == (AdmitStatus.ADMITTED, 0)
    (e,) = ev.emits
    assert e.n_tokens == 6 and e.spec.proposed == 0


def test_the_worker_flag_parses_and_registers(lc, tmp_path):
    """``--speculation draft-model:...`` parses to a ``DraftConfig`` (and back); ``register``
    offers the certified slot with a ``--draft-model`` path and skips the strategy without one or
    with a path that does not load (logged, never raised: the worker serves on)."""
    from basertd.worker.strategies import SpeculationArgError, parse_speculation, register, speculation_arg

    eng, _ = lc
    cfg = parse_speculation("draft-model:draft_max=5,min_accept_permille=0")
    assert cfg == DraftConfig(draft_max=5, min_accept_permille=0)
    assert parse_speculation(speculation_arg(cfg)) == cfg
    for bad in ("draft-model:ngram_min=2", "draft-model:draft_max=99", "draft-models"):
        with pytest.raises(SpeculationArgError):
            parse_speculation(bad)

    class Log:
        def __init__(self):
            self.events = []

        def warning(self, event, **kw):
            self.events.append(event)

        info = warning

    log = Log()
    assert register(eng, [cfg], log) == [] and log.events == ["strategy_refused"]
    assert register(eng, [cfg], log, str(tmp_path / "missing.gguf")) == []
    greedy, sampled = register(eng, [cfg], log, str(eng.model.path))  # one offer per certificate
    for offer in (greedy, sampled):
        assert offer.strategy_id == DRAFT_MODEL and offer.strategy_slot == greedy.strategy_slot
        assert offer.cert_id and offer.exactness == Exactness.DISTRIBUTION_EXACT
    assert greedy.cert_id != sampled.cert_id
    assert (greedy.param_domain, sampled.param_domain) == (CertDomain.GREEDY_ONLY, CertDomain.ANY)
    assert log.events == ["strategy_refused", "strategy_refused", "strategy_registered"]
