"""OpenTelemetry traces of requests (DESIGN.md "Operators"; config ``[tracing]``).

With ``[tracing] otlp_endpoint`` set, every accepted request becomes one trace exported over OTLP
(HTTP/protobuf, the SDK's batch processor) when it ends: a root span ``basertd.request`` from
receipt to Done or Error, and children for its phases:

- ``admission`` (receipt to its hand-over to the worker's scheduler: limits, tokenizing, routing;
  the root's event ``accepted`` marks when the client got ``Accepted``, after the journal's group
  commit with durability on),
- ``queue`` (hand-over to its first admission into a lane),
- ``prefill`` (first admission to the first token) and ``decode`` (first token to the end),
- ``tick`` spans: the ticks of its (last) worker from its first admission to its end (at most
  ``MAX_TICK_SPANS``; the root's ``basertd.ticks`` counts them all), each once, under the phase it
  started in (the tick that delivered the first token, mid-tick or at its end, under ``prefill``),
  with the tick's length,
- ``resume_after_crash``: from the moment its worker died (the scheduler requeued it) to the next
  token it delivered, one per crash.

The spans are built at the end from times the request observer (``frontend.access``) and the
metrics helpers (``Metrics.tick``, ``Metrics.crash_resumed``) recorded, so the hot path only
appends a timestamp. A request usually ends inside its last tick (a partial emit, or the Done
applied before the tick is recorded): its trace then waits for that tick's end (``tick``), at most
``PENDING_MAX_S``, so the last tick is in it. A W3C ``traceparent`` header on the HTTP request
makes the root a child of the caller's span (``transport.http`` sets ``TRACEPARENT`` for the
handler; the front end reads it when it accepts). Times are monotonic seconds, converted to the
epoch once per span.

Off (the default, ``otlp_endpoint = ""``): ``Tracing.off()`` answers ``begin`` with None and
records nothing; the OpenTelemetry SDK is not even imported (it is the optional extra
``basertd[tracing]``). ``Tracing.start(config)`` raises ``ConfigError`` when an endpoint is set
and the SDK is missing.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from basertd.server.config import ConfigError
from basertd.server.config_sections import TracingConfig

if TYPE_CHECKING:
    from basertd.server.request.record import GenerationRequest

TRACEPARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("basertd_traceparent", default=None)
"""The W3C ``traceparent`` of the HTTP request being handled (set by the HTTP middleware)."""
MAX_TICK_SPANS = 256
"""Most ``tick`` spans one request's trace carries (the first ones; the root counts them all)."""
TICKS_KEPT = 4096
"""Ticks remembered per worker (start, end) for the traces of the requests still running."""
PENDING_MAX_S = 10.0
"""Longest a finished request's trace waits for its worker to record the tick it ended in (a
worker that died mid-tick never does); then it is built without that tick."""
SPAN_TIMEOUT_MS = 5000
"""How long the exporter waits for the collector (OTLP over HTTP)."""
SPAN_QUEUE = 65536
"""Spans the batch processor holds for export (a request carries up to ``MAX_TICK_SPANS`` + 6);
beyond it the SDK drops spans rather than block the daemon."""
SPAN_BATCH = 2048
"""Spans per OTLP export request."""


@dataclass(slots=True)
class RequestTrace:
    """What one request's trace is built from (module docstring): the caller's context, when the
    front end handed it to its scheduler (``t_submitted``) and when its ``Accepted`` reached the
    client (after its group commit, with durability on), and the crashes it went through
    (monotonic seconds)."""

    parent: Any
    t_submitted: float
    t_accepted: float | None = None
    crashes: list[tuple[float, int]] = field(default_factory=list)
    resumed: list[float] = field(default_factory=list)

    def accepted(self, now: float) -> None:
        if self.t_accepted is None:
            self.t_accepted = now

    def delivered(self, now: float) -> None:
        """A token reached the client: it ends a pending ``resume_after_crash``."""
        if len(self.resumed) < len(self.crashes):
            self.resumed.append(now)


class Tracing:
    """The request tracer (module docstring). ``Tracing.off()`` records nothing;
    ``Tracing.start(config)`` exports over OTLP; ``Tracing(processor)`` takes any span processor
    of the SDK (tests give a ``SimpleSpanProcessor`` over an ``InMemorySpanExporter``)."""

    def __init__(self, processor: Any = None, *, service_name: str = "basertd") -> None:
        self.enabled = processor is not None
        self._provider: Any = None
        self._tracer: Any = None
        self._propagator: Any = None
        self._live: dict[int, RequestTrace] = {}
        self._ticks: dict[int, deque[tuple[float, float]]] = {}
        self._pending: list[tuple[float, GenerationRequest, RequestTrace, str, str | None]] = []
        """Finished requests waiting for the end of the tick they ended in (``end``)."""
        self._lock = threading.Lock()
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        if processor is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("basertd")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def off(cls) -> Tracing:
        return cls(None)

    @classmethod
    def start(cls, config: TracingConfig) -> Tracing:
        """The tracer of ``[tracing]``: off without an endpoint. Raises ``ConfigError`` when the
        SDK (``basertd[tracing]``) is not installed."""
        if not config.otlp_endpoint:
            return cls.off()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ConfigError(
                f"tracing.otlp_endpoint is set but the OpenTelemetry SDK is missing ({exc.name}): "
                "install basertd[tracing]"
            ) from None
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, timeout=SPAN_TIMEOUT_MS / 1000)
        processor = BatchSpanProcessor(exporter, max_queue_size=SPAN_QUEUE, max_export_batch_size=SPAN_BATCH)
        return cls(processor, service_name=config.service_name)

    def close(self) -> None:
        """Export what is pending and stop. Idempotent."""
        if self._provider is not None:
            self._flush(float("inf"))
        provider, self._provider = self._provider, None
        self.enabled = False
        if provider is not None:
            provider.shutdown()

    # --- recording (cheap; nothing when off) -----------------------------------------------------

    def begin(self, key: int) -> RequestTrace | None:
        """Start recording request ``key`` under the ``traceparent`` of the HTTP request being
        handled (``TRACEPARENT``; a new trace without one or with a malformed one); None when off."""
        if not self.enabled:
            return None
        header = TRACEPARENT.get()
        parent = self._propagator.extract({"traceparent": header}) if header else None
        trace = RequestTrace(parent, time.monotonic())
        with self._lock:
            self._live[key] = trace
        return trace

    def tick(self, worker_id: int, start: float, end: float) -> None:
        """Worker ``worker_id`` ran a tick from ``start`` to ``end``."""
        if not self.enabled:
            return
        with self._lock:
            ticks = self._ticks.get(worker_id)
            if ticks is None:
                ticks = self._ticks[worker_id] = deque(maxlen=TICKS_KEPT)
            ticks.append((start, end))
            waiting = bool(self._pending)
        if waiting:
            self._flush(end, worker_id)

    def crashed(self, key: int, worker_id: int, now: float) -> None:
        """Request ``key`` was requeued because worker ``worker_id`` died."""
        if not self.enabled:
            return
        with self._lock:
            trace = self._live.get(key)
        if trace is not None:
            trace.crashes.append((now, worker_id))

    # --- the spans, at the end -------------------------------------------------------------------

    def end(self, req: GenerationRequest, trace: RequestTrace, api_name: str, error_code: str | None) -> None:
        """``req`` ended: its spans are built and handed over (module docstring) once its worker has
        recorded the tick it ended in, at once when it has or it never ran on one; forget it."""
        t_end = req.t_finished if req.t_finished is not None else time.monotonic()
        with self._lock:
            self._live.pop(req.key, None)
            ticks = self._ticks.get(req.worker_id) if req.worker_id is not None else None
            wait = req.t_admitted is not None and ticks is not None and (not ticks or ticks[-1][1] < t_end)
            if wait:
                self._pending.append((t_end, req, trace, api_name, error_code))
        if not wait:
            self._build(req, trace, api_name, error_code)
        self._flush(t_end - PENDING_MAX_S)

    def _flush(self, until: float, worker_id: int | None = None) -> None:
        """Build the pending traces that ended by ``until`` (of ``worker_id``'s requests only, when
        given; those of other workers only once ``PENDING_MAX_S`` has passed)."""
        with self._lock:
            due, keep = [], []
            for item in self._pending:
                t_end, req = item[0], item[1]
                mine = worker_id is None or req.worker_id == worker_id
                (due if mine and t_end <= until else keep).append(item)
            self._pending = keep
        for _, req, trace, api_name, error_code in due:
            self._build(req, trace, api_name, error_code)

    def _build(
        self, req: GenerationRequest, trace: RequestTrace, api_name: str, error_code: str | None
    ) -> None:
        with self._lock:
            ticks = list(self._ticks.get(req.worker_id, ())) if req.worker_id is not None else []
        from opentelemetry import trace as otel
        from opentelemetry.trace import Status, StatusCode

        t_end = req.t_finished if req.t_finished is not None else time.monotonic()
        ns = self._ns
        root = self._tracer.start_span(
            "basertd.request",
            context=trace.parent,
            kind=otel.SpanKind.SERVER,
            start_time=ns(req.t_received),
            attributes={
                "basertd.request_id": req.request_id,
                "basertd.api": api_name,
                "basertd.qos": str(req.qos),
                "basertd.worker_id": -1 if req.worker_id is None else req.worker_id,
                "basertd.prompt_tokens": len(req.prompt),
                "basertd.cached_tokens": req.cached_tokens,
                "basertd.completion_tokens": len(req.generated),
                "basertd.finish_reason": req.finish_reason or "",
                "basertd.preemptions": req.preemptions,
                "basertd.crash_resumes": req.crash_resumes,
            },
        )
        if error_code is not None:
            root.set_status(Status(StatusCode.ERROR, error_code))
            root.set_attribute("basertd.error_code", error_code)
        if trace.t_accepted is not None:
            root.add_event("accepted", timestamp=ns(trace.t_accepted))
        ctx = otel.set_span_in_context(root)
        marks = [
            ("admission", req.t_received, trace.t_submitted),
            ("queue", trace.t_submitted, req.t_admitted),
            ("prefill", req.t_admitted, req.t_first_token),
            ("decode", req.t_first_token, t_end if req.t_first_token is not None else None),
        ]
        rode = 0
        for name, start, stop in marks:
            if start is None or stop is None:
                continue
            stop = max(start, stop)
            span = self._tracer.start_span(name, context=ctx, start_time=ns(start))
            span.end(end_time=ns(stop))
            if name not in ("prefill", "decode"):
                continue
            # a tick belongs to the phase it started in: the first token's tick ends prefill
            if name == "prefill":
                inside = [(a, b) for a, b in ticks if start <= b and a < stop]
            else:
                inside = [(a, b) for a, b in ticks if start <= a < stop]
            phase_ctx = otel.set_span_in_context(span, ctx)
            for a, b in inside[: max(0, MAX_TICK_SPANS - rode)]:
                tick = self._tracer.start_span(
                    "tick",
                    context=phase_ctx,
                    start_time=ns(a),
                    attributes={"basertd.worker_id": req.worker_id or 0, "basertd.tick_s": b - a},
                )
                tick.end(end_time=ns(b))
            rode += len(inside)
        root.set_attribute("basertd.ticks", rode)
        for i, (t_crash, worker_id) in enumerate(trace.crashes):
            stop = trace.resumed[i] if i < len(trace.resumed) else t_end
            span = self._tracer.start_span(
                "resume_after_crash",
                context=ctx,
                start_time=ns(t_crash),
                attributes={"basertd.worker_id": worker_id},
            )
            span.end(end_time=ns(max(t_crash, stop)))
        root.end(end_time=ns(t_end))

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns


NO_TRACING = Tracing.off()
"""The tracer of components built without the daemon's: records nothing."""
