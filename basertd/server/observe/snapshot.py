"""One worker at one instant, as operators and metrics see it (DESIGN.md "Operators").

``WorkerSnapshot`` is the frozen view ``basertd.server.sched.loop.Scheduler.snapshot()`` takes of
its worker on the daemon's event loop: the slot's state, the worker's limits, every live lane, the
queue of each QoS class and the scheduler's counters. Everything above the scheduler that shows a
worker reads it: the fleet (routing aside: ``Fleet.snapshots``, status totals, served models), the
control verbs (``workers``, ``lanes``, ``queue``, ``status``), the metrics collectors (``LiveState``
of ``basertd.server.observe.metrics`` and the vLLM names of ``metrics_vllm``) and the daemon's
systemd status line. Values only: nothing in it refers back to the scheduler, so a reader may keep
it, hand it to another thread or compare two of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from basertd.schema.tick import MemCounters
from basertd.server.request.record import QOS_CLASSES
from basertd.server.states import SlotState
from basertd.server.workers.limits import WorkerLimits


@dataclass(frozen=True, slots=True)
class LaneSnapshot:
    """One live lane: ``tag``, the ``request_id`` and ``qos`` it serves, ``phase`` ("prefill",
    "decode" or "retiring"), ``prompt_tokens`` (its prefill end), ``generated_tokens`` and
    ``cached_tokens`` of its request, ``reserved_tokens`` of KV, ``admitted_at`` (monotonic
    seconds)."""

    tag: int
    request_id: str
    qos: str
    phase: str
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    reserved_tokens: int
    admitted_at: float


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """One QoS class's queue: ``qos``, its ``depth`` (requests) and how long its head has waited
    (``oldest_wait_s``, seconds; 0 when empty)."""

    qos: str
    depth: int
    oldest_wait_s: float


@dataclass(frozen=True, slots=True)
class HostTierCounts:
    """A worker's host tier of evicted prefixes (the llama.cpp engine's ``host_tier``) as its
    engine last reported it: ``entries`` and ``bytes`` held, ``capacity_bytes``, ``restores``
    into the pool and their wall time ``restore_s`` (seconds), ``refused`` snapshots, prefixes
    ``demoted`` into it, prompts ``snapshotted`` into it as their prefill passed their last page
    and entries ``dropped`` from it. Counts since the worker incarnation started."""

    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    restores: int = 0
    restore_s: float = 0.0
    refused: int = 0
    demoted: int = 0
    snapshotted: int = 0
    dropped: int = 0

    @classmethod
    def of(cls, stats: Mapping[str, int]) -> HostTierCounts | None:
        """From an engine's ``stats()`` (a PONG's ``host_*`` keys); None for an engine without
        a host tier."""
        if "host_capacity_bytes" not in stats:
            return None
        return cls(
            entries=int(stats.get("host_entries", 0)),
            bytes=int(stats.get("host_bytes", 0)),
            capacity_bytes=int(stats["host_capacity_bytes"]),
            restores=int(stats.get("host_restores_total", 0)),
            restore_s=int(stats.get("host_restore_ns_total", 0)) / 1e9,
            refused=int(stats.get("host_refused_total", 0)),
            demoted=int(stats.get("host_demotions_total", 0)),
            snapshotted=int(stats.get("host_snapshots_total", 0)),
            dropped=int(stats.get("host_dropped_total", 0)),
        )


@dataclass(frozen=True, slots=True)
class SpecVerifyCost:
    """What a speculative round's verification costs on a worker's engine, as it last reported
    it (the llama.cpp engine's ``verify_cost``): a round verifying m drafts costs ``base +
    per_draft * m`` plain decode steps; ``measured`` is False while the engine still assumes its
    defaults (too few rounds timed yet). Its ``auto`` speculation pauses a lane whose drafts do not
    pay at this cost."""

    base: float
    per_draft: float
    measured: bool

    @classmethod
    def of(cls, stats: Mapping[str, int]) -> SpecVerifyCost | None:
        """From an engine's ``stats()`` (a PONG's ``spec_verify_*`` keys, in thousandths of a
        step); None for an engine that does not measure it."""
        if "spec_verify_base_permille" not in stats:
            return None
        return cls(
            base=int(stats["spec_verify_base_permille"]) / 1000,
            per_draft=int(stats.get("spec_verify_per_draft_permille", 0)) / 1000,
            measured=bool(stats.get("spec_verify_measured", 0)),
        )


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One worker and its scheduler at ``taken_at`` (monotonic seconds); module docstring.

    The slot: ``state`` (a ``SlotState``), ``pid`` (0 without a process), ``respawns``
    (incarnations after the first), ``last_error`` (why the last start failed, "" while ready).
    The scheduler: ``limits`` (``WorkerLimits`` of the current or last incarnation, or of the
    config before the first handshake), ``lanes`` (by tag, retiring ones included), ``queues``
    (every QoS class, highest first), ``mem`` (the engine's memory counters of the last accepted
    tick of the current incarnation, None before its first), ``stall_reason`` (the progress
    watchdog's, None while it progresses), ``prefix_caching`` (``[cache] enabled``). Counters
    only grow, across respawns: ``ticks_run``, ``plans_rejected``, ``requests_done``,
    ``prefill_tokens``, ``decode_tokens`` (engine tokens), ``preemptions``, ``checkpoints``,
    ``crash_resumes`` (lanes requeued), ``yields_requested`` (yields asked of ticks in
    flight), and ``speculation``: per strategy, (strategy id, tokens drafted, drafts accepted).
    ``host_tier``: the engine's host tier as last read (``HostTierCounts``; None for an engine
    without one, or before the worker first reported it); ``spec_verify``: its verify cost as last
    read (``SpecVerifyCost``; None likewise)."""

    worker_id: int
    taken_at: float
    state: SlotState
    pid: int
    respawns: int
    last_error: str
    limits: WorkerLimits
    lanes: tuple[LaneSnapshot, ...]
    queues: tuple[QueueSnapshot, ...]
    mem: MemCounters | None
    stall_reason: str | None
    prefix_caching: bool
    ticks_run: int
    plans_rejected: int
    requests_done: int
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    checkpoints: int
    crash_resumes: int
    yields_requested: int
    host_tier: HostTierCounts | None = None
    speculation: tuple[tuple[str, int, int], ...] = ()
    spec_verify: SpecVerifyCost | None = None

    @property
    def ready(self) -> bool:
        """The worker has handshaken and serves."""
        return self.state is SlotState.READY

    @property
    def lanes_busy(self) -> int:
        """Live lanes (retiring ones included)."""
        return len(self.lanes)

    @property
    def queued(self) -> int:
        """Requests queued, every class."""
        return sum(q.depth for q in self.queues)

    def depth(self, qos: str) -> int:
        """Requests queued in class ``qos`` (0 for a class it does not list)."""
        return next((q.depth for q in self.queues if q.qos == qos), 0)

    @property
    def kv_reserved_tokens(self) -> int:
        """KV tokens reserved by the live lanes."""
        return sum(lane.reserved_tokens for lane in self.lanes)


@dataclass(frozen=True, slots=True)
class FleetTotals:
    """Sums over the snapshots of every worker (``basertctl status``, the systemd status line):
    workers ``ready`` of ``total``, ``lanes_busy`` of ``lanes_max``, and requests queued per QoS
    class (``queued_by_class``: every class, highest first), and per speculation strategy the
    tokens drafted and drafts accepted (``speculation``: strategy -> (drafted, accepted))."""

    ready: int
    total: int
    lanes_busy: int
    lanes_max: int
    queued_by_class: dict[str, int]
    speculation: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, snapshots: Sequence[WorkerSnapshot]) -> FleetTotals:
        spec: dict[str, tuple[int, int]] = {}
        for s in snapshots:
            for name, drafted, accepted in s.speculation:
                d, a = spec.get(name, (0, 0))
                spec[name] = (d + drafted, a + accepted)
        return cls(
            speculation=spec,
            ready=sum(1 for s in snapshots if s.ready),
            total=len(snapshots),
            lanes_busy=sum(s.lanes_busy for s in snapshots),
            lanes_max=sum(s.limits.max_lanes for s in snapshots),
            queued_by_class={q: sum(s.depth(q) for s in snapshots) for q in QOS_CLASSES},
        )

    @property
    def queued(self) -> int:
        """Requests queued, every class."""
        return sum(self.queued_by_class.values())
