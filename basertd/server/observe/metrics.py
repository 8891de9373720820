"""The daemon's Prometheus metrics: one prometheus-client registry (DESIGN.md "Operators").

``Metrics`` owns a private ``CollectorRegistry`` and every metric of the coordinator. Two kinds:

- **Event metrics** are prometheus-client objects updated where things happen, through the helper
  methods below: the request observer (``basertd.server.frontend.access``) calls ``first_token``,
  ``tokens`` and ``request_finished``; the front end ``admission_error``; the scheduler ``tick``
  and ``preempted``; the control guard ``control_denied``. The prefix-cache counts live on
  ``cache_counters`` (``basertd.server.observe.cache_counters``), which exports them itself and answers
  the operator's cache stats, so nothing reads a value back from the registry.
- **Live gauges and engine counters** are read from the daemon's state at scrape time by a
  collector (``LiveState``: every worker's ``WorkerSnapshot``, ``basertd.server.observe.snapshot``,
  built by ``basertd.server.fleet.Fleet.live_state`` on the daemon's event loop), so queue depth,
  lanes active, KV usage and in-flight requests are exactly 0 once traffic stops, and the
  per-worker token / tick / respawn counters need no bookkeeping of their own.

The text exposition is ``exposition()`` (``basertctl metrics``); ``serve_http(host, port)`` also
serves it at ``/metrics`` on a loopback port (prometheus-client's own HTTP server, in a thread;
a scrape from that thread takes the live state on the event loop). Names and labels are listed
in README.md "Operating basertd".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from basertd.server.observe.cache_counters import CacheCounters
from basertd.server.observe.snapshot import WorkerSnapshot
from basertd.server.observe.tracing import NO_TRACING, Tracing
from basertd.server.observe.windows import Windows
from basertd.server.request.record import QOS_CLASSES
from basertd.server.states import SlotState

if TYPE_CHECKING:
    from basertd.server.request.record import GenerationRequest

log = structlog.get_logger("basertd.metrics")

NAMESPACE = "basertd"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds: TTFT, queue time and request duration."""
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
"""Seconds between tokens."""
TICK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Seconds of one tick's wall time."""
SCRAPE_TIMEOUT_S = 2.0
"""How long an HTTP scrape waits for the event loop to hand over the live state."""


@dataclass
class LiveState:
    """Scrape-time view of the daemon: every worker's ``WorkerSnapshot`` (by id) and the model
    each serves (``model_names``, by worker id), accepted requests not yet finished, and whether it
    drains."""

    workers: list[WorkerSnapshot] = field(default_factory=list)
    model_names: dict[int, str] = field(default_factory=dict)
    in_flight: int = 0
    draining: bool = False


class _LiveCollector(Collector):
    """Yields the live gauges and engine counters from ``source()``, taken on ``loop`` when the
    scrape runs on another thread (the HTTP server)."""

    def __init__(self) -> None:
        self.source: Callable[[], LiveState] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None

    def _state(self) -> LiveState | None:
        source, loop = self.source, self.loop
        if source is None:
            return None
        if loop is None or threading.get_ident() == self.loop_thread:
            return source()
        fut: concurrent.futures.Future[LiveState] = concurrent.futures.Future()

        def take() -> None:
            try:
                fut.set_result(source())
            except BaseException as exc:  # handed to the scraping thread
                fut.set_exception(exc)

        try:
            loop.call_soon_threadsafe(take)
            return fut.result(SCRAPE_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError):  # loop closed or blocked
            return None

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        if state is None:
            return
        w = ["worker"]
        rows = [(str(ws.worker_id), ws) for ws in state.workers]

        def gauge(name: str, doc: str, value: Callable[[WorkerSnapshot], float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, labels=w)
            for label, ws in rows:
                g.add_metric([label], float(value(ws)))
            return g

        def counter(name: str, doc: str, value: Callable[[WorkerSnapshot], int]) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{NAMESPACE}_{name}", doc, labels=w)
            for label, ws in rows:
                c.add_metric([label], float(value(ws)))
            return c

        def mem(ws: WorkerSnapshot, attr: str) -> int:
            return getattr(ws.mem, attr) if ws.mem is not None else 0

        q = GaugeMetricFamily(f"{NAMESPACE}_queue_depth", "Requests queued, per QoS class.", labels=["qos"])
        for qos in QOS_CLASSES:
            q.add_metric([qos], float(sum(ws.depth(qos) for ws in state.workers)))
        yield q
        yield GaugeMetricFamily(
            f"{NAMESPACE}_requests_in_flight",
            "Accepted requests not finished yet (queued or running), and embedding requests being served.",
            value=float(state.in_flight),
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_draining",
            "1 while the daemon drains (no new requests).",
            value=float(state.draining),
        )
        yield gauge("worker_ready", "1 when the worker has handshaken and serves.", lambda ws: ws.ready)
        yield gauge(
            "worker_given_up",
            "1 once the supervisor gave up starting the worker (its last_error says why).",
            lambda ws: ws.state is SlotState.GIVEN_UP,
        )
        yield gauge(
            "scheduler_stalled",
            "1 while the worker's progress watchdog reports a stall (work waits, no tick lands).",
            lambda ws: ws.stall_reason is not None,
        )
        yield gauge("lanes_active", "Live lanes (retiring ones included).", lambda ws: ws.lanes_busy)
        yield gauge("lanes_max", "Lanes the worker offers.", lambda ws: ws.limits.max_lanes)
        yield gauge(
            "kv_reserved_tokens", "KV tokens reserved by live lanes.", lambda ws: ws.kv_reserved_tokens
        )
        yield gauge(
            "kv_capacity_tokens", "KV tokens the worker's pool holds.", lambda ws: ws.limits.kv_tokens
        )
        yield gauge(
            "kv_pool_usage_ratio",
            "Share of the KV pool reserved by live lanes (0..1).",
            lambda ws: ws.kv_reserved_tokens / ws.limits.kv_tokens if ws.limits.kv_tokens else 0.0,
        )
        yield gauge(
            "engine_pool_blocks_used",
            "KV pool blocks in use after the last tick (prefix-cache entries included).",
            lambda ws: mem(ws, "pool_blocks_used"),
        )
        yield gauge(
            "engine_pool_blocks_total",
            "KV pool blocks of the engine.",
            lambda ws: mem(ws, "pool_blocks_total"),
        )
        yield gauge(
            "engine_pool_evictable_bytes",
            "Bytes of evictable prefix-cache entries after the last tick.",
            lambda ws: mem(ws, "pool_bytes_evictable"),
        )
        yield from host_tier_series(gauge, counter)
        yield counter(
            "prefill_tokens", "Prompt tokens prefilled by the engine.", lambda ws: ws.prefill_tokens
        )
        yield counter("decode_tokens", "Tokens decoded by the engine.", lambda ws: ws.decode_tokens)
        yield counter("ticks", "Ticks run.", lambda ws: ws.ticks_run)
        drafted = CounterMetricFamily(
            f"{NAMESPACE}_spec_draft_tokens",
            "Tokens drafted by speculative decoding, per strategy.",
            labels=["worker", "strategy"],
        )
        accepted = CounterMetricFamily(
            f"{NAMESPACE}_spec_accepted_tokens",
            "Drafted tokens the target model accepted, per strategy.",
            labels=["worker", "strategy"],
        )
        for label, ws in rows:
            for name, d, a in ws.speculation:
                drafted.add_metric([label, name], float(d))
                accepted.add_metric([label, name], float(a))
        yield drafted
        yield accepted
        yield from spec_verify_series(rows)
        yield counter(
            "plans_rejected",
            "Tick plans the engine rejected (nothing changed).",
            lambda ws: ws.plans_rejected,
        )
        yield counter(
            "worker_respawns", "Worker incarnations started after the first.", lambda ws: ws.respawns
        )


def spec_verify_series(rows: list[tuple[str, WorkerSnapshot]]) -> Iterator[Metric]:
    """Each worker's verify cost of a speculative round (``SpecVerifyCost``, from the engine's
    stats read every few seconds by the scheduler loop), in plain decode steps: a round verifying
    m drafts costs ``base + per_draft * m``; ``measured`` 0 while the engine assumes its defaults.
    Only workers whose engine reports it appear."""
    series = (
        ("base", "Plain decode steps a speculative round costs before its drafts (measured by the engine)."),
        (
            "per_draft",
            "Plain decode steps each draft row adds to a speculative round (measured by the engine).",
        ),
        ("measured", "1 once the engine has timed enough rounds, 0 while it assumes its default costs."),
    )
    for attr, doc in series:
        g = GaugeMetricFamily(f"{NAMESPACE}_spec_verify_{attr}", doc, labels=["worker"])
        for label, ws in rows:
            if ws.spec_verify is not None:
                g.add_metric([label], float(getattr(ws.spec_verify, attr)))
        yield g


def _host(ws: WorkerSnapshot, attr: str) -> float:
    return getattr(ws.host_tier, attr) if ws.host_tier is not None else 0


def host_tier_series(gauge: Callable[..., Metric], counter: Callable[..., Metric]) -> Iterator[Metric]:
    """The host tier's series per worker (``HostTierCounts``, from the engine's stats read every
    few seconds by the scheduler loop; 0 for a worker without a tier). Counters restart with a
    worker incarnation (Prometheus reads that as a counter reset)."""
    yield gauge("host_tier_entries", "Evicted prefixes kept in host memory.", lambda ws: _host(ws, "entries"))
    yield gauge("host_tier_bytes", "Bytes of the host tier in use.", lambda ws: _host(ws, "bytes"))
    yield gauge(
        "host_tier_capacity_bytes",
        "Bytes the host tier may use ([cache] host_bytes).",
        lambda ws: _host(ws, "capacity_bytes"),
    )
    yield counter(
        "host_tier_restores",
        "Prefixes restored from the host tier into the KV pool instead of prefilled.",
        lambda ws: _host(ws, "restores"),
    )
    yield counter(
        "host_tier_restore_seconds",
        "Wall time of the host tier's restores (divide by restores for the mean).",
        lambda ws: _host(ws, "restore_s"),
    )
    yield counter(
        "host_tier_refused",
        "Host-tier snapshots refused at restore (corrupt, another model or layout, wrong length).",
        lambda ws: _host(ws, "refused"),
    )
    yield counter(
        "host_tier_demotions",
        "Prefixes evicted from the KV pool and kept in the host tier.",
        lambda ws: _host(ws, "demoted"),
    )
    yield counter(
        "host_tier_snapshots",
        "Long prompts kept in the host tier at their last page boundary as their prefill passed it.",
        lambda ws: _host(ws, "snapshotted"),
    )


class Metrics:
    """Every metric of the daemon in one registry (module docstring). Helpers take seconds and
    token counts; none raises. ``bind(source)`` attaches the live-state source on the running
    loop; ``exposition()`` returns the text format (version 0.0.4)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no ``*_created`` series: they double the text and nobody graphs them
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ns = NAMESPACE
        self.ttft = Histogram(
            "ttft_seconds",
            "Time to first token, from receipt of the Generate.",
            ["qos"],
            namespace=ns,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "inter_token_latency_seconds",
            "Seconds between token deliveries, per token delivered (the tokens arriving with the "
            "first one are part of TTFT).",
            ["qos"],
            namespace=ns,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "queue_time_seconds",
            "Seconds from receipt to first admission into a lane.",
            ["qos"],
            namespace=ns,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "request_duration_seconds",
            "Seconds from receipt to Done or Error.",
            ["qos"],
            namespace=ns,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tick_seconds = Histogram(
            "tick_seconds",
            "Wall time of one tick as the coordinator sees it (submit to result).",
            ["worker"],
            namespace=ns,
            buckets=TICK_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "requests",
            "Accepted requests that ended, by finish reason (stop, length, eos, cancelled, error).",
            ["qos", "finish_reason"],
            namespace=ns,
            registry=r,
        )
        self.request_errors = Counter(
            "request_errors",
            "Accepted requests that ended with an Error, by error code.",
            ["code"],
            namespace=ns,
            registry=r,
        )
        self.admission_errors = Counter(
            "admission_errors",
            "Requests refused before acceptance, by error code.",
            ["code"],
            namespace=ns,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens of ended requests.", ["qos"], namespace=ns, registry=r
        )
        self.completion_tokens = Counter(
            "completion_tokens", "Tokens delivered to clients.", ["qos"], namespace=ns, registry=r
        )
        self.cache_counters = CacheCounters()
        """Per-worker prefix-cache counts (hits, misses, cached and looked-up prompt tokens),
        exported by the object itself."""
        r.register(self.cache_counters)
        self.preemptions = Counter(
            "preemptions",
            "Decoding lanes preempted for a higher QoS class (DESIGN.md 'Scheduling').",
            ["worker", "qos"],
            namespace=ns,
            registry=r,
        )
        self.crash_resumes = Counter(
            "crash_resumes",
            "Running requests requeued to resume exactly after their worker died.",
            ["worker"],
            namespace=ns,
            registry=r,
        )
        self.grammar_handles = Gauge(
            "grammar_handles",
            "Grammar handles the scheduler holds on the worker (one per constrained lane).",
            ["worker"],
            namespace=ns,
            registry=r,
        )
        self.control_denials = Counter(
            "control_denied",
            "Control verbs refused by the peer-credential check.",
            ["verb"],
            namespace=ns,
            registry=r,
        )
        self.reloads = Counter("reloads", "Configuration reloads (SIGHUP).", namespace=ns, registry=r)
        self.connections_dropped = Counter(
            "connections_dropped",
            "Client connections refused or closed by a [limits] cap, by reason (total_cap, uid_cap, "
            "buffer_budget, frame_timeout, idle_timeout, slow_reader), or by an [http] bound "
            "(http_total_cap, http_peer_cap, http_header_timeout, http_body_timeout, "
            "http_idle_timeout, http_write_timeout).",
            ["reason"],
            namespace=ns,
            registry=r,
        )
        self.connections_open = Gauge(
            "client_connections", "Open client-socket connections.", namespace=ns, registry=r
        )
        self.http_connections_open = Gauge(
            "http_connections",
            "Open HTTP connections (counted against http.max_connections).",
            namespace=ns,
            registry=r,
        )
        self.request_buffer_bytes = Gauge(
            "request_buffer_bytes",
            "Bytes reserved for request frames being received (counted against "
            "limits.max_request_buffer_bytes).",
            namespace=ns,
            registry=r,
        )
        self.resumed = Counter(
            "requests_resumed",
            "Requests resumed: after a daemon restart (re-queued from the write-ahead log) or after a "
            "worker crash (DESIGN.md 'Crash = preemption; acceptance is durable').",
            ["after"],
            namespace=ns,
            registry=r,
        )
        self.wal_bytes = Counter(
            "wal_bytes", "Bytes written to the write-ahead log (group commits).", namespace=ns, registry=r
        )
        self.wal_commits = Counter(
            "wal_commits",
            "Write-ahead log group commits (one write each; mode tick: one fdatasync each too).",
            namespace=ns,
            registry=r,
        )
        self.wal_fsync_seconds = Histogram(
            "wal_fsync_seconds",
            "Latency of one fdatasync making write-ahead log group commits durable (seconds): mode "
            "tick, one per commit; mode write, one per background sync covering every commit before "
            "it (at most one per [durability] sync_interval_ms).",
            namespace=ns,
            registry=r,
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
        )
        self.wal_recovered = Gauge(
            "wal_recovered",
            "What the write-ahead log recovery found at start: records replayed, unfinished requests "
            "re-queued, finished results kept, bytes of torn tail truncated.",
            ["what"],
            namespace=ns,
            registry=r,
        )
        self.tracing: Tracing = NO_TRACING
        """The request tracer (``observe.tracing``; the daemon sets it from ``[tracing]``): fed
        ticks and crashes by the helpers below, requests by the request observer."""
        self.windows = Windows()
        """Rolling windows of the same events for the live views (``basertctl top``, the page at
        ``/``): fed by the helpers below, never read back from the registry."""
        self.grammar_compiles = Counter(
            "grammar_compiles",
            "Grammar specs compiled at admission (each distinct spec once; cached results not counted).",
            namespace=ns,
            registry=r,
        )
        self.sandbox_failures = Counter(
            "sandbox_jobs_failed",
            "Jobs of a sandbox pool (pool: grammar, chat_template) that gave no result, by reason: "
            "refused (the spec or template is invalid), timeout, crash (the child process died), busy "
            "(too many waiting).",
            ["pool", "reason"],
            namespace=ns,
            registry=r,
        )
        self.info = Gauge("build_info", "The daemon's version.", ["version"], namespace=ns, registry=r)
        self._live = _LiveCollector()
        r.register(self._live)
        self.extra_collectors: list[_LiveCollector] = []
        """Live collectors registered beside the built-in one (``metrics_vllm.bind_vllm``); their
        source is dropped at ``close()``."""
        self._http: tuple[Any, threading.Thread] | None = None

    # --- wiring ----------------------------------------------------------------------------------

    def bind(self, source: Callable[[], LiveState], version: str = "") -> None:
        """Read live gauges from ``source()`` on the running event loop from now on."""
        self._live.source = source
        self._live.loop = asyncio.get_running_loop()
        self._live.loop_thread = threading.get_ident()
        if version:
            self.info.labels(version=version).set(1)

    def unbind(self) -> None:
        """Stop reading live state (the daemon stopped): live gauges disappear from scrapes."""
        self._live.source = None
        self._live.loop = None
        for extra in self.extra_collectors:
            extra.source = None
            extra.loop = None

    def exposition(self) -> str:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry).decode()

    def serve_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (prometheus-client's HTTP server in a daemon thread).
        Returns the bound port (``port`` 0 picks one). Raises ``OSError`` if it cannot bind."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = (server, thread)
        bound = int(server.server_address[1])
        log.info("metrics_http_listening", address=host, port=bound)
        return bound

    def close(self) -> None:
        """Stop the HTTP server, if any, and unbind. Idempotent."""
        if self._http is not None:
            server, thread = self._http
            self._http = None
            server.shutdown()
            server.server_close()
            thread.join(5.0)
        self.unbind()

    # --- helpers called where things happen ------------------------------------------------------

    def first_token(self, req: GenerationRequest, count: int = 1) -> None:
        """A request delivered its first ``count`` tokens: TTFT and queue time (seconds); a
        prefix-cache hit when its admission reused cached tokens (``req.cached_tokens``), else a
        miss. Called once per request, so a lane re-admitted after a preemption is never counted
        again."""
        if req.t_first_token is not None:
            ttft = max(0.0, req.t_first_token - req.t_received)
            self.ttft.labels(req.qos).observe(ttft)
            now = time.monotonic()
            self.windows.first_token(now, ttft, len(req.prompt), req.cached_tokens)
            self.windows.delivered(now, count, None)
        if req.t_admitted is not None:
            self.queue_time.labels(req.qos).observe(max(0.0, req.t_admitted - req.t_received))
        worker = str(req.worker_id if req.worker_id is not None else "")
        self.cache_counters.first_admission(worker, len(req.prompt), req.cached_tokens)

    def tokens(self, qos: str, count: int, gap_s: float) -> None:
        """``count`` tokens reached the client ``gap_s`` seconds after the previous delivery: one
        inter-token latency of ``gap_s / count`` per token."""
        if count <= 0:
            return
        self.windows.delivered(time.monotonic(), count, gap_s)
        per = max(0.0, gap_s) / count
        h = self.itl.labels(qos)
        for _ in range(count):
            h.observe(per)

    def request_finished(self, req: GenerationRequest, error_code: str | None = None) -> None:
        """An accepted request sent Done (``error_code`` None) or Error(``error_code``)."""
        qos = req.qos
        self.requests.labels(qos, req.finish_reason or ("error" if error_code else "")).inc()
        if error_code is not None:
            self.request_errors.labels(error_code).inc()
        self.prompt_tokens.labels(qos).inc(len(req.prompt))
        self.completion_tokens.labels(qos).inc(len(req.generated))
        if req.t_finished is not None:
            self.request_duration.labels(qos).observe(max(0.0, req.t_finished - req.t_received))

    def admission_error(self, code: str) -> None:
        """A request was refused before acceptance with ``code`` (an ``ErrorCode`` value)."""
        self.admission_errors.labels(str(code)).inc()

    def tick(self, worker_id: int, seconds: float) -> None:
        """Worker ``worker_id`` finished a tick that took ``seconds`` of wall time."""
        self.tick_seconds.labels(str(worker_id)).observe(seconds)
        if self.tracing.enabled:
            now = time.monotonic()
            self.tracing.tick(worker_id, now - seconds, now)

    def preempted(self, worker_id: int, qos: str) -> None:
        """A ``qos`` lane of worker ``worker_id`` was preempted (``basertd.server.sched.qos``: preemption)."""
        self.preemptions.labels(str(worker_id), qos).inc()

    def crash_resumed(self, worker_id: int, key: int | None = None) -> None:
        """A running request (``key``, ``GenerationRequest.key``) of worker ``worker_id`` was
        requeued after the worker died (also counted as ``requests_resumed{after="worker_crash"}``;
        a ``resume_after_crash`` span of its trace)."""
        self.crash_resumes.labels(str(worker_id)).inc()
        if key is not None:
            self.tracing.crashed(key, worker_id, time.monotonic())
        self.request_resumed("worker_crash")

    def grammar_handles_held(self, worker_id: int, count: int) -> None:
        """Worker ``worker_id`` holds ``count`` grammar handles of the scheduler's now."""
        self.grammar_handles.labels(str(worker_id)).set(count)

    def grammar_compiled(self) -> None:
        """One grammar spec was compiled in a child process (a cache miss)."""
        self.grammar_compiles.inc()

    def sandbox_failed(self, pool: str, reason: str) -> None:
        """A job of sandbox pool ``pool`` gave no result (``reason``: refused, timeout, crash, busy)."""
        self.sandbox_failures.labels(pool, reason).inc()

    def connection_dropped(self, reason: str) -> None:
        """A client connection was refused or closed by a ``[limits]`` cap or an ``[http]`` bound
        (``reason``)."""
        self.connections_dropped.labels(reason).inc()

    def wal_commit(self, nbytes: int, fsync_s: float | None) -> None:
        """A write-ahead log group commit wrote ``nbytes`` and its fdatasync took ``fsync_s``
        seconds (None: mode "write", whose commits do not fsync) (the journal's ``on_commit``
        hook; called from the committing thread, or the event loop in mode "write")."""
        self.wal_bytes.inc(nbytes)
        self.wal_commits.inc()
        if fsync_s is not None:
            self.wal_fsync(fsync_s)

    def wal_fsync(self, seconds: float) -> None:
        """One fdatasync of the write-ahead log took ``seconds`` (a commit's in mode "tick"; the
        journal's ``on_sync`` hook in mode "write", called from the syncing thread)."""
        self.wal_fsync_seconds.observe(seconds)
        self.windows.fsync(time.monotonic(), seconds)

    def wal_recovery(self, records: int, requests: int, results: int, truncated_bytes: int) -> None:
        """What the write-ahead log recovery found at start."""
        for what, n in (
            ("records", records),
            ("requests", requests),
            ("results", results),
            ("truncated_bytes", truncated_bytes),
        ):
            self.wal_recovered.labels(what).set(n)

    def request_resumed(self, after: str) -> None:
        """A request resumed ``after`` "restart" (from the log) or "worker_crash"."""
        self.resumed.labels(after).inc()

    def control_denied(self, verb: str) -> None:
        """A control verb was refused by the peer-credential check."""
        self.control_denials.labels(verb).inc()


NULL_METRICS = Metrics()
"""A registry nobody reads: the default of components built without the daemon's ``Metrics``."""
