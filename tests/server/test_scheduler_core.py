"""The synchronous scheduler core in-process (DESIGN.md "Scheduling"): no processes, no rings, no
link. Requests with a list sink are submitted, plans drafted and launched, and synthetic tick
outcomes applied through the loop's verbs (``hint_requests``, ``draft``, ``launch``, ``on_emit``,
``apply``, ``cancel``); the deliveries they return are handed to the sinks as the loop does, and
the tests assert what reaches the sinks and what the core hands back to its loop (seed leases to
release, grammar handles to free, requests to resume, restarts).
"""

from __future__ import annotations

import time

import pytest
from sink_testutil import Sink

from basertd.schema import client as api
from basertd.schema import link
from basertd.schema.abi import AdmitStatus, CertDomain, CertMode, FaultCode, Finish, ShedKind, Status
from basertd.schema.client import ErrorCode
from basertd.schema.tick import (
    AdmitResult,
    LaneEmit,
    LaneFault,
    ShedEntry,
    ShedReport,
    SpecStats,
    TickEvents,
    TickTimings,
    TokenRef,
)
from basertd.server.cache.policy import Seed
from basertd.server.config_sections import CacheConfig, SchedulerConfig
from basertd.server.request.record import AdmissionError, GenerationRequest, RequestState, sampler_for
from basertd.server.request.tokenizer import BytesTokenizer
from basertd.server.sched.core import SchedulerCore
from basertd.server.sched.draft import Plan, Resolved
from basertd.server.sched.outcome import Accepted, Applied, Delivery, Lost, Outcome, Rejected
from basertd.server.workers.limits import WorkerLimits
from basertd.shm import YieldReason

TOK = BytesTokenizer()
PAGE = 16


def make_core(
    *, lanes: int = 4, cache: bool = False, strategies: tuple[link.StrategyOffer, ...] = (), **sched
) -> SchedulerCore:
    limits = WorkerLimits(
        context_length=1024,
        max_lanes=lanes,
        max_batch_size=lanes,
        page_tokens=PAGE,
        kv_tokens=lanes * 1024,
        max_admit_tokens=1024,
        strategies=strategies,
    )
    return SchedulerCore(
        0, limits, SchedulerConfig(**sched), CacheConfig(enabled=cache, coalesce_min_tokens=0)
    )


def make_req(prompt: str = "hello", max_tokens: int = 8, qos: str = "interactive", **kw):
    sink = Sink()
    gen = api.Generate(request_id=prompt[:8], prompt=prompt, max_tokens=max_tokens, temperature=0.0, seed=7)
    req = GenerationRequest(
        request_id=prompt[:8],
        prompt=TOK.encode(prompt, add_bos=False),
        max_tokens=max_tokens,
        sampler=sampler_for(gen),
        sink=sink,
        tokenizer=TOK,
        qos=qos,
        **kw,
    )
    return req, sink


def launch(core: SchedulerCore, resolved: dict[int, Resolved] | None = None) -> tuple[Plan, object]:
    """Draft and launch the next plan as the loop does (refs stand for ring-1 spans)."""
    now = time.monotonic()
    core.hint_requests(now)
    plan = core.draft(now, resolved)
    refs = {cand.key: TokenRef(ring_id=1, index=i) for i, (_, cand) in enumerate(plan.draft.admitted)}
    refs.update(plan.refs)
    return plan, core.launch(plan, refs, {}, now)


def events(
    plan: Plan,
    *,
    emits: dict[int, tuple[list[int], Finish]] | None = None,
    refused: dict[int, Status] | None = None,
    shed: dict[int, int] | None = None,
    faults: tuple[int, ...] = (),
    spec: dict[int, tuple[int, int]] | None = None,
    decode_ns: int = 0,
) -> tuple[TickEvents, dict[int, list[int] | None]]:
    """Synthetic events of ``plan``'s tick and the emitted tokens the loop would have read;
    ``spec``: a lane's (drafts proposed, accepted) in its emit."""
    refused = refused or {}
    results = []
    for tag, _ in plan.draft.admitted:
        if tag in refused:
            code = int(refused[tag]) & 0xFFFFFFFF
            results.append(AdmitResult(lane_tag=tag, status=int(AdmitStatus.REJECTED), reject_code=code))
        else:
            results.append(AdmitResult(lane_tag=tag, status=int(AdmitStatus.ADMITTED)))
    lane_emits, read = [], {}
    for tag, (toks, finish) in (emits or {}).items():
        proposed, accepted = (spec or {}).get(tag, (0, 0))
        stats = SpecStats(proposed=proposed, accepted=accepted)
        lane_emits.append(LaneEmit(lane_tag=tag, n_tokens=len(toks), finish=int(finish), spec=stats))
        if toks:
            read[tag] = list(toks)
    entries = [
        ShedEntry(lane_tag=t, kind=int(ShedKind.PREFILL_CHUNK), tokens=n) for t, n in (shed or {}).items()
    ]
    ev = TickEvents(
        plan_seq=1,
        admit_results=results,
        emits=lane_emits,
        faults=[LaneFault(lane_tag=t, code=int(FaultCode.OOM_TENTATIVE)) for t in faults],
        shed=ShedReport(entries=entries),
        timings=TickTimings(decode_ns=decode_ns),
    )
    return ev, read


def send(deliveries: list[Delivery]) -> None:
    """Hand the core's deliveries to the sinks, as the loop does."""
    for d in deliveries:
        d.send()


def apply(core: SchedulerCore, plan: Plan | None, outcome: Outcome) -> Applied:
    """Apply a tick's outcome as the loop does; its deliveries reach the sinks."""
    applied = core.apply(plan, outcome, time.monotonic())
    send(applied.deliveries)
    return applied


def accept(core: SchedulerCore, plan: Plan, ev: TickEvents, read: dict[int, list[int] | None]) -> None:
    apply(core, plan, Accepted(ev, read))


def on_emit(core: SchedulerCore, tag: int, tokens: list[int]) -> None:
    d = core.on_emit(tag, tokens, time.monotonic())
    send([d] if d is not None else [])


def cancel(core: SchedulerCore, req: GenerationRequest) -> YieldReason | None:
    why, out = core.cancel(req, time.monotonic())
    send(out)
    return why


def tick(core: SchedulerCore, resolved=None, **kw) -> Plan:
    plan, _ = launch(core, resolved)
    accept(core, plan, *events(plan, **kw))
    return plan


def only_tag(plan: Plan) -> int:
    (tag, _), *_ = plan.draft.admitted
    return tag


# --- admission -------------------------------------------------------------------------------------


def test_check_admission_refuses_what_can_never_run_or_cannot_be_queued():
    core = make_core(queue_limit=1)
    with pytest.raises(AdmissionError) as e:
        core.check_admission(1000, 100, "batch")
    assert e.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    core.submit(make_req(qos="batch")[0])
    with pytest.raises(AdmissionError) as e:
        core.check_admission(5, 5, "batch")
    assert e.value.code == ErrorCode.QUEUE_FULL
    core.check_admission(5, 5, "interactive")  # another class still has room


def test_a_queued_cancel_drops_the_request_and_a_running_one_yields_the_tick():
    core = make_core()
    a, sa = make_req("aaaa")
    b, _ = make_req("bbbb")
    core.submit(a)
    assert cancel(core, a) is None
    assert len(core.queues) == 0 and isinstance(sa.end(), api.Error)
    assert sa.end().code == ErrorCode.CANCELLED
    core.submit(b)
    plan, _ = launch(core)
    assert cancel(core, b) is YieldReason.CANCEL  # its lane is in the tick in flight
    ev, read = events(plan, emits={only_tag(plan): ([65], Finish.NONE)})
    accept(core, plan, ev, read)
    nxt, _ = launch(core)
    assert nxt.draft.retires == [(only_tag(plan), False)]


# --- tokens, finishes -------------------------------------------------------------------------------


def test_tokens_reach_the_sink_in_order_and_eos_finishes_and_retires_with_publish():
    core = make_core()
    req, sink = make_req("abcd", max_tokens=10)
    core.submit(req)
    plan = tick(core, emits={})
    tag = only_tag(plan)
    assert plan.draft.prefills and core.lanes[tag].phase == "decode"
    tick(core, emits={tag: ([72, 105], Finish.NONE)})
    tick(core, emits={tag: ([33], Finish.EOS)})
    assert sink.ids() == [72, 105, 33]
    assert isinstance(sink.end(), api.Done) and sink.end().finish_reason == "eos"
    retire, _ = launch(core)
    assert retire.draft.retires == [(tag, True)]
    accept(core, retire, *events(retire))
    assert tag not in core.lanes and core.requests_done == 1


def test_partial_emits_stream_and_the_terminal_emit_delivers_only_the_rest():
    core = make_core()
    req, sink = make_req("abcd", max_tokens=10)
    core.submit(req)
    tag = only_tag(tick(core))
    plan, _ = launch(core)
    on_emit(core, tag, [70])
    on_emit(core, tag, [71])
    assert sink.ids() == [70, 71]  # streamed while the tick runs
    ev, read = events(plan, emits={tag: ([70, 71, 72], Finish.NONE)})
    accept(core, plan, ev, read)
    assert sink.ids() == [70, 71, 72]
    assert core.lanes[tag].emitted == [70, 71, 72] and core.decode_tokens_total == 3


def test_the_core_returns_one_delivery_per_request_and_sends_nothing_itself():
    core = make_core()
    a, sa = make_req("aaaa", max_tokens=10)
    b, sb = make_req("bbbb", max_tokens=2)
    core.submit(a)
    core.submit(b)
    plan = tick(core)
    ta, tb = (tag for tag, _ in plan.draft.admitted)
    plan, _ = launch(core)
    ev, read = events(plan, emits={ta: ([70, 71], Finish.NONE), tb: ([72, 73], Finish.NONE)})
    applied = core.apply(plan, Accepted(ev, read), 123.0)
    assert sa.sent == [] and sb.sent == []  # nothing reaches a sink until the loop hands it over
    by_req = {d.request.key: d for d in applied.deliveries}
    assert len(applied.deliveries) == 2 and set(by_req) == {a.key, b.key}
    assert [type(m) for m in by_req[b.key].messages] == [api.Tokens, api.Done]  # tokens, then Done
    assert a.t_first_token == 123.0 and b.t_finished == 123.0  # the loop's clock, not the core's
    send(applied.deliveries)
    assert sa.ids() == [70, 71] and sb.ids() == [72, 73] and sb.end().finish_reason == "length"


def test_max_tokens_is_exact_and_finishes_length():
    core = make_core()
    req, sink = make_req("abcd", max_tokens=2)
    core.submit(req)
    tag = only_tag(tick(core))
    tick(core, emits={tag: ([70, 71, 72], Finish.NONE)})
    assert sink.ids() == [70, 71] and sink.end().finish_reason == "length"


def test_unreadable_emitted_tokens_fail_the_request():
    core = make_core()
    req, sink = make_req("abcd")
    core.submit(req)
    tag = only_tag(tick(core))
    plan, _ = launch(core)
    ev, _ = events(plan, emits={tag: ([1, 2], Finish.NONE)})
    accept(core, plan, ev, {tag: None})
    assert sink.end().code == ErrorCode.INTERNAL and core.lanes[tag].retire


# --- admit results, prefill progress, faults ---------------------------------------------------------


def test_a_refused_admit_fails_the_request_and_frees_its_grammar_handle_and_seed():
    core = make_core()
    req, sink = make_req("abcd")
    core.submit(req)
    core.grammars.hold(req, 42)  # created by the loop for this admission
    plan, tick_plan = launch(core)
    assert tick_plan.admits[0].grammar_handle == 42
    ev, read = events(plan, refused={only_tag(plan): Status.REJECT_BOUNDS})
    accept(core, plan, ev, read)
    assert sink.end().code == ErrorCode.INVALID_REQUEST and "REJECT_BOUNDS" in sink.end().message
    assert core.lanes == {} and core.grammars.pending_free == [42] and core.grammars.get(req) == 0


def test_a_transiently_refused_admit_is_requeued_at_the_head_of_its_class():
    core = make_core()
    a, sa = make_req("aaaa")
    b, _ = make_req("bbbb")
    core.submit(a)
    plan, _ = launch(core)
    core.submit(b)
    ev, read = events(plan, refused={only_tag(plan): Status.NEEDS_REPLAN})
    accept(core, plan, ev, read)
    assert list(core.queues) == [a, b] and a.state is RequestState.QUEUED and sa.end() is None
    assert a.admissions == 0


def test_a_shed_prefill_chunk_resumes_next_tick_and_the_lane_does_not_decode():
    core = make_core(prefill_budget=64, long_prefill_budget=64)
    req, _ = make_req("x" * 200, max_tokens=4, qos="batch")  # a long tick's 64-token chunk
    core.submit(req)
    plan = tick(core, shed={1: 40})
    (tag, offset, count), *_ = plan.draft.prefills
    assert (tag, offset) == (1, 0)
    assert core.lanes[tag].prefilled == count - 40 and core.prefill_tokens_total == count - 40
    nxt, _ = launch(core)
    assert nxt.draft.prefills[0][:2] == (tag, count - 40)  # the cut part is prefilled again


def test_a_lane_fault_fails_its_request_and_retires_it_without_publish():
    core = make_core()
    req, sink = make_req("abcd")
    core.submit(req)
    tag = only_tag(tick(core))
    tick(core, emits={tag: ([65], Finish.NONE)}, faults=(tag,))
    assert sink.end().code == ErrorCode.INTERNAL and "OOM_TENTATIVE" in sink.end().message
    retire, _ = launch(core)
    assert retire.draft.retires == [(tag, False)]


# --- preemption --------------------------------------------------------------------------------------


def test_an_interactive_request_preempts_a_batch_lane_which_resumes_with_decode_replay():
    core = make_core(lanes=1)
    batch, bsink = make_req("batch job", max_tokens=20, qos="batch")
    core.submit(batch)
    btag = only_tag(tick(core))
    tick(core, emits={btag: ([66, 67, 68], Finish.NONE)})
    inter, isink = make_req("urgent!", max_tokens=2)
    assert core.submit(inter) is None  # no tick in flight: nothing to yield
    plan, tick_plan = launch(core)
    assert plan.draft.preempted == [btag] and (btag, True) in plan.draft.retires
    assert [a.lane_tag for a in tick_plan.admits] == [only_tag(plan)]
    itag = only_tag(plan)
    ev, read = events(plan, emits={itag: ([105], Finish.NONE)})
    accept(core, plan, ev, read)
    assert batch.state is RequestState.QUEUED and list(core.queues) == [batch]
    assert batch.preemptions == 1 and core.preemptions == 1 and bsink.end() is None
    tick(core, emits={itag: ([106], Finish.NONE)})
    assert isink.end().finish_reason == "length"
    plan, tick_plan = launch(core)  # the interactive lane retires; the batch request resumes
    (admit,) = tick_plan.admits
    assert admit.decode_replay == 3 and admit.rng_counter_base == batch.sampler.rng_counter_base(3)
    assert core.lanes[admit.lane_tag].replay_left == 3
    assert bsink.ids() == [66, 67, 68]  # nothing repeated


def test_an_interactive_arrival_yields_a_batch_tick_in_flight():
    core = make_core()
    batch, _ = make_req("batch job", qos="batch")
    core.submit(batch)
    launch(core)
    assert core.submit(make_req("hurry")[0]) is YieldReason.URGENT_ADMIT


@pytest.mark.parametrize("decode_tick_s", [0.05, 0.0])
def test_a_batch_arrival_cuts_a_tick_lengthened_by_decode_tick_s_only_while_a_lane_is_free(decode_tick_s):
    """At 2 ms a decode step, ``decode_tick_s`` 0.05 grants 25 rounds instead of 8; a batch
    request arriving then, with a lane free to take it, asks the tick to end (ADMIT) instead of
    waiting out rounds only the coordinator's turn asked for. With every lane busy, or the tick at
    its configured grant, it waits."""
    core = make_core(lanes=2, decode_grant=8, decode_tick_s=decode_tick_s)
    first, _ = make_req("first", max_tokens=500, qos="batch")
    core.submit(first)
    tag = only_tag(tick(core))
    core.rates.observe(prefill_tokens=0, prefill_s=0.0, decode_steps=10, decode_s=0.02)
    plan, _ = launch(core)
    lengthened = decode_tick_s > 0
    assert plan.draft.decodes == [(tag, 25 if lengthened else 8)] and plan.draft.lengthened == lengthened
    second, _ = make_req("second", max_tokens=500, qos="batch")
    assert core.submit(second) is (YieldReason.ADMIT if lengthened else None)
    accept(core, plan, *events(plan, emits={tag: ([70], Finish.NONE)}))
    plan, _ = launch(core)  # both lanes taken
    assert len(core.lanes) == 2
    assert core.submit(make_req("third", max_tokens=500, qos="batch")[0]) is None
    accept(core, plan, *events(plan, emits={t: ([71], Finish.NONE) for t in core.lanes}))
    plan, _ = launch(core)  # "third" waits for a lane: no lengthened tick while it does
    assert [g for _, g in plan.draft.decodes] == [8, 8]


# --- rejected plans ----------------------------------------------------------------------------------


def test_a_rejected_plan_changes_nothing_and_plans_again_smaller():
    core = make_core()
    reqs = [make_req(f"req {i}")[0] for i in range(4)]
    for r in reqs:
        core.submit(r)
    core.grammars.hold(reqs[0], 9)
    seed = Seed(handle=77, length=0, expires_after=5)
    plan, _ = launch(core)
    plan.seeds[reqs[1].key] = seed
    assert len(plan.draft.admitted) == 4 and len(core.lanes) == 4
    assert apply(core, plan, Rejected(Status.NEEDS_REPLAN, "no room")).restart is None
    assert core.lanes == {} and list(core.queues) == reqs  # back at the head, in order
    assert all(r.state is RequestState.QUEUED and r.t_admitted is None for r in reqs)
    assert core.to_release == [77] and core.grammars.pending_free == [9]
    assert core.plans_rejected == 1 and core.max_admits == 2
    nxt, _ = launch(core)
    assert len(nxt.draft.admitted) == 2


def test_plans_rejected_again_and_again_restart_the_worker():
    core = make_core()
    core.submit(make_req("a")[0])
    reasons = []
    for _ in range(8):
        plan, _ = launch(core)
        reasons.append(apply(core, plan, Rejected(Status.REJECT_BAD_STRUCT, "bad")).restart)
        if reasons[-1]:
            break
    assert reasons[-1] is not None and "rejected" in reasons[-1]


# --- a lost worker -----------------------------------------------------------------------------------


def test_a_lost_worker_requeues_its_lanes_for_resume_with_decode_replay():
    core = make_core(max_crash_resumes=3)
    a, sa = make_req("first", max_tokens=10)
    b, _ = make_req("second", max_tokens=10)
    core.submit(a)
    core.submit(b)
    plan = tick(core)
    ta, tb = (tag for tag, _ in plan.draft.admitted)
    tick(core, emits={ta: ([65, 66], Finish.NONE), tb: ([67], Finish.NONE)})
    core.grammars.hold(a, 5)
    lost = apply(core, None, Lost("worker died"))
    assert core.lanes == {} and lost.failed == [] and core.crash_resumes == 2
    assert (
        {r.key for r in lost.resume} == {a.key, b.key}
        and core.grammars.get(a) == 0
        and len(core.grammars) == 0
    )
    for req in lost.resume:
        core.requeue(req)
    assert next(iter(core.queues)) is a  # the oldest at the head
    _, tick_plan = launch(core)
    replay = {adm.decode_replay for adm in tick_plan.admits}
    assert replay == {2, 1} and sa.ids() == [65, 66] and sa.end() is None


def test_a_poison_request_fails_after_max_crash_resumes_without_a_token():
    core = make_core(max_crash_resumes=2)
    req, sink = make_req("poison")
    core.submit(req)
    for crash in range(2):
        launch(core)
        lost = apply(core, None, Lost(f"crash {crash}"))
        for r in lost.resume:
            core.requeue(r)
    assert lost.failed == [req.key] and sink.end().code == ErrorCode.WORKER_FAILED
    assert len(core.queues) == 0


def test_partial_emits_of_a_tick_that_died_are_no_progress_a_completed_tick_past_the_crash_is():
    core = make_core(max_crash_resumes=3)
    req, sink = make_req("poison", max_tokens=50)
    core.submit(req)
    for crash in range(2):  # each incarnation streams a token, then dies before its result
        _, _ = launch(core)
        (tag,) = core.lanes
        on_emit(core, tag, [70 + crash])
        for r in apply(core, None, Lost(f"crash {crash}")).resume:
            core.requeue(r)
    assert req.crash_streak == 2 and sink.ids() == [70, 71] and sink.end() is None
    plan, _ = launch(core)  # a completed tick that only replays what was delivered: no progress
    (tag,) = core.lanes
    accept(core, plan, *events(plan, emits={tag: ([], Finish.NONE)}))
    assert req.crash_streak == 2
    plan = tick(core, emits={tag: ([72], Finish.NONE)})  # past its last crash, and the tick ended
    assert req.crash_streak == 0 and sink.ids() == [70, 71, 72]


def test_requests_one_crash_from_failing_run_one_at_a_time():
    core = make_core(max_crash_resumes=2)
    reqs = [make_req(f"suspect {i}")[0] for i in range(3)]
    for r in reqs:
        core.submit(r)
    launch(core)
    for r in apply(core, None, Lost("crash")).resume:
        core.requeue(r)
    plan, _ = launch(core)
    assert len(plan.draft.admitted) == 1  # on probation: one per plan until a token is delivered


def test_a_stalled_worker_fails_its_running_work_instead_of_resuming_it():
    core = make_core()
    req, sink = make_req("slow")
    core.submit(req)
    launch(core)
    lost = apply(core, None, Lost("restarted", stalled="no tick for 60 s"))
    assert lost.resume == [] and sink.end().code == ErrorCode.WORKER_FAILED


# --- cached-prefix seeds -----------------------------------------------------------------------------


def test_hints_are_resolved_once_and_the_plan_uses_the_acquired_seed():
    core = make_core(cache=True)
    prefix = "p" * 48
    core.cache_policy.published(TOK.encode(prefix, add_bos=False), 48)
    req, _ = make_req(prefix + " and more")
    core.submit(req)
    now = time.monotonic()
    hinted = core.hint_requests(now)
    assert hinted == [req]
    ref = TokenRef(ring_id=1, index=3, count=len(req.prompt), generation=1)
    plan = core.draft(now, {req.key: Resolved(ref, Seed(handle=11, length=32, expires_after=9))})
    ((_, cand),) = plan.draft.admitted
    assert cand.prefilled == 32 and plan.seeds[req.key].handle == 11 and plan.refs[req.key] == ref
    tick_plan = core.launch(plan, {req.key: ref}, {}, now)
    assert tick_plan.admits[0].seed_handle == 11 and tick_plan.admits[0].prompt == ref
    assert core.to_release == []


def test_an_unresolved_hint_is_a_cold_prefill_and_an_unused_seed_is_released():
    core = make_core(cache=True, lanes=1)
    prefix = "q" * 48
    core.cache_policy.published(TOK.encode(prefix, add_bos=False), 48)
    a, _ = make_req(prefix + " one")
    b, _ = make_req(prefix + " two")
    core.submit(a)
    core.submit(b)
    now = time.monotonic()
    assert core.hint_requests(now) == [a]  # one lane: only a is likely admitted
    ref = TokenRef(ring_id=1, index=1, count=1, generation=1)
    resolved = {a.key: Resolved(ref, None), b.key: Resolved(ref, Seed(handle=12, length=48, expires_after=9))}
    plan = core.draft(now, resolved)
    ((_, cand),) = plan.draft.admitted
    assert cand.key == a.key and cand.prefilled == 0 and plan.seeds == {}
    assert core.to_release == [12]


# --- grammar handles ---------------------------------------------------------------------------------


def test_a_finished_constrained_lane_frees_its_grammar_handle_when_it_retires():
    core = make_core()
    req, _ = make_req("json please", max_tokens=10)
    core.submit(req)
    core.grammars.hold(req, 31)
    tag = only_tag(tick(core))
    tick(core, emits={tag: ([123, 125], Finish.GRAMMAR)})
    assert core.grammars.pending_free == []  # the lane still holds it until it retires
    tick(core)
    assert core.grammars.pending_free == [31] and tag not in core.lanes


def test_a_hinted_request_that_arrives_while_hints_resolve_waits_for_the_next_plan():
    core = make_core(cache=True)
    prefix = "r" * 48
    core.cache_policy.published(TOK.encode(prefix, add_bos=False), 48)
    a, _ = make_req(prefix + " first")
    core.submit(a)
    now = time.monotonic()
    assert core.hint_requests(now) == [a]
    late, _ = make_req(prefix + " late")
    cold, _ = make_req("no cached prefix")
    core.submit(late)  # arrives while the loop awaits the match and acquire of ``a``
    core.submit(cold)
    ref = TokenRef(ring_id=1, index=1, count=1, generation=1)
    plan = core.draft(now, {a.key: Resolved(ref, Seed(handle=13, length=48, expires_after=9))})
    assert [c.key for _, c in plan.draft.admitted] == [a.key]  # never admitted cold, order kept
    core.launch(plan, {a.key: ref}, {}, now)
    assert core.hint_requests(now) == [late]  # the next plan resolves it


# --- long ticks beside streaming lanes ---------------------------------------------------------


def test_beside_a_streaming_lane_the_grant_spreads_the_pending_prefill_over_rounds():
    from basertd.server.sched.draft import pending_prefill, plan_limits

    core = make_core(lanes=2, decode_grant=8, long_prefill_budget=1024, max_itl_s=0.5)
    chat, _ = make_req("chat", max_tokens=50, qos="batch", stream=True)
    core.submit(chat)
    plan, _ = launch(core)
    ev, read = events(plan, emits={only_tag(plan): ([65], Finish.NONE)})
    accept(core, plan, ev, read)
    core.rates.observe(prefill_tokens=1000, prefill_s=4.0, decode_steps=8, decode_s=0.8)  # 4 ms/token
    doc, _ = make_req("d" * 1000, max_tokens=2, qos="batch")
    core.submit(doc)
    live = list(core.lanes.values())
    assert pending_prefill(core, live, 1024) == 1000
    assert plan_limits(core).decode_grant == 8  # an engine that does not spread: the configured grant
    core.can_yield = core.spreads_prefill = True  # the llama.cpp engine: yields, spreads
    grant = plan_limits(core).decode_grant
    assert grant == core.rates.round_grant(1000) == 14  # 75 prefill tokens per round
    assert not plan_limits(core).lengthened  # spread for the prefill, not for a short step
    assert (1000 / grant) * 0.004 + 0.1 <= 0.5  # each round within the inter-token bound


LOOKUP = link.StrategyOffer(
    strategy_id="prompt-lookup",
    strategy_slot=1,
    cert_id=1,
    sampling_modes=int(CertMode.GREEDY),
    param_domain=int(CertDomain.GREEDY_ONLY),
)


def test_a_speculating_lane_is_granted_decode_grant_rounds_of_its_measured_tokens_per_round():
    """``decode_grant`` counts rounds: a lane whose rounds commit accepted drafts gets that many
    rounds' worth of tokens (its tokens per round a decaying mean over its ticks), so its ticks do
    not end after one round; a plain lane keeps the configured grant, and the decode rate is
    measured per round, not per token."""
    core = make_core(strategies=(LOOKUP,), decode_grant=8)
    spec, _ = make_req("spec", max_tokens=500)
    plain, _ = make_req("plain", max_tokens=500, speculation="off")
    core.submit(spec)
    core.submit(plain)
    first = tick(core)
    s, p = (tag for tag, _ in first.draft.admitted)
    assert (core.lanes[s].strategy, core.lanes[p].strategy) == ("prompt-lookup", "")
    assert first.draft.decodes == [(s, 8), (p, 8)]  # nothing measured yet
    plan, _ = launch(core)
    assert plan.draft.decodes == [(s, 8), (p, 8)]
    # 3 rounds made 12 tokens (9 accepted drafts): 4 a round; the plain lane made 8 in 8 rounds.
    ev, read = events(
        plan,
        emits={s: (list(range(12)), Finish.NONE), p: (list(range(8)), Finish.NONE)},
        spec={s: (10, 9)},
        decode_ns=80_000_000,
    )
    accept(core, plan, ev, read)
    assert core.lanes[s].tokens_per_round == pytest.approx(2.5)  # half way from 1 to 4
    assert core.rates.decode_s_per_step == pytest.approx(0.01)  # 80 ms over 8 rounds, not 12 tokens
    plan, _ = launch(core)
    assert plan.draft.decodes == [(s, 20), (p, 8)]
    # A tick whose lookups found nothing: one token a round pulls the grant back down.
    ev, read = events(plan, emits={s: (list(range(20)), Finish.NONE), p: (list(range(8)), Finish.NONE)})
    accept(core, plan, ev, read)
    assert core.lanes[s].tokens_per_round == pytest.approx(1.75)
    plan, _ = launch(core)
    assert plan.draft.decodes == [(s, 14), (p, 8)]


def test_a_request_ending_on_a_partial_emit_reports_the_drafts_of_its_last_tick_so_far():
    """A speculating request whose Done goes out on a partial emit (``max_tokens`` reached
    mid-tick) counts in its usage the drafts the TICK_EMIT reports for that tick so far: the tick's
    SpecStats come after its Done. They then go to the worker's counters only, not twice into the
    usage."""
    core = make_core(strategies=(LOOKUP,), decode_grant=8)
    req, sink = make_req("spec", max_tokens=10)
    core.submit(req)
    first = tick(core)
    ((tag, _),) = first.draft.admitted
    plan, _ = launch(core)
    accept(core, plan, *events(plan, emits={tag: ([1, 2, 3, 4], Finish.NONE)}, spec={tag: (5, 3)}))
    plan, _ = launch(core)
    d = core.on_emit(tag, [5, 6, 7, 8, 9, 10], time.monotonic(), drafted=7, accepted=5)
    send([d])
    done = sink.end()
    assert isinstance(done, api.Done) and done.finish_reason == "length"
    assert (done.usage.draft_tokens, done.usage.accepted_draft_tokens) == (5 + 7, 3 + 5)
    accept(core, plan, *events(plan, emits={tag: ([5, 6, 7, 8, 9, 10], Finish.LENGTH)}, spec={tag: (9, 6)}))
    assert (req.draft_tokens, req.accepted_draft_tokens) == (12, 8)  # the Done's, not recounted
    assert core.spec_tokens["prompt-lookup"] == [5 + 9, 3 + 6]  # the worker verified all of them


def test_on_a_yielding_engine_a_long_interactive_prompt_prefills_whole_in_its_admitting_tick():
    core = make_core(lanes=2, prefill_budget=128, long_prefill_budget=1024)
    req, _ = make_req("i" * 900, max_tokens=2)  # interactive
    core.submit(req)
    core.can_yield = True
    plan, _ = launch(core)
    (_, offset, count), *_ = plan.draft.prefills
    assert (offset, count) == (0, 900)  # not cut to tiny tick-target chunks
    other = make_core(lanes=2, prefill_budget=128, long_prefill_budget=1024)  # cannot yield
    req2, _ = make_req("i" * 900, max_tokens=2)
    other.submit(req2)
    plan2, _ = launch(other)
    assert plan2.draft.prefills[0][2] < 900


def test_a_batch_arrival_cuts_a_long_prefill_tick_while_a_lane_is_free():
    """A tick that prefills past ``prefill_budget`` (the long budget: nothing urgent waited) runs
    for seconds; a batch request a free lane could take asks it to end (ADMIT, at a step boundary)
    instead of waiting that out. A short tick, or every lane busy, and it waits."""
    core = make_core(lanes=2, prefill_budget=64, long_prefill_budget=512)
    core.can_yield = True
    first, _ = make_req("the first prompt is long " * 20, max_tokens=8, qos="batch")
    core.submit(first)
    plan, _ = launch(core)
    assert plan.draft.prefill_tokens > 64
    assert core.submit(make_req("second", qos="batch")[0]) is YieldReason.ADMIT
    short = make_core(lanes=2, prefill_budget=512)
    short.can_yield = True
    short.submit(make_req("a short one", qos="batch")[0])
    launch(short)
    assert short.submit(make_req("second", qos="batch")[0]) is None
    full = make_core(lanes=1, prefill_budget=64, long_prefill_budget=512)
    full.can_yield = True
    full.submit(make_req("the first prompt is long " * 20, qos="batch")[0])
    launch(full)
    assert full.submit(make_req("second", qos="batch")[0]) is None  # no lane to take it
