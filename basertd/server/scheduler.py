"""The per-worker scheduler: continuous batching over the tick ABI (DESIGN.md "Scheduling").

One ``Scheduler`` per worker runs one asyncio task. Each turn it builds a plan with the pure
``basertd.server.plan.build_plan`` from its lanes and queues (retires, admits, prefills, decodes),
writes the admitted prompts into the worker's prompt ring right before submitting, submits the
tick, streams partial emits (TICK_EMIT) to the clients while the tick runs, and applies the
events: admit results, prefill progress (shed chunks resume next tick, ABI rule 57), emitted
tokens (read from the emit ring; the terminal emit delivers only what the partial emits did not),
finishes and lane faults. With nothing to do it awaits an event (a new request, a cancel, the
worker's death); it never polls.

Failure rules:

- A rejected plan changes nothing in the engine (ABI rules 13-52): it is logged with its status and
  re-planned (NEEDS_REPLAN: fewer admits, then less prefill); a plan refused again and again means
  the engine and the scheduler disagree, and the worker is restarted.
- An admit refused by the engine (AdmitResult REJECTED) fails its request with a typed error, or
  requeues it at the head of its class when the code is transient.
- A worker that dies (or breaks the link) fails each of its lanes with ``WORKER_FAILED`` after the
  tokens already delivered (none is delivered twice); queued requests stay queued and are served by
  the respawned worker (``basertd.server.supervisor``).

Lane tags come from a counter that is never reset, so a tag is never reused within a worker (nor
across its incarnations). Sampling and the RNG stream: see ``basertd.server.requests.Sampler``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import structlog

from basertd.schema import link
from basertd.schema.abi import AdmitStatus, FaultCode, Finish, ShedKind, SpaceKind, Status, TickFlag
from basertd.schema.client import ErrorCode
from basertd.schema.tick import (
    LaneAdmit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    ShedPolicy,
    TickEvents,
    TickPlan,
)
from basertd.server.config import CacheConfig, SchedulerConfig
from basertd.server.lanes import Lane, RequestQueues, candidate, reservation
from basertd.server.link import EmitCallbackError, LinkError, PlanRejected
from basertd.server.metrics import NULL_METRICS, Metrics
from basertd.server.notify import Heartbeat
from basertd.server.plan import PlanDraft, PlanLimits, TickRates, build_plan
from basertd.server.requests import QOS_CLASSES, AdmissionError, GenerationRequest, RequestState
from basertd.server.supervisor import WorkerSlot
from basertd.server.worker_proc import WorkerProcess
from basertd.shm import RingError

log = structlog.get_logger("basertd.scheduler")

U64_MAX = (1 << 64) - 1
TICK_TIMEOUT_S = 120.0
"""A tick that has not answered within this many seconds means a hung worker: it is restarted."""
TRANSIENT_ADMIT_CODES = frozenset({Status.REJECT_STALE_SEED, Status.NEEDS_REPLAN, Status.REJECT_BUDGET})
"""Admit reject codes after which the request is requeued rather than failed."""
MAX_ADMIT_RETRIES = 3
FINISH_REASON = {Finish.EOS: "eos", Finish.LENGTH: "length", Finish.GRAMMAR: "stop"}


class WorkerLimits:
    """The numbers admission and planning need from a worker's capability record (or, before
    the first handshake, from its config): context length, lanes and max batch size, page size
    (tokens), KV capacity (tokens) and the prompt tokens one plan may write into the prompt ring."""

    def __init__(
        self,
        context_length: int,
        max_lanes: int,
        max_batch_size: int,
        page_tokens: int,
        kv_tokens: int,
        max_admit_tokens: int,
    ) -> None:
        self.context_length = context_length
        self.max_lanes = max_lanes
        self.max_batch_size = max_batch_size
        self.page_tokens = page_tokens
        self.kv_tokens = kv_tokens
        self.max_admit_tokens = max_admit_tokens

    @classmethod
    def from_worker(cls, proc: WorkerProcess) -> WorkerLimits:
        """Limits of a started worker. KV capacity: the pool bytes over the bytes per token of its
        paged state spaces when it reports them, else ``max_lanes * context_length``."""
        caps = proc.capabilities
        per_token = sum(
            s.bytes_per_token
            for s in caps.state_spaces
            if s.kind in (SpaceKind.PAGED_TOKEN_KV, SpaceKind.DEPTH_PAGED_KV) and s.bytes_per_token
        )
        kv = caps.max_lanes * caps.context_length
        if per_token and caps.pool_bytes:
            kv = caps.pool_bytes // per_token
        return cls(
            context_length=caps.context_length,
            max_lanes=caps.max_lanes,
            max_batch_size=max(1, caps.max_batch_size),
            page_tokens=max(1, caps.page_size_tokens),
            kv_tokens=kv,
            max_admit_tokens=proc.prompt_ring.max_span_elems // 2,
        )


class Scheduler:
    """The scheduler of one worker (module docstring). The daemon calls ``check_admission`` and
    ``submit`` for each accepted Generate, ``cancel`` for Cancel and gone clients, and runs
    ``run()`` as a task. State for operators and tests: ``lanes`` (tag -> ``Lane``), ``queues``
    (``RequestQueues``), ``limits``, ``ticks_run``, ``plans_rejected``, counters.

    Operators (issue 9): ``metrics`` receives each tick's wall time; ``heartbeat`` beats on every
    loop turn and every second of a bounded wait, so the systemd watchdog stops when this loop
    hangs (``basertd.server.notify.Watchdog``)."""

    def __init__(
        self,
        slot: WorkerSlot,
        limits: WorkerLimits,
        config: SchedulerConfig,
        cache: CacheConfig,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        self.slot = slot
        self.metrics = metrics if metrics is not None else NULL_METRICS
        self.heartbeat = Heartbeat(f"scheduler-{slot.worker_id}")
        self.worker_id = slot.worker_id
        self.limits = limits
        self.config = config
        self.cache = cache
        self.lanes: dict[int, Lane] = {}
        self.queues = RequestQueues()
        self.rates = TickRates(config.tick_target_s, config.prefill_budget, config.decode_grant)
        self.ticks_run = 0
        self.plans_rejected = 0
        self.requests_done = 0
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0
        self.last_mem: link.MemCounters | None = None
        self._next_tag = 1  # lane tags are never reused: the counter only grows
        self._plan_seq = 0
        self._wake = asyncio.Event()
        self._rejections = 0
        self._max_admits: int | None = None
        self._prefill_cap: int | None = None
        self._admit_retries: dict[int, int] = {}
        self._proc: WorkerProcess | None = None
        self._stopping = False

    # --- API side ---------------------------------------------------------------------------

    def check_admission(self, prompt_len: int, max_tokens: int, qos: str) -> None:
        """Refuse a Generate that can never run or cannot be queued, before anything is queued.
        Raises ``AdmissionError``: CONTEXT_LENGTH_EXCEEDED (prompt + max_tokens over the context
        window, or over the worker's KV capacity, or a prompt longer than one plan may carry),
        QUEUE_FULL (``queue_limit`` of the class or ``max_queued_tokens`` reached),
        SHUTTING_DOWN."""
        lim = self.limits
        if self._stopping:
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
        if self.queues.depth(qos) >= self.config.queue_limit:
            raise AdmissionError(
                ErrorCode.QUEUE_FULL, f"the {qos} queue is full ({self.config.queue_limit} requests)"
            )
        if self.queues.tokens + prompt_len > self.config.max_queued_tokens:
            raise AdmissionError(
                ErrorCode.QUEUE_FULL, f"queued prompt tokens would exceed {self.config.max_queued_tokens}"
            )

    def submit(self, req: GenerationRequest) -> None:
        """Queue an admitted request (``check_admission`` passed) and wake the loop."""
        req.worker_id = self.worker_id
        self.queues.push(req)
        self.slot.poke()
        self._wake.set()

    def cancel(
        self, req: GenerationRequest, *, code: ErrorCode = ErrorCode.CANCELLED, message: str = ""
    ) -> None:
        """End ``req`` now with ``Error(code)`` (a no-op once finished). A queued request is dropped
        and never starts; a running one stops receiving tokens and its lane retires in the next
        plan (DESIGN.md "Scheduling")."""
        if req.finished:
            return
        req.cancelled = True
        if req.state is RequestState.QUEUED:
            self.queues.remove(req)
        req.fail(code, message or "cancelled")
        self.requests_done += 1
        self._wake.set()

    @property
    def busy_lanes(self) -> int:
        """Live lanes (retiring ones included)."""
        return len(self.lanes)

    def load(self) -> float:
        """Queued + running requests per lane (for routing a request to the least busy worker)."""
        return (len(self.queues) + len(self.lanes)) / max(1, self.limits.max_lanes)

    def fail_queued(self, code: ErrorCode, message: str) -> int:
        """Fail every queued request with ``code``; returns how many."""
        reqs = self.queues.drain()
        for req in reqs:
            if not req.finished:
                req.fail(code, message)
                self.requests_done += 1
        return len(reqs)

    def on_give_up(self, last_error: str) -> None:
        """The supervisor stopped retrying: queued requests cannot be served, fail them typed."""
        n = self.fail_queued(ErrorCode.WORKER_FAILED, f"worker {self.worker_id} is unavailable: {last_error}")
        if n:
            log.warning("queued_requests_failed", worker_id=self.worker_id, count=n)

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve forever: wait for a live worker, tick it while there is work, and when it dies
        fail its lanes and wait for the next incarnation. Ends only by cancellation."""
        while True:
            proc = await self.heartbeat.wait(self.slot.ready())
            self._proc = proc
            self.limits = WorkerLimits.from_worker(proc)
            self.rates = TickRates(
                self.config.tick_target_s, self.config.prefill_budget, self.config.decode_grant
            )
            try:
                await self._serve(proc)
            except LinkError as exc:
                self._worker_lost(proc, exc)
            except Exception as exc:  # a bug of ours: never let it end the loop of this worker
                log.exception("scheduler_error", worker_id=self.worker_id, error=repr(exc))
                self._worker_lost(proc, LinkError(f"scheduler error: {exc!r}"))
                self.slot.restart("scheduler error: engine state and ours may disagree")
            finally:
                self._proc = None

    async def stop(self, message: str = "the daemon is shutting down") -> None:
        """Refuse new requests and fail everything queued or running with SHUTTING_DOWN."""
        self._stopping = True
        self.fail_queued(ErrorCode.SHUTTING_DOWN, message)
        for lane in self.lanes.values():
            if not lane.request.finished:
                lane.request.fail(ErrorCode.SHUTTING_DOWN, message)
                self.requests_done += 1
        self._wake.set()

    async def _serve(self, proc: WorkerProcess) -> None:
        dead = asyncio.ensure_future(proc.link.wait_dead())
        try:
            while True:
                if dead.done():
                    raise dead.result()
                self._wake.clear()
                self.heartbeat.beat()
                draft, requests = self._plan()
                if draft.empty:
                    waiter = asyncio.ensure_future(self._wake.wait())
                    try:
                        await asyncio.wait(
                            {waiter, dead},
                            timeout=self.heartbeat.interval,
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    finally:
                        waiter.cancel()
                    continue
                await self._tick(proc, draft, requests)
        finally:
            dead.cancel()

    def _candidates(self, seen: list[GenerationRequest]) -> Iterator:
        page = self.limits.page_tokens
        for req in self.queues:
            seen.append(req)
            yield candidate(req, page)

    def _plan(self) -> tuple[PlanDraft, dict[int, GenerationRequest]]:
        """Build the next draft; returns it with the requests its admits name (by key)."""
        waiting = len(self.queues) > 0 or any(lane.phase == "prefill" for lane in self.lanes.values())
        prefill_budget, grant = self.rates.budgets(waiting)
        if self._prefill_cap is not None:
            prefill_budget = min(prefill_budget, self._prefill_cap)
        lim = self.limits
        limits = PlanLimits(
            max_lanes=lim.max_lanes,
            max_decode_lanes=lim.max_batch_size,
            kv_tokens=lim.kv_tokens,
            prefill_budget=prefill_budget,
            decode_grant=grant,
            max_admit_tokens=lim.max_admit_tokens,
            max_admits=(1 << 30) if self._max_admits is None else self._max_admits,
        )
        seen: list[GenerationRequest] = []
        views = [lane.view() for lane in self.lanes.values()]
        draft = build_plan(views, self._candidates(seen), limits, next_tag=self._next_tag)
        by_key = {req.key: req for req in seen}
        return draft, {cand.key: by_key[cand.key] for _, cand in draft.admits}

    def _shed_policy(self) -> ShedPolicy:
        if not self.cache.evict_in_tick:
            return ShedPolicy()
        cap = self.cache.max_evict_bytes_per_tick or U64_MAX
        return ShedPolicy(evictable_cache_classes=U64_MAX, protected_quota_bytes=0, max_evict_bytes=cap)

    async def _tick(
        self, proc: WorkerProcess, draft: PlanDraft, requests: dict[int, GenerationRequest]
    ) -> None:
        now = time.monotonic()
        admits: list[LaneAdmit] = []
        for tag, cand in draft.admits:
            req = requests[cand.key]
            sampler = req.sampler
            try:
                ref = proc.prompt_ring.write(np.asarray(req.prompt, dtype=np.uint32))
            except RingError as exc:  # sized at admission; a failure here is a bug, fail the request
                self.queues.remove(req)
                req.fail(ErrorCode.INTERNAL, f"cannot stage the prompt: {exc}")
                self.requests_done += 1
                return
            admits.append(
                LaneAdmit(
                    lane_tag=tag,
                    prompt=ref,
                    sampling=int(sampler.mode),
                    params=sampler.params,
                    rng_counter_base=sampler.rng_counter_base(len(req.generated)),
                )
            )
        self._plan_seq += 1
        flags = TickFlag.PARTIAL_EMITS if self.config.partial_emits else 0
        plan = TickPlan(
            plan_seq=self._plan_seq,
            flags=int(flags),
            prefill_token_budget=draft.prefill_tokens,
            max_decode_lanes=min(len(draft.decodes), self.limits.max_batch_size),
            admits=admits,
            prefills=[LanePrefill(lane_tag=t, token_offset=o, token_count=n) for t, o, n in draft.prefills],
            decodes=[LaneDecode(lane_tag=t, max_new_tokens=g) for t, g in draft.decodes],
            retires=[LaneRetire(lane_tag=t, publish_to_cache=int(p)) for t, p in draft.retires],
            shed_policy=self._shed_policy(),
        )
        # The admitted lanes exist from now on: partial emits of this tick may name them.
        self._next_tag += len(draft.admits)
        for tag, cand in draft.admits:
            req = requests[cand.key]
            self.queues.pop(req)
            req.state = RequestState.RUNNING
            req.lane_tag = tag
            req.t_admitted = now
            self.lanes[tag] = Lane(
                tag=tag, request=req, prompt_len=cand.prompt_len, reserved=cand.reserve, admitted_at=now
            )
        t_tick = time.monotonic()
        try:
            events = await self.heartbeat.wait(
                proc.link.tick(plan, on_emit=self._on_emit, timeout=TICK_TIMEOUT_S)
            )
        except PlanRejected as exc:
            self._rejected(draft, requests, exc)
            return
        except EmitCallbackError as exc:
            log.error("emit_callback_failed", worker_id=self.worker_id, error=repr(exc.__cause__))
            events = exc.events
        except LinkError:
            raise
        self._rejections = 0
        self._max_admits = None
        self._prefill_cap = None
        self.metrics.tick(self.worker_id, time.monotonic() - t_tick)
        self.ticks_run += 1
        self.slot.progress()
        self._apply(proc, draft, events)

    # --- events --------------------------------------------------------------------------------

    def _on_emit(self, emit: link.TickEmit) -> None:
        lane = self.lanes.get(emit.lane_tag)
        if lane is None or lane.request.finished:
            return
        tokens = emit.tokens.tolist()
        lane.tick_tokens.extend(tokens)
        reason = lane.request.deliver(tokens)
        if reason is not None:
            self._finish(lane, reason)

    def _finish(self, lane: Lane, reason: str) -> None:
        lane.request.finish(reason)
        self.requests_done += 1
        lane.retire = True
        lane.publish = self.cache.publish_on_retire

    def _apply(self, proc: WorkerProcess, draft: PlanDraft, events: TickEvents) -> None:
        for tag, _ in draft.retires:
            self.lanes.pop(tag, None)

        results = {r.lane_tag: r for r in events.admit_results}
        for tag, _ in draft.admits:
            lane = self.lanes.get(tag)
            r = results.get(tag)
            if lane is not None and (r is None or r.status != AdmitStatus.ADMITTED):
                del self.lanes[tag]
                self._admit_refused(lane.request, r)

        shed = {e.lane_tag: e.tokens for e in events.shed.entries if e.kind == ShedKind.PREFILL_CHUNK}
        for tag, offset, count in draft.prefills:
            lane = self.lanes.get(tag)
            if lane is not None:
                done = max(0, count - shed.get(tag, 0))
                lane.prefilled = offset + done
                self.prefill_tokens_total += done

        for fault in events.faults:
            lane = self.lanes.get(fault.lane_tag)
            if lane is None:
                continue
            try:
                name = FaultCode(fault.code).name
            except ValueError:
                name = str(fault.code)
            log.warning(
                "lane_fault",
                worker_id=self.worker_id,
                lane_tag=fault.lane_tag,
                code=name,
                detail=fault.detail,
            )
            if not lane.request.finished:
                lane.request.fail(
                    ErrorCode.INTERNAL, f"the engine stopped this generation (lane fault {name})"
                )
                self.requests_done += 1
            lane.retire = True
            lane.publish = False

        for emit in events.emits:
            lane = self.lanes.get(emit.lane_tag)
            if lane is None:
                continue
            partial, lane.tick_tokens = lane.tick_tokens, []
            tokens: list[int] = []
            if emit.n_tokens:
                try:
                    tokens = proc.emit_ring.read(emit.token_ref).tolist()
                except RingError as exc:
                    log.error("emit_unreadable", worker_id=self.worker_id, lane_tag=lane.tag, error=str(exc))
                    if not lane.request.finished:
                        lane.request.fail(ErrorCode.INTERNAL, "emitted tokens were lost")
                        self.requests_done += 1
                    lane.retire = True
                    continue
            self.decode_tokens_total += len(tokens)
            if tokens[: len(partial)] != partial:
                log.error("partial_emits_disagree", worker_id=self.worker_id, lane_tag=lane.tag)
            req = lane.request
            reason = req.deliver(tokens[len(partial) :]) if len(tokens) > len(partial) else None
            if reason is None and emit.finish != Finish.NONE and not req.finished:
                if emit.finish in FINISH_REASON:
                    reason = FINISH_REASON[emit.finish]
                else:
                    req.fail(ErrorCode.INTERNAL, f"the engine ended this generation (finish {emit.finish})")
                    self.requests_done += 1
                    lane.retire = True
            if reason is not None:
                self._finish(lane, reason)
            elif emit.finish != Finish.NONE:
                lane.retire = True

        for lane in self.lanes.values():
            if lane.request.finished:
                lane.retire = True
            lane.tick_tokens.clear()

        t = events.timings
        steps = max((g for _, g in draft.decodes), default=0)
        self.rates.observe(draft.prefill_tokens, t.prefill_ns / 1e9, steps, t.decode_ns / 1e9)
        self.last_mem = events.mem

    def _admit_refused(self, req: GenerationRequest, result) -> None:
        if req.finished:
            return
        code = None
        if result is not None:
            try:
                code = result.reject_status
            except ValueError:
                code = None
        name = code.name if code is not None else "no admit result"
        tries = self._admit_retries.get(req.key, 0)
        if code in TRANSIENT_ADMIT_CODES and tries < MAX_ADMIT_RETRIES:
            self._admit_retries[req.key] = tries + 1
            req.state = RequestState.QUEUED
            req.lane_tag = None
            self.queues.push_front(req)
            log.info("admit_requeued", worker_id=self.worker_id, request_key=req.key, status=name)
            return
        self._admit_retries.pop(req.key, None)
        log.warning("admit_refused", worker_id=self.worker_id, request_key=req.key, status=name)
        req.fail(ErrorCode.INVALID_REQUEST, f"the engine refused this request ({name})")
        self.requests_done += 1

    def _rejected(self, draft: PlanDraft, requests: dict[int, GenerationRequest], exc: PlanRejected) -> None:
        """A rejected plan changed nothing in the engine: undo the admits on our side and plan
        again, smaller (ABI rules 13, 50)."""
        self.plans_rejected += 1
        self._rejections += 1
        status = exc.status.name if isinstance(exc.status, Status) else str(exc.status)
        log.warning(
            "plan_rejected",
            worker_id=self.worker_id,
            plan_seq=exc.plan_seq,
            status=status,
            message=exc.message,
            admits=len(draft.admits),
            prefill_tokens=draft.prefill_tokens,
            decodes=len(draft.decodes),
            retires=len(draft.retires),
            consecutive=self._rejections,
        )
        for tag, cand in reversed(draft.admits):  # back to the head of their classes, in order
            lane = self.lanes.pop(tag, None)
            req = requests[cand.key]
            if lane is not None and not req.finished:
                req.state = RequestState.QUEUED
                req.lane_tag = None
                req.t_admitted = None
                self.queues.push_front(req)
        for lane in self.lanes.values():
            lane.tick_tokens.clear()
        live = [lane for lane in self.lanes.values() if not lane.retire and not lane.request.finished]
        if exc.status == Status.NEEDS_REPLAN:
            if len(draft.admits) == 1 and not live:  # it cannot fit even alone: never will
                req = requests[draft.admits[0][1].key]
                self.queues.remove(req)
                req.fail(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "the request does not fit the worker's KV pool")
                self.requests_done += 1
            elif draft.admits:
                self._max_admits = len(draft.admits) // 2
            elif draft.prefills:
                self._max_admits = 0
                self._prefill_cap = max(1, draft.prefill_tokens // 2)
            elif live:  # the running lanes alone outgrow the pool: stop the youngest one
                youngest = max(live, key=lambda lane: lane.tag)
                youngest.request.fail(ErrorCode.INTERNAL, "the worker's KV pool is exhausted")
                self.requests_done += 1
                youngest.retire = True
            return
        if self._rejections == 1:
            self._max_admits = 0  # our view and the engine's disagree: stop admitting for a tick
        else:
            self.slot.restart(f"plans rejected {self._rejections} times in a row ({status})")

    def _worker_lost(self, proc: WorkerProcess, exc: LinkError) -> None:
        n = 0
        for lane in self.lanes.values():
            if not lane.request.finished:
                lane.request.fail(ErrorCode.WORKER_FAILED, f"worker {self.worker_id} failed: {exc}")
                self.requests_done += 1
                n += 1
        self.lanes.clear()
        log.warning("worker_lanes_failed", worker_id=self.worker_id, pid=proc.pid, lanes=n, error=str(exc))

    # --- operator views ------------------------------------------------------------------------

    def queue_rows(self, now: float) -> list[tuple[str, int, float]]:
        """(class, depth, oldest wait seconds) per QoS class, highest first."""
        return [(q, self.queues.depth(q), self.queues.oldest_wait(q, now)) for q in QOS_CLASSES]
