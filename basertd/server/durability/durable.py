"""Durable acceptance: the write-ahead log between the scheduler and the client (DESIGN.md "Front
ends, durability, ...": "Crash = preemption; acceptance is durable").

``Durability`` owns the daemon's ``Journal`` (``basertd.server.durability.wal``) on the event loop side:

- **Journaling sink.** Every accepted request's replies pass through a ``DurableSink`` on their
  way to the client: ``Accepted`` journals the request record (under a daemon-unique
  ``resume_id``), ``Tokens`` journal their ids, ``Done`` / ``Error`` journal the end. Each reply is
  then *held* until the group commit that holds its record has returned, and only then passed on
  (in order) to the transport's sink and to every ``Resume`` subscriber. So nothing a client sees
  can be lost by a crash of the process.
- **Group commit.** One committer task commits whenever replies are held; what is buffered while
  a commit runs goes out in the next one. With one tick in flight per worker that is one commit
  per tick (more with partial emits, fewer when the workers' ticks coincide), and a tick's tokens
  are delivered right after their commit returns. By ``[durability] mode``
  (``basertd.server.config_sections.DurabilityConfig``):

  - ``"write"`` (the default): the commit is one ``os.write`` on the event loop (an append to the
    page cache, microseconds: no thread hop), then the replies go out. The records are in the
    kernel, so a SIGKILL or crash of the coordinator loses none of them. A second task, the
    syncer, runs ``journal.sync()`` (one fdatasync) in a thread at most every
    ``sync_interval_ms``, one at a time, covering every commit written before it; a power loss or
    kernel crash may lose the tokens delivered in the last ``sync_interval_ms`` or so. A commit
    whose rotation is due runs in a thread instead (a rotation blocks for its fsyncs).
  - ``"tick"``: the commit is one write + one fdatasync in a thread (``asyncio.to_thread``: the
    fsync never stalls the event loop, so the schedulers plan and tick on while it runs); what a
    client saw survives a power loss too.
- **Restart.** ``unfinished()`` lists every unfinished request of the recovered log and
  ``restore`` attaches each, as the restart admission (``basertd.server.frontend.restart``) makes
  it, to its journal entry with its durable tokens already delivered (``GenerationRequest.restore``):
  it is admitted with ``decode_replay`` = their count and ``rng_counter_base = (seed << 32) +
  count`` (ABI rules 71-73), so generation continues exactly where it was (exact on the reference
  engine; on llama.cpp a near-tie may flip after the re-prefill, as for a preemption). Its replies
  go to whoever ``Resume``\\ s it.
- **Resume** (``resume``): the durable tokens after ``after``, then the live stream, then Done or
  Error; a finished request is answered from the log's results for ``result_ttl_s``.
- **Hand-over.** An ``Error(SHUTTING_DOWN)`` (a stop, or a drain that timed out) is NOT journaled
  as an end: the request stays unfinished in the log and the next start runs it on.

With ``[durability] mode = "off"`` (a ``NullJournal``) nothing is wrapped, held or journaled, and
Accepted carries no ``resume_id``. Requests with ``stream = false`` journal their tokens only with
their end; after a restart they are generated again from their seed (the same tokens on the
reference engine).

Errors: ``Durability.resume`` raises ``AdmissionError`` (NOT_FOUND, INVALID_REQUEST). A failed
commit or sync (``JournalFailed``: a write, an fdatasync, a rotation), or any other exception of
the committer or the syncer, stops acknowledging: held replies are dropped and nothing is released
any more (a failed fdatasync is never retried), ``failure`` says why and ``on_failed`` is called
(the daemon stops with exit status ``EXIT_JOURNAL_FAILED``, so systemd's ``Restart=on-failure``
restarts it). Neither task ever ends silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.server.config_sections import DurabilityConfig
from basertd.server.durability.replay import ReplayCache, ReplayText, replay_text
from basertd.server.durability.wal import Journal, JournalFailed
from basertd.server.durability.wal_format import RequestRecord, WalError
from basertd.server.request.grammar import GrammarSpec
from basertd.server.request.record import AdmissionError, GenerationRequest, RequestSink
from basertd.server.request.requester import UNBOUND, may_follow
from basertd.server.tasks import cancel_and_wait

if TYPE_CHECKING:
    from basertd.server.observe.metrics import Metrics
    from basertd.server.request.tokenizer import Tokenizer

log = structlog.get_logger("basertd.durable")

EXIT_JOURNAL_FAILED = 74
"""The daemon's exit status after the write-ahead log failed while serving (a write, an fsync, a
rotation, or the committer itself): ``EX_IOERR`` of sysexits.h, distinct from 1 (cannot start)
and 2 (bad configuration)."""
DEFAULT_SYNC_INTERVAL_S = DurabilityConfig().sync_interval_ms / 1000
"""Mode "write": least seconds between the starts of two background fdatasyncs, the
``[durability] sync_interval_ms`` default (one place: ``DurabilityConfig``)."""
MAINTAIN_EVERY_S = 60.0
"""Seconds between two checks for ``Journal.maintain``, which runs when no commit happened for as
long (expired results leave the disk on an idle daemon too): at most twice this after the last
commit. A timer, not a timeout on the committer's wait: ``asyncio.wait_for`` per wake-up cost the
commit path about 27 us."""
MAX_REMEMBERED = 65536
"""Requests of this run whose tokenizer and stop strings are remembered for replaying their text."""
CLIENT_ID = "client_id"
"""Key of ``RequestRecord.extra`` holding the client's own request id."""
GRAMMAR = "grammar"
"""``extra`` key of a constrained request's grammar spec, ``[kind, text]``: a request re-run after a
restart stays constrained (``basertd.server.request.grammar.GrammarSpec``)."""
LOGIT_BIAS = "logit_bias"
"""``extra`` key of a request's logit bias, ``[[token id, bias], ...]``: a request re-run after a
restart samples with the same bias."""
REQUESTER = "requester"
"""``RequestRecord.client`` key of the requester the request is bound to
(``basertd.server.request.requester``)."""
API = "api"
"""``RequestRecord.client`` key of the API the request came through (native, openai, anthropic,
ollama, ...): a request re-run after a restart keeps it in its access-log line and trace."""
CONTEXT = "context"
"""``RequestRecord.client`` key of what the transport needs to shape a resumed stream (an HTTP
dialect's response id, model, options); given back by ``resume``."""
INLINE_REPLAY_TOKENS = 2048
"""Tokens of replay text fed on the event loop; a longer catch-up runs in a thread."""
RESUME_TRIES = 4
"""Times ``resume`` looks again when the request moved on while its text was prepared."""

__all__ = ["Durability", "DurableSink", "replay_text"]


def new_resume_id() -> str:
    """A daemon-unique journal id (random: unique across restarts on the same log too)."""
    return "r-" + uuid.uuid4().hex


class DurableSink:
    """The ``RequestSink`` of one journaled request (module docstring): journals each reply, holds
    it until its commit returned, then passes it to ``inner`` and the ``Resume`` subscribers.
    ``delivered``: the ids released so far (what any client can have)."""

    def __init__(self, durability: Durability, inner: RequestSink, resume_id: str) -> None:
        self.durability = durability
        self.inner = inner
        self.resume_id = resume_id
        self.request: GenerationRequest | None = None
        self.record: RequestRecord | None = None
        self.delivered: list[int] = []
        self.subscribers: list[RequestSink] = []
        self._journaled = 0
        self._ended = False

    @property
    def closed(self) -> bool:
        """True once the original client went away (a request re-run after a restart has none and
        is never closed: it runs to its end for a later Resume)."""
        return self.inner.closed

    def send(self, msg: object) -> None:
        """Journal ``msg`` and hold it for the next commit. Never raises."""
        journal = self.durability.journal
        rid = self.resume_id
        try:
            if isinstance(msg, api.Tokens) and msg.ids:
                journal.tokens(rid, self._journaled, list(msg.ids))
                self._journaled += len(msg.ids)
            elif isinstance(msg, api.Done) and not self._ended:
                self._ended = True
                journal.finished(rid, msg.finish_reason, usage=msg.usage, timings=msg.timings)
            elif isinstance(msg, api.Error) and not self._ended and msg.code is not ErrorCode.SHUTTING_DOWN:
                self._ended = True
                req = self.request
                journal.finished(
                    rid,
                    "cancelled" if msg.code is ErrorCode.CANCELLED else "error",
                    usage=req.usage() if req is not None else None,
                    timings=req.timings() if req is not None else None,
                    error_code=str(msg.code),
                    error_message=msg.message,
                )
        except WalError as exc:  # a reply the journal cannot take: it still reaches the client
            log.error("journal_refused", resume_id=rid, kind=type(msg).__name__, error=str(exc))
        self.durability.hold(self, msg)

    def release(self, msg: object) -> None:
        """``msg`` is durable: pass it on (to subscribers under the id they resumed with)."""
        if isinstance(msg, api.Tokens):
            self.delivered.extend(msg.ids)
        self.inner.send(msg)
        if self.subscribers:
            tagged = msgspec.structs.replace(msg, request_id=self.resume_id)  # type: ignore[type-var]
            self.subscribers = [s for s in self.subscribers if not s.closed]
            for sub in self.subscribers:
                sub.send(tagged)
        if isinstance(msg, (api.Done, api.Error)):
            self.durability.live.pop(self.resume_id, None)
            self.subscribers = []
            if isinstance(msg, api.Error) and msg.code is ErrorCode.SHUTTING_DOWN:
                self.durability.handed_over.add(self.resume_id)


def _extra(gen: api.Generate, req: GenerationRequest) -> dict[str, Any]:
    """The front-end fields a request record keeps: the client's request id and the grammar."""
    extra: dict[str, Any] = {CLIENT_ID: gen.request_id}
    if req.grammar is not None:
        extra[GRAMMAR] = [req.grammar.kind, req.grammar.text]
    if gen.logit_bias:
        extra[LOGIT_BIAS] = [[int(t), float(b)] for t, b in gen.logit_bias.items()]
    return extra


class Durability:
    """The journal on the event loop (module docstring). ``enabled`` is False for mode "off".
    ``live``: resume id -> sink of every journaled request not yet ended (as clients see it).
    ``sync_interval_s``: mode "write"'s least seconds between two background fdatasyncs."""

    def __init__(
        self,
        journal: Journal,
        metrics: Metrics,
        *,
        on_failed: Callable[[], None] | None = None,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
    ) -> None:
        self.journal = journal
        self.metrics = metrics
        self.enabled = journal.mode != "off"
        self.inline = journal.mode == "write"
        """Commits run on the event loop (mode "write"), a background task syncs."""
        self.sync_interval_s = sync_interval_s
        self.on_failed = on_failed
        self.live: dict[str, DurableSink] = {}
        self.handed_over: set[str] = set()
        self._tokenizers: dict[str, tuple[Tokenizer, list[str]]] = {}
        self.replays = ReplayCache()
        self._held: list[tuple[DurableSink, object]] = []
        self._kick = asyncio.Event()
        self._settled = asyncio.Event()
        self._settled.set()
        self._task: asyncio.Task | None = None
        self._maintain_timer: asyncio.TimerHandle | None = None
        self._maintain_due = False
        self._last_commit = time.monotonic()
        self._written = asyncio.Event()  # mode "write": a commit wrote what no sync covers yet
        self._syncer: asyncio.Task | None = None
        self._failed = False
        self._closing = False
        self.failure: str | None = None
        """Why the journal stopped acknowledging (None while it works)."""
        self.commits = 0
        self.syncs = 0

    # --- the committer ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the committer task, and in mode "write" the syncer (on the running loop)."""
        if self.enabled and self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name="wal-commit")
            self._task.add_done_callback(self._ended)
            self._maintain_timer = loop.call_later(MAINTAIN_EVERY_S, self._maintain_check)
            if self.inline:
                self._syncer = loop.create_task(self._sync_loop(), name="wal-sync")
                self._syncer.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """The committer or the syncer ended: unless the daemon closes it, that is a failure
        (never silent)."""
        if self._closing or self._failed:
            return
        exc = None if task.cancelled() else task.exception()
        self._fail(exc if exc is not None else RuntimeError(f"the task {task.get_name()} ended"))

    def hold(self, sink: DurableSink, msg: object) -> None:
        """Hold ``msg`` (its record is buffered in the journal) until the next commit returns."""
        if self._failed:
            return
        self._held.append((sink, msg))
        self._settled.clear()
        self._kick.set()

    def _maintain_check(self) -> None:
        """Every ``MAINTAIN_EVERY_S``: wake the committer to see whether maintenance is due."""
        if self._closing or self._failed:
            return
        self._maintain_due = True
        self._kick.set()
        self._maintain_timer = asyncio.get_running_loop().call_later(MAINTAIN_EVERY_S, self._maintain_check)

    async def _run(self) -> None:
        journal = self.journal
        while not self._failed:
            await self._kick.wait()
            self._kick.clear()
            if self._maintain_due:
                self._maintain_due = False
                if time.monotonic() - self._last_commit >= MAINTAIN_EVERY_S:
                    try:
                        await asyncio.to_thread(journal.maintain)
                    except Exception as exc:  # any failure of the log stops acknowledging
                        self._fail(exc)
                        return
            batch, self._held = self._held, []
            if not batch:
                self._settled.set()
                continue
            try:
                # every record of ``batch`` was buffered before this point: this commit holds it
                if self.inline and not journal.rotation_due():
                    journal.commit(rotate=False)  # one os.write, on the loop
                    self._written.set()
                else:  # mode "tick" (the fsync), or a rotation: off the loop
                    await asyncio.to_thread(journal.commit)
            except Exception as exc:  # JournalFailed or a bug: never a silent end
                self._fail(exc)
                return
            if self._failed:  # the syncer failed while this commit ran: release nothing
                return
            self.commits += 1
            self._last_commit = time.monotonic()
            for sink, msg in batch:
                try:
                    sink.release(msg)
                except Exception as exc:  # one broken transport must not hold up the others
                    log.error("release_failed", resume_id=sink.resume_id, error=repr(exc))
            if not self._held:
                self._settled.set()

    async def _sync_loop(self) -> None:
        """Mode "write": after a commit wrote, wait until ``sync_interval_s`` has passed since the
        last fdatasync began, then one ``journal.sync()`` in a thread, covering every commit
        written before it (the ones written meanwhile wait for the next)."""
        loop = asyncio.get_running_loop()
        last = -self.sync_interval_s
        while not self._failed:
            await self._written.wait()
            delay = last + self.sync_interval_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._written.clear()
            last = loop.time()
            try:
                if await asyncio.to_thread(self.journal.sync) is not None:
                    self.syncs += 1
            except Exception as exc:  # JournalFailed (a failed fdatasync: never retried) or a bug
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        self._failed = True
        self.failure = f"{type(exc).__name__}: {exc}"
        self._held.clear()
        self._settled.set()
        log.error(
            "durability_failed",
            error=self.failure,
            exit_status=EXIT_JOURNAL_FAILED,
            note="no reply is acknowledged any more; stopping",
            exc_info=None if isinstance(exc, JournalFailed) else exc,  # a bug: its traceback
        )
        if self.on_failed is not None:
            self.on_failed()

    async def flush(self) -> None:
        """Wait until every held reply was committed and released."""
        if self._task is None:
            return
        while not self._settled.is_set() and not self._task.done():
            self._kick.set()
            settled = asyncio.ensure_future(self._settled.wait())
            try:  # the first of the two: the committer runs on after the replies are out
                await asyncio.wait({settled, self._task}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                settled.cancel()

    async def close(self) -> None:
        """Flush, stop the committer and close the journal (commits what is buffered, releases the
        state directory's lock). Idempotent; never raises."""
        self._closing = True
        if self._maintain_timer is not None:
            self._maintain_timer.cancel()
        with contextlib.suppress(Exception):
            await self.flush()
        tasks = [t for t in (self._task, self._syncer) if t is not None]
        if tasks:
            await cancel_and_wait(tasks)
            self._task = self._syncer = None
        try:
            self.journal.close()  # the last commit, and in mode "write" the last fdatasync
        except WalError as exc:
            log.error("journal_close_failed", error=str(exc))

    # --- admission -------------------------------------------------------------------------------

    def wrap(
        self,
        gen: api.Generate,
        prompt: list[int],
        req: GenerationRequest,
        inner: RequestSink,
        *,
        requester: str = UNBOUND,
        context: dict[str, Any] | None = None,
        api_name: str = "native",
    ) -> api.Accepted:
        """Journal the acceptance of ``gen`` (tokenized to ``prompt``), bound to ``requester``
        with the transport's resume ``context`` and the ``api_name`` it came through, and put
        ``req``'s replies through a ``DurableSink`` around ``inner``; returns the Accepted to send
        through ``req.sink``. With durability off: ``req`` unchanged, Accepted without resume_id."""
        accepted = api.Accepted(request_id=gen.request_id, prompt_tokens=len(prompt), seed=req.sampler.seed)
        if not self.enabled:
            return accepted
        rid = new_resume_id()
        record = msgspec.structs.replace(
            RequestRecord.from_generate(
                gen, prompt, req.sampler.seed, t_accepted=time.time(), extra=_extra(gen, req)
            ),
            request_id=rid,
            client={REQUESTER: requester, CONTEXT: dict(context or {}), API: api_name},
        )
        self.journal.accepted(record)
        self._attach(req, DurableSink(self, inner, rid), record)
        accepted.resume_id = rid
        return accepted

    def _attach(self, req: GenerationRequest, sink: DurableSink, record: RequestRecord) -> None:
        sink.request, sink.record = req, record
        req.sink = sink
        self.live[sink.resume_id] = sink
        self._tokenizers[sink.resume_id] = (req.tokenizer, list(req.stop))
        if len(self._tokenizers) > MAX_REMEMBERED:
            del self._tokenizers[next(iter(self._tokenizers))]

    # --- restart ---------------------------------------------------------------------------------

    def unfinished(self) -> list[tuple[RequestRecord, list[int], str]]:
        """``(record, durable tokens, client request id)`` of every unfinished request of the
        recovered log, in log order (empty when durability is off); counts the recovery in the
        metrics and logs a recovery that lost bytes. The restart admission
        (``basertd.server.frontend.restart``) queues each one or ends it with an error."""
        if not self.enabled:
            return []
        rep = self.journal.recovered.report
        st = self.journal.stats
        self.metrics.wal_recovery(
            st.records_recovered, st.requests_recovered, st.results_recovered, st.bytes_truncated
        )
        if rep is not None and (rep.truncated_bytes or rep.corrupt):
            log.warning(
                "wal_recovered_with_loss", truncated_bytes=rep.truncated_bytes, corrupt=len(rep.corrupt)
            )
        return [
            (u.record, list(u.tokens), str(u.record.extra.get(CLIENT_ID, u.record.request_id)))
            for u in self.journal.recovered.unfinished
        ]

    def sink_for(self, record: RequestRecord, inner: RequestSink) -> DurableSink:
        """The journaling sink of a recovered request, in front of ``inner``."""
        return DurableSink(self, inner, record.request_id)

    def restore(
        self, req: GenerationRequest, sink: DurableSink, record: RequestRecord, tokens: list[int]
    ) -> api.Done | None:
        """Attach the recovered ``req`` to its journal entry with its durable ``tokens`` already
        delivered (a stream; a non-streamed request is generated again from its seed: its tokens
        were never journaled before its end). Returns the ``Done`` when those tokens already end
        it (a stop string, max_tokens), else None (queue it)."""
        self._attach(req, sink, record)
        if not record.stream:
            sink._journaled = 0
            return None
        sink._journaled = len(tokens)
        sink.delivered = list(tokens)
        return req.restore(tokens)

    @staticmethod
    def generate_of(record: RequestRecord, client_id: str) -> api.Generate:
        """The ``Generate`` a recovered record was admitted from (its sampling fields)."""
        return api.Generate(
            request_id=client_id,
            prompt_tokens=record.prompt,
            max_tokens=record.max_tokens,
            temperature=record.temperature,
            top_p=record.top_p,
            top_k=record.top_k,
            min_p=record.min_p,
            repeat_penalty=record.repeat_penalty,
            frequency_penalty=record.frequency_penalty,
            presence_penalty=record.presence_penalty,
            seed=record.seed,
            stop=list(record.stop),
            qos=record.qos,  # type: ignore[arg-type]
            ignore_eos=record.ignore_eos,
            speculation=record.speculation,
            stream=record.stream,
            model=record.model,
            logprobs=getattr(record, "logprobs", None),
            logit_bias={int(t): float(b) for t, b in record.extra.get(LOGIT_BIAS, [])},
        )

    @staticmethod
    def grammar_of(record: RequestRecord) -> GrammarSpec | None:
        """The structured-output spec a recovered record carries, if any."""
        return GrammarSpec(*record.extra[GRAMMAR]) if GRAMMAR in record.extra else None

    # --- Resume ----------------------------------------------------------------------------------

    async def resume(
        self,
        resume_id: str,
        after: int,
        sink: RequestSink,
        requester: str,
        *,
        operator: bool = False,
        default_tokenizer: Any = None,
    ) -> tuple[bool, dict[str, Any]]:
        """Answer ``Resume {resume_id, after}`` from ``requester`` (an operator when ``operator``)
        through ``sink`` (module docstring). Returns ``(following, context)``: following is True
        when ``sink`` now follows a live request, False when the answer is complete; context is
        what the transport journaled to shape the rest. The text is computed once per request
        (``ReplayCache``), long catch-ups off the loop; the finished result is read from the
        journal off the loop. Raises ``AdmissionError`` NOT_FOUND (unknown or expired id,
        durability off), PERMISSION_DENIED (bound to another requester), SHUTTING_DOWN (handed
        over to the next start: retry there), INVALID_REQUEST (``after`` < 0 or past the tokens
        the daemon has) or QUEUE_FULL (the request kept moving while its text was prepared)."""
        if not self.enabled:
            raise AdmissionError(ErrorCode.NOT_FOUND, "durability is off: there is nothing to resume")
        if after < 0:
            raise AdmissionError(ErrorCode.INVALID_REQUEST, f"after must be >= 0, got {after}")
        for _ in range(RESUME_TRIES):
            live = self.live.get(resume_id)
            if live is not None:
                req, record = live.request, live.record
                assert req is not None and record is not None
                self._check_requester(resume_id, record.client, requester, operator)
                self._check_after(resume_id, after, len(live.delivered))
                entry = self.replays.get(resume_id, req.tokenizer, req.stop)
                await self._catch_up(resume_id, entry, live.delivered)
                if self.live.get(resume_id) is not live or entry.lock.locked():
                    continue  # it ended, or another resume feeds it: look again
                ids = list(live.delivered)
                self._feed(resume_id, entry, ids)  # what arrived meanwhile: a few tokens
                sink.send(
                    api.Accepted(
                        request_id=resume_id,
                        prompt_tokens=len(req.prompt),
                        seed=req.sampler.seed,
                        resume_id=resume_id,
                    )
                )
                if len(ids) > after:
                    sink.send(api.Tokens(request_id=resume_id, ids=ids[after:], text=entry.after(after)))
                live.subscribers.append(sink)
                return True, dict(record.client.get(CONTEXT, {}))
            if resume_id in self.handed_over:
                raise AdmissionError(
                    ErrorCode.SHUTTING_DOWN, "the daemon is stopping: resume this request after its restart"
                )
            res = await asyncio.to_thread(self.journal.result, resume_id)  # the mirror's lock, never an fsync
            if res is None:
                if resume_id in self.live:
                    continue
                raise AdmissionError(
                    ErrorCode.NOT_FOUND,
                    f"no request {resume_id!r} to resume (unknown, or its result expired)",
                )
            self._check_requester(resume_id, res.client, requester, operator)
            self._check_after(resume_id, after, len(res.tokens))
            tokenizer, stop = self._tokenizers.get(resume_id, (default_tokenizer, []))
            text = ""
            if len(res.tokens) > after and tokenizer is not None:
                entry = self.replays.get(resume_id, tokenizer, stop)
                await self._catch_up(resume_id, entry, res.tokens)
                if entry.lock.locked():
                    continue
                self._feed(resume_id, entry, res.tokens)
                entry.finish()
                text = entry.after(after)
            self._answer_finished(resume_id, res, after, text, sink)
            return False, dict(res.client.get(CONTEXT, {}))
        raise AdmissionError(ErrorCode.QUEUE_FULL, f"request {resume_id!r} is busy: resume it again")

    @staticmethod
    def _answer_finished(resume_id: str, res: Any, after: int, text: str, sink: RequestSink) -> None:
        sink.send(
            api.Accepted(request_id=resume_id, prompt_tokens=res.usage.prompt_tokens, resume_id=resume_id)
        )
        if len(res.tokens) > after:
            sink.send(api.Tokens(request_id=resume_id, ids=res.tokens[after:], text=text))
        if res.error_code:
            try:
                code = ErrorCode(res.error_code)
            except ValueError:
                code = ErrorCode.INTERNAL
            sink.send(api.Error(code=code, request_id=resume_id, message=res.error_message))
        else:
            sink.send(
                api.Done(
                    request_id=resume_id,
                    finish_reason=res.finish_reason,
                    usage=res.usage,
                    timings=res.timings,
                )
            )

    def _feed(self, resume_id: str, entry: ReplayText, ids: list[int]) -> None:
        """Feed ``entry`` the tokens of ``ids`` it lacks, on the loop."""
        added = len(ids) - entry.fed
        if added > 0:
            entry.extend(ids[entry.fed :])
            self.replays.account(resume_id, added)

    async def _catch_up(self, resume_id: str, entry: ReplayText, ids: list[int]) -> None:
        """Feed ``entry`` up to ``len(ids)`` tokens; more than ``INLINE_REPLAY_TOKENS`` missing
        are fed in a thread under the entry's lock (other resumes of it wait for the lock, then
        look again)."""
        if len(ids) - entry.fed <= INLINE_REPLAY_TOKENS and not entry.lock.locked():
            return
        async with entry.lock:  # another resume may be feeding it: wait for that one
            todo = ids[entry.fed : len(ids)]
            if len(todo) > INLINE_REPLAY_TOKENS:
                await asyncio.to_thread(entry.extend, todo)
                self.replays.account(resume_id, len(todo))

    @staticmethod
    def _check_requester(resume_id: str, client: dict[str, Any], requester: str, operator: bool) -> None:
        if not may_follow(str(client.get(REQUESTER, UNBOUND)), requester, operator=operator):
            raise AdmissionError(
                ErrorCode.PERMISSION_DENIED,
                f"request {resume_id!r} belongs to another requester: resume it as the user or with "
                "the API key that sent it",
            )

    @staticmethod
    def _check_after(resume_id: str, after: int, have: int) -> None:
        if after > have:
            raise AdmissionError(
                ErrorCode.INVALID_REQUEST,
                f"resume of {resume_id!r} after {after} tokens: the daemon has {have}",
            )
