"""Per-request observation: metrics, the access log line and drain accounting.

``ObservedSink`` is the ``RequestSink`` the front end gives each accepted Generate, around the
transport's own sink (a native connection, an HTTP stream). Every reply of the request passes
through it on its way to the client, so one place sees the request from acceptance to its end,
whichever API it came through, without the scheduler knowing about metrics or logs:

- the first token: TTFT, queue time and the prefix-cache hit or miss (``Metrics.first_token``);
- later tokens: inter-token latency (``Metrics.tokens``); with ``stream`` False the tokens arrive
  in one reply, so the mean gap between first and last token is observed instead;
- Done or Error: the request's counters (``Metrics.request_finished``), the in-flight set of the
  ``Drainer``, exactly one access log line and, with tracing on, its spans
  (``basertd.server.observe.tracing``: Accepted and token times are recorded on the way).

The access line is content-free (DESIGN.md "Operators"): event ``access`` with request_id, key,
api (the API it came through: native, openai, anthropic, ollama), worker_id, qos, prompt_tokens,
cached_tokens, completion_tokens, queue_s, ttft_s, tokens_per_s, total_s, finish_reason,
preemptions (times the request was preempted for an interactive one), ttft_ticks (ticks from
arrival to the tick that delivered its first token) and, for an Error, its code.
Never prompt or output text or token ids.

An embedding request (pooled between ticks, no lane) ends with one ``access`` line too, answered or
not (``embedding_access``): kind ``embedding``, api, worker_id, inputs, prompt_tokens, total_s and,
when refused or failed, error_code.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from basertd.schema import client as api

if TYPE_CHECKING:
    from basertd.server.frontend.drain import Drainer
    from basertd.server.frontend.embeddings import Embeddings
    from basertd.server.observe.metrics import Metrics
    from basertd.server.observe.tracing import RequestTrace
    from basertd.server.request.record import GenerationRequest, RequestSink

access_log = structlog.get_logger("basertd.access")


class ObservedSink:
    """Passes one generation's replies to the transport's ``inner`` sink and observes them
    (module docstring). ``attach(req)`` must be called before the request is submitted; ``send``
    never raises."""

    __slots__ = ("_last_t", "api_name", "drainer", "inner", "metrics", "request", "request_id", "trace")

    def __init__(
        self,
        inner: RequestSink,
        request_id: str,
        metrics: Metrics,
        drainer: Drainer,
        *,
        api_name: str = "native",
    ) -> None:
        self.inner = inner
        self.api_name = api_name
        self.request_id = request_id
        self.metrics = metrics
        self.drainer = drainer
        self.request: GenerationRequest | None = None
        self.trace: RequestTrace | None = None
        self._last_t: float | None = None

    def attach(self, req: GenerationRequest) -> None:
        """Observe ``req`` (counted in flight from now on; traced when tracing is on, under the
        ``traceparent`` of the HTTP request being handled)."""
        self.request = req
        self.drainer.accepted(req)
        self.trace = self.metrics.tracing.begin(req.key)

    @property
    def closed(self) -> bool:
        """True once the client went away."""
        return self.inner.closed

    def send(self, msg: object) -> None:
        """Observe ``msg`` and queue it on the connection."""
        req = self.request
        if req is not None:
            try:
                self._observe(req, msg)
            except Exception as exc:  # observation must never break a reply
                access_log.error("observe_failed", error=repr(exc))
        self.inner.send(msg)

    def _observe(self, req: GenerationRequest, msg: object) -> None:
        trace = self.trace
        if isinstance(msg, api.Accepted) and trace is not None:
            trace.accepted(time.monotonic())
        elif isinstance(msg, api.Tokens) and msg.ids:
            now = time.monotonic()
            if trace is not None:
                trace.delivered(now)
            if self._last_t is None:
                self.metrics.first_token(req, 1 if not req.stream else len(msg.ids))
                if not req.stream and len(msg.ids) > 1 and req.t_first_token is not None:
                    # one reply for the whole generation: the mean gap after the first token
                    self.metrics.tokens(req.qos, len(msg.ids) - 1, now - req.t_first_token)
            else:
                self.metrics.tokens(req.qos, len(msg.ids), now - self._last_t)
            self._last_t = now
        elif isinstance(msg, api.Done):
            self._end(req, msg.usage, msg.timings, None)
        elif isinstance(msg, api.Error):
            self._end(req, req.usage(), req.timings(), str(msg.code))

    def _end(self, req: GenerationRequest, usage: api.Usage, timings: api.Timings, code: str | None) -> None:
        self.metrics.request_finished(req, code)
        self.drainer.ended(req)
        if self.trace is not None:
            self.metrics.tracing.end(req, self.trace, self.api_name, code)
            self.trace = None
        fields = dict(
            request_id=req.request_id,
            key=req.key,
            api=self.api_name,
            worker_id=req.worker_id,
            qos=req.qos,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            queue_s=round(timings.queue_s, 6),
            ttft_s=round(timings.ttft_s, 6),
            tokens_per_s=round(timings.decode_tokens_per_s, 3),
            total_s=round(timings.total_s, 6),
            finish_reason=req.finish_reason,
            preemptions=req.preemptions,
            crash_resumes=req.crash_resumes,
            ttft_ticks=req.ttft_ticks,
        )
        if code is not None:
            fields["error_code"] = code
        access_log.info("access", **fields)


def embedding_access(
    api_name: str,
    inputs: int,
    total_s: float,
    out: Embeddings | None = None,
    *,
    error_code: str | None = None,
) -> None:
    """The access line of one embedding request (module docstring): ``inputs`` texts or token
    lists, ``total_s`` seconds from its start to its end, ``out`` its result when answered,
    ``error_code`` when not."""
    fields: dict[str, object] = dict(
        kind="embedding",
        api=api_name,
        worker_id=None if out is None else out.worker_id,
        inputs=inputs,
        prompt_tokens=0 if out is None else out.prompt_tokens,
        total_s=round(total_s, 6),
    )
    if error_code is not None:
        fields["error_code"] = error_code
    access_log.info("access", **fields)
