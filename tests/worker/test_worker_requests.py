"""Link W requests through a real worker on the reference engine: plan rejection
changes nothing, one tick in flight, TICK_EMIT before the result, PING/PONG with queue depth,
DRAIN, ring re-attach, and the cache / seed / state-op / grammar / logit-bias / vocabulary
requests with ERROR mapped to typed exceptions."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import numpy as np
import pytest
from proc_testutil import process_state, wait_until_async
from worker_plans import (
    EMIT_RING,
    LOGITS_RING,
    PROMPT_RING,
    InProcess,
    StreamConfig,
    ring_geometry,
)

from basertd.native.ref import RefConfig
from basertd.schema import link
from basertd.schema.abi import AdmitStatus, OpState, Status, TickFlag
from basertd.schema.tick import (
    LaneAdmit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    ShedPolicy,
    TickPlan,
    TokenRange,
)
from basertd.server.workers.link_errors import (
    EmitCallbackError,
    LinkTimeout,
    MessageNotEncodable,
    PlanRejected,
    TickInFlight,
    WorkerError,
)
from basertd.server.workers.process import RingGeometry
from basertd.server.workers.sync_worker import SyncWorker

PAGE = 4


@pytest.fixture
def worker(make_spec):
    with SyncWorker(make_spec(ref_config={"page_size_tokens": PAGE}, emit_window_ms=0)) as w:
        yield w


def admit(w, tag: int, tokens, decode: int = 1, seq: int = 1, seed: int = 0, offset: int = 0) -> TickPlan:
    arr = np.asarray(tokens, dtype=np.uint32)
    ref = w.proc.prompt_ring.write(arr)
    return TickPlan(
        plan_seq=seq,
        prefill_token_budget=256,
        max_decode_lanes=1 if decode else 0,
        admits=[LaneAdmit(lane_tag=tag, prompt=ref, seed_handle=seed)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=offset, token_count=len(arr) - offset)],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=decode)] if decode else [],
    )


def with_flags(plan: TickPlan, flags: int) -> TickPlan:
    return msgspec.structs.replace(plan, flags=int(flags))


def stats_without(pong: link.Pong, *keys: str) -> dict[str, int]:
    return {k: v for k, v in pong.stats.items() if k not in keys}


# --- ticks ----------------------------------------------------------------------------------


def test_rejected_plans_change_nothing(make_spec):
    ref = RefConfig()
    geo = ring_geometry(StreamConfig(), ref)
    spec = make_spec(
        prompt_ring=RingGeometry(*geo[PROMPT_RING]),
        emit_ring=RingGeometry(*geo[EMIT_RING]),
        logits_ring=RingGeometry(*geo[LOGITS_RING]),
    )
    prompt = np.arange(40, 60, dtype=np.uint32)
    plan1 = lambda r: TickPlan(  # noqa: E731
        plan_seq=1,
        prefill_token_budget=64,
        max_decode_lanes=1,
        admits=[LaneAdmit(lane_tag=1, prompt=r)],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=20)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=3)],
    )
    plan2 = TickPlan(plan_seq=2, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=1, max_new_tokens=4)])
    expected = InProcess(ref, geo)  # the same two plans, never shown a bad one
    try:
        expected.tick(plan1(expected.write_prompt(prompt)))
        want = expected.read_tokens(expected.tick(plan2).emits[0].token_ref)
    finally:
        expected.close()

    with SyncWorker(spec) as w:
        w.tick(plan1(w.proc.prompt_ring.write(prompt)))
        before = w.ping()
        bad = [
            (
                TickPlan(plan_seq=2, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=99)]),
                Status.REJECT_UNKNOWN_LANE,
            ),
            (
                TickPlan(plan_seq=1, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=1)]),
                Status.REJECT_ILLEGAL_COMBINATION,
            ),
            (
                TickPlan(
                    plan_seq=2, max_decode_lanes=2, decodes=[LaneDecode(lane_tag=1), LaneDecode(lane_tag=1)]
                ),
                Status.REJECT_DUPLICATE_LANE,
            ),
            (
                TickPlan(plan_seq=2, max_decode_lanes=99, decodes=[LaneDecode(lane_tag=1)]),
                Status.REJECT_BUDGET,
            ),
            # Fits the wire (u64) but not the ABI (u32): refused by the binding before any C call.
            (
                TickPlan(plan_seq=2, max_decode_lanes=1 << 40, decodes=[LaneDecode(lane_tag=1)]),
                Status.REJECT_BOUNDS,
            ),
            (TickPlan(plan_seq=2, retires=[LaneRetire(lane_tag=1)], admits=[LaneAdmit(lane_tag=1)]), None),
        ]
        for plan, status in bad:
            with pytest.raises(PlanRejected) as err:
                w.tick(plan)
            assert err.value.plan_seq == plan.plan_seq
            if status is not None:
                assert err.value.status == status
        after = w.ping()
        assert stats_without(after, "rejected_plans") == stats_without(before, "rejected_plans")
        assert (after.ticks_run, after.last_plan_seq) == (before.ticks_run, before.last_plan_seq)
        assert after.mem == before.mem
        # A value that does not fit the wire at all never leaves the coordinator.
        with pytest.raises(MessageNotEncodable):
            w.tick(TickPlan(plan_seq=1 << 64))
        events = w.tick(plan2)
        np.testing.assert_array_equal(w.proc.emit_ring.read(events.emits[0].token_ref), want)


def test_partial_emits_arrive_before_the_result(worker):
    seen: list[tuple[int, list[int]]] = []
    plan = admit(worker, 5, range(10, 22), decode=6)
    plan = TickPlan(
        **{**{f: getattr(plan, f) for f in plan.__struct_fields__}, "flags": int(TickFlag.PARTIAL_EMITS)}
    )
    events = worker.tick(plan, on_emit=lambda e: seen.append((e.lane_tag, e.tokens.tolist())))
    tokens = worker.proc.emit_ring.read(events.emits[0].token_ref).tolist()
    assert len(tokens) == 6
    assert [tag for tag, _ in seen] == [5] * len(seen)
    assert [tok for _, part in seen for tok in part] == tokens


def test_partial_emits_are_coalesced_within_the_window(make_spec):
    # The reference engine draws a tick's tokens within microseconds: with a window longer than
    # the tick nothing is streamed (the result carries every token); what is streamed is always a
    # prefix of the lane's tokens.
    with SyncWorker(make_spec(emit_window_ms=1000)) as w:
        seen: list[int] = []
        plan = with_flags(admit(w, 5, range(10, 22), decode=6), TickFlag.PARTIAL_EMITS)
        events = w.tick(plan, on_emit=lambda e: seen.extend(e.tokens.tolist()))
        assert seen == [] and events.emits[0].n_tokens == 6
    with SyncWorker(make_spec(emit_window_ms=0.5, ref_config={"tick_delay_us": 5000})) as w:
        seen = []
        plan = with_flags(admit(w, 5, range(10, 22), decode=6), TickFlag.PARTIAL_EMITS)
        events = w.tick(plan, on_emit=lambda e: seen.extend(e.tokens.tolist()))
        tokens = w.proc.emit_ring.read(events.emits[0].token_ref).tolist()
        assert tokens[: len(seen)] == seen


def test_emit_callback_error_keeps_the_tick_and_the_link(worker):
    plan = admit(worker, 5, range(10, 14), decode=2)
    plan = TickPlan(
        **{**{f: getattr(plan, f) for f in plan.__struct_fields__}, "flags": int(TickFlag.PARTIAL_EMITS)}
    )

    def boom(_emit):
        raise RuntimeError("scheduler bug")

    with pytest.raises(EmitCallbackError) as err:
        worker.tick(plan, on_emit=boom)
    assert err.value.events.plan_seq == 1 and isinstance(err.value.__cause__, RuntimeError)
    assert worker.ping().ticks_run == 1


def test_one_tick_in_flight_and_timeouts(make_spec):
    with SyncWorker(make_spec(ref_config={"tick_delay_us": 300_000})) as w:

        async def scenario():
            first = asyncio.ensure_future(w.link.tick(admit(w, 1, [5, 6, 7])))
            await asyncio.sleep(0)
            assert w.link.tick_in_flight
            with pytest.raises(TickInFlight):
                await w.link.tick(TickPlan(plan_seq=2))
            events = await first
            assert not w.link.tick_in_flight
            with pytest.raises(LinkTimeout):
                await w.link.tick(
                    TickPlan(plan_seq=2, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=1)]), timeout=0.05
                )
            assert w.link.tick_in_flight  # the result of plan 2 is still owed
            await wait_until_async(lambda: not w.link.tick_in_flight, what="the owed result of plan 2")
            return events

        assert w.call(scenario()).plan_seq == 1
        assert w.ping().last_plan_seq == 2


def test_pong_reports_queue_depth_and_answers_mid_tick(make_spec):
    with SyncWorker(make_spec(emit_window_ms=0)) as w:

        async def frozen(plan: TickPlan, *, ping_last: bool):
            # Freeze the worker so that the tick, a PING and three TOKENIZEs are all queued before
            # it runs again. Mid-tick the worker answers a PING as soon as it reads it, so there the
            # PING goes last: Link W is one ordered stream, and the three TOKENIZEs are queued
            # before the PING is read. After a tick the worker reads everything waiting on the
            # socket and answers PINGs first, so there the PING goes first.
            os.kill(w.proc.pid, signal.SIGSTOP)
            try:
                await wait_until_async(lambda: process_state(w.proc.pid) == "T", what="worker stopped")
                tick = asyncio.ensure_future(w.link.tick(plan))
                await asyncio.sleep(0)
                ping = None if ping_last else asyncio.ensure_future(w.link.ping())
                tokenizes = [
                    asyncio.ensure_future(w.link.request(link.Tokenize(text=b"x"))) for _ in range(3)
                ]
                if ping is None:
                    ping = asyncio.ensure_future(w.link.ping())
                # Give zmq's I/O thread a moment to move the frames into the stopped worker's
                # socket (no API shows when it has); the mid-tick queue depth does not depend on it.
                await asyncio.sleep(0.1)
            finally:
                os.kill(w.proc.pid, signal.SIGCONT)
            return await tick, await ping, await asyncio.gather(*tokenizes)

        streaming = with_flags(admit(w, 3, range(10, 30), decode=4), TickFlag.PARTIAL_EMITS)
        _, mid, toks = w.call(frozen(streaming, ping_last=True))
        assert mid.tick_in_flight and mid.ticks_run == 0  # answered from inside the tick
        assert mid.queue_depth == 3  # the TOKENIZEs wait for the tick
        assert [t.tokens.tolist() for t in toks] == [[1, 3 + ord("x")]] * 3

        plain = TickPlan(plan_seq=2, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=3)])
        events, after, _ = w.call(frozen(plain, ping_last=False))
        assert not after.tick_in_flight and after.ticks_run == 2 and after.last_plan_seq == 2
        assert after.queue_depth == 3
        assert after.lanes_active == 1 and after.stats["live_lanes"] == 1
        assert after.stats["decode_tokens_total"] == 5
        assert after.mem == events.mem


def test_drain_refuses_admits_and_answers_once_no_lane_is_left(worker):
    worker.tick(admit(worker, 1, [5, 6, 7, 8]))

    async def scenario():
        drain = asyncio.ensure_future(worker.link.drain())
        await asyncio.sleep(0.05)  # time for a wrong early answer to arrive: none may while a lane lives
        assert not drain.done()
        with pytest.raises(PlanRejected) as err:
            await worker.link.tick(admit(worker, 2, [9, 9], seq=2))
        assert err.value.status == Status.REJECT_ILLEGAL_COMBINATION
        await worker.link.tick(TickPlan(plan_seq=2, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=1)]))
        assert not drain.done()
        await worker.link.tick(TickPlan(plan_seq=3, retires=[LaneRetire(lane_tag=1)]))
        return await asyncio.wait_for(drain, 5)

    assert worker.call(scenario()).lanes_active == 0


def test_rings_reattach_checks_specs_and_resets_generations(worker):
    events = worker.tick(admit(worker, 1, [5, 6, 7], decode=2))
    assert events.emits[0].token_ref.generation == 1
    good = []
    for rid in (PROMPT_RING, EMIT_RING, LOGITS_RING):
        r = next(r for r in worker.capabilities.rings if r.ring_id == rid)
        fd = worker.proc._res.segments[rid - 1].fd
        good.append(link.RingAttachSpec(**{f: getattr(r, f) for f in r.__struct_fields__}, fd=fd))
    wrong_geometry = [link.RingAttachSpec(**{**_fields(good[1]), "slots": good[1].slots + 1})]
    wrong_fd = [link.RingAttachSpec(**{**_fields(good[1]), "fd": 1})]
    for specs in (wrong_geometry, wrong_fd):
        reply = worker.request(link.RingsAttach(rings=specs))
        assert reply.status == Status.ERR_RING_LAYOUT
    assert worker.request(link.RingsAttach(rings=good)).status == Status.OK
    events = worker.tick(TickPlan(plan_seq=2, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=1)]))
    assert events.emits[0].token_ref.generation == 1  # ABI rule 130


def _fields(spec) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


# --- cache and seeds ------------------------------------------------------------------------


def test_match_seed_and_evict(worker):
    prompt = list(range(30, 42))  # 12 tokens = 3 pages
    worker.tick(admit(worker, 1, prompt, decode=1))
    worker.tick(TickPlan(plan_seq=2, retires=[LaneRetire(lane_tag=1, publish_to_cache=1)]))
    stats = worker.ping().stats
    assert stats["cache_entries"] >= 1 and stats["cache_bytes"] > 0  # `cache stats` reads both
    span = worker.proc.prompt_ring.write(np.array(prompt, dtype=np.uint32))
    match = worker.call(worker.link.match(span))
    lens = [c.prefix_len for s in match.spaces for c in s.candidates]
    assert lens and all(n % PAGE == 0 for n in lens) and max(lens) >= 8
    grant = worker.call(worker.link.seed_acquire(span, 8))
    assert grant.seed_handle and grant.lease_ticks == 8 and grant.tick == 2
    before = worker.ping().stats["prefill_tokens_total"]
    plan = admit(worker, 2, prompt, decode=1, seq=3, seed=grant.seed_handle, offset=8)
    events = worker.tick(plan)
    assert events.admit_results[0].status == AdmitStatus.ADMITTED
    assert worker.ping().stats["prefill_tokens_total"] - before == 4  # the seed served 8 tokens
    with pytest.raises(WorkerError) as err:
        worker.call(worker.link.seed_release(grant.seed_handle))  # consumed by the admit (rule 81)
    assert err.value.status == Status.ERR_UNKNOWN_HANDLE
    worker.tick(TickPlan(plan_seq=4, retires=[LaneRetire(lane_tag=2)]))
    entries, held = worker.ping().stats["cache_entries"], worker.ping().stats["cache_bytes"]
    freed = worker.call(
        worker.link.cache_evict(ShedPolicy(evictable_cache_classes=1, max_evict_bytes=1 << 30), 1 << 30)
    )
    assert freed > 0 and worker.ping().stats["cache_entries"] < entries
    assert worker.ping().stats["cache_bytes"] < held
    assert worker.request(link.CacheEvictEntries(keys=[])) == link.Ok()  # nothing named, nothing evicted


# --- state ops, grammar, bias, vocabulary ---------------------------------------------------


def test_sequences_and_state_ops(worker):
    worker.tick(admit(worker, 1, range(5, 17), decode=2))
    lane_seq = worker.call(worker.link.state_op(link.OpLaneSequence(lane_tag=1))).value
    assert lane_seq > 0
    assert worker.call(worker.link.state_op(link.OpLaneSequence(lane_tag=404))).value == 0
    bare = worker.call(worker.link.state_op(link.OpSequenceCreate())).value
    assert bare > 0 and bare != lane_seq
    sized = worker.call(
        worker.link.state_op(link.OpExportSize(seq=lane_seq, space_id=0, range=TokenRange(start=0, end=8)))
    )
    assert sized.op == 0 and sized.value > 136 and sized.sizing_gen > 0
    accepted = worker.call(
        worker.link.state_op(
            link.OpSnapshot(
                seq=lane_seq, space_id=0, boundary_pos=8, sizing_gen=sized.sizing_gen, dst_bytes=sized.value
            )
        )
    )
    assert accepted.op
    worker.tick(TickPlan(plan_seq=2))  # ops complete across ticks (ABI rule 69)
    done = worker.call(worker.link.op_done(accepted.op, timeout=5))
    assert done.state == OpState.DONE and done.error == 0
    assert done.data is not None and len(done.data) == sized.value  # the sealed export (rule 95)
    assert bytes(done.data[:8]) == b"BRTSTATE"
    restored = worker.call(worker.link.state_op(link.OpRestore(seq=bare, space_id=0, data=done.data)))
    assert restored.op and restored.op != accepted.op
    worker.tick(TickPlan(plan_seq=3))
    assert worker.call(worker.link.op_done(restored.op, timeout=5)).state == OpState.DONE
    # A flipped payload byte is refused by the checksum (rule 103): FAILED, carried back typed.
    bad = np.array(done.data, copy=True)
    bad[-1] ^= 0xFF
    other = worker.call(worker.link.state_op(link.OpSequenceCreate())).value
    try:
        refused = worker.call(worker.link.state_op(link.OpRestore(seq=other, space_id=0, data=bad)))
    except WorkerError as exc:
        assert exc.status == Status.ERR_CHECKSUM
    else:
        worker.tick(TickPlan(plan_seq=4))
        end = worker.call(worker.link.op_done(refused.op, timeout=5))
        assert end.state == OpState.FAILED and end.error == Status.ERR_CHECKSUM
    assert worker.call(worker.link.state_op(link.OpSequenceFree(seq=bare))) == link.StateOpAccepted()
    with pytest.raises(WorkerError) as err:
        worker.call(worker.link.state_op(link.OpSequenceFree(seq=bare)))  # ABI rule 112
    assert err.value.status == Status.ERR_UNKNOWN_HANDLE
    with pytest.raises(WorkerError) as err:
        worker.call(worker.link.state_op(link.OpTrim(seq=999, space_id=0, new_len=0)))
    assert err.value.status == Status.ERR_UNKNOWN_HANDLE


def test_grammar_and_logit_bias_handles(worker):
    g = worker.request(link.GrammarCreate(json_schema='{"type": "object"}')).handle
    assert g > 0
    assert worker.request(link.GrammarFree(handle=g)) == link.Ok()
    with pytest.raises(WorkerError) as err:
        worker.request(link.GrammarFree(handle=g))  # ABI rule 113
    assert err.value.status == Status.ERR_UNKNOWN_HANDLE
    assert worker.request(link.GrammarCreate(json_schema="{not json")).handle == 0
    b = worker.request(link.LogitBiasCreate(tokens=[5, 6], values=[1.5, -2.0])).handle
    assert b > 0
    assert worker.request(link.LogitBiasFree(handle=b)) == link.Ok()
    with pytest.raises(WorkerError) as err:
        worker.request(link.LogitBiasFree(handle=b))
    assert err.value.status == Status.ERR_UNKNOWN_HANDLE
    assert worker.request(link.LogitBiasCreate()).handle == 0  # empty: no handle (rule 113)
    with pytest.raises(WorkerError) as err:
        worker.request(link.LogitBiasCreate(tokens=[5, 6], values=[1.0]))
    assert err.value.status == Status.REJECT_BOUNDS


def test_tokenize_and_detokenize(worker):
    toks = worker.request(link.Tokenize(text="héllo".encode(), add_special=True)).tokens.tolist()
    assert toks == [1] + [3 + b for b in "héllo".encode()]
    text = worker.request(link.Detokenize(tokens=[1, *toks[1:], 2, 400])).text
    assert text == "héllo".encode()
