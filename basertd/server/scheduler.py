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
- A worker that dies (or breaks the link) preempts its lanes: each request goes back to the head
  of its class with its prompt and delivered tokens and resumes on the respawned worker
  (``basertd.server.supervisor``) with ``decode_replay`` exactly as after a preemption (ABI rules
  71-73), so its client sees a pause, never an error or a repeated token. A request that ran at
  ``max_crash_resumes`` crashes in a row with no token delivered in between fails
  ``WORKER_FAILED`` (a poison request cannot crash-loop its worker). Requests one crash away from
  that bound run one at a time until they deliver a token, so the bound fails the poison request
  and not the lanes that shared its ticks. The lanes resume on a live worker serving the same
  model when there is one (``peers``), else on the respawned worker. Queued requests stay queued.
  A worker the progress watchdog restarts is not a crash: its running work is what stalled, and
  fails ``WORKER_FAILED`` (``basertd.server.watchdog``).

Grammar-constrained lanes (DESIGN.md "Link W", ABI rule 74): a request with a grammar spec owns a
grammar handle on its worker from the plan that admits its lane to the plan that retires it. The
handle is created (GRAMMAR_CREATE) for each admission, right after the plan is drafted (handle 0
fails the request INTERNAL and the plan is drafted again), admitted as ``grammar_handle`` with
``grammar_replay = decode_replay`` on a resume, and freed (GRAMMAR_FREE, between ticks) whenever
the lane leaves the engine: done, cancel, fault, preemption, checkpoint, a refused admit or a
rejected plan. Handles belong to one worker incarnation: a dead worker's are forgotten and a
resumed request gets a new one on the next.

Long ticks that yield (``basertd.shm.control``): with nothing urgent waiting, ticks are long
(``TickRates`` throughput budgets). The yield word ends the tick in flight at its next step when a
request that outranks it arrives, a running request is cancelled, the scheduler stops, or a
streaming lane would otherwise wait past ``max_itl_s`` (a timer that follows the lanes' tokens);
it is cleared just before the next plan is sent. A lane whose prefill was cut (a PREFILL_CHUNK
shed entry) did not decode in that tick, so its replay is not counted down for it.

Lane tags come from a counter that is never reset, so a tag is never reused within a worker (nor
across its incarnations). Sampling and the RNG stream: see ``basertd.server.requests.Sampler``.

Serving under contention (issue 8):

- **QoS** (``basertd.server.qos``): admission follows the classes with aging and lane caps; a
  waiting interactive request preempts the lowest-class lane in the very plan that admits it. The
  victim retires with ``publish_to_cache``, its request goes back to the head of its class and
  is admitted later with its delivered tokens appended (``decode_replay`` = their count,
  ``rng_counter_base = (seed << 32) + count``: ABI rule 73, where DESIGN.md still says "same RNG
  counter base"), seeded from its own published prefix; its client sees a pause, never a
  repeated or different token. A short interactive prompt prefills whole, first, in the tick that
  admits it (``PlanLimits.urgent_prefill_budget``).
- **Prefix cache** (``basertd.server.cache_policy``): before each plan the scheduler runs the
  jobs queued for it between ticks (cache verbs), renews pin leases, evicts down to the low
  watermark when the pool went above the high one, decides prefix coalescing, then builds the
  plan with each candidate's cached-prefix hint from the index; the admits that carry a hint are
  matched and seeded (``space_match`` then ``seed_acquire``) and the plan is rebuilt when a hint
  did not hold. Unused leases are released at once. Lanes retired with publish enter the index.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import structlog

from basertd.schema import client as api
from basertd.schema import link
from basertd.schema.abi import (
    AdmitStatus,
    FaultCode,
    Finish,
    Sampling,
    ShedKind,
    SpaceKind,
    Status,
    TickFlag,
)
from basertd.schema.client import ErrorCode
from basertd.schema.tick import (
    LaneAdmit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    SamplingParams,
    ShedPolicy,
    TickEvents,
    TickPlan,
    TokenRef,
)
from basertd.server.cache_policy import Seed, WorkerCache
from basertd.server.coalescing import Coalescing, PrefillingLane, QueuedPrompt, coalesce
from basertd.server.config import CacheConfig, SchedulerConfig
from basertd.server.grammar_handles import GrammarHandles
from basertd.server.lanes import Lane, Probe, RequestQueues, candidate, on_probation, reservation
from basertd.server.link import EmitCallbackError, LinkError, LinkTimeout, PlanRejected, WorkerError
from basertd.server.logit_bias import BiasTables
from basertd.server.metrics import NULL_METRICS, Metrics
from basertd.server.notify import Heartbeat
from basertd.server.plan import Candidate, PlanDraft, PlanLimits, TickRates, build_plan, rate_curve
from basertd.server.qos import INTERACTIVE, LaneCaps, effective_rank, qos_rank
from basertd.server.rejects import CLIENT_FIELD, Action, suspect_field, triage
from basertd.server.requests import (
    QOS_CLASSES,
    AdmissionError,
    GenerationRequest,
    RequestState,
    Sampler,
    token_logprobs,
)
from basertd.server.supervisor import WorkerSlot
from basertd.server.tokenizer import Tokenizer
from basertd.server.watchdog import Phase, ProgressWatchdog
from basertd.server.worker_proc import WorkerProcess
from basertd.shm import RingError, YieldReason

log = structlog.get_logger("basertd.scheduler")

U64_MAX = (1 << 64) - 1
TICK_TIMEOUT_S = 120.0
"""A tick that has not answered within this many seconds means a hung worker: it is restarted."""
TRANSIENT_ADMIT_CODES = frozenset({Status.REJECT_STALE_SEED, Status.NEEDS_REPLAN, Status.REJECT_BUDGET})
"""Admit reject codes after which the request is requeued rather than failed."""
MAX_ADMIT_RETRIES = 3
FINISH_REASON = {Finish.EOS: "eos", Finish.LENGTH: "length", Finish.GRAMMAR: "stop"}
SEED_ROUNDS = 2
"""Times one plan is rebuilt because a cached-prefix hint did not hold (then unresolved hints
count as cold prefills)."""
COALESCE_SCAN = 256
"""Queued requests (in admission order) considered for prefix coalescing each plan."""
JOB_TIMEOUT_S = 60.0
"""Seconds a job queued for the gap between two ticks (a cache verb) may wait for it."""
PIN_RETRY_S = 5.0
"""Seconds before a pin that could not be warmed again is retried."""
QUEUED_FIRST_S = 1.0
"""Seconds a request waits in the queue before its first ``Queued`` notice."""
QUEUED_EVERY_S = 5.0
"""Seconds between two ``Queued`` notices of a request that still waits."""
CURVE_EVERY_S = 5.0
"""Seconds between two reads of the engine's measured rate curve (a PING between ticks)."""
CURVE_TIMEOUT_S = 1.0
"""Seconds the curve's PING may take before it is skipped until the next turn."""


class _WarmupSink:
    """The sink of an internal request that prefills a prefix to pin (nobody reads its tokens):
    ``done`` resolves with its Done or Error."""

    closed = False

    def __init__(self) -> None:
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def send(self, msg: object) -> None:
        if isinstance(msg, (api.Done, api.Error)) and not self.done.done():
            self.done.set_result(msg)


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


class _Plan:
    """One plan in the making: the draft, the requests its admits name (by key), the seed
    leases acquired for them and the prompt-ring refs those were matched on (by key)."""

    __slots__ = ("admits", "draft", "refs", "requests", "seeds")

    def __init__(self) -> None:
        self.draft = PlanDraft()
        self.admits: list[LaneAdmit] = []
        self.requests: dict[int, GenerationRequest] = {}
        self.seeds: dict[int, Seed] = {}
        self.refs: dict[int, TokenRef] = {}


class Scheduler:
    """The scheduler of one worker (module docstring). The daemon calls ``check_admission`` and
    ``submit`` for each accepted Generate, ``cancel`` for Cancel and gone clients, and runs
    ``run()`` as a task. State for operators and tests: ``lanes`` (tag -> ``Lane``), ``queues``
    (``RequestQueues``), ``limits``, ``ticks_run``, ``plans_rejected``, counters.

    Operators (issue 9): ``metrics`` receives each tick's wall time; ``heartbeat`` beats on every
    loop turn and every second of a bounded wait, so the systemd watchdog stops when this loop
    hangs (``basertd.server.notify.Watchdog``).

    Issue 8: ``cache_policy`` (``WorkerCache``) is this worker's prefix-cache policy;
    ``between_ticks(job)`` runs a coroutine with the live worker between two ticks (the cache
    verbs); ``warm_prefix(tokens)`` prefills a prefix with an internal request so it can be pinned
    (``tokenizer``, the worker's vocabulary, decodes that request's one token); ``preemptions`` and
    ``checkpoints`` count lanes requeued for an interactive request and for prefix coalescing."""

    def __init__(
        self,
        slot: WorkerSlot,
        limits: WorkerLimits,
        config: SchedulerConfig,
        cache: CacheConfig,
        *,
        metrics: Metrics | None = None,
        tokenizer: Tokenizer | None = None,
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
        self.yields_requested = 0
        self._t_token: dict[int, float] = {}  # lane tag -> monotonic seconds of its last token
        self._flight: _Plan | None = None  # the plan of the tick in flight
        self._urgent_arrivals: list[GenerationRequest] = []  # since the plan in making started
        self._itl_timer: asyncio.TimerHandle | None = None
        self._curve_at = 0.0
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
        self.tokenizer = tokenizer
        self.cache_policy = WorkerCache(slot.worker_id, cache)
        self.preemptions = 0
        self.checkpoints = 0
        self._jobs: deque[tuple[Callable[[Any], Awaitable[Any]], asyncio.Future]] = deque()
        self._in_tick = False
        self._seedless_plans = 0
        self._release: list[int] = []
        self.grammars = GrammarHandles(slot.worker_id, self.metrics)
        self.crash_resumes = 0
        self._stalled: str | None = None
        self.peers: Callable[[], list[Scheduler]] = list
        """The schedulers of the other workers serving the same model with the same vocabulary
        (set by the fleet): a crashed worker's lanes resume on the least loaded live one."""
        self._biases = BiasTables()  # logit-bias tables of this incarnation's requests
        self._warming: set[int] = set()
        self._tasks: set[asyncio.Task] = set()
        self._ticked = asyncio.Event()  # set (and replaced) after every tick and worker loss
        self.watchdog = ProgressWatchdog(config.stall_timeout_s)
        self._queued_notices: dict[int, float] = {}  # request key -> when its last Queued was sent
        self._phase = Phase.NO_WORKER

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
        req.plan_seq_received = self._plan_seq
        req.tick_in_flight_at_arrival = self._in_tick
        self.queues.push(req)
        self._urgent_arrival(req)
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
        elif self._flight is not None and req.lane_tag is not None:
            self._yield(YieldReason.CANCEL)  # its lane retires in the next plan: end this tick soon
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

    def cached_prefix(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` this worker's prefix index holds (for routing; a hint only)."""
        wc = self.cache_policy
        if not wc.attached or not wc.enabled:
            return 0
        return wc.hint(wc.hashes(prompt), len(prompt))

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
                last = self._queued_notices.get(req.key)
                if last is not None:
                    notices[req.key] = last
                waited = now - req.t_received
                if waited >= QUEUED_FIRST_S and (last is None or now - last >= QUEUED_EVERY_S):
                    req.sink.send(api.Queued(request_id=req.request_id, position=ahead, qos=qos))
                    notices[req.key] = now
                    sent += 1
                ahead += 1
        self._queued_notices = notices
        return sent

    @property
    def stall_reason(self) -> str | None:
        """Why this scheduler is stalled (``basertd.server.watchdog``), or None while it progresses."""
        return self.watchdog.reason

    async def watch(self) -> None:
        """The progress watchdog's task (``basertd.server.watchdog``); runs beside ``run``."""
        wd = self.watchdog
        while True:
            await asyncio.sleep(min(wd.poll_s, QUEUED_FIRST_S / 2))
            self.notify_queued(time.monotonic())
            wd.bound_s = self.config.stall_timeout_s  # a reload may have changed it
            live = sum(1 for lane in self.lanes.values() if not lane.request.finished)
            phase = self._phase
            reason = wd.check(phase, len(self.queues) + live)
            if reason is None:
                continue
            log.error("scheduler_stalled", worker_id=self.worker_id, reason=reason)
            if phase is Phase.IDLE:
                now = time.monotonic()
                stuck = [r for r in self.queues if now - r.t_received >= wd.bound_s]
                for req in stuck:
                    self.queues.remove(req)
                    req.fail(ErrorCode.INTERNAL, f"worker {self.worker_id} stalled: {reason}")
                    self.requests_done += 1
                self._max_admits = None
                self._prefill_cap = None
                if not live:
                    continue
            if self.slot.proc is not None:
                self._stalled = reason  # its running work is the suspect: failed, not resumed
            self.slot.restart(f"scheduler stalled: {reason}")

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve forever: wait for a live worker, tick it while there is work, and when it dies
        fail its lanes and wait for the next incarnation; the progress watchdog runs beside it.
        Ends only by cancellation."""
        watch = asyncio.ensure_future(self.watch())
        try:
            await self._run()
        finally:
            watch.cancel()

    async def _run(self) -> None:
        while True:
            self._phase = Phase.NO_WORKER
            proc = await self.heartbeat.wait(self.slot.ready())
            self.watchdog.progress()
            self._proc = proc
            self._stalled = None
            self.cache_policy.attach(proc.capabilities)
            self.limits = WorkerLimits.from_worker(proc)
            self.rates = TickRates(
                self.config.tick_target_s, self.config.prefill_budget, self.config.decode_grant
            )
            try:
                await self._serve(proc)
            except LinkError as exc:
                self._worker_lost(proc, exc)
                if proc.link.alive:  # a tick that never answered: the engine holds the lanes
                    self.slot.restart(f"link error: {exc}")
            except Exception as exc:  # a bug of ours: never let it end the loop of this worker
                log.exception("scheduler_error", worker_id=self.worker_id, error=repr(exc))
                self._worker_lost(proc, LinkError(f"scheduler error: {exc!r}"))
                self.slot.restart("scheduler error: engine state and ours may disagree")
            finally:
                self._proc = None
                self.cache_policy.detach()
                self._release.clear()  # leases die with the incarnation
                self.grammars.forget()  # and so do grammar handles
                self._biases.clear()

    async def stop(self, message: str = "the daemon is shutting down") -> None:
        """Refuse new requests and fail everything queued or running with SHUTTING_DOWN."""
        self._stopping = True
        self._yield(YieldReason.DRAIN)
        for task in list(self._tasks):
            task.cancel()
        while self._jobs:
            _, fut = self._jobs.popleft()
            if not fut.done():
                fut.set_exception(LinkError(message))
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
                self._phase = Phase.BETWEEN
                await self._between(proc)
                self._phase = Phase.PLANNING
                plan = await self._plan(proc)
                if plan.draft.empty and (self._release or self.grammars.pending_free):
                    continue  # release the leases and grammars it did not use before waiting
                if plan.draft.empty:
                    self._phase = Phase.IDLE
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
                await self._tick(proc, plan)
        finally:
            dead.cancel()

    # --- between ticks: jobs, leases, watermarks -----------------------------------------------

    async def between_ticks(
        self, job: Callable[[Any], Awaitable[Any]], timeout: float = JOB_TIMEOUT_S
    ) -> Any:
        """Run ``job(proc)`` on this scheduler's loop between two ticks, with the live worker, and
        return its result (so nothing races a tick's prompt-ring writes or seed leases). Raises
        what the job raises, ``LinkError`` when the worker is not running, ``TimeoutError`` when
        no gap between ticks came within ``timeout`` seconds."""
        if self._proc is None or self._stopping:
            raise LinkError(f"worker {self.worker_id} is not running")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._jobs.append((job, fut))
        self._wake.set()
        return await asyncio.wait_for(asyncio.shield(fut), timeout)

    async def _between(self, proc: WorkerProcess) -> None:
        wc = self.cache_policy
        wc.config = self.cache  # a reload (SIGHUP) may have replaced the [cache] knobs
        while self._jobs:
            job, fut = self._jobs.popleft()
            if fut.done():
                continue
            try:
                result = await job(proc)
            except LinkError as exc:
                fut.set_exception(exc)
                if not proc.link.alive:
                    raise  # the worker is gone; a refusal (WorkerError) leaves it serving
            except Exception as exc:  # handed to the caller (a control verb)
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        while self._release:
            await wc.release(proc, self._release.pop())
        await self.grammars.free_pending(proc)
        await self._read_curve(proc)
        await self._biases.sweep(proc.link, {lane.request.key for lane in self.lanes.values()})
        if wc.renewals_due():
            for pin in await wc.renew(proc):
                self._spawn(self._rewarm(pin.pin_id))
        now = time.monotonic()
        for pin in wc.pins.values():
            if not pin.handle and pin.pin_id not in self._warming and now >= pin.retry_at:
                self._spawn(self._rewarm(pin.pin_id))
        if self.last_mem is not None:
            target = wc.watermark_target(self.last_mem)
            self.last_mem = None  # re-read after the next tick
            if target:
                try:
                    freed = await wc.evict(proc, target)
                except WorkerError as exc:
                    log.warning("cache_watermark_evict_refused", worker_id=self.worker_id, error=str(exc))
                else:
                    log.info("cache_watermark_evicted", worker_id=self.worker_id, target=target, freed=freed)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def warm_prefix(self, tokens: list[int], timeout: float = 120.0) -> None:
        """Prefill ``tokens`` with an internal one-token greedy request (class batch) and wait
        until its lane has retired with publish, so the prefix is in the engine's cache. Raises
        ``TimeoutError``, or ``LinkError`` when the request failed."""
        if self.tokenizer is None:
            raise LinkError("no tokenizer to run a warm-up request with")
        sink = _WarmupSink()
        req = GenerationRequest(
            request_id=f"warmup-{self.worker_id}-{self._next_tag}",
            prompt=list(tokens),
            max_tokens=1,
            sampler=Sampler(Sampling.GPU_GREEDY, SamplingParams(), 0),
            sink=sink,
            tokenizer=self.tokenizer,
            qos="batch",
            stream=False,
        )
        self.submit(req)

        async def settled() -> None:
            msg = await sink.done
            if isinstance(msg, api.Error):
                raise LinkError(f"warm-up failed: {msg.message}")
            while any(lane.request is req for lane in self.lanes.values()):
                await self._ticked.wait()  # its lane retires (and publishes) in a coming tick

        try:
            await asyncio.wait_for(settled(), timeout)
        except BaseException:
            self.cancel(req, message="warm-up abandoned")
            raise

    async def _rewarm(self, pin_id: int) -> None:
        """Warm and hold a pin whose lease was lost (a respawned worker, an expired lease)."""
        self._warming.add(pin_id)
        try:
            pin = self.cache_policy.pins.get(pin_id)
            if pin is None:
                return
            wc = self.cache_policy
            if not await self.between_ticks(lambda proc: wc.hold(proc, pin)):
                await self.warm_prefix([int(t) for t in pin.tokens])
                if pin_id in wc.pins and not await self.between_ticks(lambda proc: wc.hold(proc, pin)):
                    log.warning("pin_not_restored", worker_id=self.worker_id, pin_id=pin_id)
                    pin.retry_at = time.monotonic() + PIN_RETRY_S
        except (LinkError, TimeoutError) as exc:
            log.warning("pin_rewarm_failed", worker_id=self.worker_id, pin_id=pin_id, error=str(exc))
            pin = self.cache_policy.pins.get(pin_id)
            if pin is not None:
                pin.retry_at = time.monotonic() + PIN_RETRY_S
        finally:
            self._warming.discard(pin_id)

    # --- planning ------------------------------------------------------------------------------

    def _hashes(self, req: GenerationRequest) -> list[int]:
        if not req.page_hashes and len(req.prompt) >= self.cache_policy.page:
            req.page_hashes = self.cache_policy.hashes(req.prompt)
        return req.page_hashes

    def _coalesce(self, now: float) -> Coalescing:
        """Prefix coalescing (``basertd.server.coalescing.coalesce``): which queued requests wait for a
        leader's prefix; leader lanes get their checkpoint (a lane already past it retires now)."""
        wc = self.cache_policy
        if not wc.enabled or not self.cache.coalesce_min_tokens or not len(self.queues):
            return Coalescing()
        queued = []
        for req in itertools.islice(self.queues.ordered(now, self.config.aging_s), COALESCE_SCAN):
            if req.generated:
                continue  # a resumed request: its prefix is its own, it neither leads nor waits
            hashes = self._hashes(req)
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
        # checkpoint and during the plan that retires it (the index learns the prefix only once
        # that plan is accepted). A request leads at most once.
        # A finished lane retiring with publish leads for this one plan as well.
        lanes = []
        for lane in self.lanes.values():
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
        out = coalesce(queued, lanes, wc.page, self.cache.coalesce_min_tokens)
        for tag, cp in out.lane_checkpoints.items():
            lane = self.lanes[tag]
            if lane.retire or lane.request.finished:
                continue  # already retiring with publish
            lane.request.checkpointed = True
            lane.checkpoint = max(lane.checkpoint, cp)
            if lane.prefilled >= lane.checkpoint:
                self._checkpoint(lane)
        return out

    def _checkpoint(self, lane: Lane) -> None:
        """Retire ``lane`` with publish in the next plan and requeue its request (its prefix is
        shared by waiting requests)."""
        lane.retire = True
        lane.publish = True
        lane.requeue = True

    def _plan_limits(self, now: float) -> PlanLimits:
        live = [lane for lane in self.lanes.values() if not lane.retire and not lane.request.finished]
        interactive = QOS_CLASSES[INTERACTIVE]
        waiting = self.queues.depth(interactive) > 0 or any(
            lane.phase == "prefill" and lane.request.qos == interactive for lane in live
        )
        decoding = [lane for lane in live if lane.phase == "decode"]
        streaming = any(lane.request.stream for lane in decoding)
        rates, cfg = self.rates, self.config
        rates.long_prefill = cfg.long_prefill_budget
        rates.max_itl_s = cfg.max_itl_s
        rates.min_chunk = cfg.min_prefill_chunk
        proc = self._proc
        can_yield = proc is not None and proc.can_yield
        prefill_budget, grant = rates.budgets(
            waiting, bool(decoding), streaming=streaming, can_yield=can_yield
        )
        if self._prefill_cap is not None:
            prefill_budget = min(prefill_budget, self._prefill_cap)
        lim = self.limits
        return PlanLimits(
            max_lanes=lim.max_lanes,
            max_decode_lanes=lim.max_batch_size,
            kv_tokens=lim.kv_tokens,
            prefill_budget=prefill_budget,
            decode_grant=grant,
            max_admit_tokens=lim.max_admit_tokens,
            max_admits=(1 << 30) if self._max_admits is None else self._max_admits,
            urgent_prefill_budget=self.config.prefill_budget if self._prefill_cap is None else 0,
            lane_caps=LaneCaps.from_names(self.config.lane_caps),
            preempt=self.config.preempt,
            preempt_publish=self.cache.publish_on_retire,
        )

    async def _plan(self, proc: WorkerProcess) -> _Plan:
        """The next plan (``_draft``) with a grammar handle for each constrained admit; drafted
        again without the requests whose grammar the worker refused (failed INTERNAL) or that
        finished (a cancel) while it was being made. Handles made for requests the final plan does
        not admit are freed between ticks."""
        made: dict[int, GenerationRequest] = {}
        while True:
            plan = await self._draft(proc)
            dropped = False
            for _, cand in plan.draft.admits:
                req = plan.requests[cand.key]
                if not req.finished and req.grammar is not None and not req.grammar_handle:
                    await self._create_grammar(proc, req)
                    if req.grammar_handle:
                        made[req.key] = req
                if req.finished:
                    dropped = True
            if not dropped:
                break
            self._release.extend(seed.handle for seed in plan.seeds.values())
        admitted = {cand.key for _, cand in plan.draft.admits}
        for key, req in made.items():
            if key not in admitted:
                self.grammars.drop(req)
        return plan

    async def _create_grammar(self, proc: WorkerProcess, req: GenerationRequest) -> None:
        """A grammar handle for ``req``'s admission; a worker that gives none fails ``req``
        INTERNAL (and dequeues it). Raises ``LinkError`` when the link died."""
        why = await self.grammars.create(proc, req)
        if why is None or req.grammar is None:
            return
        log.warning("grammar_create_failed", worker_id=self.worker_id, request_key=req.key, error=why)
        self.queues.remove(req)
        what = req.grammar.kind
        req.fail(ErrorCode.INTERNAL, f"the worker could not compile this request's {what} ({why})")
        self.requests_done += 1

    async def _draft(self, proc: WorkerProcess) -> _Plan:
        """Build the next plan: coalescing, then the plan with cached-prefix hints, then matches
        and seed leases for the admits that carry a hint, rebuilt while a hint did not hold."""
        now = time.monotonic()
        self._urgent_arrivals = []  # arrivals from now on may miss this plan (``_tick`` checks)
        limits = self._plan_limits(now)
        wc = self.cache_policy
        use_seeds = wc.enabled and self._seedless_plans == 0
        if self._seedless_plans:
            self._seedless_plans -= 1
        plan = _Plan()
        cold: set[int] = set()  # hints that did not hold: admitted cold
        for attempt in range(SEED_ROUNDS + 1):
            coal = self._coalesce(now)
            probe = Probe(any(self._probation(lane.request) for lane in self.lanes.values()))
            seen: list[GenerationRequest] = []
            last = attempt == SEED_ROUNDS or not use_seeds

            def seed_of(req: GenerationRequest, last: bool = last) -> int:
                got = plan.seeds.get(req.key)
                if got is not None:
                    return got.length
                if last or req.key in cold:
                    return 0
                prompt_len = len(req.prompt) + len(req.generated)
                return wc.hint(self._resume_hashes(req), prompt_len)

            def candidates(
                coal: Coalescing = coal, seen: list = seen, seed_of=seed_of, probe: Probe = probe
            ) -> Iterator[Candidate]:
                blocked = coal.blocked
                order = self.queues.ordered(now, self.config.aging_s, skip=lambda r: r.key in blocked)
                for req in order:
                    if self._probation(req) and not probe.take():
                        continue
                    seen.append(req)
                    yield candidate(
                        req,
                        self.limits.page_tokens,
                        seed=seed_of(req),
                        urgent=req.qos == QOS_CLASSES[INTERACTIVE] and self.config.preempt,
                        checkpoint=coal.leader_checkpoints.get(req.key, 0),
                    )

            def urgent_after(
                coal: Coalescing = coal, seen: list = seen, seed_of=seed_of, probe: Probe = probe
            ) -> Iterator[Candidate]:
                if not self.config.preempt:
                    return
                read = {r.key for r in seen}
                for req in list(self.queues.classes[QOS_CLASSES[INTERACTIVE]]):
                    if req.finished or req.key in read or req.key in coal.blocked:
                        continue
                    if self._probation(req) and not probe.take():
                        continue
                    seen.append(req)
                    yield candidate(
                        req,
                        self.limits.page_tokens,
                        seed=seed_of(req),
                        urgent=True,
                        checkpoint=coal.leader_checkpoints.get(req.key, 0),
                    )

            views = [lane.view() for lane in self.lanes.values()]
            plan.draft = build_plan(
                views, candidates(), limits, next_tag=self._next_tag, urgent_after=urgent_after()
            )
            by_key = {req.key: req for req in seen}
            plan.requests = {cand.key: by_key[cand.key] for _, cand in plan.draft.admits}
            todo = [c for _, c in plan.draft.admits if c.prefilled > 0 and c.key not in plan.seeds]
            if not todo or last:
                break
            changed = False
            for cand in todo:
                req = plan.requests[cand.key]
                tokens = req.resume_prompt()
                ref = proc.prompt_ring.write(np.asarray(tokens, dtype=np.uint32))
                plan.refs[cand.key] = ref
                seed = await wc.seed(proc, ref, self._resume_hashes(req), len(tokens))
                if seed is None:
                    cold.add(cand.key)
                    changed = True
                else:
                    plan.seeds[cand.key] = seed
                    changed = changed or seed.length != cand.prefilled
            if not changed:
                break
        admitted = {cand.key for _, cand in plan.draft.admits}
        for key in [k for k in plan.seeds if k not in admitted]:
            self._release.append(plan.seeds.pop(key).handle)
        return plan

    def _probation(self, req: GenerationRequest) -> bool:
        return on_probation(req, self.config.max_crash_resumes)

    def _resume_hashes(self, req: GenerationRequest) -> list[int]:
        base = self._hashes(req)
        if not req.generated:
            return base
        return self.cache_policy.hashes(req.resume_prompt(), base)

    def _shed_policy(self) -> ShedPolicy:
        if not self.cache.evict_in_tick:
            return ShedPolicy()
        return self.cache_policy.shed_policy(self.cache.max_evict_bytes_per_tick)

    async def _tick(self, proc: WorkerProcess, plan: _Plan) -> None:
        draft, requests = plan.draft, plan.requests
        now = time.monotonic()
        admits: list[LaneAdmit] = []
        prompts: dict[int, list[int]] = {}
        biases, refused = await self._biases.handles(proc.link, [requests[c.key] for _, c in draft.admits])
        for req, why in refused:
            self.queues.remove(req)
            req.fail(ErrorCode.INVALID_REQUEST, str(why))
            self.requests_done += 1
        if refused or any(requests[key].finished for key in biases):
            self._release.extend(s.handle for s in plan.seeds.values())
            return  # a request ended while its table was made: plan again without it
        for tag, cand in draft.admits:
            req = requests[cand.key]
            sampler = req.sampler
            tokens = req.resume_prompt()
            prompts[cand.key] = tokens
            seed = plan.seeds.get(cand.key)
            ref = plan.refs.get(cand.key)
            if ref is None or seed is None:
                try:
                    ref = proc.prompt_ring.write(np.asarray(tokens, dtype=np.uint32))
                except RingError as exc:  # sized at admission; a failure here is a bug, fail the request
                    self.queues.remove(req)
                    req.fail(ErrorCode.INTERNAL, f"cannot stage the prompt: {exc}")
                    self.requests_done += 1
                    self._release.extend(s.handle for s in plan.seeds.values())
                    for r in requests.values():
                        self.grammars.drop(r)
                    return
            admits.append(
                LaneAdmit(
                    lane_tag=tag,
                    prompt=ref,
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
        self._plan_seq += 1
        flags = TickFlag.PARTIAL_EMITS if self.config.partial_emits else 0
        tick_plan = TickPlan(
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
            if req.t_admitted is None:
                req.t_admitted = now
            rank = qos_rank(req.qos)
            tokens = prompts[cand.key]
            lane = Lane(
                tag=tag,
                request=req,
                prompt_len=cand.prompt_len,
                reserved=cand.reserve,
                admitted_at=now,
                prefilled=cand.prefilled,
                admitted=tokens,
                hashes=self._hashes(req),
                seed=cand.prefilled,
                replay_left=max(0, len(tokens) - max(cand.prefilled, cand.prompt_len)),
                checkpoint=cand.checkpoint if cand.checkpoint > cand.prefilled else 0,
                preemptible=rank > INTERACTIVE,
                aged=effective_rank(rank, now - req.t_received, self.config.aging_s) < rank,
            )
            if lane.checkpoint:
                req.checkpointed = True
            self.lanes[tag] = lane
        self._in_tick = True
        self._phase = Phase.TICK
        self._flight = plan
        self._send_yield_word(proc, plan)
        t_tick = time.monotonic()
        try:
            events = await self.heartbeat.wait(
                proc.link.tick(tick_plan, on_emit=self._on_emit, timeout=TICK_TIMEOUT_S)
            )
        except PlanRejected as exc:
            self._rejected(plan, exc)
            return
        except EmitCallbackError as exc:
            log.error("emit_callback_failed", worker_id=self.worker_id, error=repr(exc.__cause__))
            events = exc.events
        finally:
            self._in_tick = False
            self._flight = None
            if self._itl_timer is not None:
                self._itl_timer.cancel()
                self._itl_timer = None
        self._rejections = 0
        self._max_admits = None
        self._prefill_cap = None
        self.metrics.tick(self.worker_id, time.monotonic() - t_tick)
        self.ticks_run += 1
        self.watchdog.progress()
        self.cache_policy.on_tick(events.shed.entries)
        self.slot.progress()
        self._apply(proc, plan, events)
        self._signal_tick()

    def _signal_tick(self) -> None:
        ticked, self._ticked = self._ticked, asyncio.Event()
        ticked.set()

    # --- yield inside a tick (basertd.shm.control) ---------------------------------------------

    def _yield(self, reason: YieldReason) -> None:
        """Ask the tick in flight to end at its next step boundary (no-op when no tick is in
        flight or the engine cannot yield)."""
        proc = self._proc
        if self._flight is None or proc is None or not proc.can_yield or proc.yield_requested:
            return
        proc.request_yield(reason)
        self.yields_requested += 1
        log.debug("yield_requested", worker_id=self.worker_id, reason=reason.name)

    def _outranks_flight(self, req: GenerationRequest) -> bool:
        """Whether ``req`` outranks the work of the tick in flight: an interactive request always
        (it must not wait for a long tick), another one when every lane of that tick is of a
        lower class."""
        rank = qos_rank(req.qos)
        if rank == INTERACTIVE:
            return True
        flight = self._flight
        if flight is None:
            return False
        tags = {t for t, _, _ in flight.draft.prefills} | {t for t, _ in flight.draft.decodes}
        ranks = [qos_rank(lane.request.qos) for t in tags if (lane := self.lanes.get(t)) is not None]
        return bool(ranks) and rank < min(ranks)

    def _urgent_arrival(self, req: GenerationRequest) -> None:
        """A request was queued: when it outranks the tick in flight, that tick yields; one that
        arrives while a plan is being made is remembered, so the tick of a plan that missed it
        yields too (``_send_yield_word``)."""
        if not self._outranks_flight(req):
            return
        if self._flight is not None:
            self._yield(YieldReason.URGENT_ADMIT)
        else:
            self._urgent_arrivals.append(req)

    def _send_yield_word(self, proc: WorkerProcess, plan: _Plan) -> None:
        """Just before ``plan`` is sent: clear the yield word (this plan serves what asked for the
        yield), set it again when an urgent request arrived while the plan was made and the plan
        does not admit it, and arm the inter-token latency timer (``_arm_itl``)."""
        if not proc.can_yield:
            return
        if proc.yield_requested:
            proc.clear_yield()
        missed = [r for r in self._urgent_arrivals if r.state is RequestState.QUEUED and not r.finished]
        self._urgent_arrivals = []
        if missed:
            self._yield(YieldReason.URGENT_ADMIT)
        elif plan.draft.prefills:
            self._arm_itl(plan)

    def _itl_deadline(self, plan: _Plan) -> float | None:
        """Monotonic seconds at which the tick of ``plan`` must be asked to end so that each of its
        streaming decode lanes gets its next token within ``max_itl_s``; None when it has none."""
        proc = self._proc
        step = self.config.min_prefill_chunk
        if proc is not None:
            try:
                step = int(proc.capabilities.extra.get("step_tokens", step))
            except ValueError:
                pass
        after = self.rates.itl_yield_after(step)
        last = [
            self._t_token[tag]
            for tag, _ in plan.draft.decodes
            if tag in self._t_token
            and (lane := self.lanes.get(tag)) is not None
            and lane.request.stream
            and not lane.request.finished
        ]
        return min(last) + after if last else None

    def _arm_itl(self, plan: _Plan) -> None:
        """Yield the tick of ``plan`` (reason ITL_BOUND) when a streaming lane would otherwise
        wait past ``max_itl_s``; the deadline moves on as partial emits deliver tokens."""
        if self._itl_timer is not None:
            self._itl_timer.cancel()
            self._itl_timer = None
        if self._flight is not plan:
            return
        deadline = self._itl_deadline(plan)
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        if deadline <= time.monotonic():
            self._yield(YieldReason.ITL_BOUND)
            return
        self._itl_timer = loop.call_at(deadline - time.monotonic() + loop.time(), lambda: self._arm_itl(plan))

    async def _read_curve(self, proc: WorkerProcess) -> None:
        """Every ``CURVE_EVERY_S`` seconds, read the engine's measured prefill-rate curve from a
        PONG (``plan.rate_curve``) into ``rates``; a slow or refused PING is skipped."""
        now = time.monotonic()
        if now - self._curve_at < CURVE_EVERY_S or not self.ticks_run:
            return
        self._curve_at = now
        try:
            pong = await proc.link.ping(timeout=CURVE_TIMEOUT_S)
        except (LinkTimeout, WorkerError) as exc:  # the worker may still answer: it serves on
            log.debug("rate_curve_unread", worker_id=self.worker_id, error=repr(exc))
            return
        self.rates.set_curve(rate_curve(pong.stats))

    # --- events --------------------------------------------------------------------------------

    def _deliver(self, lane: Lane, tokens: list[int], logprobs: list | None = None) -> str | None:
        req = lane.request
        first = req.t_first_token is None
        if tokens:
            self._t_token[lane.tag] = time.monotonic()
        reason = req.deliver(tokens, logprobs=logprobs)
        if first and req.t_first_token is not None:
            req.ttft_ticks = (
                self._plan_seq - req.plan_seq_received + (1 if req.tick_in_flight_at_arrival else 0)
            )
        return reason

    def _on_emit(self, emit: link.TickEmit) -> None:
        lane = self.lanes.get(emit.lane_tag)
        if lane is None or lane.request.finished or lane.request.sampler.logprobs:
            return  # a logprobs lane's tokens go out with their rows, from the tick's events
        tokens = emit.tokens.tolist()
        lane.tick_tokens.extend(tokens)
        reason = self._deliver(lane, tokens)
        if reason is not None:
            self._finish(lane, reason)

    def _finish(self, lane: Lane, reason: str) -> None:
        lane.request.finish(reason)
        self.requests_done += 1
        lane.retire = True
        lane.publish = self.cache.publish_on_retire

    def _retired(self, lane: Lane, publish: bool, preempted: bool) -> None:
        """``lane`` was retired by an accepted plan: index what it published, requeue its request
        when it was preempted or checkpointed."""
        if publish and lane.kv_tokens >= self.cache_policy.page:
            self.cache_policy.published(lane.published_tokens(), lane.kv_tokens, lane.hashes)
        req = lane.request
        self.grammars.drop(req)
        if not (preempted or lane.requeue) or req.finished:
            return
        req.state = RequestState.QUEUED
        req.lane_tag = None
        self.queues.push_front(req)
        if preempted:
            req.preemptions += 1
            self.preemptions += 1
            self.metrics.preempted(self.worker_id, req.qos)
            log.info(
                "lane_preempted",
                worker_id=self.worker_id,
                lane_tag=lane.tag,
                request_key=req.key,
                qos=req.qos,
                generated=len(req.generated),
            )
        else:
            self.checkpoints += 1
            log.debug("lane_checkpointed", worker_id=self.worker_id, lane_tag=lane.tag, tokens=lane.kv_tokens)

    def _apply(self, proc: WorkerProcess, plan: _Plan, events: TickEvents) -> None:
        draft = plan.draft
        preempted = set(draft.preempted)
        # Victims go back to the head of their class oldest last, so the oldest is at the head.
        retired = [(tag, publish, self.lanes.pop(tag, None)) for tag, publish in draft.retires]
        retired.sort(key=lambda r: -(r[2].request.t_received if r[2] is not None else 0.0))
        for tag, publish, lane in retired:
            if lane is not None:
                self._retired(lane, publish, tag in preempted)

        results = {r.lane_tag: r for r in events.admit_results}
        for tag, cand in draft.admits:
            lane = self.lanes.get(tag)
            r = results.get(tag)
            if lane is not None and (r is None or r.status != AdmitStatus.ADMITTED):
                del self.lanes[tag]
                seed = plan.seeds.get(cand.key)
                if seed is not None:
                    self._release.append(seed.handle)
                self.grammars.drop(lane.request)
                self._admit_refused(lane.request, r)
            elif lane is not None and lane.request.admissions == 0:
                lane.request.cached_tokens = min(lane.seed, len(lane.request.prompt))
            if lane is not None and tag in self.lanes:
                lane.request.admissions += 1

        shed = {e.lane_tag: e.tokens for e in events.shed.entries if e.kind == ShedKind.PREFILL_CHUNK}
        for tag, offset, count in draft.prefills:
            lane = self.lanes.get(tag)
            if lane is not None:
                done = max(0, count - shed.get(tag, 0))
                lane.prefilled = offset + done
                self.prefill_tokens_total += done
                if lane.checkpoint and lane.prefilled >= lane.checkpoint:
                    self._checkpoint(lane)
        replayed: dict[int, int] = {}
        for tag, grant in draft.decodes:
            lane = self.lanes.get(tag)
            if tag in shed:
                continue  # its prefill was cut (a yield or a budget shed): it did not decode
            if lane is not None and lane.replay_left:
                used = min(grant, lane.replay_left)
                lane.replay_left -= used
                lane.replayed += used
                replayed[tag] = used

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
            lane.requeue = False

        rows: dict[int, list] = {}
        for row in events.logprobs:
            rows.setdefault(row.lane_tag, []).append(row)
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
                    lane.publish = False
                    continue
            lane.emitted.extend(tokens)
            self.decode_tokens_total += len(tokens)
            if tokens[: len(partial)] != partial:
                log.error("partial_emits_disagree", worker_id=self.worker_id, lane_tag=lane.tag)
            req = lane.request
            lps = None
            if req.sampler.logprobs and not req.finished:
                try:
                    lps = token_logprobs(tokens, rows.get(lane.tag, []))[len(partial) :]
                except ValueError as exc:
                    req.fail(ErrorCode.INTERNAL, f"the engine's logprobs do not match its tokens: {exc}")
                    self.requests_done += 1
            fresh = tokens[len(partial) :]
            reason = self._deliver(lane, fresh, lps) if fresh and not req.finished else None
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
        emitted = {e.lane_tag: e.n_tokens for e in events.emits}
        steps = max((emitted.get(tag, 0) + replayed.get(tag, 0) for tag, _ in draft.decodes), default=0)
        prefilled = sum(max(0, n - shed.get(tag, 0)) for tag, _, n in draft.prefills)
        self.rates.observe(prefilled, t.prefill_ns / 1e9, steps, t.decode_ns / 1e9)
        self.last_mem = events.mem
        for tag in [t for t in self._t_token if t not in self.lanes]:
            del self._t_token[tag]

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

    def _rejected(self, plan: _Plan, exc: PlanRejected) -> None:
        """A rejected plan changed nothing in the engine: undo the admits on our side, release
        their seed leases, and plan again, smaller (ABI rules 13, 50). Preempted and checkpointed
        lanes were not retired: they stay live and are retired by a later plan."""
        draft, requests = plan.draft, plan.requests
        self.plans_rejected += 1
        self._rejections += 1
        self._release.extend(seed.handle for seed in plan.seeds.values())
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
        if exc.status == Status.REJECT_STALE_SEED and plan.seeds and self._rejections <= MAX_ADMIT_RETRIES:
            self._seedless_plans = 1  # a lease the engine no longer honours: one plan without seeds
            return
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
        verdict = triage(len(draft.admits), self._rejections, self.limits.max_lanes)
        if verdict.action is Action.FAIL_ADMIT:
            tag, cand = draft.admits[0]
            req = requests[cand.key]
            admit = next((a for a in plan.admits if a.lane_tag == tag), None)
            field_ = suspect_field(admit, exc.message) if admit is not None else ""
            field_ = CLIENT_FIELD.get(field_, field_)
            if not req.finished:
                self.queues.remove(req)
                what = f"its {field_} is out of the engine's range" if field_ else "the engine cannot run it"
                req.fail(ErrorCode.INVALID_REQUEST, f"the engine refused this request: {what} ({status})")
                self.requests_done += 1
            log.warning(
                "admit_rejected_alone",
                worker_id=self.worker_id,
                request_key=req.key,
                field=field_,
                status=status,
            )
            self._max_admits = None
        elif verdict.action is Action.RESTART:
            self._max_admits = None
            self.slot.restart(f"plans rejected {self._rejections} times in a row ({status})")
        else:  # bisect the admits, or retry once without any
            self._max_admits = verdict.max_admits

    def _worker_lost(self, proc: WorkerProcess, exc: LinkError) -> None:
        """The worker died or broke the link: a preemption of every live lane (module
        docstring). Each request goes back to the head of its class (the oldest at the head) to
        resume with its delivered tokens on the next incarnation; one that ran at
        ``max_crash_resumes`` crashes in a row without a token in between fails WORKER_FAILED.
        Grammar handles of the incarnation are forgotten (the engine that held them is gone)."""
        live = [lane for lane in self.lanes.values() if not lane.request.finished]
        self.lanes.clear()
        stalled, self._stalled = self._stalled, None
        for req in self.queues:  # handles made for a plan that never ran
            req.grammar_handle = 0
        live.sort(key=lambda lane: -lane.request.t_received)
        resumed: list[int] = []
        failed: list[int] = []
        moved: list[int] = []
        for lane in live:
            req = lane.request
            req.grammar_handle = 0
            req.crash_streak += 1
            if stalled is not None:
                req.fail(
                    ErrorCode.WORKER_FAILED, f"worker {self.worker_id} stalled and was restarted: {stalled}"
                )
                self.requests_done += 1
                failed.append(req.key)
                continue
            if req.crash_streak >= self.config.max_crash_resumes:
                req.fail(
                    ErrorCode.WORKER_FAILED,
                    f"worker {self.worker_id} died {req.crash_streak} times in a row while this request "
                    f"ran, without a token in between (last: {exc})",
                )
                self.requests_done += 1
                failed.append(req.key)
                continue
            req.state = RequestState.QUEUED
            req.lane_tag = None
            req.crash_resumes += 1
            peer = self._peer_for(req)
            if peer is None:
                self.queues.push_front(req)
            else:
                peer.adopt(req)
                moved.append(req.key)
            self.crash_resumes += 1
            self.metrics.crash_resumed(self.worker_id)
            resumed.append(req.key)
        self._signal_tick()
        self._wake.set()
        log.warning(
            "worker_lanes_resumed",
            worker_id=self.worker_id,
            pid=proc.pid,
            resumed=len(resumed),
            failed=len(failed),
            resumed_keys=resumed[::-1],
            failed_keys=failed,
            moved_to_peers=moved[::-1],
            error=str(exc),
        )

    def _peer_for(self, req: GenerationRequest) -> Scheduler | None:
        """The least loaded live peer (``peers``) that can run ``req`` now, or None."""
        fits = []
        for peer in self.peers():
            proc = peer.slot.proc
            if proc is None or not proc.link.alive or peer.slot.state != "ready":
                continue
            try:
                peer.check_admission(len(req.prompt), req.max_tokens, req.qos)
            except AdmissionError:
                continue
            fits.append(peer)
        return min(fits, key=lambda p: p.load(), default=None)

    def adopt(self, req: GenerationRequest) -> None:
        """Take over ``req``, resumed after its worker died (``peers``): it goes to the head of
        its class and resumes here with its delivered tokens (ABI rules 71-73)."""
        req.worker_id = self.worker_id
        req.page_hashes = []  # this worker's page size may differ
        self.queues.push_front(req)
        self.slot.poke()
        self._wake.set()

    # --- operator views ------------------------------------------------------------------------

    def queue_rows(self, now: float) -> list[tuple[str, int, float]]:
        """(class, depth, oldest wait seconds) per QoS class, highest first."""
        return [(q, self.queues.depth(q), self.queues.oldest_wait(q, now)) for q in QOS_CLASSES]
