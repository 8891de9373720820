"""Generation requests: the request record, its sampler, and its output stream.

A ``GenerationRequest`` is everything the coordinator knows about one Generate: its prompt ids,
its parameters, where its replies go (a ``RequestSink``), the tokens already delivered to the
client, and its timings. The scheduler (``basertd.server.sched.loop``) moves it queued -> running
-> finished and feeds it tokens; the request turns them into client messages itself
(``deliver``, ``finish``, ``fail``), so the scheduler never touches a socket and every exit
path goes through one place that cannot send a reply twice.

Text rules (DESIGN.md "Client API"): text deltas never split a UTF-8 character
(``IncrementalDetokenizer``); a stop string ends the generation and neither it nor its beginning
reaches the client (``StopMatcher``); ``max_tokens`` is exact: never more tokens than that are
delivered, whatever the engine produced in a tick.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from basertd.schema import client as api
from basertd.schema.abi import Sampling, SamplingFlag
from basertd.schema.client import ErrorCode, QosClass
from basertd.schema.tick import LaneLogprob, SamplingParams
from basertd.server.request.grammar import GrammarSpec
from basertd.server.request.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

QOS_CLASSES: tuple[QosClass, ...] = tuple(QosClass)
"""QoS classes, highest first (DESIGN.md "Scheduling"): ``QosClass`` in rank order."""
MAX_SEED = (1 << 32) - 1
"""Largest RNG stream key: ``rng_counter_base = key << 32`` must fit a u64 (ABI rule 73)."""

FINISH_REASONS = ("stop", "length", "eos", "cancelled", "error")
"""Finish reasons of a generation: a stop string, max_tokens (or the context window), the model's
end-of-generation token, a cancel or disconnect, a failure."""


class AdmissionError(Exception):
    """A Generate refused before anything was queued: ``code`` is the client ``ErrorCode``
    (INVALID_REQUEST, EMPTY_PROMPT, CONTEXT_LENGTH_EXCEEDED, QUEUE_FULL, SHUTTING_DOWN, ...);
    ``param`` the ``Generate`` field refused, when one was (the HTTP dialects rename it to theirs)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class RequestSink(Protocol):
    """Where a request's replies go (a client connection). ``send`` must not block or raise;
    ``closed`` turns True when the client has gone (its requests are then cancelled)."""

    @property
    def closed(self) -> bool: ...

    def send(self, msg: object) -> None: ...


class RequestState(StrEnum):
    """Life of a request: queued (waiting for a lane), running (owns a lane), finished."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Sampler:
    """The lane's sampling as the ABI wants it: ``mode`` GPU_GREEDY for temperature 0, else
    GPU_GUMBEL with ``params`` filled; ``seed`` the request seed (drawn at random when the client
    gave none) so ``rng_counter_base = seed << 32`` for a fresh lane (ABI rule 73)."""

    mode: Sampling
    params: SamplingParams
    seed: int
    want_logprobs: int = 0
    """``LaneAdmit.want_logprobs``: 0 = off, else 1 + the top alternatives per token (<= 20)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)`` pairs for the lane's logit-bias table (LOGIT_BIAS_CREATE, ABI rule
    113), sorted by id; empty: no table (``logit_bias_handle`` 0)."""

    @property
    def logprobs(self) -> bool:
        """True when the lane reports a ``LaneLogprob`` row per emitted token."""
        return self.want_logprobs > 0

    def rng_counter_base(self, generated: int = 0) -> int:
        """Counter base of a lane that resumes after ``generated`` tokens: ``(seed << 32) + k``."""
        return (self.seed << 32) + generated


def fold_seed(seed: int) -> int:
    """A u64 request seed folded to the 32-bit key of the RNG stream (``rng_counter_base = key <<
    32``, ABI rule 73); seeds up to ``MAX_SEED`` are their own key."""
    return (seed ^ (seed >> 32)) & MAX_SEED


def sampler_for(gen: api.Generate, vocab_size: int | None = None) -> Sampler:
    """The ``Sampler`` of a Generate that passed ``basertd.server.frontend.limits.check_generate``: the
    seed folded to 32 bits (drawn at random when none was given), a ``top_k`` at or above
    ``vocab_size`` turned off, ``logprobs`` and ``logit_bias`` in the ABI's terms. A greedy request
    (temperature 0) with a penalty keeps it, as vLLM and llama.cpp's server do: GPU_GUMBEL at
    temperature 0, the argmax of the penalised row."""
    seed = fold_seed(gen.seed) if gen.seed is not None else secrets.randbelow(MAX_SEED + 1)
    flags = SamplingFlag.IGNORE_EOS if gen.ignore_eos else 0
    extra: dict = {
        "want_logprobs": 0 if gen.logprobs is None else 1 + gen.logprobs,
        "logit_bias": tuple(sorted((int(t), float(v)) for t, v in gen.logit_bias.items())),
    }
    penalised = gen.frequency_penalty or gen.presence_penalty or gen.repeat_penalty not in (0.0, 1.0)
    if gen.temperature == 0.0 and not penalised:
        return Sampler(Sampling.GPU_GREEDY, SamplingParams(flags=int(flags)), seed, **extra)
    # A greedy request with penalties is a GUMBEL lane at temperature 0: the engine takes the
    # argmax of the penalised row (GPU_GREEDY is the plain argmax, penalties not applied).
    params = SamplingParams(
        temperature=gen.temperature,
        top_p=0.0 if gen.top_p >= 1.0 else gen.top_p,
        min_p=gen.min_p,
        top_k=0 if vocab_size is not None and gen.top_k >= vocab_size else gen.top_k,
        freq_penalty=gen.frequency_penalty,
        presence_penalty=gen.presence_penalty,
        repeat_penalty=0.0 if gen.repeat_penalty == 1.0 else gen.repeat_penalty,
        flags=int(flags),
    )
    return Sampler(Sampling.GPU_GUMBEL, params, seed, **extra)


def token_logprobs(ids: Sequence[int], rows: Sequence[LaneLogprob]) -> list[api.TokenLogprob]:
    """The client records of emitted ``ids`` from the engine's ``LaneLogprob`` rows of the same
    lane, in emission order (one row per id; ``n_top`` alternatives each, ABI "LaneLogprob").
    Raises ``ValueError`` when the counts differ."""
    if len(ids) != len(rows):
        raise ValueError(f"{len(rows)} logprob rows for {len(ids)} tokens")
    out = []
    for t, r in zip(ids, rows, strict=True):
        n = min(r.n_top, len(r.top_ids), len(r.top_logprobs))
        top = [
            api.TopLogprob(id=int(i), logprob=float(lp))
            for i, lp in zip(r.top_ids[:n], r.top_logprobs[:n], strict=True)
        ]
        out.append(api.TokenLogprob(id=int(t), logprob=float(r.logprob), top=top))
    return out


_keys = itertools.count(1)


@dataclass(eq=False)
class GenerationRequest:
    """One Generate from admission to Done/Error.

    Fixed at admission: ``key`` (daemon-unique, never reused), ``request_id`` (the client's),
    ``prompt`` (token ids), ``max_tokens`` (tokens), ``sampler``, ``stop``, ``qos``, ``stream``,
    ``sink``, ``t_received`` (monotonic seconds). Moving state: ``state``, ``worker_id`` and
    ``lane_tag`` while running, ``generated`` (ids delivered to the client, in order; the record
    a resume after preemption replays), ``cached_tokens`` (prompt tokens served from the prefix
    cache at its first admission: a re-admission after a preemption or checkpoint never counts),
    timings, ``finish_reason`` once finished, ``cancelled`` once the client cancelled or went away.

    Under contention: ``admissions`` (times admitted into a lane), ``preemptions`` (times preempted for an
    interactive request), ``checkpointed`` (it led a prefix checkpoint, which it does at most once),
    ``page_hashes`` (the prompt's page hash path at its worker's page size,
    ``basertd.server.cache.policy.page_hashes``, under its ``cache_salt``: 0, or its API key's own
    with ``[cache] isolate_by_api_key``), ``plan_seq_received`` (the last plan submitted to
    its worker when it arrived) and ``ttft_ticks`` (ticks from its arrival to the tick that
    delivered its first token, the tick in flight at arrival included).

    Worker crashes (DESIGN.md "Scheduling": a crash is a preemption): ``crash_resumes`` (times it
    was requeued because its worker died while it ran; the access log's field) and
    ``crash_streak`` (crashes of the workers it ran on, counted across workers, since it last made
    progress; at the scheduler's ``max_crash_resumes`` it fails WORKER_FAILED) and ``crash_mark``
    (its generated-token count at its last crash). Progress is a tick that *completed* on a worker
    and delivered this request tokens past ``crash_mark`` (``basertd.server.sched.apply``): tokens
    of a partial emit whose tick then died prove nothing, as a poison request may emit before it
    kills its worker.

    Speculative decoding: ``speculation`` (the client's "auto", "off" or a strategy name,
    ``basertd.server.sched.speculation``), ``draft_tokens`` and ``accepted_draft_tokens`` (the
    engine's SpecStats over every lane the request ran in, up to its end: a tick that ends it
    through a partial emit reports its drafts after the Done).

    Structured output: ``grammar`` (the validated spec, ``basertd.server.request.grammar.GrammarSpec``, or
    None; its handle on the worker is booked by the scheduler, ``basertd.server.sched.grammar_handles``)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    sink: RequestSink
    tokenizer: Tokenizer
    stop: Sequence[str] = ()
    qos: QosClass = QosClass.INTERACTIVE
    stream: bool = True
    key: int = field(default_factory=lambda: next(_keys))
    t_received: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.QUEUED
    worker_id: int | None = None
    lane_tag: int | None = None
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    speculation: str = "auto"
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    cancelled: bool = False
    finish_reason: str | None = None
    t_admitted: float | None = None
    t_first_token: float | None = None
    t_finished: float | None = None
    admissions: int = 0
    preemptions: int = 0
    checkpointed: bool = False
    page_hashes: list[int] = field(default_factory=list)
    cache_salt: int = 0
    plan_seq_received: int = 0
    tick_in_flight_at_arrival: bool = False
    ttft_ticks: int | None = None
    crash_resumes: int = 0
    crash_streak: int = 0
    crash_mark: int = 0
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer)
        self._stops = StopMatcher(self.stop)
        self._pending_ids: list[int] = []  # stream=False: everything goes out with Done
        self._pending_text: list[str] = []
        self._pending_logprobs: list[api.TokenLogprob] = []

    # --- views the scheduler plans with ---------------------------------------------------

    @property
    def finished(self) -> bool:
        """True once Done or Error was sent (or the request was dropped)."""
        return self.state is RequestState.FINISHED

    @property
    def remaining(self) -> int:
        """Tokens still allowed by max_tokens."""
        return self.max_tokens - len(self.generated)

    def resume_prompt(self) -> list[int]:
        """The prompt an admission uses: the prompt, then every token already delivered (replayed
        with ``decode_replay = len(generated)``, ABI rules 71-73)."""
        return self.prompt + self.generated if self.generated else self.prompt

    @property
    def gone(self) -> bool:
        """True when the client cancelled or disconnected: the lane retires, a queued request never
        starts."""
        return self.cancelled or self.sink.closed

    def restore(self, ids: Sequence[int]) -> str | None:
        """Take ``ids`` as already delivered (a request re-run from the write-ahead log after a
        restart): they join ``generated`` and prime the detokenizer and stop matcher, sending
        nothing. Returns "stop" or "length" when they already end the generation, else None."""
        ids = [int(t) for t in ids[: max(self.remaining, 0)]]
        if not ids:
            return None
        self.generated.extend(ids)
        if self.t_first_token is None:
            self.t_first_token = time.monotonic()
        text = self._detok.feed(ids)
        if self._stops.stops and self._stops.feed(text)[1]:
            return "stop"
        return "length" if self.remaining <= 0 else None

    # --- output ---------------------------------------------------------------------------

    def _tokens(self, ids: list[int], text: str, logprobs: list[api.TokenLogprob]) -> api.Tokens:
        return api.Tokens(
            request_id=self.request_id,
            ids=ids,
            text=text,
            logprobs=logprobs if self.sampler.logprobs else None,
        )

    def _pending(self) -> api.Tokens:
        return self._tokens(self._pending_ids, "".join(self._pending_text), self._pending_logprobs)

    def _send_tokens(
        self,
        send: Callable[[object], None],
        ids: list[int],
        text: str,
        final: bool,
        logprobs: Sequence[api.TokenLogprob] = (),
    ) -> None:
        if self.stream:
            if ids or text:
                send(self._tokens(ids, text, list(logprobs)))
            return
        self._pending_ids.extend(ids)
        self._pending_text.append(text)
        self._pending_logprobs.extend(logprobs)
        if final and (self._pending_ids or any(self._pending_text)):
            send(self._tokens(self._pending_ids, "".join(self._pending_text), self._pending_logprobs))

    def deliver(
        self,
        ids: Sequence[int],
        now: float | None = None,
        logprobs: Sequence[api.TokenLogprob] | None = None,
        out: list | None = None,
    ) -> str | None:
        """Deliver freshly generated ``ids`` (in order) to the client. At most ``remaining`` of them
        are taken; with stop strings, none after the token that completed one. ``logprobs`` holds
        one entry per id (the engine's ``LaneLogprob`` rows) when the request asked for logprobs;
        the entries of the ids taken ride in the same Tokens. Returns the finish reason this
        delivery reached ("stop" or "length"), else None; the caller then retires the lane and
        calls ``finish``. Ignored once finished. ``out``: the messages are appended to it instead
        of being sent to ``sink`` (the scheduler core returns them as deliveries,
        ``basertd.server.sched.outcome``); the same holds for ``finish`` and ``fail``."""
        if self.finished or not ids:
            return None
        now = time.monotonic() if now is None else now
        if self.t_first_token is None:
            self.t_first_token = now
        take = [int(t) for t in ids[: max(self.remaining, 0)]]
        reason = None
        if self._stops.stops:
            sent: list[int] = []
            text_parts: list[str] = []
            for t in take:
                sent.append(t)
                safe, stopped = self._stops.feed(self._detok.feed((t,)))
                text_parts.append(safe)
                if stopped:
                    reason = "stop"
                    break
            take, text = sent, "".join(text_parts)
        else:
            text = self._detok.feed(take)
        self.generated.extend(take)
        if reason is None and self.remaining <= 0:
            reason = "length"
        send = self.sink.send if out is None else out.append
        self._send_tokens(send, take, text, False, logprobs[: len(take)] if logprobs is not None else ())
        return reason

    def finish(self, reason: str, now: float | None = None, out: list | None = None) -> None:
        """Send the held-back text (unless a stop string matched) and Done with ``reason``, usage
        and timings. Idempotent: a finished request sends nothing more."""
        if self.finished:
            return
        now = time.monotonic() if now is None else now
        tail = ""
        if not self._stops.stopped:
            tail = self._stops.feed(self._detok.flush())[0] + self._stops.flush()
        send = self.sink.send if out is None else out.append
        self._send_tokens(send, [], tail, final=True)
        self.state = RequestState.FINISHED
        self.finish_reason = reason
        self.t_finished = now
        send(
            api.Done(
                request_id=self.request_id, finish_reason=reason, usage=self.usage(), timings=self.timings()
            )
        )

    def fail(self, code: ErrorCode, message: str, now: float | None = None, out: list | None = None) -> None:
        """End the request with ``Error(code, message)`` after whatever was already delivered
        (never repeated). Idempotent."""
        if self.finished:
            return
        self.state = RequestState.FINISHED
        self.finish_reason = "cancelled" if code is ErrorCode.CANCELLED else "error"
        self.t_finished = time.monotonic() if now is None else now
        send = self.sink.send if out is None else out.append
        if not self.stream and self._pending_ids:
            send(self._tokens(self._pending_ids, "".join(self._pending_text), self._pending_logprobs))
        send(api.Error(code=code, request_id=self.request_id, message=message))

    def usage(self) -> api.Usage:
        """Token counts: prompt, cached (prefix cache), completion (delivered), drafted and
        accepted drafts (speculative decoding, every admission of the request)."""
        return api.Usage(
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            completion_tokens=len(self.generated),
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens,
        )

    def timings(self) -> api.Timings:
        """Seconds queued, TTFT and total from receipt, and the decode rate after the first token
        (tokens/s; 0 with fewer than two tokens)."""
        end = self.t_finished if self.t_finished is not None else time.monotonic()
        queue_s = (self.t_admitted if self.t_admitted is not None else end) - self.t_received
        ttft = (self.t_first_token - self.t_received) if self.t_first_token is not None else 0.0
        rate = 0.0
        if self.t_first_token is not None and len(self.generated) > 1 and end > self.t_first_token:
            rate = (len(self.generated) - 1) / (end - self.t_first_token)
        return api.Timings(
            queue_s=queue_s, ttft_s=ttft, decode_tokens_per_s=rate, total_s=end - self.t_received
        )
