"""What the HTTP dialects need from the front end, and nothing more (docs/architecture.md
"transports"): ``FrontendPort`` is the surface every route handler under ``transport/http/`` reads;
``basertd.server.frontend.admission.Frontend`` satisfies it in the daemon, a fake satisfies it in
tests/http/test_http_dialects_fake.py (no daemon, no worker).

A *worker handle* (``route``) is an opaque int naming the worker a request for a model would go to
now; the handlers only pass it back to ``context_length``, ``model_name`` and ``template_inputs``,
and use it as the key of the per-worker chat-template cache (``templates.Templates``).

Errors: every method that routes raises ``AdmissionError`` (``basertd.server.request.record``) with
a typed ``ErrorCode`` (NOT_FOUND for an unknown model, INVALID_REQUEST / CONTEXT_LENGTH_EXCEEDED /
QUEUE_FULL / SHUTTING_DOWN / DRAINING at admission); the HTTP middleware maps them to statuses
(``errors.STATUS_OF``) and each dialect's error shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from basertd.schema import client as api
from basertd.server.frontend.embeddings import Embeddings
from basertd.server.frontend.scoring import PromptScores
from basertd.server.observe.snapshot import WorkerSnapshot
from basertd.server.request.grammar import GrammarSpec
from basertd.server.states import HealthStatus


class StreamPort(Protocol):
    """The replies of one admitted (or resumed) request as an async iterator: ``Tokens`` and
    ``Queued`` notices, ending after ``Done`` or ``Error`` (both yielded). ``aclose()`` (or leaving
    ``async with``) before the end cancels a live request; a resumed one only stops following."""

    accepted: api.Accepted | None
    """The ``Accepted`` reply (``resume_id``, ``prompt_tokens``); None when an ``Error`` came first."""

    @property
    def request_id(self) -> str:
        """The request id the stream's events are numbered under (``<id>:<tokens so far>``)."""
        ...

    @property
    def finished(self) -> bool:
        """True once the request ended (Done or Error delivered)."""
        ...

    @property
    def followed(self) -> bool:
        """True while a resumed stream (``FrontendPort.follow``) follows this request."""
        ...

    def piece(self, token_id: int) -> bytes:
        """The bytes of ``token_id`` in the vocabulary of the worker serving the request."""
        ...

    def __aiter__(self) -> AsyncIterator[Any]: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> StreamPort: ...

    async def __aexit__(self, *exc: object) -> None: ...


class ResumedPort(StreamPort, Protocol):
    """A followed stream (``FrontendPort.follow``): a ``StreamPort`` plus the ``context`` the
    dialect journaled with the request (``resume.context_of``; {} when none)."""

    context: dict[str, Any]


class TemplateInputs(Protocol):
    """What a worker's chat template is built from (``chat_template.template_source``):
    ``configured`` the worker key ``chat_template`` ("" = none), ``own`` the model's own template
    (GGUF ``tokenizer.chat_template``) or None, ``default_model`` whether the worker serves the
    default model (llama.cpp without a ``model`` path), and the texts of its BOS and EOS tokens
    ("" when unknown)."""

    @property
    def configured(self) -> str: ...

    @property
    def own(self) -> str | None: ...

    @property
    def default_model(self) -> bool: ...

    @property
    def bos_token(self) -> str: ...

    @property
    def eos_token(self) -> str: ...


class FrontendPort(Protocol):
    """The front end as the HTTP dialects see it (module docstring)."""

    async def stream(
        self,
        gen: api.Generate,
        *,
        api_name: str,
        requester: str = "",
        context: dict[str, Any] | None = None,
    ) -> StreamPort:
        """Admit ``gen`` and return its replies; ``api_name`` labels it in logs and metrics; the
        request is bound to ``requester`` (``basertd.server.request.requester``) and ``context``
        is journaled with it for a later ``follow``. Raises ``AdmissionError`` with nothing
        queued."""
        ...

    async def follow(self, resume_id: str, after: int, requester: str) -> ResumedPort:
        """The replies of the durable request ``resume_id`` after its first ``after`` tokens,
        then its live ones, for ``requester``. Raises ``AdmissionError`` (NOT_FOUND,
        PERMISSION_DENIED, INVALID_REQUEST, SHUTTING_DOWN, QUEUE_FULL: too many resumes)."""
        ...

    async def tokenize(self, model: str, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` with ``model``'s vocabulary (BOS as the worker wants it when
        ``add_special``). Raises ``AdmissionError``."""
        ...

    async def control_texts(self, model: str, texts: list[str]) -> frozenset[str]:
        """The texts of ``model``'s control tokens (``<start_of_turn>``, ...) that occur in
        ``texts``; empty when none does (or the vocabulary has none). Raises ``AdmissionError``."""
        ...

    async def tokenize_parts(
        self, model: str, parts: list[tuple[str, bool]], *, add_special: bool
    ) -> list[int]:
        """Token ids of the concatenated ``parts``, each ``(text, special)``: with ``special``
        False control-token text is plain text (``literal.encode_chat``). Raises
        ``AdmissionError``."""
        ...

    async def detokenize(self, model: str, tokens: list[int]) -> str:
        """The text of ``tokens`` (invalid UTF-8 as U+FFFD). Raises ``AdmissionError``."""
        ...

    def pieces(self, model: str, tokens: list[int]) -> list[bytes]:
        """The bytes of each of ``tokens`` in ``model``'s vocabulary (ids below its size)."""
        ...

    async def score(self, model: str, tokens: list[int], top_k: int) -> PromptScores:
        """Each prompt token's log-probability after the first, with ``top_k`` alternatives
        (``echo`` with ``logprobs``). Raises ``AdmissionError``."""
        ...

    async def embed(
        self,
        model: str,
        inputs: list[str] | list[list[int]],
        *,
        truncate: bool = False,
        dimensions: int | None = None,
        api_name: str = "native",
    ) -> Embeddings:
        """Pooled, unit-length embeddings of texts or token lists, row i of input i (``truncate``:
        an input over the context length keeps its first tokens; ``dimensions``: refused unless the
        model's; ``api_name``: the API, for the access line). Raises ``AdmissionError``
        (INVALID_REQUEST for an engine without embeddings)."""
        ...

    async def compile_spec(self, model: str, qos: str, spec: GrammarSpec) -> GrammarSpec:
        """The candidate of ``spec`` that compiles (cached for admission), after the queue caps of
        ``model``'s worker for ``qos``. Raises ``AdmissionError`` (INVALID_REQUEST, QUEUE_FULL)."""
        ...

    def route(self, model: str) -> int:
        """The worker handle a new request for ``model`` ("" = any) goes to now. Raises
        ``AdmissionError(NOT_FOUND)`` for a model no worker serves."""
        ...

    def context_length(self, worker: int) -> int:
        """The context window of ``worker``, in tokens (prompt plus generated)."""
        ...

    def model_name(self, worker: int) -> str:
        """The served model name of ``worker`` (the ``model`` field of responses)."""
        ...

    def template_inputs(self, worker: int) -> TemplateInputs:
        """What ``worker``'s chat template is built from (``TemplateInputs``)."""
        ...

    def models(self) -> list[api.ModelInfo]:
        """One entry per served model name (id, engine, context_length, vocab_size, workers)."""
        ...

    def health(self) -> tuple[HealthStatus, str]:
        """``(status, reason)`` of the daemon (reason "" when ``ok``)."""
        ...

    def workers_ready(self) -> int:
        """Workers that serve now."""
        ...

    def worker_snapshots(self) -> list[WorkerSnapshot]:
        """Every worker now, by worker handle (``WorkerSnapshot``: lanes, queues, limits); cheap,
        read on the event loop (the endpoints routers poll, ``router_api``)."""
        ...

    def metrics_exposition(self) -> str:
        """The Prometheus text exposition of the daemon's registry."""
        ...
