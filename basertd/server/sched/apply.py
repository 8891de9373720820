"""Applying one accepted tick's events to the scheduling state (DESIGN.md "Scheduling", ABI
rules 53-73). Synchronous: the loop has already read the emitted tokens from the emit ring.

Order (as the engine applied the plan, rule 53): retires first (a retire with publish enters the
prefix index; a preempted or checkpointed lane's request goes back to the head of its class, the
oldest at the head), then admit results (a refused admit releases its seed and grammar handle and
fails its request, or requeues it when the code is transient), prefill progress (a PREFILL_CHUNK
shed entry cut the chunk: the rest resumes next tick, rule 57, and that lane did not decode),
replay countdown (rule 72), lane faults, then emitted tokens (the terminal emit delivers only what
the tick's partial emits did not), and last the measured rates.

Functions over the ``SchedulerState`` (as ``basertd.server.sched.draft``'s are); what reaches the
clients is collected into an ``Outbox`` (``basertd.server.sched.outcome``), never sent from here;
``now`` (monotonic seconds) is the loop's clock.
"""

from __future__ import annotations

import structlog

from basertd.schema.abi import AdmitStatus, FaultCode, Finish, ShedKind, Status
from basertd.schema.client import ErrorCode
from basertd.schema.tick import TickEvents
from basertd.server.request.record import GenerationRequest, token_logprobs
from basertd.server.sched.draft import Plan, checkpoint
from basertd.server.sched.lanes import Lane
from basertd.server.sched.outcome import Accepted, Delivery, Outbox
from basertd.server.sched.state import SchedulerState

log = structlog.get_logger("basertd.scheduler")

TRANSIENT_ADMIT_CODES = frozenset({Status.REJECT_STALE_SEED, Status.NEEDS_REPLAN, Status.REJECT_BUDGET})
"""Admit reject codes after which the request is requeued rather than failed."""
MAX_ADMIT_RETRIES = 3
"""Transient admit refusals (and stale-seed plan rejections in a row) before a request fails."""
FINISH_REASON = {Finish.EOS: "eos", Finish.LENGTH: "length", Finish.GRAMMAR: "stop"}


def deliver(
    st: SchedulerState, lane: Lane, tokens: list[int], now: float, out: list, logprobs: list | None = None
) -> str | None:
    """``tokens`` for ``lane``'s request (its messages into ``out``); returns its finish reason
    when they end it."""
    req = lane.request
    first = req.t_first_token is None
    if tokens:
        st.t_token[lane.tag] = now
        if req.admissions == 0:  # tokens before the admitting tick's apply (a partial emit): the
            _count_cached(lane)  # admit took, and the Done they may bring reports the cached tokens
    reason = req.deliver(tokens, now, logprobs, out)
    if first and req.t_first_token is not None:
        in_flight = 1 if req.tick_in_flight_at_arrival else 0
        req.ttft_ticks = st.plan_seq - req.plan_seq_received + in_flight
    return reason


def _count_cached(lane: Lane) -> None:
    """``lane``'s request at its first admission: the prompt tokens its seed served are its
    cached tokens (later admissions, seeded from its own work, do not count)."""
    lane.request.cached_tokens = min(lane.seeded_tokens, len(lane.request.prompt))


def finish(st: SchedulerState, lane: Lane, reason: str, now: float, out: list) -> None:
    """``lane``'s request ended with ``reason`` (its Done into ``out``): the lane retires (with
    publish when ``[cache] publish_on_retire``) in the next plan."""
    lane.request.finish(reason, now, out)
    st.requests_done += 1
    lane.retire = True
    lane.publish = st.cache.publish_on_retire


def on_emit(
    st: SchedulerState, lane_tag: int, tokens: list[int], now: float, *, drafted: int = 0, accepted: int = 0
) -> Delivery | None:
    """A partial emit (TICK_EMIT) of the tick in flight: ``tokens`` of lane ``lane_tag`` for its
    client now (a logprobs lane's go out with their rows, from the tick's events). ``drafted`` /
    ``accepted``: the lane's drafts so far this tick (``link.TickEmit``); a request that ends here
    counts them in its usage, as its Done goes out before the tick's SpecStats (``_count_spec``
    then leaves its usage alone). Returns the request's delivery, None when there is nothing to
    send."""
    lane = st.lanes.get(lane_tag)
    if lane is None or lane.request.finished or lane.request.sampler.logprobs:
        return None
    lane.tick_tokens.extend(tokens)
    d = Delivery(lane.request)
    reason = deliver(st, lane, tokens, now, d.messages)
    if reason is not None:
        lane.request.draft_tokens += drafted
        lane.request.accepted_draft_tokens += accepted
        finish(st, lane, reason, now, d.messages)
    return d if d.messages else None


def _retired(st: SchedulerState, lane: Lane, publish: bool, preempted: bool, now: float) -> None:
    """``lane`` was retired by an accepted plan: index what it published, requeue its request
    when it was preempted or checkpointed."""
    if publish and lane.kv_tokens >= st.cache_policy.page:
        st.cache_policy.published(lane.published_tokens(), lane.kv_tokens, lane.hashes, now)
    req = lane.request
    st.grammars.drop(req)
    if not (preempted or lane.requeue) or req.finished:
        return
    st.requeue(req)
    if preempted:
        req.preemptions += 1
        st.preemptions += 1
        st.metrics.preempted(st.worker_id, req.qos)
        log.info(
            "lane_preempted",
            worker_id=st.worker_id,
            lane_tag=lane.tag,
            request_key=req.key,
            qos=req.qos,
            generated=len(req.generated),
        )
    else:
        st.checkpoints += 1
        log.debug("lane_checkpointed", worker_id=st.worker_id, lane_tag=lane.tag, tokens=lane.kv_tokens)


def _admit_refused(st: SchedulerState, req: GenerationRequest, result, now: float, out: Outbox) -> None:
    if req.finished:
        return
    code = None
    if result is not None:
        try:
            code = result.reject_status
        except ValueError:
            code = None
    name = code.name if code is not None else "no admit result"
    tries = st.admit_retries.get(req.key, 0)
    if code in TRANSIENT_ADMIT_CODES and tries < MAX_ADMIT_RETRIES:
        st.admit_retries[req.key] = tries + 1
        st.requeue(req)
        log.info("admit_requeued", worker_id=st.worker_id, request_key=req.key, status=name)
        return
    st.admit_retries.pop(req.key, None)
    log.warning("admit_refused", worker_id=st.worker_id, request_key=req.key, status=name)
    st.fail(req, ErrorCode.INVALID_REQUEST, f"the engine refused this request ({name})", now, out)


def _end_lane(st: SchedulerState, lane: Lane, message: str, now: float, out: Outbox) -> None:
    if not lane.request.finished:
        st.fail(lane.request, ErrorCode.INTERNAL, message, now, out)
    lane.retire = True
    lane.publish = False


def apply_accepted(st: SchedulerState, plan: Plan, tick: Accepted, now: float, out: Outbox) -> None:
    """Apply the accepted tick of ``plan``: its events and the tokens of each emit with
    ``n_tokens`` (``Accepted.tokens``). Counts the tick, the tokens and the cache evictions it
    reports; what reaches the clients goes into ``out``."""
    events = tick.events
    st.rejections = 0
    st.max_admits = None
    st.prefill_cap = None
    st.ticks_run += 1
    st.cache_policy.on_tick(events.shed.entries)
    draft = plan.draft
    preempted = set(draft.preempted)
    # Victims go back to the head of their class oldest last, so the oldest is at the head.
    retired = [(tag, publish, st.lanes.pop(tag, None)) for tag, publish in draft.retires]
    retired.sort(key=lambda r: -(r[2].request.t_received if r[2] is not None else 0.0))
    for tag, publish, lane in retired:
        if lane is not None:
            _retired(st, lane, publish, tag in preempted, now)

    results = {r.lane_tag: r for r in events.admit_results}
    for tag, cand in draft.admitted:
        lane = st.lanes.get(tag)
        r = results.get(tag)
        if lane is not None and (r is None or r.status != AdmitStatus.ADMITTED):
            del st.lanes[tag]
            seed = plan.seeds.get(cand.key)
            if seed is not None:
                st.to_release.append(seed.handle)
            st.grammars.drop(lane.request)
            _admit_refused(st, lane.request, r, now, out)
        elif lane is not None and lane.request.admissions == 0:
            _count_cached(lane)
        if lane is not None and tag in st.lanes:
            lane.request.admissions += 1

    shed = {e.lane_tag: e.tokens for e in events.shed.entries if e.kind == ShedKind.PREFILL_CHUNK}
    for tag, offset, count in draft.prefills:
        lane = st.lanes.get(tag)
        if lane is not None:
            done = max(0, count - shed.get(tag, 0))
            lane.prefilled = offset + done
            st.prefill_tokens_total += done
            if lane.checkpoint and lane.prefilled >= lane.checkpoint:
                checkpoint(lane)
    replayed: dict[int, int] = {}
    for tag, grant in draft.decodes:
        lane = st.lanes.get(tag)
        if tag in shed:
            continue  # its prefill was cut (a yield or a budget shed): it did not decode
        if lane is not None and lane.replay_left:
            used = min(grant, lane.replay_left)
            lane.replay_left -= used
            lane.replayed += used
            replayed[tag] = used

    for fault in events.faults:
        lane = st.lanes.get(fault.lane_tag)
        if lane is None:
            continue
        try:
            name = FaultCode(fault.code).name
        except ValueError:
            name = str(fault.code)
        log.warning(
            "lane_fault",
            worker_id=st.worker_id,
            lane_tag=fault.lane_tag,
            code=name,
            detail=fault.detail,
        )
        _end_lane(st, lane, f"the engine stopped this generation (lane fault {name})", now, out)
        lane.requeue = False

    _apply_emits(st, events, tick.tokens, now, out)
    for tag, _ in draft.decodes:  # a completed tick that took a request past its last crash
        lane = st.lanes.get(tag)
        if lane is not None and tag not in shed:
            req = lane.request
            if req.crash_streak and len(req.generated) > req.crash_mark:
                req.crash_streak = 0

    for lane in st.lanes.values():
        if lane.request.finished:
            lane.retire = True
        lane.tick_tokens.clear()

    t = events.timings
    rounds = {e.lane_tag: decode_rounds(e.n_tokens, e.spec.accepted) for e in events.emits}
    steps = max((rounds.get(tag, 0) + replayed.get(tag, 0) for tag, _ in draft.decodes), default=0)
    prefilled = sum(max(0, n - shed.get(tag, 0)) for tag, _, n in draft.prefills)
    st.rates.observe(prefilled, t.prefill_ns / 1e9, steps, t.decode_ns / 1e9)
    st.last_mem = events.mem
    for tag in [t for t in st.t_token if t not in st.lanes]:
        del st.t_token[tag]


def decode_rounds(tokens: int, accepted: int) -> int:
    """Decode rounds that committed ``tokens`` tokens of which ``accepted`` were accepted drafts:
    each round commits its accepted drafts and one token of its own (tick ABI §2), so ``tokens -
    accepted``, at least 1 when any token came (a lane that finished on an accepted draft commits
    no token of its own in its last round)."""
    if tokens <= 0:
        return 0
    return max(1, tokens - accepted)


TOKENS_PER_ROUND_ALPHA = 0.5
"""Weight of one tick in a lane's ``tokens_per_round`` (its past halves every tick, so a lane whose
drafts stop paying is back near one token a round after a tick or two)."""


def _note_rounds(lane: Lane, tokens: int, accepted: int) -> None:
    """Fold one tick's ``tokens`` and accepted drafts into ``lane.tokens_per_round`` (the grant's
    scale, ``plan_builder``); a tick that emitted nothing says nothing."""
    rounds = decode_rounds(tokens, accepted)
    if rounds:
        lane.tokens_per_round += TOKENS_PER_ROUND_ALPHA * (tokens / rounds - lane.tokens_per_round)


def _count_spec(st: SchedulerState, lane: Lane, drafted: int, accepted: int) -> None:
    """An emit's SpecStats (tick ABI §2): into the worker's counters of the lane's strategy, and
    into the request's usage unless its Done already went out (it ended on a partial emit, which
    counted the drafts up to its end: ``on_emit``)."""
    req = lane.request
    if not req.finished:
        req.draft_tokens += drafted
        req.accepted_draft_tokens += accepted
    row = st.spec_tokens.setdefault(lane.strategy or "unknown", [0, 0])
    row[0] += drafted
    row[1] += accepted


def _apply_emits(
    st: SchedulerState, events: TickEvents, read: dict[int, list[int] | None], now: float, out: Outbox
) -> None:
    rows: dict[int, list] = {}
    for row in events.logprobs:
        rows.setdefault(row.lane_tag, []).append(row)
    for emit in events.emits:
        lane = st.lanes.get(emit.lane_tag)
        if lane is None:
            continue
        partial, lane.tick_tokens = lane.tick_tokens, []
        tokens: list[int] = []
        if emit.n_tokens:
            got = read.get(emit.lane_tag)
            if got is None:
                log.error("emit_unreadable", worker_id=st.worker_id, lane_tag=lane.tag)
                _end_lane(st, lane, "emitted tokens were lost", now, out)
                continue
            tokens = list(got)
        lane.emitted.extend(tokens)
        st.decode_tokens_total += len(tokens)
        if emit.spec.proposed:
            _count_spec(st, lane, emit.spec.proposed, emit.spec.accepted)
        if lane.strategy:
            _note_rounds(lane, len(tokens), emit.spec.accepted)
        if tokens[: len(partial)] != partial:
            log.error("partial_emits_disagree", worker_id=st.worker_id, lane_tag=lane.tag)
        req = lane.request
        lps = None
        if req.sampler.logprobs and not req.finished:
            try:
                lps = token_logprobs(tokens, rows.get(lane.tag, []))[len(partial) :]
            except ValueError as exc:
                st.fail(
                    req, ErrorCode.INTERNAL, f"the engine's logprobs do not match its tokens: {exc}", now, out
                )
        fresh = tokens[len(partial) :]
        if req.finished:
            reason = None
        else:
            msgs = out.to(req)
            reason = deliver(st, lane, fresh, now, msgs, lps) if fresh else None
            if reason is None and emit.finish != Finish.NONE:
                if emit.finish in FINISH_REASON:
                    reason = FINISH_REASON[emit.finish]
                else:
                    st.fail(
                        req,
                        ErrorCode.INTERNAL,
                        f"the engine ended this generation (finish {emit.finish})",
                        now,
                        out,
                    )
                    lane.retire = True
            if reason is not None:
                finish(st, lane, reason, now, msgs)
                continue
        if emit.finish != Finish.NONE:
            lane.retire = True
