"""The front end: one transport-independent path from a request to a stream of outputs.

Every API the daemon speaks (the native Unix-socket protocol, the HTTP dialects) turns its request
into a ``basertd.schema.client.Generate`` and hands it to ``Frontend``; everything after that is
the same for all of them (DESIGN.md "Client API"):

1. admission: the daemon is ready and not draining; the request's values are inside the limits
   table (``basertd.server.frontend.limits``); the prompt's byte length can fit the context at all;
   a structured-output spec passes its cheap checks and names a kind the worker compiles;
2. tokenizing, with BOS as the worker wants it: long texts off the event loop (a bounded thread
   pool), so a megabyte prompt never stalls other streams;
3. routing: the least loaded worker serving the model, then the peer holding the longest cached
   prefix (``Fleet.route`` / ``route_prefix``); the scheduler's own admission check (context
   window, KV pool, queue caps); only then the spec compiled, once per distinct spec, in a child
   process (``spec_compiler.SpecCompiler``), so a spec that crashes the compiler is a 400 and a
   flood of specs the queues refuse costs no compilation;
4. the request record (``GenerationRequest``) with an ``ObservedSink`` around the transport's
   sink, so metrics, the access log and drain accounting see every API alike; with durability on
   (``basertd.server.durability.durable``) a ``DurableSink`` around that journals the request and holds
   each reply until its group commit returned; ``Accepted`` (with the ``resume_id``) is the first
   reply; the scheduler then sends Tokens / Done / Error through the same sink.

A transport either gives its own ``RequestSink`` (``submit``: the native API writes frames
straight to its connection) or takes an async iterator (``stream``: ``GenerationStream``, used
by HTTP). A consumer that goes away cancels its request: its lane retires in the next plan and a
queued request never starts. Refusals raise ``AdmissionError`` (a typed ``ErrorCode``) before
anything is queued, and are counted in ``basertd_admission_errors_total``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.server.durability.durable import Durability
from basertd.server.fleet import Fleet
from basertd.server.frontend import embeddings, scoring
from basertd.server.frontend.access import ObservedSink, embedding_access
from basertd.server.frontend.drain import Drainer
from basertd.server.frontend.limits import (
    check_generate,
    check_logit_bias,
    check_prompt_bytes,
    check_prompt_tokens,
)
from basertd.server.frontend.resume_limits import ResumeLimiter
from basertd.server.frontend.spec_compiler import SpecCompiler
from basertd.server.frontend.streams import GenerationStream, QueueSink, ResumedStream
from basertd.server.observe.metrics import Metrics
from basertd.server.observe.snapshot import WorkerSnapshot
from basertd.server.request.grammar import GrammarRequestError, GrammarSpec, spec_from_request
from basertd.server.request.record import AdmissionError, GenerationRequest, RequestSink, sampler_for
from basertd.server.request.requester import UNBOUND, cache_salt
from basertd.server.request.tokenizer import TokenizerError
from basertd.server.sched.speculation import explicit_refusal, named_refusal
from basertd.server.states import DaemonState, HealthStatus, SlotState

log = structlog.get_logger("basertd.frontend")

TOKENIZER_THREADS = 2
"""Threads that tokenize and detokenize off the event loop."""
MAX_PENDING_TOKENIZE = 64
"""Tokenize jobs allowed to wait for a thread at once; more are refused QUEUE_FULL."""
INLINE_TOKENIZE_CHARS = 4096
"""Texts up to this many characters are tokenized on the event loop (tens of microseconds: cheaper
than a thread hop); longer ones go to the pool."""


@dataclass(frozen=True)
class ChatTemplateInputs:
    """What one worker's chat template is built from (``Frontend.template_inputs``; the fields of
    ``basertd.server.transport.http.port.TemplateInputs``)."""

    configured: str
    own: str | None
    default_model: bool
    bos_token: str
    eos_token: str


class Frontend:
    """The front end of one daemon (module docstring). ``state()`` returns the daemon's public
    state (``ready`` admits); ``api`` labels requests in logs by the API they came through."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics,
        drainer: Drainer,
        state: Callable[[], str],
        durability: Durability | None = None,
        resume_limiter: ResumeLimiter | None = None,
    ) -> None:
        self.fleet = fleet
        self.durability = durability
        self.resume_limiter = resume_limiter
        self.metrics = metrics
        self.drainer = drainer
        self._state = state
        self._pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self._pending = 0
        self.requests_total = 0  # generations accepted and embedding requests answered
        cc = fleet.config.compile
        self.specs = SpecCompiler(
            metrics,
            processes=cc.processes,
            timeout_s=cc.grammar_timeout_s,
            max_pending=cc.max_pending,
            memory_bytes=cc.memory_mib << 20,
        )

    def start(self, children: int | None = None) -> None:
        """Start ``children`` of the grammar compiler's child processes in the background (default:
        every one not started yet)."""
        self.specs.pool.start(children)

    async def close(self) -> None:
        """Stop the tokenizer threads (running jobs finish) and the grammar compiler's children."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        await self.specs.close()

    # --- off-loop work ---------------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the tokenizer pool. Raises ``AdmissionError(QUEUE_FULL)`` when
        ``MAX_PENDING_TOKENIZE`` jobs already wait."""
        if self._pending >= MAX_PENDING_TOKENIZE:
            raise AdmissionError(ErrorCode.QUEUE_FULL, "too many prompts are being tokenized; retry shortly")
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._pending -= 1

    async def encode(self, worker_id: int, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` for ``worker_id``'s vocabulary (BOS as the worker wants it when
        ``add_special``), tokenized off the loop. Raises ``AdmissionError(INVALID_REQUEST)`` for
        text the tokenizer refuses."""
        tok = self.fleet[worker_id].tokenizer
        bos = add_special and self.fleet.add_bos(worker_id)
        try:
            if len(text) <= INLINE_TOKENIZE_CHARS:
                return tok.encode(text, add_bos=bos)
            return await self._off_loop(lambda: tok.encode(text, add_bos=bos))
        except TokenizerError as exc:
            raise AdmissionError(ErrorCode.INVALID_REQUEST, str(exc)) from None

    async def tokenize(self, model: str, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` with ``model``'s vocabulary. Raises ``AdmissionError``
        (NOT_FOUND for an unknown model, INVALID_REQUEST for text over the byte limit)."""
        wid = self.fleet.route(model)
        m = self.fleet[wid]
        check_prompt_bytes(text, m.config.context_length, m.tokenizer, what="text")
        return await self.encode(wid, text, add_special=add_special)

    async def control_texts(self, model: str, texts: list[str]) -> frozenset[str]:
        """The control-token texts of ``model``'s vocabulary (``<start_of_turn>``, ...) that occur
        in ``texts`` (chat message contents); empty for a vocabulary without any (the byte
        vocabulary) or a tokenizer that cannot tell (a libbaseRT bundle's). Raises
        ``AdmissionError`` (NOT_FOUND, INVALID_REQUEST)."""
        wid = self.fleet.route(model)
        m = self.fleet[wid]
        find = getattr(m.tokenizer, "control_texts_in", None)
        joined = "\x00".join(texts)  # no control text spans a NUL
        if find is None or not joined:
            return frozenset()
        check_prompt_bytes(joined, m.config.context_length, m.tokenizer, what="messages", param="messages")
        try:
            if len(joined) <= INLINE_TOKENIZE_CHARS:
                return find(joined)
            return await self._off_loop(find, joined)
        except TokenizerError as exc:
            raise AdmissionError(ErrorCode.INVALID_REQUEST, str(exc)) from None

    async def tokenize_parts(
        self, model: str, parts: list[tuple[str, bool]], *, add_special: bool
    ) -> list[int]:
        """Token ids of the concatenated ``parts`` (``(text, special)``: with ``special`` False
        the text is plain text, control-token text included), BOS as the worker wants it when
        ``add_special``. One part with special on tokenizes exactly like ``tokenize``. Raises
        ``AdmissionError`` like ``tokenize``."""
        if len(parts) == 1 and parts[0][1]:
            return await self.tokenize(model, parts[0][0], add_special=add_special)
        wid = self.fleet.route(model)
        m = self.fleet[wid]
        tok = m.tokenizer
        check_prompt_bytes("".join(t for t, _ in parts), m.config.context_length, tok, what="text")
        bos = add_special and self.fleet.add_bos(wid)

        encode_parts = getattr(tok, "encode_parts", None)

        def run() -> list[int]:
            if encode_parts is None:  # a vocabulary without control texts: one text
                return tok.encode("".join(t for t, _ in parts), add_bos=bos)
            return encode_parts(parts, add_bos=bos)

        try:
            return await self._off_loop(run)
        except TokenizerError as exc:
            raise AdmissionError(ErrorCode.INVALID_REQUEST, str(exc)) from None

    async def embed(
        self,
        model: str,
        inputs: list[str] | list[list[int]],
        *,
        truncate: bool = False,
        dimensions: int | None = None,
        api_name: str = "native",
    ) -> embeddings.Embeddings:
        """Pooled embeddings of ``inputs`` (``frontend.embeddings.embed``: its errors, and
        SHUTTING_DOWN / DRAINING as for a generation; each error counted in
        ``basertd_admission_errors_total``). Ends with one access line, answered or not
        (``access.embedding_access``; ``api_name`` the API it came through)."""
        t0 = time.monotonic()
        try:
            self._admissible()
            with self.drainer.serving():  # a drain (and a stop) waits for it
                out = await embeddings.embed(
                    self.fleet,
                    lambda wid, text: self.encode(wid, text),
                    lambda wid: self.fleet[wid].tokenizer.vocab_size,
                    lambda wid: self.fleet[wid].tokenizer,
                    model,
                    inputs,
                    truncate=truncate,
                    dimensions=dimensions,
                )
        except AdmissionError as exc:
            self.metrics.admission_error(exc.code)
            embedding_access(api_name, len(inputs), time.monotonic() - t0, error_code=str(exc.code))
            raise
        self.requests_total += 1
        embedding_access(api_name, len(inputs), time.monotonic() - t0, out)
        return out

    def pieces(self, model: str, tokens: list[int]) -> list[bytes]:
        """The bytes of each of ``tokens`` in ``model``'s vocabulary (ids already checked)."""
        tok = self.fleet[self.fleet.route(model)].tokenizer
        return [tok.piece(t) for t in tokens]

    async def score(self, model: str, tokens: list[int], top_k: int) -> scoring.PromptScores:
        """Prompt log-probabilities of ``tokens`` (``frontend.scoring.score``: its errors, and
        SHUTTING_DOWN / DRAINING as for a generation)."""
        self._admissible()
        vocab = self.fleet[self.fleet.route(model)].tokenizer.vocab_size
        return await scoring.score(self.fleet, vocab, model, tokens, top_k)

    async def detokenize(self, model: str, tokens: list[int]) -> str:
        """The text of ``tokens`` (ids outside the vocabulary are INVALID_REQUEST); special tokens
        render as nothing, invalid UTF-8 as U+FFFD."""
        wid = self.fleet.route(model)
        m = self.fleet[wid]
        check_prompt_tokens(tokens, m.tokenizer.vocab_size, m.config.context_length * 16, what="tokens")
        tok = m.tokenizer

        def run() -> str:
            return b"".join(tok.piece(t) for t in tokens).decode("utf-8", "replace")

        return await self._off_loop(run)

    # --- views for the HTTP dialects (``basertd.server.transport.http.port.FrontendPort``) ------

    async def compile_spec(self, model: str, qos: str, spec: GrammarSpec) -> GrammarSpec:
        """The candidate of ``spec`` that compiles (``SpecCompiler.compile``: a fallback chosen,
        the result cached for admission), for a dialect that must know it before it builds its
        ``Generate`` (a tool grammar). The queue caps of the worker ``model`` goes to are checked
        first. Raises ``AdmissionError`` (INVALID_REQUEST naming the spec's ``label``,
        QUEUE_FULL, NOT_FOUND, SHUTTING_DOWN)."""
        self._admissible()
        self.fleet[self.fleet.route(model)].scheduler.core.check_admission(0, 1, qos)
        try:
            return await self.specs.compile(spec)
        except GrammarRequestError as exc:
            raise AdmissionError(exc.code, str(exc)) from None

    def route(self, model: str) -> int:
        """The worker a new request for ``model`` ("" = any) goes to now (``Fleet.route``). Raises
        ``AdmissionError(NOT_FOUND)`` for a model no worker serves."""
        return self.fleet.route(model)

    def context_length(self, worker: int) -> int:
        """``worker``'s context window in tokens (its scheduler's limits)."""
        return self.fleet[worker].scheduler.core.limits.context_length

    def model_name(self, worker: int) -> str:
        """``worker``'s served model name."""
        return self.fleet[worker].model_name

    def template_inputs(self, worker: int) -> ChatTemplateInputs:
        """What ``worker``'s chat template is built from: its ``chat_template`` key, the model's
        own template (GGUF ``tokenizer.chat_template``), whether it serves the default model, and
        its BOS / EOS texts."""
        m = self.fleet[worker]
        cfg, tok = m.config, m.tokenizer
        meta = getattr(tok, "meta", None)
        text_of = getattr(tok, "token_text", None)
        return ChatTemplateInputs(
            configured=cfg.chat_template,
            own=meta("tokenizer.chat_template") if meta is not None else None,
            default_model=cfg.engine == "llamacpp" and not cfg.model,
            bos_token=text_of(getattr(tok, "bos_id", -1)) if text_of else "",
            eos_token=text_of(getattr(tok, "eos_id", -1)) if text_of else "",
        )

    def models(self) -> list[api.ModelInfo]:
        """One entry per served model name (``Fleet.models``)."""
        return self.fleet.models()

    def workers_ready(self) -> int:
        """Workers that serve now."""
        return self.fleet.ready_count

    def worker_snapshots(self) -> list[WorkerSnapshot]:
        """Every worker now, by id (``Fleet.snapshots``; on the event loop)."""
        return self.fleet.snapshots()

    def metrics_exposition(self) -> str:
        """The Prometheus text exposition of the daemon's registry."""
        return self.metrics.exposition()

    def default_piece(self, token_id: int) -> bytes:
        """The bytes of ``token_id`` in the vocabulary of the worker a request for any model goes
        to (a resumed stream's tokens: the request record is not at hand)."""
        return self.fleet[self.fleet.route("")].tokenizer.piece(token_id)

    # --- generation ------------------------------------------------------------------------------

    def _admissible(self) -> None:
        state = self._state()
        if state in (DaemonState.STOPPING, DaemonState.STOPPED):
            raise AdmissionError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        refusal = self.drainer.refusal()
        if refusal is not None:
            raise AdmissionError(*refusal)

    async def submit(
        self,
        gen: api.Generate,
        sink: RequestSink,
        *,
        api_name: str = "native",
        requester: str = UNBOUND,
        context: dict[str, Any] | None = None,
    ) -> GenerationRequest:
        """Admit ``gen`` (module docstring) and queue it, bound to ``requester``
        (``basertd.server.request.requester``: only it, or an operator, may resume it) with the
        transport's resume ``context`` journaled beside it; ``Accepted`` is sent through ``sink``
        before this returns, then the scheduler's replies. Raises ``AdmissionError`` with nothing
        queued (counted in ``basertd_admission_errors_total``)."""
        try:
            return await self._submit(gen, sink, api_name, requester, context)
        except AdmissionError as exc:
            self.metrics.admission_error(exc.code)
            raise

    async def _submit(
        self,
        gen: api.Generate,
        sink: RequestSink,
        api_name: str,
        requester: str,
        context: dict[str, Any] | None,
    ) -> GenerationRequest:
        self._admissible()
        check_generate(gen)
        try:  # structured output: cheap checks now, compiled after the queue caps
            spec = spec_from_request(gen.response_format, gen.grammar, gen.regex)
        except GrammarRequestError as exc:
            raise AdmissionError(exc.code, str(exc), _structured_param(gen)) from None
        why = explicit_refusal(gen.speculation, self.fleet.config.speculation.strategies, spec is not None)
        if why is not None:
            raise AdmissionError(ErrorCode.INVALID_REQUEST, why, "speculation")
        wid = self.fleet.route(gen.model)
        m = self.fleet[wid]
        check_logit_bias(gen, m.tokenizer.vocab_size)
        if gen.prompt is not None:
            check_prompt_bytes(gen.prompt, m.config.context_length, m.tokenizer)
            prompt = await self.encode(wid, gen.prompt)
        else:
            prompt = list(gen.prompt_tokens or [])
            # the dialects send their rendered prompts as tokens: name it for what it is to all
            check_prompt_tokens(prompt, m.tokenizer.vocab_size, m.config.context_length, what="the prompt")
        self._admissible()  # the daemon may have begun draining while the prompt was tokenized
        if sink.closed:
            raise AdmissionError(ErrorCode.CANCELLED, "the client went away before its request was queued")
        tokenized_by = m.tokenizer
        salt = cache_salt(requester) if self.fleet.config.cache.isolate_by_api_key else 0
        wid = self.fleet.route_prefix(wid, prompt, salt)
        m = self.fleet[wid]
        if m.tokenizer is not tokenized_by:  # a reload gave the worker another model meanwhile
            raise AdmissionError(
                ErrorCode.WORKER_FAILED, f"worker {wid} changed its model; retry the request"
            )
        m.scheduler.core.check_admission(len(prompt), gen.max_tokens, gen.qos)
        if spec is not None:
            kinds = m.scheduler.core.limits.grammar_kinds
            if spec.kind not in kinds:
                raise AdmissionError(
                    ErrorCode.INVALID_REQUEST,
                    f"worker {wid} ({m.config.engine}) compiles only {', '.join(kinds) or 'no'} grammars, "
                    f"not {spec.kind}",
                    _structured_param(gen),
                )
            try:  # in a child process: a spec that crashes the compiler fails only this request
                spec = await self.specs.compile(spec)
            except GrammarRequestError as exc:
                raise AdmissionError(exc.code, str(exc), _structured_param(gen)) from None
            self._admissible()
            if sink.closed:
                raise AdmissionError(
                    ErrorCode.CANCELLED, "the client went away before its request was queued"
                )
            m.scheduler.core.check_admission(len(prompt), gen.max_tokens, gen.qos)
        sampler = sampler_for(gen, m.tokenizer.vocab_size)
        if m.slot.state is SlotState.READY:  # its handshake said which strategies it registered
            strategies = m.scheduler.core.limits.strategies
            why = named_refusal(gen.speculation, sampler, spec is not None, strategies, f"worker {wid}")
            if why is not None:
                raise AdmissionError(ErrorCode.INVALID_REQUEST, why, "speculation")
        observed = ObservedSink(sink, gen.request_id, self.metrics, self.drainer, api_name=api_name)
        req = GenerationRequest(
            request_id=gen.request_id,
            prompt=prompt,
            max_tokens=gen.max_tokens,
            sampler=sampler,
            sink=observed,
            tokenizer=m.tokenizer,
            stop=list(gen.stop),
            qos=gen.qos,
            stream=gen.stream,
            grammar=spec,
            cache_salt=salt,
            speculation=gen.speculation,
        )
        if self.durability is not None:
            accepted = self.durability.wrap(
                gen, prompt, req, observed, requester=requester, context=context, api_name=api_name
            )
        else:
            accepted = api.Accepted(
                request_id=gen.request_id, prompt_tokens=len(prompt), seed=req.sampler.seed
            )
        self.requests_total += 1
        observed.attach(req)
        req.sink.send(accepted)
        m.scheduler.submit(req)
        return req

    def cancel(
        self, req: GenerationRequest, *, code: ErrorCode = ErrorCode.CANCELLED, message: str = "cancelled"
    ) -> None:
        """End ``req`` with ``Error(code)`` after what it already delivered: its lane retires in
        the next plan, a queued request never starts. Ignored once finished."""
        if req.worker_id is not None and not req.finished:
            self.fleet[req.worker_id].scheduler.cancel(req, code=code, message=message)

    async def resume(
        self, resume_id: str, after: int, sink: RequestSink, requester: str, *, operator: bool = False
    ) -> tuple[bool, dict[str, Any]]:
        """Answer a Resume from ``requester`` (an operator when ``operator``) through ``sink``
        (``Durability.resume``): ``(following, context)``, following True when ``sink`` now
        follows a live request. Each requester's resumes are rate-limited (``ResumeLimiter``).
        Raises ``AdmissionError`` (NOT_FOUND, PERMISSION_DENIED, INVALID_REQUEST, SHUTTING_DOWN,
        QUEUE_FULL)."""
        if self.durability is None:
            raise AdmissionError(ErrorCode.NOT_FOUND, "durability is off: there is nothing to resume")
        if self.resume_limiter is not None:
            self.resume_limiter.take(requester)
        tokenizer = self.fleet[self.fleet.route("")].tokenizer if len(self.fleet) else None
        return await self.durability.resume(
            resume_id, after, sink, requester, operator=operator, default_tokenizer=tokenizer
        )

    async def follow(self, resume_id: str, after: int, requester: str) -> ResumedStream:
        """The replies of ``resume_id`` after its first ``after`` tokens, then its live ones, as an
        async iterator (``ResumedStream``, whose ``context`` is what the transport journaled).
        Raises ``AdmissionError`` from ``resume``."""
        sink = QueueSink()
        _, context = await self.resume(resume_id, after, sink, requester)
        first = sink.queue.get_nowait()
        assert isinstance(first, api.Accepted), first
        return ResumedStream(sink, first, self.default_piece, context)

    async def stream(
        self,
        gen: api.Generate,
        *,
        api_name: str,
        requester: str = UNBOUND,
        context: dict[str, Any] | None = None,
    ) -> GenerationStream:
        """Admit ``gen`` for ``requester`` (with the resume ``context``, as ``submit``) and return
        its outputs as an async iterator (``GenerationStream``). Raises ``AdmissionError`` like
        ``submit``."""
        sink = QueueSink()
        req = await self.submit(gen, sink, api_name=api_name, requester=requester, context=context)
        # Accepted is the first reply; with durability it waits for its group commit. A caller
        # cancelled meanwhile (its client went away) holds no stream that could cancel the request
        # later: cancel it here, or it runs to its end for nobody.
        try:
            first = await sink.queue.get()
        except BaseException:
            self.cancel(req, message="client disconnected before Accepted")
            sink.close()
            raise
        if isinstance(first, api.Accepted):
            return GenerationStream(self, req, sink, first)
        stream = GenerationStream(self, req, sink, None)
        stream.push_front(first)  # an Error before Accepted (the daemon stopped meanwhile)
        return stream

    # --- health ----------------------------------------------------------------------------------

    def health(self) -> tuple[HealthStatus, str]:
        """``(status, reason)``: status ``ok`` while every worker serves and nothing stalls,
        ``degraded`` when some serve and a worker gave up or stalled (the reason names it and
        why), ``starting`` while no worker serves yet, ``draining`` / ``stopping`` / ``stopped``
        from the daemon's state. The reason is "" for ``ok``."""
        state = self._state()
        problems = self.fleet.problems()
        ready = self.fleet.ready_count
        if state != DaemonState.READY:
            return HealthStatus(state), state
        if problems:
            return HealthStatus.DEGRADED, "; ".join(problems)
        if ready == len(self.fleet):
            return HealthStatus.OK, ""
        if ready == 0:
            return HealthStatus.STARTING, "no worker has finished starting yet"
        return HealthStatus.DEGRADED, f"workers {ready}/{len(self.fleet)} ready"


def _structured_param(gen: api.Generate) -> str:
    """The ``Generate`` field that asked for structured output (``response_format``, ``grammar`` or
    ``regex``), named by a refusal of it."""
    if gen.response_format is not None:
        return "response_format"
    return "grammar" if gen.grammar is not None else "regex"
