"""Reference-engine behaviour the rest of basertd relies on, beyond the numbered rules: logprob
records, the refuse-admits hook, counters, the tick delay, HOST rows, scripted tokens, re-entry
from the partial-emit callback and config refusals. Reference engine only (``rig.ref``)."""

from __future__ import annotations

import math
import time

import pytest
from lanekit import C, D, P, R, need_ref

from basertd.native.abi import AbiError, PartialEmitCallbackError
from basertd.native.ref import RefSpace, RefuseKind, create_ref_bundle
from basertd.schema.abi import AdmitStatus, FaultCode, Finish, Sampling, SpaceKind, Status


def test_logprob_records_follow_the_emitted_tokens(rig):
    need_ref(rig.bundle)
    events = rig.start(1, [5, 6, 7], decode=6, want_logprobs=1 + 5)
    tokens = rig.emitted(events, 1)
    records = [r for r in events.logprobs if r.lane_tag == 1]
    assert len(records) == len(tokens) == 6
    for token, rec in zip(tokens, records, strict=True):
        assert rec.n_top == 5
        assert rec.top_logprobs == sorted(rec.top_logprobs, reverse=True)
        assert rec.top_ids[0] == token  # greedy: the emitted token ranks first
        assert math.isclose(rec.logprob, rec.top_logprobs[0], rel_tol=1e-6)
        assert rec.logprob <= 0.0
        assert sum(math.exp(v) for v in rec.top_logprobs) <= 1.0 + 1e-5
    bare = rig.start(2, [5, 6, 7], decode=2, want_logprobs=1)
    assert [r.n_top for r in bare.logprobs] == [0, 0]
    assert not [r for r in rig.start(3, [5, 6], decode=2).logprobs if r.lane_tag == 3]


def test_refuse_admits_rejects_in_admit_results(rig):
    ref = rig.ref
    ref.refuse_admits(RefuseKind.TAG_MASK, 0x100, Status.REJECT_BUDGET)
    spans = [rig.put([5, 6, 7]), rig.put([8, 9])]
    events = rig.tick(
        [rig.admit(0x101, spans[0]), rig.admit(2, spans[1])],
        prefills=[P(0x101, 0, 3), P(2, 0, 2)],
        decodes=[D(0x101, 2), D(2, 2)],
    )
    results = {r.lane_tag: r for r in events.admit_results}
    assert results[0x101].status == AdmitStatus.REJECTED
    assert results[0x101].reject_code == Status.REJECT_BUDGET & 0xFFFFFFFF
    assert results[2].status == AdmitStatus.ADMITTED
    assert [e.lane_tag for e in events.emits] == [2]  # the refused lane's records were skipped
    with pytest.raises(AbiError):
        ref.lane_info(0x101)
    ref.refuse_admits(RefuseKind.PROMPT_OVER, 2, Status.REJECT_CERT_UNMATCHED)
    events = rig.tick([rig.admit(3, rig.put([1, 2, 3])), rig.admit(4, rig.put([1, 2]))])
    assert [r.status for r in events.admit_results] == [AdmitStatus.REJECTED, AdmitStatus.ADMITTED]
    ref.refuse_admits(RefuseKind.NONE)
    assert rig.tick([rig.admit(3, rig.put([1, 2, 3]))]).admit_results[0].status == AdmitStatus.ADMITTED
    with pytest.raises(AbiError):
        ref.refuse_admits(9, 0, -1)


def test_counters(rig):
    ref = rig.ref
    prefix = list(range(100, 132))
    rig.start(1, prefix, decode=3)
    rig.tick(retires=[R(1, publish=True)])
    span = rig.put([*prefix, 7, 8, 9, 10])
    seed = rig.bundle.seed_acquire(span, 32, 0)
    assert ref.stats()["live_seed_leases"] == 1
    rig.tick([rig.admit(2, span, seed_handle=seed)], prefills=[P(2, 32, 4)], decodes=[D(2, 2)])
    rig.start(3, [5, 6, 7, 8], decode=3, decode_replay=2)  # 2 replayed, 1 generated
    ref.inject_fault(3, FaultCode.INTERNAL)
    rig.tick()
    rig.bundle.seq_fork(rig.bundle.lane_sequence(2))
    s = ref.stats()
    assert s["prefill_tokens_total"] == 32 + 4 + 2
    assert s["decode_tokens_total"] == 3 + 2 + 1
    assert s["replay_tokens_total"] == 2
    assert (s["live_lanes"], s["live_seed_leases"], s["faults_total"], s["bare_sequences"]) == (2, 0, 1, 1)
    assert (s["cache_entries"], s["cache_bytes"]) == (1, 2048)
    # Lane 2 (38 tokens, 3 blocks, 2 shared with the entry and the fork) + nothing else.
    assert s["pool_blocks_used"] == 3 and s["pool_bytes_used"] == 3 * 1024
    assert s["pool_bytes_total"] == 1 << 20
    assert s["ticks"] == s["last_plan_seq"] == rig.seq


def test_tick_delay_sleeps(make_rig):
    rig = make_rig(tick_delay_us=30_000)
    rig.start(1, [5, 6, 7])
    wall, cpu = time.monotonic(), time.process_time()
    events = rig.tick(decodes=[D(1, 1)])
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert wall >= 0.03 and events.timings.wall_ns >= 30_000_000
    assert cpu < wall / 2, "the delay must sleep, not spin"
    assert events.timings.decode_ns <= events.timings.wall_ns


def test_host_rows_reproduce_the_greedy_lane(rig):
    need_ref(rig.bundle)
    greedy = rig.emitted(rig.start(1, [5, 6, 7], decode=6), 1)
    events = rig.start(2, [5, 6, 7], decode=1, sampling=Sampling.HOST)
    chosen = []
    for _ in range(6):
        token = int(rig.row(events, 2).argmax())
        chosen.append(token)
        events = rig.tick(
            commits=[C(2, token, rig.emit_of(events, 2).logits_row.generation)], decodes=[D(2, 1)]
        )
    assert chosen == greedy


def test_scripted_tokens_survive_a_resume(make_rig):
    script = [40, 41, 42, 43, 44, 2]
    rig = make_rig(scripted_tokens=script, eos_token=2)
    events = rig.start(1, [5, 6, 7], decode=10)
    assert rig.emitted(events, 1) == script
    assert rig.emit_of(events, 1).finish == Finish.EOS
    events = rig.start(2, [5, 6, 7, 40, 41], decode=10, decode_replay=2)
    assert rig.emitted(events, 2) == script[2:]


def test_callback_reentry_is_refused(rig):
    need_ref(rig.bundle)
    rig.start(1, [5, 6, 7])

    def reenter(tag, tokens):
        rig.bundle.stats()

    with pytest.raises(PartialEmitCallbackError) as info:
        rig.tick(decodes=[D(1, 2)], on_partial_emit=reenter)
    assert isinstance(info.value.__cause__, AbiError) and info.value.__cause__.status == Status.EBUSY
    assert info.value.events.emits[0].n_tokens == 2  # the tick itself completed


@pytest.mark.parametrize(
    "config",
    [
        dict(vocab_size=1),
        dict(eos_token=512),
        dict(scripted_tokens=[600]),
        dict(page_size_tokens=0),
        dict(spaces=[RefSpace(0), RefSpace(1, SpaceKind.DEPTH_PAGED_KV)]),
        dict(spaces=[RefSpace(0), RefSpace(0, SpaceKind.RECURRENT_BLOB)]),
        dict(spaces=[RefSpace(3, SpaceKind.RECURRENT_BLOB, snapshot_cadence=2)]),
    ],
    ids=["vocab", "eos", "script", "page", "two paged", "duplicate id", "no interval"],
)
def test_config_refusals(rig, config):
    need_ref(rig.bundle)
    with pytest.raises(AbiError) as info:
        create_ref_bundle(**config).close()
    assert info.value.status == Status.REJECT_BOUNDS


def test_faulted_lane_sequence_is_empty(rig):
    need_ref(rig.bundle)
    rig.start(1, list(range(100, 140)), decode=2)
    seq = rig.bundle.lane_sequence(1)  # a handle taken before the fault
    rig.ref.inject_fault(1, FaultCode.INTERNAL)
    rig.tick()
    assert rig.bundle.lane_sequence(1) is None
    child = rig.bundle.seq_fork(seq)
    assert rig.ref.stats()["pool_blocks_used"] == 0
    rig.bundle.sequence_publish(child, [])  # nothing left to publish, and nothing read past it
    assert rig.ref.stats()["cache_entries"] == 0
