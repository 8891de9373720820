"""Tick semantics of the llama.cpp engine on the tiny model (RULES.md section E and F): order,
emits, finishes, shed reports, faults, HOST lanes, partial emits, replay, counters."""

from __future__ import annotations

import numpy as np
import pytest
from lc_harness import admit, ignore_eos, make_prompt

from basertd.schema.abi import (
    AdmitStatus,
    FaultCode,
    Finish,
    Sampling,
    ShedKind,
    Status,
    TickStatus,
)
from basertd.schema.tick import (
    LaneCommit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    SamplingParams,
)
from basertd.worker.engines.base import PlanRejected
from basertd.worker.engines.llamacpp import sampling
from basertd.worker.engines.llamacpp.hooks import LaneTestHooks
from basertd.worker.engines.llamacpp.rounds import SPLIT_MIN_PREFILL_ROWS, decode_share_ns

EOS = 2


def start(coord, tag, prompt, n_prefill=None, decode=0, **kw):
    """Admit + prefill (all by default) + optional decode in one tick; returns the events."""
    ref = coord.prompt(prompt)
    n = len(prompt) if n_prefill is None else n_prefill
    return coord.tick(
        admits=[admit(tag, ref, **kw)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=n)] if n else [],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=decode)] if decode else [],
    )


def emit_of(ev, tag):
    (e,) = [e for e in ev.emits if e.lane_tag == tag]
    return e


def test_admit_prefill_decode_in_one_tick(lc):
    # ABI rule 54: ADMITTED, one emit of k tokens, finish NONE, committed length n + k
    eng, coord = lc
    prompt = make_prompt(1, 12)
    ev = start(coord, 7, prompt, decode=5, params=ignore_eos())
    assert [(r.lane_tag, r.status) for r in ev.admit_results] == [(7, AdmitStatus.ADMITTED)]
    e = emit_of(ev, 7)
    assert (e.n_tokens, e.finish) == (5, Finish.NONE)
    assert len(coord.read(e.token_ref)) == 5
    lane = eng.lanes[7]
    assert lane.n_tokens == 12 + 5 and lane.kv_len == 12 + 4  # the 5th token is forwarded next tick
    assert ev.plan_seq == coord.plan_seq  # ABI rule 55
    assert ev.tick_status == TickStatus.OK
    assert ev.logprobs == [] and ev.faults == []


def test_ticks_run_retires_commits_admits_prefills_decodes_in_order(lc):
    # ABI rule 53: a retire frees its lane's slot before the same plan's admit needs it
    eng, coord = lc
    for t in range(1, 9):
        start(coord, t, make_prompt(t, 6))
    assert len(eng.lanes) == eng.max_lanes
    ev = coord.tick(
        retires=[LaneRetire(lane_tag=1)],
        admits=[admit(9, coord.prompt(make_prompt(9, 6)))],
        prefills=[LanePrefill(lane_tag=9, token_offset=0, token_count=6)],
        decodes=[LaneDecode(lane_tag=9, max_new_tokens=1)],
    )
    assert emit_of(ev, 1).finish == Finish.CANCELLED
    assert emit_of(ev, 9).n_tokens == 1
    assert 1 not in eng.lanes and 9 in eng.lanes


def test_prefill_over_budget_is_shed_and_resumes(lc):
    # ABI rules 56, 57, 59
    eng, coord = lc
    prompt = make_prompt(2, 40)
    ref = coord.prompt(prompt)
    ev = coord.tick(
        admits=[admit(1, ref)],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=40)],
        prefill_token_budget=25,
    )
    assert ev.tick_status == TickStatus.SHED
    assert ev.shed.prefill_chunks_dropped == 1
    (s,) = ev.shed.entries
    assert (s.lane_tag, s.kind, s.tokens) == (1, ShedKind.PREFILL_CHUNK, 15)
    assert eng.lanes[1].prefilled == 25 and eng.lanes[1].kv_len == 25
    with pytest.raises(PlanRejected) as ex:  # ABI rule 45: resumes exactly at 25
        coord.tick(prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=15)])
    assert ex.value.status == Status.REJECT_ILLEGAL_COMBINATION
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=1, token_offset=25, token_count=15)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=2)],
    )
    assert ev.tick_status == TickStatus.OK and emit_of(ev, 1).n_tokens == 2
    assert eng.stats()["prefill_tokens_total"] == 40


def test_zero_budget_sheds_every_prefill(lc):
    eng, coord = lc
    ref = coord.prompt(make_prompt(3, 8))
    ev = coord.tick(
        admits=[admit(1, ref)],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=8)],
        prefill_token_budget=0,
    )
    assert ev.shed.prefill_chunks_dropped == 1 and ev.shed.entries[0].tokens == 8
    assert eng.lanes[1].prefilled == 0


def test_eos_finishes_unless_ignore_eos(lc):
    # ABI rule 68, and the EOS finish: a bias makes EOS the greedy choice
    eng, coord = lc
    bias = eng.logit_bias_create([EOS], [100.0])
    ev = start(coord, 1, make_prompt(4, 6), decode=4, logit_bias_handle=bias)
    e = emit_of(ev, 1)
    assert (e.n_tokens, e.finish) == (1, Finish.EOS)
    assert coord.read(e.token_ref) == [EOS]
    with pytest.raises(PlanRejected) as ex:  # ABI rule 48
        coord.tick(decodes=[LaneDecode(lane_tag=1, max_new_tokens=1)])
    assert ex.value.status == Status.REJECT_ILLEGAL_COMBINATION
    ev = start(coord, 2, make_prompt(4, 6), decode=4, logit_bias_handle=bias, params=ignore_eos())
    e = emit_of(ev, 2)
    assert (e.n_tokens, e.finish) == (4, Finish.NONE)
    assert coord.read(e.token_ref) == [EOS] * 4
    ev = coord.tick(retires=[LaneRetire(lane_tag=1), LaneRetire(lane_tag=2)])
    assert [(x.lane_tag, x.finish) for x in ev.emits] == [(2, Finish.CANCELLED)]  # 1 had finished


def test_length_finishes_at_the_lane_context(make_engine):
    eng, coord = make_engine(context_length=16)
    ev = start(coord, 1, make_prompt(5, 10), decode=20, params=ignore_eos())
    e = emit_of(ev, 1)
    assert (e.n_tokens, e.finish) == (6, Finish.LENGTH)
    assert eng.lanes[1].n_tokens == 16
    ev = start(coord, 2, make_prompt(6, 16), decode=1)  # a full-context prompt admits, then stops
    assert (emit_of(ev, 2).n_tokens, emit_of(ev, 2).finish) == (0, Finish.LENGTH)
    with pytest.raises(PlanRejected) as ex:
        start(coord, 3, make_prompt(6, 17))
    assert ex.value.status == Status.REJECT_BOUNDS


def test_lane_fault_stops_one_lane_and_frees_its_kv(lc):
    # ABI rules 59-62
    eng, coord = lc
    for t in (1, 2):
        start(coord, t, make_prompt(t, 20), decode=1)
    used = eng.ledger.used
    LaneTestHooks.install(eng).inject_fault(1, FaultCode.INTERNAL)
    ev = coord.tick(decodes=[LaneDecode(lane_tag=t, max_new_tokens=1) for t in (1, 2)])
    assert ev.tick_status == TickStatus.LANE_ERRORS
    assert [(f.lane_tag, f.code) for f in ev.faults] == [(1, FaultCode.INTERNAL)]
    assert emit_of(ev, 1).finish == Finish.ERROR and emit_of(ev, 1).n_tokens == 0
    assert emit_of(ev, 2).n_tokens == 1
    assert eng.ledger.used == used - 20 + 1  # lane 1's cells went, lane 2 forwarded one token
    assert ev.mem.allocated_bytes == eng.ledger.used * eng.bytes_per_token
    with pytest.raises(PlanRejected) as ex:
        coord.tick(decodes=[LaneDecode(lane_tag=1, max_new_tokens=1)])
    assert ex.value.status == Status.REJECT_UNKNOWN_LANE
    coord.tick(retires=[LaneRetire(lane_tag=1)])
    with pytest.raises(PlanRejected) as ex:
        coord.tick(retires=[LaneRetire(lane_tag=1)])
    assert ex.value.status == Status.REJECT_UNKNOWN_LANE


def test_force_finish_hook_and_hook_errors(lc):
    eng, coord = lc
    start(coord, 1, make_prompt(1, 5))
    hooks = LaneTestHooks.install(eng)
    hooks.force_finish(1, Finish.EOS)
    ev = coord.tick()
    assert [(e.lane_tag, e.finish, e.n_tokens) for e in ev.emits] == [(1, Finish.EOS, 0)]
    for call in (lambda: hooks.force_finish(1, Finish.EOS), lambda: hooks.inject_fault(99)):
        with pytest.raises(Exception) as ex:
            call()
        assert ex.value.status == Status.REJECT_UNKNOWN_LANE


def test_partial_emits_fire_per_round_and_match_the_terminal_emit(lc):
    # ABI rule 64
    _eng, coord = lc
    seen = []
    ref = coord.prompt(make_prompt(8, 9))
    ev = coord.tick(
        on_partial_emit=lambda tag, toks: seen.append((tag, toks.tolist(), toks.dtype)),
        admits=[admit(1, ref, params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=9)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=4)],
    )
    assert len(seen) == 4 and all(t == 1 and len(x) == 1 and d == np.uint32 for t, x, d in seen)
    assert [x[0] for _, x, _ in seen] == coord.read(emit_of(ev, 1).token_ref)


def test_host_lane_rows_commits_and_nonces(lc):
    # ABI rules 39-44, 65, 66
    eng, coord = lc
    prompt = make_prompt(9, 10)
    ev = start(coord, 1, prompt, decode=1, sampling=Sampling.HOST)
    e = emit_of(ev, 1)
    assert e.n_tokens == 0 and e.logits_row.generation != 0 and e.token_ref.count == 0
    row = coord.row(e.logits_row)
    assert row.shape == (eng.n_vocab,)
    greedy = emit_of(start(coord, 2, prompt, decode=1), 2)
    assert int(np.argmax(row)) == coord.read(greedy.token_ref)[0]  # the same logits
    nonce = e.logits_row.generation

    def rejected(status, **kw):
        with pytest.raises(PlanRejected) as ex:
            coord.tick(**kw)
        assert ex.value.status == status

    rejected(Status.REJECT_HOST_RULES, decodes=[LaneDecode(lane_tag=1)])  # row pending [44]
    rejected(Status.REJECT_STALE_NONCE, commits=[LaneCommit(lane_tag=1, token_id=5, logits_nonce=nonce + 1)])
    rejected(Status.REJECT_BOUNDS, commits=[LaneCommit(lane_tag=1, token_id=eng.n_vocab, logits_nonce=nonce)])
    rejected(Status.REJECT_ILLEGAL_COMBINATION, commits=[LaneCommit(lane_tag=2, token_id=5, logits_nonce=1)])
    rejected(
        Status.REJECT_HOST_RULES,
        commits=[LaneCommit(lane_tag=1, token_id=5, logits_nonce=nonce)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=2)],
    )  # [43]
    ev = coord.tick(
        commits=[LaneCommit(lane_tag=1, token_id=5, logits_nonce=nonce)], decodes=[LaneDecode(lane_tag=1)]
    )
    e2 = emit_of(ev, 1)
    assert e2.n_tokens == 0 and e2.logits_row.generation not in (0, nonce)  # [66]
    assert eng.lanes[1].tokens[10] == 5 and eng.lanes[1].generated == 1  # [67]
    ev = coord.tick(commits=[LaneCommit(lane_tag=1, token_id=7, logits_nonce=e2.logits_row.generation)])
    assert ev.emits == []  # a commit alone is not echoed
    rejected(Status.REJECT_HOST_RULES, commits=[LaneCommit(lane_tag=1, token_id=7, logits_nonce=1)])  # [40]
    ev = coord.tick(decodes=[LaneDecode(lane_tag=1)])
    e3 = emit_of(ev, 1)
    ev = coord.tick(commits=[LaneCommit(lane_tag=1, token_id=EOS, logits_nonce=e3.logits_row.generation)])
    assert [(x.lane_tag, x.finish, x.n_tokens) for x in ev.emits] == [(1, Finish.EOS, 0)]


def test_host_admit_needs_a_logits_ring(make_engine):
    _eng, coord = make_engine(coord_kw={"with_logits": False})
    with pytest.raises(PlanRejected) as ex:
        start(coord, 1, make_prompt(1, 5), sampling=Sampling.HOST)
    assert ex.value.status == Status.REJECT_HOST_RULES


def test_logprobs_records_follow_emission_order(lc):
    _eng, coord = lc
    ev = start(coord, 1, make_prompt(11, 7), decode=3, want_logprobs=1 + 4, params=ignore_eos())
    toks = coord.read(emit_of(ev, 1).token_ref)
    assert [r.lane_tag for r in ev.logprobs] == [1, 1, 1]
    for r, t in zip(ev.logprobs, toks, strict=True):
        assert r.n_top == 4 and r.top_ids[0] == t  # greedy: the emitted token ranks first
        assert r.logprob == pytest.approx(r.top_logprobs[0]) and r.logprob < 0
        assert r.top_logprobs == sorted(r.top_logprobs, reverse=True)


def sampled_run(coord, tag, prompt, n, base, preempt_at=None, eng=None):
    """Generate n sampled tokens; with ``preempt_at`` = k, retire after k tokens and resume with
    decode_replay = k and rng_counter_base advanced by k (ABI rule 73)."""
    params = ignore_eos(temperature=0.8, top_k=40, top_p=0.95)
    out = []
    ev = start(
        coord, tag, prompt, decode=1, params=params, sampling=Sampling.GPU_GUMBEL, rng_counter_base=base
    )
    out += coord.read(emit_of(ev, tag).token_ref)
    while len(out) < n:
        if preempt_at is not None and len(out) == preempt_at:
            coord.tick(retires=[LaneRetire(lane_tag=tag)])
            k = len(out)
            ref = coord.prompt(prompt + out)
            ev = coord.tick(
                admits=[
                    admit(
                        tag,
                        ref,
                        params=params,
                        sampling=Sampling.GPU_GUMBEL,
                        rng_counter_base=base + k,
                        decode_replay=k,
                    )
                ],
                prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))],
                decodes=[LaneDecode(lane_tag=tag, max_new_tokens=k + 1)],
            )
            e = emit_of(ev, tag)
            assert e.n_tokens == 1  # k grant units replay, the (k+1)-th generates [72]
            out += coord.read(e.token_ref)
            preempt_at = None
            continue
        ev = coord.tick(decodes=[LaneDecode(lane_tag=tag, max_new_tokens=1)])
        out += coord.read(emit_of(ev, tag).token_ref)
    coord.tick(retires=[LaneRetire(lane_tag=tag)])
    return out


def test_a_preempted_sampled_lane_resumes_identically(lc):
    # ABI rules 67, 72, 73
    eng, coord = lc
    prompt = make_prompt(12, 14)
    whole = sampled_run(coord, 1, prompt, 16, base=77 << 32)
    for k in (1, 5):
        resumed = sampled_run(coord, 2, prompt, 16, base=77 << 32, preempt_at=k)
        assert resumed == whole
    assert sampled_run(coord, 3, prompt, 16, base=78 << 32) != whole  # the seed matters
    assert eng.stats()["replay_tokens_total"] == 1 + 5


def test_replay_units_emit_nothing_until_the_tail_is_fed(lc):
    # ABI rule 72
    _eng, coord = lc
    prompt = [*make_prompt(13, 8), 20, 21, 22]
    ev = start(coord, 1, prompt, n_prefill=8, decode=2, decode_replay=3)
    e = emit_of(ev, 1)
    assert (e.n_tokens, e.finish) == (0, Finish.NONE)
    ev = coord.tick(decodes=[LaneDecode(lane_tag=1, max_new_tokens=2)])
    assert emit_of(ev, 1).n_tokens == 1
    with pytest.raises(PlanRejected) as ex:  # ABI rule 46: no prefill into the replay tail
        start(coord, 2, prompt, n_prefill=9, decode_replay=3)
    assert ex.value.status == Status.REJECT_BOUNDS


def test_same_plans_same_tokens_across_instances(make_engine):
    # ABI rule 63
    runs = []
    for _ in range(2):
        _eng, coord = make_engine()
        prompts = [make_prompt(20 + i, 5 + 3 * i) for i in range(4)]
        ev = coord.tick(
            admits=[
                admit(
                    i + 1,
                    coord.prompt(p),
                    sampling=Sampling.GPU_GUMBEL,
                    rng_counter_base=(i + 9) << 32,
                    params=ignore_eos(temperature=1.1),
                )
                for i, p in enumerate(prompts)
            ],
            prefills=[
                LanePrefill(lane_tag=i + 1, token_offset=0, token_count=len(p)) for i, p in enumerate(prompts)
            ],
            decodes=[LaneDecode(lane_tag=i + 1, max_new_tokens=6) for i in range(4)],
        )
        runs.append(coord.tokens_of(ev))
    assert runs[0] == runs[1] and len(runs[0]) == 4


def test_sampled_tokens_are_the_counter_draws(lc):
    """The first sampled token is exactly select(row, cfg, draw(rng_counter_base)) on the lane's
    logits row (read through a HOST lane with the same prompt)."""
    _eng, coord = lc
    prompt = make_prompt(14, 9)
    params = SamplingParams(temperature=1.3)
    row = coord.row(emit_of(start(coord, 1, prompt, decode=1, sampling=Sampling.HOST), 1).logits_row)
    base = 5 << 32
    ev = start(coord, 2, prompt, decode=1, sampling=Sampling.GPU_GUMBEL, params=params, rng_counter_base=base)
    cfg = sampling.SamplerConfig.from_admit(Sampling.GPU_GUMBEL, params, 0)
    assert coord.read(emit_of(ev, 2).token_ref) == [sampling.select(row, cfg, sampling.draw(base))]


def test_a_round_beside_a_prefill_counts_its_decode_rows_as_decode_time(lc):
    """The tick's ``decode_ns`` / ``prefill_ns`` feed the scheduler's rates: a decode step that
    shared its round with another lane's prefill chunk is decode time (``rounds.decode_share_ns``),
    not prefill time, or the prefill looks slower the fewer rows each round carries."""
    eng, coord = lc
    start(coord, 1, make_prompt(16, 20), decode=1, params=ignore_eos())
    prompt = make_prompt(17, 40)  # >= SPLIT_MIN_PREFILL_ROWS: the decode row runs on its own first
    ev = coord.tick(
        admits=[admit(2, coord.prompt(prompt))],
        prefills=[LanePrefill(lane_tag=2, token_offset=0, token_count=len(prompt))],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=1)],
    )
    parts = eng.rounds.batch.parts
    assert parts[0][0] == 1 and sum(r for r, _ in parts) == 41, parts
    t = ev.timings
    assert t.decode_ns == parts[0][1] and t.prefill_ns >= sum(ns for _, ns in parts[1:]), (t, parts)


def test_decode_share_of_a_round():
    assert decode_share_ns(2, [(2, 700), (30, 9000)]) == 700  # split: the first call is theirs
    assert decode_share_ns(2, [(6, 900)]) == 300  # rode with 4 prefill rows: a third of the call
    assert decode_share_ns(0, [(6, 900)]) == 0 and decode_share_ns(3, []) == 0


def test_timings_and_mem_counters(lc):
    eng, coord = lc
    ev = start(coord, 1, make_prompt(15, 33), decode=2)
    t = ev.timings
    assert t.wall_ns >= t.prefill_ns + t.decode_ns and t.prefill_ns > 0 and t.decode_ns > 0
    m = ev.mem
    assert m.pool_blocks_total == eng.n_cells // eng.page
    assert m.allocated_bytes == (33 + 1) * eng.bytes_per_token
    assert m.pool_blocks_used == -(-(33 + 1) // eng.page)
    assert m.pool_bytes_evictable == 0 and m.host_retained_bytes == 0
    s = eng.stats()
    assert (s["ticks"], s["prefill_tokens_total"], s["decode_tokens_total"], s["live_lanes"]) == (1, 33, 2, 1)
    assert eng.info().pool_bytes == s["pool_bytes_total"]


def test_held_row_across_ticks(lc):
    """Prefill completes in one tick, the first decode comes a tick later: the logits row is held
    and the tokens equal those of a lane decoding in the prefill tick."""
    eng, coord = lc
    prompt = make_prompt(16, 11)
    start(coord, 1, prompt)
    assert eng.lanes[1].held_row is not None
    assert coord.tick().mem.host_retained_bytes == eng.n_vocab * 4
    a = coord.read(emit_of(coord.tick(decodes=[LaneDecode(lane_tag=1, max_new_tokens=3)]), 1).token_ref)
    b = coord.read(emit_of(start(coord, 2, prompt, decode=3), 2).token_ref)
    assert a == b


@pytest.mark.parametrize(
    ("prefill_rows", "parts"), [(40, [1, 40]), (SPLIT_MIN_PREFILL_ROWS - 1, [SPLIT_MIN_PREFILL_ROWS])]
)
def test_decode_rows_go_in_their_own_llama_decode_beside_a_prefill(lc, prefill_rows, parts):
    # A prefill chunk sharing llama.cpp's flash-attention query tiles with other lanes' decode rows
    # would attend over all their keys (rounds.SPLIT_MIN_PREFILL_ROWS); below the threshold the
    # round stays one llama_decode.
    eng, coord = lc
    start(coord, 2, make_prompt(2, 10), decode=1, params=ignore_eos())
    ev = coord.tick(
        admits=[admit(1, coord.prompt(make_prompt(3, prefill_rows)), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=prefill_rows)],
        decodes=[LaneDecode(lane_tag=2, max_new_tokens=1)],
    )
    assert [rows for rows, _ in eng.rounds.batch.parts] == parts
    assert emit_of(ev, 2).n_tokens == 1
    assert eng.lanes[1].kv_len == prefill_rows and eng.lanes[2].kv_len == 11
