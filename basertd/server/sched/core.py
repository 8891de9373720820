"""The synchronous scheduler core of one worker (DESIGN.md "Scheduling"): state in, plan out;
outcomes in, deliveries out. No awaits, no link, no rings, no processes, no sinks, no clock: every
verb that needs the time takes ``now`` (monotonic seconds) from the loop.

The async per-worker loop (``basertd.server.sched.loop.Scheduler``) drives it with these verbs:

- requests in: ``submit(req)`` (returns a ``YieldReason`` when the tick in flight must yield),
  ``adopt(req)`` (a peer's lost lane), ``cancel(req, now)`` / ``drop(req, code, message, now)``,
  and ``check_admission`` before any of them;
- a plan: ``hint_requests(now)`` names the requests whose cached-prefix seed the loop resolves
  (match then acquire, ``basertd.server.sched.draft``), ``draft(now, resolved)`` builds the
  ``Plan`` value once (unused seeds go to ``to_release``; ``abandon(plan)`` when the loop will
  not send it), ``launch(plan, refs, biases, now)`` makes its admits lanes and returns the
  ``TickPlan`` to submit (the loop wrote the prompts into ring 1 and gave their refs);
- while the tick runs, ``on_emit(lane_tag, tokens, now)`` per partial emit (TICK_EMIT);
- ``apply(plan, outcome, now)`` with the tick's outcome (``basertd.server.sched.outcome``):
  ``Accepted(events, tokens)``, ``Rejected(status)`` (the engine changed nothing, ABI rules
  13-52), or ``Lost(error)`` (the worker died: its live lanes become requests to resume, or fail
  after ``max_crash_resumes`` crashes in a row without a token);
- time passing: ``expire(now)`` sends ``Queued`` notices (and fails stuck requests when the loop
  stalled); ``fail_queued`` / ``stop`` end what waits (the worker gave up, the daemon stops).

Every verb that ends or feeds requests returns ``Delivery`` records (one per request: its client
messages in order); the loop hands them to the sinks. Retired lanes publish to the prefix index
and requeue preempted or checkpointed requests at the head of their class (``requeue``, with
``decode_replay`` on re-admission, ABI rules 71-73); seed leases to release collect in
``to_release``, grammar handles to free in ``grammars.pending_free`` (ABI rule 74).
"""

from __future__ import annotations

import structlog

from basertd.schema import client as api
from basertd.schema.abi import Status, TickFlag
from basertd.schema.client import ErrorCode
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, ShedPolicy, TickPlan, TokenRef
from basertd.server.request.record import QOS_CLASSES, AdmissionError, GenerationRequest, RequestState
from basertd.server.sched import apply as scheduler_apply
from basertd.server.sched import draft as scheduler_draft
from basertd.server.sched.apply import MAX_ADMIT_RETRIES
from basertd.server.sched.draft import Plan, Resolved
from basertd.server.sched.lanes import Lane, reservation
from basertd.server.sched.outcome import Accepted, Applied, Delivery, Lost, Outbox, Outcome, Rejected
from basertd.server.sched.qos import INTERACTIVE, effective_rank, qos_rank
from basertd.server.sched.rejects import CLIENT_FIELD, Action, suspect_field, triage
from basertd.server.sched.speculation import overshoot, strategy_for
from basertd.server.sched.state import SchedulerState
from basertd.shm import YieldReason

log = structlog.get_logger("basertd.scheduler")

QUEUED_FIRST_S = 1.0
"""Seconds a request waits in the queue before its first ``Queued`` notice."""
QUEUED_EVERY_S = 5.0
"""Seconds between two ``Queued`` notices of a request that still waits."""


class SchedulerCore(SchedulerState):
    """The scheduler core of one worker (module docstring): the verbs over its
    ``SchedulerState``; accepted ticks are applied by ``basertd.server.sched.apply``, plans drafted
    by ``basertd.server.sched.draft``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.flight: Plan | None = None  # the plan of the tick in flight
        self.urgent_arrivals: list[GenerationRequest] = []  # since the plan in making started
        self.queued_notices: dict[int, float] = {}  # request key -> when its last Queued was sent

    # --- requests in ------------------------------------------------------------------------------

    def check_admission(
        self, prompt_len: int, max_tokens: int, qos: str, *, acknowledged: bool = False
    ) -> None:
        """Refuse a Generate that can never run or cannot be queued, before anything is queued.
        Raises ``AdmissionError``: CONTEXT_LENGTH_EXCEEDED (prompt + max_tokens over the context
        window, or over the worker's KV capacity, or a prompt longer than one plan may carry),
        QUEUE_FULL (``queue_limit`` of the class or ``max_queued_tokens`` reached; not for an
        ``acknowledged`` request, one recovered after a restart: refusing it would lose it),
        SHUTTING_DOWN."""
        lim = self.limits
        if self.stopping:
            raise AdmissionError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        # The field to shorten: the prompt when it alone overflows, else max_tokens.
        param = "prompt" if prompt_len >= lim.context_length else "max_tokens"
        if prompt_len + max_tokens > lim.context_length:
            raise AdmissionError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"({lim.context_length} tokens)",
                param,
            )
        if (
            reservation(prompt_len + max_tokens, lim.page_tokens) > lim.kv_tokens
            or prompt_len > lim.max_admit_tokens
        ):
            raise AdmissionError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) does not fit the worker's KV pool",
                "prompt" if prompt_len > lim.max_admit_tokens else param,
            )
        if acknowledged:
            return
        if self.queues.depth(qos) >= self.config.queue_limit:
            raise AdmissionError(
                ErrorCode.QUEUE_FULL, f"the {qos} queue is full ({self.config.queue_limit} requests)"
            )
        if self.queues.tokens + prompt_len > self.config.max_queued_tokens:
            raise AdmissionError(
                ErrorCode.QUEUE_FULL, f"queued prompt tokens would exceed {self.config.max_queued_tokens}"
            )

    def submit(self, req: GenerationRequest) -> YieldReason | None:
        """Queue an admitted request (``check_admission`` passed). Returns URGENT_ADMIT when the
        tick in flight must yield for it (``outranks_flight``), ADMIT when a free lane could take
        it and that tick was lengthened past ``decode_grant`` (``lengthened_flight``) or prefills
        past ``prefill_budget`` (``long_flight``), else None;
        an urgent one that arrives while a plan is being made is remembered for
        ``urgent_missed``."""
        req.worker_id = self.worker_id
        req.plan_seq_received = self.plan_seq
        req.tick_in_flight_at_arrival = self.flight is not None
        self.queues.push(req)
        if not self.outranks_flight(req):
            return YieldReason.ADMIT if self.lengthened_flight() or self.long_flight() else None
        if self.flight is not None:
            return YieldReason.URGENT_ADMIT
        self.urgent_arrivals.append(req)
        return None

    def adopt(self, req: GenerationRequest) -> None:
        """Take over ``req``, resumed after another worker died: it goes to the head of its class
        and resumes here with its delivered tokens (ABI rules 71-73)."""
        req.worker_id = self.worker_id
        req.page_hashes = []  # this worker's page size may differ
        self.requeue(req)

    def cancel(
        self, req: GenerationRequest, now: float, code: ErrorCode = ErrorCode.CANCELLED, message: str = ""
    ) -> tuple[YieldReason | None, list[Delivery]]:
        """End ``req`` now with ``Error(code)`` (a no-op once finished): the client cancelled or
        went away. A queued request is dropped and never starts; a running one stops receiving
        tokens and its lane retires in the next plan (DESIGN.md "Scheduling"). Returns CANCEL when
        the tick in flight should end soon, and the deliveries."""
        if req.finished:
            return None, []
        req.cancelled = True
        why = None
        if req.state is not RequestState.QUEUED and self.flight is not None and req.lane_tag is not None:
            why = YieldReason.CANCEL  # its lane retires in the next plan: end this tick soon
        return why, self.drop(req, code, message or "cancelled", now)

    def drop(self, req: GenerationRequest, code: ErrorCode, message: str, now: float) -> list[Delivery]:
        """End ``req`` with ``Error(code, message)``, dequeued when it is queued (a running one's
        lane retires in the next plan); a no-op once finished. Returns the deliveries."""
        if req.finished:
            return []
        if req.state is RequestState.QUEUED:
            self.queues.remove(req)
        out = Outbox()
        self.fail(req, code, message, now, out)
        return out.take()

    def fail_queued(self, code: ErrorCode, message: str, now: float) -> list[Delivery]:
        """Fail every queued request with ``code`` (the worker is unavailable); returns the
        deliveries (one per request failed)."""
        out = Outbox()
        for req in self.queues.drain():
            if not req.finished:
                self.fail(req, code, message, now, out)
        return out.take()

    def stop(self, code: ErrorCode, message: str, now: float) -> list[Delivery]:
        """Refuse new requests from now on and fail everything queued or running with ``code``
        (the daemon stops); returns the deliveries."""
        self.stopping = True
        out = self.fail_queued(code, message, now)
        tail = Outbox()
        for lane in self.lanes.values():
            if not lane.request.finished:
                self.fail(lane.request, code, message, now, tail)
        return out + tail.take()

    def expire(self, now: float, stalled: str | None = None, bound_s: float = 0.0) -> list[Delivery]:
        """Time passed (``now``: monotonic seconds): ``Queued`` notices for requests still waiting
        for their first token (``QUEUED_FIRST_S``, then every ``QUEUED_EVERY_S``). With
        ``stalled`` (why the idle loop stalled), first fail each request queued ``bound_s``
        seconds or more and drop the re-planning caps (they may be what keeps every plan empty).
        Returns the deliveries."""
        out = Outbox()
        if stalled is not None:
            for req in [r for r in self.queues if now - r.t_received >= bound_s]:
                self.queues.remove(req)
                self.fail(req, ErrorCode.INTERNAL, f"worker {self.worker_id} stalled: {stalled}", now, out)
            self.max_admits = None
            self.prefill_cap = None
        self._notify_queued(now, out)
        return out.take()

    def _notify_queued(self, now: float, out: Outbox) -> None:
        ahead = 0
        notices: dict[int, float] = {}
        for qos in QOS_CLASSES:
            for req in list(self.queues.classes[qos]):
                if req.finished or req.t_first_token is not None:
                    ahead += not req.finished
                    continue  # the notice is for the wait before the first token
                last = self.queued_notices.get(req.key)
                if last is not None:
                    notices[req.key] = last
                waited = now - req.t_received
                if waited >= QUEUED_FIRST_S and (last is None or now - last >= QUEUED_EVERY_S):
                    out.to(req).append(api.Queued(request_id=req.request_id, position=ahead, qos=qos))
                    notices[req.key] = now
                ahead += 1
        self.queued_notices = notices

    # --- views ------------------------------------------------------------------------------------

    def load(self) -> float:
        """Queued + running requests per lane (for routing a request to the least busy worker)."""
        return (len(self.queues) + len(self.lanes)) / max(1, self.limits.max_lanes)

    def cached_prefix(self, prompt: list[int], salt: int = 0) -> int:
        """Tokens of ``prompt`` this worker's prefix index holds under cache salt ``salt`` (for
        routing; a hint only)."""
        wc = self.cache_policy
        if not wc.attached or not wc.enabled:
            return 0
        return wc.hint(wc.hashes(prompt, salt=salt), len(prompt))

    def queue_rows(self, now: float) -> list[tuple[str, int, float]]:
        """(class, depth, oldest wait seconds) per QoS class, highest first."""
        return [(q, self.queues.depth(q), self.queues.oldest_wait(q, now)) for q in QOS_CLASSES]

    def live(self) -> int:
        """Lanes whose request still runs."""
        return sum(1 for lane in self.lanes.values() if not lane.request.finished)

    # --- planning ---------------------------------------------------------------------------------

    def hint_requests(self, now: float) -> list[GenerationRequest]:
        """A plan is being made from now on: the requests whose cached-prefix hint the loop must
        resolve first (``scheduler_draft.hint_requests``). Arrivals from now on may miss the
        plan (``urgent_missed``)."""
        self.urgent_arrivals = []
        return scheduler_draft.hint_requests(self, now)

    def draft(self, now: float, resolved: dict[int, Resolved] | None = None) -> Plan:
        """The plan, built once (``scheduler_draft.draft``)."""
        return scheduler_draft.draft(self, now, resolved or {})

    def abandon(self, plan: Plan) -> None:
        """``plan`` will not be sent (a request of it ended while it was made): its seeds are
        released; the loop plans again."""
        self.to_release.extend(seed.handle for seed in plan.seeds.values())
        plan.seeds.clear()

    def shed_policy(self) -> ShedPolicy:
        """The shed envelope of the next plan (``[cache] evict_in_tick``, ABI rules 50, 58)."""
        if not self.cache.evict_in_tick:
            return ShedPolicy()
        return self.cache_policy.shed_policy(self.cache.max_evict_bytes_per_tick)

    def launch(self, plan: Plan, refs: dict[int, TokenRef], biases: dict[int, int], now: float) -> TickPlan:
        """``plan`` goes out: its admits (prompts written at ``refs``, request key -> ref; logit
        bias handles by key) become lanes, dequeued and RUNNING, the plan sequence moves on, and
        the plan is the tick in flight until ``landed``. Returns the ``TickPlan`` to submit."""
        draft, requests = plan.draft, plan.requests
        admits: list[LaneAdmit] = []
        strategies: dict[int, str] = {}
        for tag, cand in draft.admitted:
            req = requests[cand.key]
            sampler = req.sampler
            seed = plan.seeds.get(cand.key)
            grammar = self.grammars.get(req)
            offer = strategy_for(req.speculation, sampler, req.grammar is not None, self.limits.strategies)
            strategies[tag] = offer.strategy_id if offer is not None else ""
            admits.append(
                LaneAdmit(
                    lane_tag=tag,
                    prompt=refs[cand.key],
                    seed_handle=seed.handle if seed is not None else 0,
                    sampling=int(sampler.mode),
                    params=sampler.params,
                    rng_counter_base=sampler.rng_counter_base(len(req.generated)),
                    decode_replay=len(req.generated),
                    grammar_handle=grammar,
                    grammar_replay=len(req.generated) if grammar else 0,
                    logit_bias_handle=biases.get(cand.key, 0),
                    want_logprobs=sampler.want_logprobs,
                    strategy_slot=offer.strategy_slot if offer is not None else 0,
                )
            )
        self.plan_seq += 1
        admitted = {tag: requests[cand.key] for tag, cand in draft.admitted}

        def decode(tag: int, grant: int) -> LaneDecode:
            lane = self.lanes.get(tag)
            if lane is not None:
                req, strategy, replaying = lane.request, lane.strategy, lane.replay_left > 0
            else:  # admitted by this plan, its prefill ending in this tick
                req, strategy, replaying = admitted[tag], strategies[tag], bool(admitted[tag].generated)
            extra = overshoot(strategy, grant, req.remaining, replaying)
            return LaneDecode(lane_tag=tag, max_new_tokens=grant, overshoot=extra)

        flags = TickFlag.PARTIAL_EMITS if self.config.partial_emits else 0
        tick_plan = TickPlan(
            plan_seq=self.plan_seq,
            flags=int(flags),
            prefill_token_budget=draft.prefill_tokens,
            max_decode_lanes=min(len(draft.decodes), self.limits.max_batch_size),
            admits=admits,
            prefills=[LanePrefill(lane_tag=t, token_offset=o, token_count=n) for t, o, n in draft.prefills],
            decodes=[decode(t, g) for t, g in draft.decodes],
            retires=[LaneRetire(lane_tag=t, publish_to_cache=int(p)) for t, p in draft.retires],
            shed_policy=self.shed_policy(),
        )
        # The admitted lanes exist from now on: partial emits of this tick may name them.
        self.next_tag += len(draft.admitted)
        for tag, cand in draft.admitted:
            req = requests[cand.key]
            self.queues.pop(req)
            req.state = RequestState.RUNNING
            req.lane_tag = tag
            if req.t_admitted is None:
                req.t_admitted = now
            rank = qos_rank(req.qos)
            tokens = req.resume_prompt()
            lane = Lane(
                tag=tag,
                request=req,
                prompt_len=cand.prompt_len,
                reserved=cand.reserve,
                admitted_at=now,
                prefilled=cand.prefilled,
                admitted=tokens,
                hashes=self.hashes(req),
                seeded_tokens=cand.prefilled,
                replay_left=max(0, len(tokens) - max(cand.prefilled, cand.prompt_len)),
                checkpoint=cand.checkpoint if cand.checkpoint > cand.prefilled else 0,
                preemptible=rank > INTERACTIVE,
                aged=effective_rank(rank, now - req.t_received, self.config.aging_s) < rank,
                strategy=strategies[tag],
            )
            if lane.checkpoint:
                req.checkpointed = True
            self.lanes[tag] = lane
        plan.tick = tick_plan
        self.flight = plan
        return tick_plan

    # --- yield inside a tick (basertd.shm.control) --------------------------------------------------

    def outranks_flight(self, req: GenerationRequest) -> bool:
        """Whether ``req`` outranks the work of the tick in flight: an interactive request always
        (it must not wait for a long tick), another one when every lane of that tick is of a
        lower class."""
        rank = qos_rank(req.qos)
        if rank == INTERACTIVE:
            return True
        flight = self.flight
        if flight is None:
            return False
        tags = {t for t, _, _ in flight.draft.prefills} | {t for t, _ in flight.draft.decodes}
        ranks = [qos_rank(lane.request.qos) for t in tags if (lane := self.lanes.get(t)) is not None]
        return bool(ranks) and rank < min(ranks)

    def lengthened_flight(self) -> bool:
        """Whether the tick in flight was lengthened past ``decode_grant`` for a short decode step
        (``PlanDraft.lengthened``: ``decode_tick_s``) while a lane is free: a request arriving then
        would otherwise wait out rounds that only the coordinator's cost between ticks asked for."""
        flight = self.flight
        return flight is not None and flight.draft.lengthened and len(self.lanes) < self.limits.max_lanes

    def long_flight(self) -> bool:
        """Whether the tick in flight prefills more than ``prefill_budget`` tokens (a long tick:
        ``long_prefill_budget``, taken when nothing urgent waited) while a lane is free: a request
        of any class arriving then would otherwise wait out seconds of another prompt's prefill
        with that lane idle; the tick ends at its next step boundary instead (no KV is lost)."""
        flight = self.flight
        return (
            flight is not None
            and flight.draft.prefill_tokens > self.config.prefill_budget
            and len(self.lanes) < self.limits.max_lanes
        )

    def urgent_missed(self) -> bool:
        """Whether an urgent request arrived while the plan about to be sent was made and the plan
        does not admit it (its tick must then yield at once); forgets those arrivals."""
        missed = [r for r in self.urgent_arrivals if r.state is RequestState.QUEUED and not r.finished]
        self.urgent_arrivals = []
        return bool(missed)

    def itl_deadline(self, plan: Plan) -> float | None:
        """Monotonic seconds at which the tick of ``plan`` must be asked to end so that each of its
        streaming decode lanes gets its next token within ``max_itl_s``; None when it has none."""
        after = self.rates.itl_yield_after(self.step_tokens or self.config.min_prefill_chunk)
        last = [
            self.t_token[tag]
            for tag, _ in plan.draft.decodes
            if tag in self.t_token
            and (lane := self.lanes.get(tag)) is not None
            and lane.request.stream
            and not lane.request.finished
        ]
        return min(last) + after if last else None

    # --- the tick's outcome ------------------------------------------------------------------------

    def apply(self, plan: Plan | None, outcome: Outcome, now: float) -> Applied:
        """The tick of ``plan`` (the one in flight; None for a worker lost between ticks) answered
        with ``outcome`` (``basertd.server.sched.outcome``): ``Accepted`` applies its events
        (``basertd.server.sched.apply``), ``Rejected`` undoes the plan and plans again smaller
        (``Applied.restart`` when the worker must be restarted), ``Lost`` preempts every live lane
        (``Applied.resume`` / ``failed``). Returns what it did, with the deliveries."""
        self.flight = None
        out = Outbox()
        res = Applied()
        match outcome:
            case Accepted():
                assert plan is not None
                scheduler_apply.apply_accepted(self, plan, outcome, now, out)
            case Rejected(status=status, message=message, plan_seq=plan_seq):
                assert plan is not None
                res.restart = self._rejected(plan, status, message, plan_seq, now, out)
            case Lost(error=error, stalled=stalled, planned=planned):
                self._worker_lost(error, stalled, now, out, res, planned)
        res.deliveries = out.take()
        return res

    def on_emit(
        self, lane_tag: int, tokens: list[int], now: float, *, drafted: int = 0, accepted: int = 0
    ) -> Delivery | None:
        """A partial emit of the tick in flight (``basertd.server.sched.apply.on_emit``): the
        delivery of lane ``lane_tag``'s request, None when there is nothing to send."""
        return scheduler_apply.on_emit(self, lane_tag, tokens, now, drafted=drafted, accepted=accepted)

    def _rejected(
        self, plan: Plan, status: int, message: str, plan_seq: int, now: float, out: Outbox
    ) -> str | None:
        """The engine rejected ``plan`` with ``status`` and changed nothing (ABI rules 13, 50):
        undo its admits on our side (back to the head of their classes, in order), release its seed
        leases and free its grammar handles, and plan again, smaller (NEEDS_REPLAN: fewer admits,
        then less prefill; others: ``rejects.triage``). Preempted and checkpointed lanes were not
        retired: they stay live and are retired by a later plan. Returns why the worker must be
        restarted (plans rejected again and again), else None."""
        draft, requests = plan.draft, plan.requests
        self.plans_rejected += 1
        self.rejections += 1
        self.to_release.extend(seed.handle for seed in plan.seeds.values())
        name = status.name if isinstance(status, Status) else str(status)
        log.warning(
            "plan_rejected",
            worker_id=self.worker_id,
            plan_seq=plan_seq,
            status=name,
            message=message,
            admits=len(draft.admitted),
            prefill_tokens=draft.prefill_tokens,
            decodes=len(draft.decodes),
            retires=len(draft.retires),
            consecutive=self.rejections,
        )
        for tag, cand in reversed(draft.admitted):  # back to the head of their classes, in order
            lane = self.lanes.pop(tag, None)
            req = requests[cand.key]
            self.grammars.drop(req)
            if lane is not None and not req.finished:
                if req.admissions == 0:
                    req.t_admitted = None  # the admission never happened
                self.requeue(req)
        for lane in self.lanes.values():
            lane.tick_tokens.clear()
        live = [lane for lane in self.lanes.values() if not lane.retire and not lane.request.finished]
        if status == Status.REJECT_STALE_SEED and plan.seeds and self.rejections <= MAX_ADMIT_RETRIES:
            self.seedless_plans = 1  # a lease the engine no longer honours: one plan without seeds
            return None
        if status == Status.NEEDS_REPLAN:
            if len(draft.admitted) == 1 and not live:  # it cannot fit even alone: never will
                req = requests[draft.admitted[0][1].key]
                self.queues.remove(req)
                self.fail(
                    req,
                    ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                    "the request does not fit the worker's KV pool",
                    now,
                    out,
                )
            elif draft.admitted:
                self.max_admits = len(draft.admitted) // 2
            elif draft.prefills:
                self.max_admits = 0
                self.prefill_cap = max(1, draft.prefill_tokens // 2)
            elif live:  # the running lanes alone outgrow the pool: stop the youngest one
                youngest = max(live, key=lambda lane: lane.tag)
                self.fail(youngest.request, ErrorCode.INTERNAL, "the worker's KV pool is exhausted", now, out)
                youngest.retire = True
            return None
        verdict = triage(len(draft.admitted), self.rejections, self.limits.max_lanes)
        if verdict.action is Action.FAIL_ADMIT:
            tag, cand = draft.admitted[0]
            req = requests[cand.key]
            sent = plan.tick.admits if plan.tick is not None else []
            admit = next((a for a in sent if a.lane_tag == tag), None)
            field_ = suspect_field(admit, message) if admit is not None else ""
            field_ = CLIENT_FIELD.get(field_, field_)
            if not req.finished:
                self.queues.remove(req)
                what = f"its {field_} is out of the engine's range" if field_ else "the engine cannot run it"
                self.fail(
                    req,
                    ErrorCode.INVALID_REQUEST,
                    f"the engine refused this request: {what} ({name})",
                    now,
                    out,
                )
            log.warning(
                "admit_rejected_alone",
                worker_id=self.worker_id,
                request_key=req.key,
                field=field_,
                status=name,
            )
            self.max_admits = None
        elif verdict.action is Action.RESTART:
            self.max_admits = None
            return f"plans rejected {self.rejections} times in a row ({name})"
        else:  # bisect the admits, or retry once without any
            self.max_admits = verdict.max_admits
        return None

    def _worker_lost(
        self, error: str, stalled: str | None, now: float, out: Outbox, res: Applied, planned: bool = False
    ) -> None:
        """The worker died or broke the link (``error``): a preemption of every live lane. Each
        request is to resume with its delivered tokens (``res.resume``, youngest first: the loop
        requeues each, here or on a peer); one that ran at ``max_crash_resumes`` crashes, counted
        across workers, without progress in between (``GenerationRequest.crash_streak``: a
        completed tick delivering tokens past its last crash) fails WORKER_FAILED, and so does
        every one when the progress watchdog restarted the worker (``stalled``: its running work
        is what stalled). Grammar handles of the incarnation are forgotten. ``planned`` (a
        hand-over between two ticks, the worker alive): every request resumes, no crash charged
        (``handovers`` counts them)."""
        live = [lane for lane in self.lanes.values() if not lane.request.finished]
        self.lanes.clear()
        self.flight = None
        self.grammars.forget()  # those of lanes and of plans that never ran died with the worker
        live.sort(key=lambda lane: -lane.request.t_received)
        for lane in live:
            req = lane.request
            if planned:
                self.handovers += 1
                res.resume.append(req)
                continue
            req.crash_streak += 1
            req.crash_mark = len(req.generated)
            if stalled is not None:
                self.fail(
                    req,
                    ErrorCode.WORKER_FAILED,
                    f"worker {self.worker_id} stalled and was restarted: {stalled}",
                    now,
                    out,
                )
                res.failed.append(req.key)
                continue
            if req.crash_streak >= self.config.max_crash_resumes:
                self.fail(
                    req,
                    ErrorCode.WORKER_FAILED,
                    f"the worker died {req.crash_streak} times in a row while this request ran, "
                    "without progress in between",
                    now,
                    out,
                )
                res.failed.append(req.key)
                continue
            req.crash_resumes += 1
            self.crash_resumes += 1
            self.metrics.crash_resumed(self.worker_id, req.key)
            res.resume.append(req)

    def detach(self) -> None:
        """The incarnation is gone: its leases, grammar handles, plan caps, memory counters and
        measured verify cost go with it."""
        self.to_release.clear()
        self.last_mem = None
        self.spec_verify = None
        self.grammars.forget()
        self.flight = None
