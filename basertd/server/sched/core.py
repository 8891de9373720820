"""The synchronous scheduler core of one worker (DESIGN.md "Scheduling"): state in, plan out;
events in, outcomes out. No awaits, no link, no rings, no processes.

The async per-worker loop (``basertd.server.sched.loop.Scheduler``) drives it each turn:

1. ``hint_requests(now)``: the requests to resolve a cached-prefix seed for (the loop matches and
   acquires each, ``basertd.server.sched.draft``);
2. ``draft(now, resolved)``: the plan, built once; unused seeds go to ``to_release``;
3. ``launch(plan, refs, biases, now)``: the lanes of its admits exist from now on; returns the
   ``TickPlan`` the loop submits (the loop wrote the prompts into ring 1 and gave their refs);
4. while the tick runs, ``on_emit(lane_tag, tokens)`` per partial emit (TICK_EMIT);
5. ``landed()`` then ``apply(plan, events, tokens)`` with the tick's ``TickEvents`` and the emitted
   tokens the loop read from the emit ring (lane tag -> tokens; None: unreadable), or
   ``rejected(plan, exc)`` when the engine refused the plan (changed nothing, ABI rules 13-52).

Outcomes: tokens, finishes and errors go straight to the requests' sinks (``GenerationRequest.
deliver / finish / fail``); retired lanes publish to the prefix index and requeue preempted or
checkpointed requests at the head of their class (``decode_replay`` on re-admission, ABI rules
71-73); seed leases to release collect in ``to_release``, grammar handles to free in
``grammars.pending_free`` (ABI rule 74); ``rejected`` returns a restart reason when the engine and
the scheduler disagree. A dead worker is ``worker_lost(error, stalled)``: its live lanes become
requests to resume (or fail after ``max_crash_resumes`` crashes in a row without a token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from basertd.schema import client as api
from basertd.schema.abi import Status, TickFlag
from basertd.schema.client import ErrorCode
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, ShedPolicy, TickPlan, TokenRef
from basertd.server.request.record import QOS_CLASSES, AdmissionError, GenerationRequest, RequestState
from basertd.server.sched import draft as scheduler_draft
from basertd.server.sched.apply import MAX_ADMIT_RETRIES, EventApplier
from basertd.server.sched.draft import Plan, Resolved
from basertd.server.sched.lanes import Lane, reservation
from basertd.server.sched.qos import INTERACTIVE, effective_rank, qos_rank
from basertd.server.sched.rejects import CLIENT_FIELD, Action, suspect_field, triage
from basertd.shm import YieldReason

log = structlog.get_logger("basertd.scheduler")

QUEUED_FIRST_S = 1.0
"""Seconds a request waits in the queue before its first ``Queued`` notice."""
QUEUED_EVERY_S = 5.0
"""Seconds between two ``Queued`` notices of a request that still waits."""


@dataclass
class Lost:
    """What ``worker_lost`` did: the requests to resume elsewhere (state QUEUED, oldest last: put
    each at the head of its class in this order, so the oldest ends at the head), and the keys of
    those it failed."""

    resume: list[GenerationRequest] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)


class SchedulerCore(EventApplier):
    """The scheduler core of one worker (module docstring); its state is ``SchedulerState``'s,
    tick events are applied by ``EventApplier.apply``."""

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
        if prompt_len + max_tokens > lim.context_length:
            raise AdmissionError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"({lim.context_length} tokens)",
            )
        if (
            reservation(prompt_len + max_tokens, lim.page_tokens) > lim.kv_tokens
            or prompt_len > lim.max_admit_tokens
        ):
            raise AdmissionError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) does not fit the worker's KV pool",
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
        tick in flight must yield for it (``outranks_flight``), else None; one that arrives while
        a plan is being made is remembered for ``urgent_missed``."""
        req.worker_id = self.worker_id
        req.plan_seq_received = self.plan_seq
        req.tick_in_flight_at_arrival = self.flight is not None
        self.queues.push(req)
        if not self.outranks_flight(req):
            return None
        if self.flight is not None:
            return YieldReason.URGENT_ADMIT
        self.urgent_arrivals.append(req)
        return None

    def adopt(self, req: GenerationRequest) -> None:
        """Take over ``req``, resumed after another worker died: it goes to the head of its class
        and resumes here with its delivered tokens (ABI rules 71-73)."""
        req.worker_id = self.worker_id
        req.page_hashes = []  # this worker's page size may differ
        self.queues.push_front(req)

    def cancel(
        self, req: GenerationRequest, code: ErrorCode = ErrorCode.CANCELLED, message: str = ""
    ) -> YieldReason | None:
        """End ``req`` now with ``Error(code)`` (a no-op once finished). A queued request is dropped
        and never starts; a running one stops receiving tokens and its lane retires in the next
        plan (DESIGN.md "Scheduling"). Returns CANCEL when the tick in flight should end soon."""
        if req.finished:
            return None
        req.cancelled = True
        why = None
        if req.state is RequestState.QUEUED:
            self.queues.remove(req)
        elif self.flight is not None and req.lane_tag is not None:
            why = YieldReason.CANCEL  # its lane retires in the next plan: end this tick soon
        self.fail(req, code, message or "cancelled")
        return why

    def fail_queued(self, code: ErrorCode, message: str) -> int:
        """Fail every queued request with ``code``; returns how many."""
        reqs = self.queues.drain()
        for req in reqs:
            if not req.finished:
                self.fail(req, code, message)
        return len(reqs)

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """Fail everything queued or running with ``code`` (the daemon stops)."""
        self.stopping = True
        self.fail_queued(code, message)
        for lane in self.lanes.values():
            if not lane.request.finished:
                self.fail(lane.request, code, message)

    def fail_stuck(self, now: float, bound_s: float, reason: str) -> None:
        """The idle loop stalled: fail each request queued ``bound_s`` seconds or more, and drop
        the re-planning caps (they may be what keeps every plan empty)."""
        for req in [r for r in self.queues if now - r.t_received >= bound_s]:
            self.queues.remove(req)
            self.fail(req, ErrorCode.INTERNAL, f"worker {self.worker_id} stalled: {reason}")
        self.max_admits = None
        self.prefill_cap = None

    def notify_queued(self, now: float) -> int:
        """Send ``Queued`` to each request still waiting for its first token that has waited
        ``QUEUED_FIRST_S`` seconds and had no notice for ``QUEUED_EVERY_S`` seconds (``now``:
        monotonic seconds); returns how many."""
        sent = 0
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
                    req.sink.send(api.Queued(request_id=req.request_id, position=ahead, qos=qos))
                    notices[req.key] = now
                    sent += 1
                ahead += 1
        self.queued_notices = notices
        return sent

    # --- views ------------------------------------------------------------------------------------

    def load(self) -> float:
        """Queued + running requests per lane (for routing a request to the least busy worker)."""
        return (len(self.queues) + len(self.lanes)) / max(1, self.limits.max_lanes)

    def cached_prefix(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` this worker's prefix index holds (for routing; a hint only)."""
        wc = self.cache_policy
        if not wc.attached or not wc.enabled:
            return 0
        return wc.hint(wc.hashes(prompt), len(prompt))

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
        for tag, cand in draft.admits:
            req = requests[cand.key]
            sampler = req.sampler
            seed = plan.seeds.get(cand.key)
            admits.append(
                LaneAdmit(
                    lane_tag=tag,
                    prompt=refs[cand.key],
                    seed_handle=seed.handle if seed is not None else 0,
                    sampling=int(sampler.mode),
                    params=sampler.params,
                    rng_counter_base=sampler.rng_counter_base(len(req.generated)),
                    decode_replay=len(req.generated),
                    grammar_handle=req.grammar_handle,
                    grammar_replay=len(req.generated) if req.grammar_handle else 0,
                    logit_bias_handle=biases.get(cand.key, 0),
                    want_logprobs=sampler.want_logprobs,
                )
            )
        plan.admits = admits
        self.plan_seq += 1
        flags = TickFlag.PARTIAL_EMITS if self.config.partial_emits else 0
        tick_plan = TickPlan(
            plan_seq=self.plan_seq,
            flags=int(flags),
            prefill_token_budget=draft.prefill_tokens,
            max_decode_lanes=min(len(draft.decodes), self.limits.max_batch_size),
            admits=admits,
            prefills=[LanePrefill(lane_tag=t, token_offset=o, token_count=n) for t, o, n in draft.prefills],
            decodes=[LaneDecode(lane_tag=t, max_new_tokens=g) for t, g in draft.decodes],
            retires=[LaneRetire(lane_tag=t, publish_to_cache=int(p)) for t, p in draft.retires],
            shed_policy=self.shed_policy(),
        )
        # The admitted lanes exist from now on: partial emits of this tick may name them.
        self.next_tag += len(draft.admits)
        for tag, cand in draft.admits:
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
            )
            if lane.checkpoint:
                req.checkpointed = True
            self.lanes[tag] = lane
        self.flight = plan
        return tick_plan

    def landed(self) -> None:
        """The tick in flight answered (accepted, rejected or lost)."""
        self.flight = None

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

    # --- a rejected plan --------------------------------------------------------------------------

    def rejected(self, plan: Plan, status: int, message: str = "", plan_seq: int = 0) -> str | None:
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
            admits=len(draft.admits),
            prefill_tokens=draft.prefill_tokens,
            decodes=len(draft.decodes),
            retires=len(draft.retires),
            consecutive=self.rejections,
        )
        for tag, cand in reversed(draft.admits):  # back to the head of their classes, in order
            lane = self.lanes.pop(tag, None)
            req = requests[cand.key]
            self.grammars.drop(req)
            if lane is not None and not req.finished:
                req.state = RequestState.QUEUED
                req.lane_tag = None
                if req.admissions == 0:
                    req.t_admitted = None
                self.queues.push_front(req)
        for lane in self.lanes.values():
            lane.tick_tokens.clear()
        live = [lane for lane in self.lanes.values() if not lane.retire and not lane.request.finished]
        if status == Status.REJECT_STALE_SEED and plan.seeds and self.rejections <= MAX_ADMIT_RETRIES:
            self.seedless_plans = 1  # a lease the engine no longer honours: one plan without seeds
            return None
        if status == Status.NEEDS_REPLAN:
            if len(draft.admits) == 1 and not live:  # it cannot fit even alone: never will
                req = requests[draft.admits[0][1].key]
                self.queues.remove(req)
                self.fail(
                    req, ErrorCode.CONTEXT_LENGTH_EXCEEDED, "the request does not fit the worker's KV pool"
                )
            elif draft.admits:
                self.max_admits = len(draft.admits) // 2
            elif draft.prefills:
                self.max_admits = 0
                self.prefill_cap = max(1, draft.prefill_tokens // 2)
            elif live:  # the running lanes alone outgrow the pool: stop the youngest one
                youngest = max(live, key=lambda lane: lane.tag)
                self.fail(youngest.request, ErrorCode.INTERNAL, "the worker's KV pool is exhausted")
                youngest.retire = True
            return None
        verdict = triage(len(draft.admits), self.rejections, self.limits.max_lanes)
        if verdict.action is Action.FAIL_ADMIT:
            tag, cand = draft.admits[0]
            req = requests[cand.key]
            admit = next((a for a in plan.admits if a.lane_tag == tag), None)
            field_ = suspect_field(admit, message) if admit is not None else ""
            field_ = CLIENT_FIELD.get(field_, field_)
            if not req.finished:
                self.queues.remove(req)
                what = f"its {field_} is out of the engine's range" if field_ else "the engine cannot run it"
                self.fail(req, ErrorCode.INVALID_REQUEST, f"the engine refused this request: {what} ({name})")
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

    # --- a lost worker ----------------------------------------------------------------------------

    def worker_lost(self, error: str, stalled: str | None = None) -> Lost:
        """The worker died or broke the link (``error``): a preemption of every live lane. Each
        request is to resume with its delivered tokens (``Lost.resume``); one that ran at
        ``max_crash_resumes`` crashes in a row without a token in between fails WORKER_FAILED,
        and so does every one when the progress watchdog restarted the worker (``stalled``: its
        running work is what stalled). Grammar handles of the incarnation are forgotten."""
        live = [lane for lane in self.lanes.values() if not lane.request.finished]
        self.lanes.clear()
        self.flight = None
        for req in self.queues:  # handles made for a plan that never ran
            req.grammar_handle = 0
        live.sort(key=lambda lane: -lane.request.t_received)
        out = Lost()
        for lane in live:
            req = lane.request
            req.grammar_handle = 0
            req.crash_streak += 1
            if stalled is not None:
                self.fail(
                    req,
                    ErrorCode.WORKER_FAILED,
                    f"worker {self.worker_id} stalled and was restarted: {stalled}",
                )
                out.failed.append(req.key)
                continue
            if req.crash_streak >= self.config.max_crash_resumes:
                self.fail(
                    req,
                    ErrorCode.WORKER_FAILED,
                    f"worker {self.worker_id} died {req.crash_streak} times in a row while this request "
                    f"ran, without a token in between (last: {error})",
                )
                out.failed.append(req.key)
                continue
            req.state = RequestState.QUEUED
            req.lane_tag = None
            req.crash_resumes += 1
            self.crash_resumes += 1
            self.metrics.crash_resumed(self.worker_id)
            out.resume.append(req)
        return out

    def detach(self) -> None:
        """The incarnation is gone: its leases, grammar handles and plan caps go with it."""
        self.to_release.clear()
        self.grammars.forget()
        self.flight = None
