"""The scheduling state of one worker (DESIGN.md "Scheduling"): plain data, no I/O.

``SchedulerState`` is what the synchronous scheduler core (``basertd.server.sched.core``), its
plan drafting (``basertd.server.sched.draft``) and its tick applying
(``basertd.server.sched.apply``) read and change: the live lanes, the per-class queues, the
worker's limits and the configuration, the lane-tag and plan counters, the adaptive tick rates,
the re-planning caps after a rejected plan, the seed leases to release and the grammar handles to
free, and the counters operators read. The async per-worker loop (``basertd.server.sched.loop``)
owns one core and drives it; nothing here awaits, sends to a sink or reads a clock.
"""

from __future__ import annotations

from basertd.schema import link
from basertd.schema.client import ErrorCode
from basertd.server.cache.policy import WorkerCache
from basertd.server.config_sections import CacheConfig, SchedulerConfig
from basertd.server.observe.metrics import NULL_METRICS, Metrics
from basertd.server.observe.snapshot import SpecVerifyCost
from basertd.server.request.record import GenerationRequest, RequestState
from basertd.server.sched.grammar_handles import grammar_handles
from basertd.server.sched.lanes import Lane, RequestQueues, on_probation
from basertd.server.sched.outcome import Outbox
from basertd.server.sched.plan_builder import PlanLimits, TickRates
from basertd.server.workers.limits import WorkerLimits


class SchedulerState:
    """The state of one worker's scheduler (module docstring).

    Public: ``worker_id``, ``limits`` (``WorkerLimits``), ``config`` (``[scheduler]``), ``cache``
    (``[cache]``), ``metrics``, ``lanes`` (tag -> ``Lane``), ``queues`` (``RequestQueues``),
    ``rates`` (``TickRates``), ``cache_policy`` (``WorkerCache``), ``grammars``
    (a ``WorkerHandles`` by request, ``basertd.server.sched.handles``: the core drops the handle of
    a lane that ends, the loop creates them and sends the frees), and the
    counters ``ticks_run``, ``plans_rejected``, ``requests_done``, ``prefill_tokens_total``,
    ``decode_tokens_total`` (tokens), ``preemptions``, ``checkpoints``, ``crash_resumes``, ``handovers``
    (lanes handed over by a planned replacement, not charged as crashes), ``spec_tokens``
    (per speculation strategy, tokens drafted and accepted), ``spec_verify`` (the engine's
    measured verify cost of a speculative round as last read from a PONG, ``SpecVerifyCost``; None
    before, or for an engine that does not measure it).
    ``last_mem``: the engine's memory counters of the last accepted tick of this incarnation
    (None before its first; the snapshot's ``mem`` and the ``engine_pool_*`` gauges). ``to_release``: seed
    lease handles the loop releases between ticks (ABI rule 81). ``can_yield`` / ``step_tokens``:
    what the current incarnation's engine supports (``basertd.shm.control``)."""

    def __init__(
        self,
        worker_id: int,
        limits: WorkerLimits,
        config: SchedulerConfig,
        cache: CacheConfig,
        *,
        metrics: Metrics | None = None,
        cache_policy: WorkerCache | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.limits = limits
        self.config = config
        self.cache = cache
        self.metrics = metrics if metrics is not None else NULL_METRICS
        self.lanes: dict[int, Lane] = {}
        self.queues = RequestQueues()
        self.rates = TickRates(config.tick_target_s, config.prefill_budget, config.decode_grant)
        self.cache_policy = cache_policy if cache_policy is not None else WorkerCache(worker_id, cache)
        self.grammars = grammar_handles(worker_id, self.metrics)
        self.ticks_run = 0
        self.plans_rejected = 0
        self.requests_done = 0
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0
        self.preemptions = 0
        self.checkpoints = 0
        self.crash_resumes = 0
        self.handovers = 0  # lanes moved off a live worker that a reload or an operator replaced
        self.spec_tokens: dict[str, list[int]] = {}  # strategy -> [drafted, accepted] tokens
        self.spec_verify: SpecVerifyCost | None = None
        self.last_mem: link.MemCounters | None = None
        self.to_release: list[int] = []
        self.can_yield = False
        self.spreads_prefill = False  # the engine spreads a tick's prefill over its decode rounds
        self.step_tokens = 0  # engine tokens per step (capabilities), 0: min_prefill_chunk
        self.stopping = False
        self.next_tag = 1  # lane tags are never reused: the counter only grows
        self.plan_seq = 0
        self.rejections = 0  # plans rejected in a row
        self.max_admits: int | None = None  # re-planning caps after a rejected plan
        self.prefill_cap: int | None = None
        self.seedless_plans = 0
        self.draft_limits: PlanLimits | None = None  # of the plan in the making (scheduler_draft)
        self.draft_seeding = False  # its hints were resolved (scheduler_draft.hint_requests)
        self.admit_retries: dict[int, int] = {}
        self.t_token: dict[int, float] = {}  # lane tag -> monotonic seconds of its last token

    def fail(self, req: GenerationRequest, code: ErrorCode, message: str, now: float, out: Outbox) -> None:
        """End ``req`` with ``Error(code, message)`` (into ``out``; ``now``: monotonic seconds) and
        count it done."""
        req.fail(code, message, now, out.to(req))
        self.requests_done += 1

    def requeue(self, req: GenerationRequest) -> None:
        """Put ``req`` back at the head of its class, without a lane: a preempted or checkpointed
        lane, a transiently refused admit, an admit of a rejected plan, a lost worker's request
        (ABI rules 71-73: it resumes with ``decode_replay``). The one place this is done."""
        req.state = RequestState.QUEUED
        req.lane_tag = None
        self.queues.push_front(req)

    def reset_rates(self) -> None:
        """Fresh adaptive rates (a new incarnation measures its own)."""
        cfg = self.config
        self.rates = TickRates(cfg.tick_target_s, cfg.prefill_budget, cfg.decode_grant)

    def hashes(self, req: GenerationRequest) -> list[int]:
        """``req``'s prompt page-hash path at this worker's page size (computed once)."""
        if not req.page_hashes and len(req.prompt) >= self.cache_policy.page:
            req.page_hashes = self.cache_policy.hashes(req.prompt, salt=req.cache_salt)
        return req.page_hashes

    def resume_hashes(self, req: GenerationRequest) -> list[int]:
        """The page-hash path of what ``req`` is admitted with: its prompt, plus the tokens it
        generated before a preemption (ABI rules 71-73)."""
        base = self.hashes(req)
        if not req.generated:
            return base
        return self.cache_policy.hashes(req.resume_prompt(), base)

    def probation(self, req: GenerationRequest) -> bool:
        """Whether ``req`` is one crash away from failing (``lanes.on_probation``)."""
        return on_probation(req, self.config.max_crash_resumes)
