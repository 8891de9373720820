"""Drafting one plan from the scheduling state (DESIGN.md "Scheduling", "Prefix cache policy").

Synchronous: no awaits, no link. A plan is made in two steps around the loop's I/O:

1. ``hint_requests(state, now)``: a trial draft with each candidate's cached-prefix *hint* from the
   prefix index; the requests it admits with a hint are the ones the loop resolves (writes their
   prompt into ring 1, ``space_match``, then ``seed_acquire``), all of them, before anything else.
2. ``draft(state, now, resolved)``: the plan, built once from the state and the resolved seeds. A
   hint that did not resolve counts as a cold prefill (seed 0); seeds the plan does not use are
   put on ``state.to_release`` so the loop releases them before the tick.

Both run prefix coalescing first (``coalescing_for``), so a leader lane gets its checkpoint and a
follower waits; requests on probation (one crash away from failing) are admitted one per plan;
a waiting interactive request may preempt a lower-class lane (``build_plan``'s ``urgent_after``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from basertd.schema.tick import TickPlan, TokenRef
from basertd.server.cache.coalescing import Coalescing, PrefillingLane, QueuedPrompt, coalesce
from basertd.server.cache.policy import Seed
from basertd.server.request.record import QOS_CLASSES, GenerationRequest
from basertd.server.sched.lanes import Lane, Probe, candidate
from basertd.server.sched.plan_builder import Candidate, PlanDraft, PlanLimits, build_plan
from basertd.server.sched.qos import INTERACTIVE, LaneCaps, qos_rank
from basertd.server.sched.state import SchedulerState

COALESCE_SCAN = 256
"""Queued requests (in admission order) considered for prefix coalescing each plan."""


@dataclass(eq=False)
class Plan:
    """One plan: the ``draft`` (``PlanDraft``: ``draft.admitted`` holds the (lane tag,
    ``Candidate``) pairs), the requests it admits (by request key), the seed leases it consumes and
    the prompt-ring refs those were matched on (by key), and, once launched, the ``TickPlan`` sent
    (``tick``; its ``admits`` are the ``LaneAdmit`` records)."""

    draft: PlanDraft = field(default_factory=PlanDraft)
    requests: dict[int, GenerationRequest] = field(default_factory=dict)
    seeds: dict[int, Seed] = field(default_factory=dict)
    refs: dict[int, TokenRef] = field(default_factory=dict)
    tick: TickPlan | None = None


@dataclass(frozen=True)
class Resolved:
    """A cached-prefix hint resolved by the loop: the prompt-ring ``ref`` the prompt was matched
    on and the acquired ``seed`` (None: the hint did not hold; the request is admitted cold)."""

    ref: TokenRef
    seed: Seed | None


def checkpoint(lane: Lane) -> None:
    """Retire ``lane`` with publish in the next plan and requeue its request (its prefix is shared
    by waiting requests)."""
    lane.retire = True
    lane.publish = True
    lane.requeue = True


def coalescing_for(st: SchedulerState, now: float) -> Coalescing:
    """Prefix coalescing (``basertd.server.cache.coalescing.coalesce``): which queued requests wait for a
    leader's prefix; leader lanes get their checkpoint (a lane already past it retires now)."""
    wc = st.cache_policy
    if not wc.enabled or not st.cache.coalesce_min_tokens or not len(st.queues):
        return Coalescing()
    queued = []
    for req in itertools.islice(st.queues.ordered(now, st.config.aging_s), COALESCE_SCAN):
        if req.generated:
            continue  # a resumed request: its prefix is its own, it neither leads nor waits
        hashes = st.hashes(req)
        queued.append(
            QueuedPrompt(
                req.key,
                hashes,
                wc.index.longest(hashes),
                len(req.prompt),
                not req.checkpointed,
                qos_rank(req.qos),
            )
        )
    # A leader keeps leading until its prefix is published: while it prefills towards its
    # checkpoint and during the plan that retires it (the index learns the prefix only once that
    # plan is accepted). A request leads at most once. A finished lane retiring with publish
    # leads for this one plan as well.
    lanes = []
    for lane in st.lanes.values():
        done = lane.retire or lane.request.finished
        publishing = done and (lane.requeue or lane.publish)
        if (done and not publishing) or lane.replay_left or not lane.hashes:
            continue
        if publishing:  # it publishes its generated tokens too (a conversation's next turn)
            kv = lane.kv_tokens
            hashes = wc.hashes(lane.published_tokens(), lane.hashes)
            lanes.append(PrefillingLane(lane.tag, hashes, kv, kv, True, qos_rank(lane.request.qos), True))
            continue
        lanes.append(
            PrefillingLane(
                lane.tag,
                lane.hashes,
                lane.prefilled,
                lane.prompt_len,
                lane.checkpoint > 0 or not lane.request.checkpointed,
                qos_rank(lane.request.qos),
            )
        )
    out = coalesce(queued, lanes, wc.page, st.cache.coalesce_min_tokens)
    for tag, cp in out.lane_checkpoints.items():
        lane = st.lanes[tag]
        if lane.retire or lane.request.finished:
            continue  # already retiring with publish
        lane.request.checkpointed = True
        lane.checkpoint = max(lane.checkpoint, cp)
        if lane.prefilled >= lane.checkpoint:
            checkpoint(lane)
    return out


def pending_prefill(st: SchedulerState, live: list, limit: int) -> int:
    """Prompt tokens the next tick may prefill (at most ``limit``): what the live lanes have left
    to prefill, then the queued prompts in queue order."""
    total = sum(max(0, lane.prompt_len - lane.prefilled) for lane in live if lane.phase == "prefill")
    for req in st.queues:
        if total >= limit:
            break
        total += len(req.prompt) + len(req.generated)
    return min(total, limit)


def plan_limits(st: SchedulerState) -> PlanLimits:
    """The limits of the next plan: the worker's lanes, batch and KV, this tick's prefill budget
    and decode grant (``TickRates.budgets``; no more than ``decode_grant`` rounds while requests
    are queued; capped after a rejected plan), the lane caps."""
    live = [lane for lane in st.lanes.values() if not lane.retire and not lane.request.finished]
    interactive = QOS_CLASSES[INTERACTIVE]
    waiting = st.queues.depth(interactive) > 0 or any(
        lane.phase == "prefill" and lane.request.qos == interactive for lane in live
    )
    decoding = [lane for lane in live if lane.phase == "decode"]
    streaming = any(lane.request.stream for lane in decoding)
    rates, cfg = st.rates, st.config
    rates.long_prefill = cfg.long_prefill_budget
    rates.max_itl_s = cfg.max_itl_s
    rates.min_chunk = cfg.min_prefill_chunk
    rates.decode_tick_s = cfg.decode_tick_s
    prefill_budget, grant = rates.budgets(
        waiting, bool(decoding), streaming=streaming, can_yield=st.can_yield
    )
    if len(st.queues):
        # Requests wait for a lane: no ticks lengthened past decode_grant (decode_tick_s), so a lane
        # that finishes mid-tick (which the coordinator may learn only at the tick's end) is
        # refilled soon.
        grant = min(grant, rates.max_grant)
    lengthened = grant > rates.max_grant
    urgent_budget = cfg.prefill_budget
    if st.can_yield:  # an arrival cuts a long tick anyway: an interactive prompt prefills whole
        urgent_budget = max(urgent_budget, cfg.long_prefill_budget)
    rows = rates.round_rows()
    if streaming and st.can_yield and st.spreads_prefill and rows:
        # The engine spreads the tick's prefill over its decode rounds: grant enough rounds that
        # each fits the inter-token bound, and prefill no more than the rounds the streaming lanes
        # can still run (a lane near its end decodes its last tokens, then stops).
        pending = pending_prefill(st, live, prefill_budget + (urgent_budget if waiting else 0))
        grant = max(grant, rates.round_grant(pending))
        rounds = min(grant, max(lane.request.remaining for lane in decoding if lane.request.stream))
        prefill_budget = min(prefill_budget, max(1, rounds) * rows)
        urgent_budget = min(urgent_budget, max(1, rounds) * rows)
    if st.prefill_cap is not None:
        prefill_budget = min(prefill_budget, st.prefill_cap)
    lim = st.limits
    return PlanLimits(
        max_lanes=lim.max_lanes,
        max_decode_lanes=lim.max_batch_size,
        kv_tokens=lim.kv_tokens,
        prefill_budget=prefill_budget,
        decode_grant=grant,
        max_admit_tokens=lim.max_admit_tokens,
        max_admits=(1 << 30) if st.max_admits is None else st.max_admits,
        urgent_prefill_budget=urgent_budget if st.prefill_cap is None else 0,
        lane_caps=LaneCaps.from_names(cfg.lane_caps),
        preempt=cfg.preempt,
        preempt_publish=st.cache.publish_on_retire,
        lengthened=lengthened,
    )


def _build(st: SchedulerState, now: float, seed_of, limits: PlanLimits, held=None) -> Plan:
    """One ``build_plan`` over the state with ``seed_of(req)`` tokens cached for each candidate;
    ``held(req)``: the request must not be admitted by this plan (nor any after it in admission
    order; an urgent one is skipped alone)."""
    coal = coalescing_for(st, now)
    probe = Probe(any(st.probation(lane.request) for lane in st.lanes.values()))
    seen: list[GenerationRequest] = []
    interactive = QOS_CLASSES[INTERACTIVE]

    def offer(req: GenerationRequest, urgent: bool) -> Candidate:
        seen.append(req)
        return candidate(
            req,
            st.limits.page_tokens,
            seed=seed_of(req),
            urgent=urgent,
            checkpoint=coal.leader_checkpoints.get(req.key, 0),
        )

    def candidates() -> Iterator[Candidate]:
        blocked = coal.blocked
        for req in st.queues.ordered(now, st.config.aging_s, skip=lambda r: r.key in blocked):
            if held is not None and held(req):
                return
            if st.probation(req) and not probe.take():
                continue
            yield offer(req, req.qos == interactive and st.config.preempt)

    def urgent_after() -> Iterator[Candidate]:
        if not st.config.preempt:
            return
        read = {r.key for r in seen}
        for req in list(st.queues.classes[interactive]):
            if req.finished or req.key in read or req.key in coal.blocked:
                continue
            if held is not None and held(req):
                continue
            if st.probation(req) and not probe.take():
                continue
            yield offer(req, True)

    views = [lane.view() for lane in st.lanes.values()]
    plan = Plan()
    plan.draft = build_plan(views, candidates(), limits, next_tag=st.next_tag, urgent_after=urgent_after())
    by_key = {req.key: req for req in seen}
    plan.requests = {cand.key: by_key[cand.key] for _, cand in plan.draft.admitted}
    return plan


def _hint(st: SchedulerState, req: GenerationRequest) -> int:
    """Tokens of ``req``'s admitted prompt the prefix index says are cached (a page multiple)."""
    return st.cache_policy.hint(st.resume_hashes(req), len(req.prompt) + len(req.generated))


def hint_requests(st: SchedulerState, now: float) -> list[GenerationRequest]:
    """The requests the next plan is likely to admit with a cached-prefix hint from the index
    (a trial draft), in admission order: the loop resolves each (match, then acquire) before the
    plan is drafted. Empty when seeds are off (cache disabled, or one seedless plan after a
    stale-seed rejection, which this call consumes)."""
    st.draft_limits = plan_limits(st)  # one plan in the making: its limits hold for both drafts
    st.draft_seeding = st.cache_policy.enabled and st.seedless_plans == 0
    if st.seedless_plans:
        st.seedless_plans -= 1
    if not st.draft_seeding:
        return []
    trial = _build(st, now, lambda req: _hint(st, req), st.draft_limits)
    return [trial.requests[c.key] for _, c in trial.draft.admitted if c.prefilled > 0]


def draft(st: SchedulerState, now: float, resolved: dict[int, Resolved]) -> Plan:
    """The plan, built once from the state and the resolved hints (request key -> ``Resolved``;
    a hint that did not resolve is a cold prefill). A request with a hint the loop did not
    resolve (it arrived while the hints were resolved, or the seeds left room for more than the
    trial draft admitted) is not admitted cold: it and those after it wait for the next plan,
    which resolves it. The plan's ``seeds`` and ``refs`` are those of its admits; every other
    resolved seed goes to ``st.to_release``."""
    seeding, st.draft_seeding = st.draft_seeding, False

    def held(req: GenerationRequest) -> bool:
        return seeding and req.key not in resolved and _hint(st, req) > 0

    def seed_of(req: GenerationRequest) -> int:
        got = resolved.get(req.key)
        return got.seed.length if got is not None and got.seed is not None else 0

    limits, st.draft_limits = st.draft_limits or plan_limits(st), None
    plan = _build(st, now, seed_of, limits, held)
    admitted = {cand.key for _, cand in plan.draft.admitted}
    for key, got in resolved.items():
        if got.seed is None:
            continue
        if key in admitted:
            plan.seeds[key] = got.seed
            plan.refs[key] = got.ref
        else:
            st.to_release.append(got.seed.handle)
    return plan
