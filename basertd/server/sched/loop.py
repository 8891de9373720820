"""The per-worker scheduler loop: continuous batching over the tick ABI (DESIGN.md "Scheduling").

One ``Scheduler`` per worker runs one asyncio task and does every await; the decisions are the
synchronous core's (``basertd.server.sched.core.SchedulerCore``), which returns what reaches the
clients as ``Delivery`` records; the loop hands them to the requests' sinks (``_deliver``) and
gives the core the clock (``time.monotonic()``). Each turn it:

1. runs the commands queued for the gap between two ticks (``basertd.server.cache.commands``:
   the cache verbs, pin holds), releases unused seed leases, frees the worker-held handles no
   lane needs (grammars, logit-bias tables: ``basertd.server.sched.handles``), reads the engine's
   rate curve, renews pin leases and evicts down to the low watermark;
2. resolves every cached-prefix hint of the coming plan first (``core.hint_requests``: writes the
   prompt into ring 1, ``space_match`` then ``seed_acquire``), then has the plan drafted once
   (``core.draft``);
3. creates a grammar handle for each constrained admit (ABI rule 74) and a logit-bias table per
   request, writes the remaining admitted prompts into ring 1, and submits the tick
   (``core.launch``); partial emits (TICK_EMIT) stream to the clients while it runs and the yield
   word (``basertd.server.workers.yield_word``) can end it early;
4. reads the emitted tokens from the emit ring and applies the tick's outcome (``core.apply``):
   ``Accepted`` events, or a ``Rejected`` plan to undo (a plan refused again and again restarts
   the worker).

With nothing to do it awaits an event (a new request, a cancel, a command, the worker's death); it
never polls. Ring 1 has one writer: the ``PromptFeed`` of the incarnation this loop serves
(``basertd.server.workers.prompt_feed``).

A worker that dies (or breaks the link) preempts its lanes: each request resumes on the respawned
worker (``basertd.server.workers.slot``) or a live peer exactly as after a preemption, so its
client sees a pause, never an error or a repeated token; a poison request fails after
``max_crash_resumes`` crashes in a row (``core.apply`` with ``Lost``). A planned replacement
preempts them the same way without the crash and parks the loop. Both are ``handover.HandOver``'s
(``Scheduler.handover``). A worker the progress watchdog restarts is not a crash: its running work
is what stalled, and fails ``WORKER_FAILED`` (``basertd.server.sched.watchdog``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable
from typing import Any

import structlog

from basertd.schema import link
from basertd.schema.client import ErrorCode
from basertd.schema.tick import TokenRef
from basertd.server.cache.commands import Command, DropPin, Evict, HoldPin, ListEntries
from basertd.server.cache.policy import WorkerCache
from basertd.server.config_sections import CacheConfig, SchedulerConfig
from basertd.server.observe.metrics import Metrics
from basertd.server.observe.notify import Heartbeat
from basertd.server.observe.snapshot import SpecVerifyCost, WorkerSnapshot
from basertd.server.request.record import GenerationRequest
from basertd.server.request.tokenizer import Tokenizer
from basertd.server.sched import grammar_handles, logit_bias
from basertd.server.sched.core import QUEUED_FIRST_S, SchedulerCore
from basertd.server.sched.draft import Plan, Resolved
from basertd.server.sched.handover import HandOver
from basertd.server.sched.outcome import Accepted, Delivery, Rejected
from basertd.server.sched.pin_warmup import rewarm, warm_prefix
from basertd.server.sched.plan_builder import rate_curve
from basertd.server.sched.view import worker_snapshot
from basertd.server.sched.watchdog import Phase, ProgressWatchdog
from basertd.server.workers.limits import WorkerLimits
from basertd.server.workers.link_errors import (
    EmitCallbackError,
    LinkError,
    LinkTimeout,
    PlanRejected,
    WorkerError,
)
from basertd.server.workers.process import WorkerProcess
from basertd.server.workers.prompt_feed import WorkerPort
from basertd.server.workers.slot import WorkerSlot
from basertd.server.workers.yield_word import YieldWord
from basertd.shm import RingError, YieldReason

__all__ = ["Scheduler", "WorkerLimits"]

log = structlog.get_logger("basertd.scheduler")

TICK_TIMEOUT_S = 120.0
"""A tick that has not answered within this many seconds means a hung worker: it is restarted."""
COMMAND_TIMEOUT_S = 60.0
"""Seconds a command queued for the gap between two ticks may wait for it."""
CURVE_EVERY_S = 5.0
"""Seconds between two reads of the engine's measured rate curve (a PING between ticks)."""
CURVE_TIMEOUT_S = 1.0
"""Seconds the curve's PING may take before it is skipped until the next turn."""


class Scheduler:
    """The scheduler loop of one worker (module docstring). The front end calls
    ``core.check_admission`` and ``submit`` for each accepted Generate, ``cancel`` for Cancel and
    gone clients, and runs ``run()`` as a task. The synchronous questions go to ``core``
    (``SchedulerCore``: ``check_admission``, ``load`` and ``cached_prefix`` for routing), which keeps
    the state; what operators and metrics see of this worker is ``snapshot()``, a frozen
    ``WorkerSnapshot`` (``basertd.server.observe.snapshot``); a reload hands its knobs to
    ``reconfigure``. The ``cache_policy`` argument is this worker's prefix-cache policy
    (``WorkerCache``; a default one when None), which the core runs and whoever made it (the
    fleet) keeps for the cache verbs.

    ``metrics`` receives each tick's wall time; ``heartbeat`` beats on every loop turn and every
    second of a bounded wait, so the systemd watchdog stops when this loop hangs
    (``basertd.server.observe.notify.Watchdog``). ``command(cmd)`` runs a typed command with the live
    worker between two ticks; ``warm_prefix(tokens)`` prefills a prefix with an internal request so
    it can be pinned (``tokenizer``, the worker's vocabulary, decodes its one token)."""

    def __init__(
        self,
        slot: WorkerSlot,
        limits: WorkerLimits,
        config: SchedulerConfig,
        cache: CacheConfig,
        *,
        metrics: Metrics | None = None,
        tokenizer: Tokenizer | None = None,
        cache_policy: WorkerCache | None = None,
    ) -> None:
        self.slot = slot
        self.worker_id = slot.worker_id
        self.core = SchedulerCore(
            slot.worker_id, limits, config, cache, metrics=metrics, cache_policy=cache_policy
        )
        self.metrics = self.core.metrics
        self.heartbeat = Heartbeat(f"scheduler-{slot.worker_id}")
        self.tokenizer = tokenizer
        self.handover = HandOver(self)
        """Where this worker's requests go when it stops serving them (``sched.handover``)."""
        self.watchdog = ProgressWatchdog(config.stall_timeout_s)
        self.yield_word = YieldWord(slot.worker_id)
        self.port: WorkerPort | None = None
        self._commands: deque[tuple[Command, asyncio.Future]] = deque()
        self.wake = asyncio.Event()
        self._ticked = asyncio.Event()  # set (and replaced) after every tick and worker loss
        self._biases = logit_bias.bias_tables(slot.worker_id)  # this incarnation's requests'
        self._warming: set[int] = set()
        self._tasks: set[asyncio.Task] = set()
        self.stalled: str | None = None
        self._curve_at = 0.0
        self._watermark_tick = 0  # core.ticks_run when the pool was last held to the watermarks
        self.phase = Phase.NO_WORKER

    # --- API side -------------------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> None:
        """Queue an admitted request (``check_admission`` passed) and wake the loop; the tick in
        flight yields when ``req`` outranks it."""
        self.yield_word.request(self.core.submit(req))
        self.slot.poke()
        self.wake.set()

    def cancel(
        self, req: GenerationRequest, *, code: ErrorCode = ErrorCode.CANCELLED, message: str = ""
    ) -> None:
        """``SchedulerCore.cancel``; the tick in flight yields when it runs ``req``."""
        why, out = self.core.cancel(req, time.monotonic(), code, message)
        self._deliver(out)
        self.yield_word.request(why)
        self.wake.set()

    def adopt(self, req: GenerationRequest) -> None:
        """Take over ``req``, resumed after its worker died (``SchedulerCore.adopt``)."""
        self.core.adopt(req)
        self.slot.poke()
        self.wake.set()

    def fail_queued(self, code: ErrorCode, message: str) -> int:
        """Fail every queued request with ``code``; returns how many."""
        out = self.core.fail_queued(code, message, time.monotonic())
        self._deliver(out)
        return len(out)

    def on_give_up(self, last_error: str) -> None:
        """The supervisor stopped retrying: queued requests cannot be served, fail them typed.
        Clients get a generic message; ``last_error`` (the worker's own line: file paths, exit
        status) stays in the log and the operator views (``basertctl status``, Health)."""
        n = self.fail_queued(
            ErrorCode.WORKER_FAILED,
            f"worker {self.worker_id} is unavailable: it could not be started "
            "(the operator finds why in `basertctl status` and the daemon's log)",
        )
        if n:
            log.warning("queued_requests_failed", worker_id=self.worker_id, count=n, last_error=last_error)

    def reconfigure(self, config: SchedulerConfig, cache: CacheConfig) -> None:
        """Take a reload's ``[scheduler]`` and ``[cache]`` knobs (``basertd.server.ops.reload``):
        the measured tick rates are kept, their caps (tick target, prefill budget, decode grant)
        updated; the ``[cache]`` knobs reach the cache policy in the next gap between two ticks."""
        core = self.core
        core.config, core.cache = config, cache
        core.rates.tick_target_s = config.tick_target_s
        core.rates.max_prefill = config.prefill_budget
        core.rates.max_grant = config.decode_grant

    def snapshot(self) -> WorkerSnapshot:
        """This worker now, as operators and metrics see it (``basertd.server.observe.snapshot``):
        a frozen copy, taken on the event loop (``sched.view.worker_snapshot``)."""
        return worker_snapshot(
            self.worker_id,
            self.core,
            self.slot,
            self.watchdog.reason,
            self.yield_word.requested,
            time.monotonic(),
        )

    async def ticked(self) -> None:
        """Wait for the next tick to land (or the worker to be lost)."""
        await self._ticked.wait()

    async def watch(self) -> None:
        """The progress watchdog's task (``basertd.server.sched.watchdog``); runs beside ``run``."""
        wd = self.watchdog
        while True:
            await asyncio.sleep(min(wd.poll_s, QUEUED_FIRST_S / 2))
            self._deliver(self.core.expire(time.monotonic()))
            wd.bound_s = self.core.config.stall_timeout_s  # a reload may have changed it
            live = self.core.live()
            phase = self.phase
            reason = wd.check(phase, len(self.core.queues) + live)
            if reason is None:
                continue
            log.error("scheduler_stalled", worker_id=self.worker_id, reason=reason)
            if phase is Phase.IDLE:
                self._deliver(self.core.expire(time.monotonic(), reason, wd.bound_s))
                if not live:
                    continue
            if self.slot.proc is not None:
                self.stalled = reason  # its running work is the suspect: failed, not resumed
            self.slot.restart(f"scheduler stalled: {reason}")

    # --- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve forever: wait for a live worker, tick it while there is work, and when it dies
        resume its lanes and wait for the next incarnation; the progress watchdog runs beside it.
        Ends only by cancellation."""
        watch = asyncio.ensure_future(self.watch())
        try:
            await self._run()
        finally:
            watch.cancel()

    async def _run(self) -> None:
        core = self.core
        while True:
            self.phase = Phase.NO_WORKER
            proc = await self.heartbeat.wait(self.slot.ready())
            self.watchdog.progress()
            self.port = WorkerPort.of(proc)
            self.yield_word.proc = proc
            self.stalled = None
            core.cache_policy.attach(proc.capabilities)
            core.limits = WorkerLimits.from_worker(proc)
            core.reset_rates()
            core.can_yield = proc.can_yield
            core.spreads_prefill = proc.capabilities.extra.get("prefill_rounds") == "spread"
            try:
                core.step_tokens = int(proc.capabilities.extra.get("step_tokens", 0))
            except ValueError:
                core.step_tokens = 0
            try:
                await self._serve(proc)
            except LinkError as exc:
                self.handover.lost(proc, exc)
                if proc.link.alive:  # a tick that never answered: the engine holds the lanes
                    self.slot.restart(f"link error: {exc}")
            except Exception as exc:  # a bug of ours: never let it end the loop of this worker
                log.exception("scheduler_error", worker_id=self.worker_id, error=repr(exc))
                self.handover.lost(proc, LinkError(f"scheduler error: {exc!r}"))
                self.slot.restart("scheduler error: engine state and ours may disagree")
            finally:
                self.handover.left()
                self.port = None
                self.yield_word.proc = None
                core.cache_policy.detach()
                core.detach()  # leases and grammar handles die with the incarnation
                self._biases.forget()

    async def stop(self, message: str = "the daemon is shutting down") -> None:
        """Refuse new requests and fail everything queued or running with SHUTTING_DOWN."""
        self.core.stopping = True
        self.yield_word.request(YieldReason.DRAIN)
        for task in list(self._tasks):
            task.cancel()
        while self._commands:
            _, fut = self._commands.popleft()
            if not fut.done():
                fut.set_exception(LinkError(message))
        self._deliver(self.core.stop(ErrorCode.SHUTTING_DOWN, message, time.monotonic()))
        self.wake.set()

    async def _serve(self, proc: WorkerProcess) -> None:
        dead = asyncio.ensure_future(proc.link.wait_dead())
        try:
            while True:
                if self.handover.reason is not None:
                    await self.handover.park(proc)
                    return
                if dead.done():
                    raise dead.result()
                self.wake.clear()
                self.heartbeat.beat()
                self.phase = Phase.BETWEEN
                await self._between(proc)
                self.phase = Phase.PLANNING
                plan = await self._plan(proc)
                if plan is None or (
                    plan.draft.empty and (self.core.to_release or self.core.grammars.pending_free)
                ):
                    continue  # release the leases and grammars it did not use before waiting
                if plan.draft.empty:
                    self.phase = Phase.IDLE
                    waiter = asyncio.ensure_future(self.wake.wait())
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

    # --- between ticks: commands, leases, watermarks ----------------------------------------------

    async def command(self, cmd: Command, timeout: float = COMMAND_TIMEOUT_S) -> Any:
        """Run ``cmd`` on this scheduler's loop between two ticks, with the live worker, and return
        its result (so nothing races a tick's prompt-ring writes or seed leases). Raises what the
        command raises, ``LinkError`` when the worker is not running, ``TimeoutError`` when no gap
        between ticks came within ``timeout`` seconds."""
        if self.port is None or self.core.stopping:
            raise LinkError(f"worker {self.worker_id} is not running")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._commands.append((cmd, fut))
        self.wake.set()
        return await asyncio.wait_for(asyncio.shield(fut), timeout)

    async def _execute(self, port: WorkerPort, cmd: Command) -> Any:
        """The one place commands run (``basertd.server.cache.commands``)."""
        wc = self.core.cache_policy
        match cmd:
            case HoldPin(pin=pin):
                return await wc.hold(port, pin)
            case DropPin(pin_id=pin_id):
                return await wc.drop_pin(port, pin_id)
            case Evict(bytes_target=target):
                return await wc.evict(port, target)
            case ListEntries():
                return await wc.verified_entries(port)
        raise TypeError(f"not a scheduler command: {cmd!r}")

    async def _between(self, proc: WorkerProcess) -> None:
        port = self.port
        assert port is not None
        core, wc = self.core, self.core.cache_policy
        wc.config = core.cache  # a reload (SIGHUP) may have replaced the [cache] knobs
        while self._commands:
            cmd, fut = self._commands.popleft()
            if fut.done():
                continue
            try:
                result = await self._execute(port, cmd)
            except LinkError as exc:
                fut.set_exception(exc)
                if not proc.link.alive:
                    raise  # the worker is gone; a refusal (WorkerError) leaves it serving
            except Exception as exc:  # handed to the caller (a control verb)
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        while core.to_release:
            await wc.release(port, core.to_release.pop())
        laned = {lane.request.key for lane in core.lanes.values()}
        for handles in (core.grammars, self._biases):  # sched.handles: freed between ticks
            handles.drop_where(lambda req: req.finished and req.key not in laned)
            await handles.free_pending(proc.link)
        await self._read_curve(proc)
        if wc.renewals_due():
            for pin in await wc.renew(port):
                self._spawn(self._rewarm(pin.pin_id))
        now = time.monotonic()
        for pin in wc.pins.values():
            if not pin.handle and pin.pin_id not in self._warming and now >= pin.retry_at:
                self._spawn(self._rewarm(pin.pin_id))
        if core.last_mem is not None and self._watermark_tick != core.ticks_run:
            self._watermark_tick = core.ticks_run  # once per accepted tick
            target = wc.watermark_target(core.last_mem)
            if target:
                try:
                    freed = await wc.evict(port, target)
                except WorkerError as exc:
                    log.warning("cache_watermark_evict_refused", worker_id=self.worker_id, error=str(exc))
                else:
                    log.info("cache_watermark_evicted", worker_id=self.worker_id, target=target, freed=freed)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def warm_prefix(self, tokens: list[int], timeout: float = 120.0) -> None:
        """Prefill ``tokens`` so the prefix is in the engine's cache (``pin_warmup.warm_prefix``).
        Raises ``TimeoutError``, or ``LinkError`` when the request failed."""
        await warm_prefix(self, tokens, self.core.next_tag, timeout)

    async def _rewarm(self, pin_id: int) -> None:
        """Warm and hold a pin whose lease was lost (``pin_warmup.rewarm``)."""
        self._warming.add(pin_id)
        try:
            await rewarm(self, pin_id, self.warm_prefix)
        finally:
            self._warming.discard(pin_id)

    async def _read_curve(self, proc: WorkerProcess) -> None:
        """Every ``CURVE_EVERY_S`` seconds, read the engine's measured prefill-rate curve from a
        PONG (``plan.rate_curve``) into ``rates``, its host-tier counts into the cache policy
        (``WorkerCache.engine_reported``) and its speculation's verify cost into ``spec_verify``
        (both for the metrics); a slow or refused PING is skipped."""
        now = time.monotonic()
        if now - self._curve_at < CURVE_EVERY_S or not self.core.ticks_run:
            return
        self._curve_at = now
        try:
            pong = await proc.link.ping(timeout=CURVE_TIMEOUT_S)
        except (LinkTimeout, WorkerError) as exc:  # the worker may still answer: it serves on
            log.debug("rate_curve_unread", worker_id=self.worker_id, error=repr(exc))
            return
        self.core.rates.set_curve(rate_curve(pong.stats))
        self.core.cache_policy.engine_reported(pong.stats)
        self.core.spec_verify = SpecVerifyCost.of(pong.stats)

    # --- planning ---------------------------------------------------------------------------------

    async def _plan(self, proc: WorkerProcess) -> Plan | None:
        """The next plan: every cached-prefix hint resolved first (match, then acquire), the plan
        drafted once, then a grammar handle for each constrained admit. None when a request of it
        ended while it was made (a grammar the worker refused fails INTERNAL, a cancel): the
        loop plans again. Handles made for requests the plan does not admit are freed."""
        port = self.port
        assert port is not None
        core, wc = self.core, self.core.cache_policy
        now = time.monotonic()
        resolved: dict[int, Resolved] = {}
        for req in core.hint_requests(now):
            tokens = req.resume_prompt()
            ref = port.feed.write(tokens)
            seed = await wc.seed(port, ref, core.resume_hashes(req), len(tokens))
            resolved[req.key] = Resolved(ref, seed)
        plan = core.draft(now, resolved)
        made: list[GenerationRequest] = []
        for _, cand in plan.draft.admitted:
            req = plan.requests[cand.key]
            if not req.finished and req.grammar is not None and not core.grammars.get(req):
                await self._create_grammar(proc, req)
                if core.grammars.get(req):
                    made.append(req)
        if any(req.finished for req in plan.requests.values()):
            core.abandon(plan)
            for req in made:
                core.grammars.drop(req)
            return None
        return plan

    async def _create_grammar(self, proc: WorkerProcess, req: GenerationRequest) -> None:
        """A grammar handle for ``req``'s admission; a worker that gives none fails ``req``
        INTERNAL (and dequeues it). Raises ``LinkError`` when the link died."""
        why = await grammar_handles.create(self.core.grammars, proc.link, req)
        if why is None or req.grammar is None:
            return
        log.warning("grammar_create_failed", worker_id=self.worker_id, request_key=req.key, error=why)
        what = f"the worker could not compile this request's {req.grammar.kind} ({why})"
        self._deliver(self.core.drop(req, ErrorCode.INTERNAL, what, time.monotonic()))

    def _stage(self, plan: Plan) -> dict[int, TokenRef] | None:
        """Write into ring 1 each admitted prompt not already there for its seed; the refs by
        request key, or None when one cannot be staged (that request fails INTERNAL)."""
        port = self.port
        assert port is not None
        refs: dict[int, TokenRef] = {}
        for _, cand in plan.draft.admitted:
            req = plan.requests[cand.key]
            ref = plan.refs.get(cand.key)
            if ref is None or cand.key not in plan.seeds:
                try:
                    ref = port.feed.write(req.resume_prompt())
                except RingError as exc:  # sized at admission; a failure here is a bug
                    why = f"cannot stage the prompt: {exc}"
                    self._deliver(self.core.drop(req, ErrorCode.INTERNAL, why, time.monotonic()))
                    return None
            refs[cand.key] = ref
        return refs

    async def _tick(self, proc: WorkerProcess, plan: Plan) -> None:
        core, requests = self.core, plan.requests
        now = time.monotonic()
        reqs = [requests[c.key] for _, c in plan.draft.admitted]
        biases, refused = await logit_bias.handles(self._biases, proc.link, reqs)
        for req, why in refused:
            self._deliver(core.drop(req, ErrorCode.INVALID_REQUEST, str(why), time.monotonic()))
        if refused or any(requests[key].finished for key in biases):
            core.abandon(plan)
            return  # a request ended while its table was made: plan again without it
        refs = self._stage(plan)
        if refs is None:
            core.abandon(plan)
            for r in requests.values():
                core.grammars.drop(r)
            return
        tick_plan = core.launch(plan, refs, biases, now)
        self.phase = Phase.TICK
        deadline = (lambda: core.itl_deadline(plan)) if plan.draft.prefills else None
        self.yield_word.send(core.urgent_missed(), deadline)
        t_tick = time.monotonic()
        try:
            events = await self.heartbeat.wait(
                proc.link.tick(tick_plan, on_emit=self._on_emit, timeout=TICK_TIMEOUT_S)
            )
        except PlanRejected as exc:
            applied = core.apply(plan, Rejected(exc.status, exc.message, exc.plan_seq), time.monotonic())
            self._deliver(applied.deliveries)
            if applied.restart is not None:
                self.slot.restart(applied.restart)
            return
        except EmitCallbackError as exc:
            log.error("emit_callback_failed", worker_id=self.worker_id, error=repr(exc.__cause__))
            events = exc.events
        finally:
            self.yield_word.landed()
        now = time.monotonic()
        self.metrics.tick(self.worker_id, now - t_tick)
        self.watchdog.progress()
        self.slot.progress()
        applied = core.apply(plan, Accepted(events, self._read_emits(proc, events)), now)
        self._deliver(applied.deliveries)
        self.signal_tick()

    def _on_emit(self, emit: link.TickEmit) -> None:
        tokens, now = emit.tokens.tolist(), time.monotonic()
        d = self.core.on_emit(emit.lane_tag, tokens, now, drafted=emit.proposed, accepted=emit.accepted)
        if d is not None:
            d.send()

    @staticmethod
    def _deliver(deliveries: list[Delivery]) -> None:
        """Hand the core's deliveries to the requests' sinks (WAL, metrics, access log, socket)."""
        for d in deliveries:
            d.send()

    def _read_emits(self, proc: WorkerProcess, events) -> dict[int, list[int] | None]:
        """The emitted tokens of each emit of a live lane, read from the emit ring (None:
        unreadable)."""
        out: dict[int, list[int] | None] = {}
        for emit in events.emits:
            if not emit.n_tokens or emit.lane_tag not in self.core.lanes:
                continue
            try:
                out[emit.lane_tag] = proc.emit_ring.read(emit.token_ref).tolist()
            except RingError as exc:
                log.error("emit_unreadable", worker_id=self.worker_id, lane_tag=emit.lane_tag, error=str(exc))
                out[emit.lane_tag] = None
        return out

    def signal_tick(self) -> None:
        ticked, self._ticked = self._ticked, asyncio.Event()
        ticked.set()
