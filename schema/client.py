"""The client API of the Unix socket (DESIGN.md "Client API").

Requests: Generate, Cancel, Resume, Tokenize, Models, Health. Replies: Accepted, Queued (zero or more,
while the request waits for a lane), Tokens (zero or more), then Done or Error for a Generate;
TokenizeResult, ModelsResult, HealthResult; Error for any
request. Frames are msgpack maps tagged by ``"type"`` (``{"type": "generate", ...}``), framed and
decoded by ``basertd.schema.codec.ClientCodec``; control verbs share the socket
(``basertd.schema.control``).

Every message carries ``request_id``: the client's id for a Generate (required) and for any other
request optionally, echoed in its replies so one connection can multiplex. Decoding enforces the
types; value ranges (``max_tokens`` > 0, ``logprobs`` <= 20, ...) are the coordinator's to check,
so it can answer an ``Error`` with ``ErrorCode.INVALID_REQUEST`` naming the request. Fields are
appended with defaults; unknown fields are ignored so older and newer peers interoperate.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec


class QosClass(StrEnum):
    """The QoS class of a request, highest first (DESIGN.md "Scheduling"); the definition order is
    the rank order (``basertd.server.sched.qos``). A ``StrEnum``: on the wire and in labels it is the
    plain name."""

    INTERACTIVE = "interactive"
    BATCH = "batch"
    BACKGROUND = "background"


Qos = QosClass
"""The type of a ``qos`` field (an alias of ``QosClass``)."""


class ErrorCode(StrEnum):
    """Typed error of a client or control request (the ``code`` of ``Error``)."""

    INVALID_REQUEST = "invalid_request"
    EMPTY_PROMPT = "empty_prompt"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    QUEUE_FULL = "queue_full"
    CANCELLED = "cancelled"
    WORKER_FAILED = "worker_failed"
    SHUTTING_DOWN = "shutting_down"
    DRAINING = "draining"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    INTERNAL = "internal"
    TIMEOUT = "timeout"
    PROTOCOL_ERROR = "protocol_error"
    """The connection sent a frame that does not decode (a ``FrameError``); it is closed."""


class _Msg(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of every client-socket message: a map tagged by ``"type"``."""


class _Rec(msgspec.Struct, kw_only=True):
    """Base of untagged records nested inside messages."""


# --- requests ---------------------------------------------------------------------------------


class Generate(_Msg, tag="generate"):
    """Generate tokens for ``prompt`` (text) or ``prompt_tokens`` (ids); exactly one is given.

    ``max_tokens`` caps generated tokens; prompt + max_tokens must fit the context (else
    CONTEXT_LENGTH_EXCEEDED, never a silent truncation). Sampling: ``temperature`` 0 is greedy,
    ``top_k`` 0 / ``top_p`` 1 / ``min_p`` 0 / ``repeat_penalty`` 1 / ``frequency_penalty`` 0 /
    ``presence_penalty`` 0 disable their knob; ``seed`` (None: the coordinator picks one) seeds
    the counter-based RNG. ``stop`` strings end the text; ``ignore_eos`` decodes to max_tokens.
    ``logprobs`` None: no logprobs; 0..20: each Tokens carries every generated token's natural-log
    probability and that many top alternatives (``TokenLogprob``). ``logit_bias`` maps token ids
    (in the vocabulary) to a finite bias in [-100, 100] added to the token's logit before sampling
    (at most 300 entries; -100 bans a token, +100 all but forces it). ``stream`` False sends one
    Tokens reply before Done instead of one per tick. ``model`` "" is the default model.

    Structured output (at most one of the three): ``response_format`` in OpenAI's shape
    (``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}``), ``grammar`` (a Lark grammar, llguidance's dialect) or
    ``regex``; the output then always matches it and a generation the grammar completes ends with
    finish reason "stop". A spec that does not compile is INVALID_REQUEST with the library's
    message, before anything is queued.

    ``speculation``: "auto" (speculative decoding where the worker's strategies are certified for
    the request and pay), "off", or a strategy name enabled in the ``[speculation]`` config (e.g.
    "prompt-lookup"; INVALID_REQUEST for one not enabled, or for a request with a grammar, which
    no certificate covers). Speculation never changes the output distribution: greedy requests
    keep their tokens up to the near-ties a batch's shape may flip (greedy verification), sampled
    ones their sampling distribution (the rejection rule; tick ABI §2)."""

    request_id: str
    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    qos: Qos = QosClass.INTERACTIVE
    logprobs: int | None = None
    ignore_eos: bool = False
    stream: bool = True
    model: str = ""
    response_format: dict[str, Any] | None = None
    grammar: str | None = None
    regex: str | None = None
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    speculation: str = "auto"


class Cancel(_Msg, tag="cancel"):
    """Cancel generation ``request_id`` of this connection; its lane retires in the next plan and
    the Generate ends with Error(CANCELLED). Unknown ids are ignored (the race with Done is
    benign)."""

    request_id: str


class Resume(_Msg, tag="resume_stream"):
    """Pick up generation ``request_id`` (the ``resume_id`` its Accepted gave) after a reconnect or
    a daemon restart: ``after`` is how many of its tokens the client already has. Answered with
    Accepted, then one Tokens with the durable tokens after ``after`` (if any), then the live
    Tokens, then Done or Error, all tagged ``request_id``; NOT_FOUND when the daemon keeps no such
    request (durability off, or finished more than ``result_ttl_s`` ago), INVALID_REQUEST when
    ``after`` exceeds the tokens it has."""

    request_id: str
    after: int = 0


class Tokenize(_Msg, tag="tokenize"):
    """Token ids of ``text`` with ``model``'s vocabulary (BOS/special tokens when
    ``add_special``); answered with TokenizeResult."""

    text: str
    request_id: str = ""
    add_special: bool = True
    model: str = ""


class Models(_Msg, tag="models"):
    """List the served models; answered with ModelsResult."""

    request_id: str = ""


class Health(_Msg, tag="health"):
    """Liveness and readiness; answered with HealthResult (open to every client)."""

    request_id: str = ""


# --- replies ----------------------------------------------------------------------------------


class Accepted(_Msg, tag="accepted"):
    """Generate ``request_id`` passed admission; ``prompt_tokens`` is its prompt length (tokens);
    ``seed`` the sampling seed in effect (the request's, or the one drawn for it, so a sampled
    generation can be reproduced; None from daemons that do not report it). ``resume_id`` is the
    daemon-unique id under which the request is journaled ("" with durability off): ``Resume`` with
    it continues the stream after a reconnect or a daemon restart."""

    request_id: str
    prompt_tokens: int
    seed: int | None = None
    resume_id: str = ""


class Queued(_Msg, tag="queued"):
    """Generate ``request_id`` waits in its worker's queue: ``position`` requests are ahead of it
    (the earlier ones of its class and every queued request of a higher class; aging may reorder
    them), ``qos`` its class. Sent after Accepted when the request was not admitted within about a
    second, then every few seconds while it waits, so a client sees bytes before its first token;
    a client may ignore it."""

    request_id: str
    position: int
    qos: str


class TopLogprob(_Rec):
    """One alternative: token ``id`` and its natural-log probability."""

    id: int
    logprob: float


class TokenLogprob(_Rec):
    """Natural-log probability (<= 0) of generated token ``id`` under the distribution it was
    sampled from (after logit bias and penalties, before temperature and truncation) and its
    ``top`` alternatives, most likely first (as many as the Generate's ``logprobs``, <= 20)."""

    id: int
    logprob: float
    top: list[TopLogprob] = msgspec.field(default_factory=list)


class Tokens(_Msg, tag="tokens"):
    """Newly generated token ``ids`` of ``request_id`` and the ``text`` they complete (a UTF-8
    delta: bytes of an unfinished character wait for the next Tokens). ``logprobs`` has one entry
    per id when the Generate asked for logprobs, else None."""

    request_id: str
    ids: list[int] = msgspec.field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None


class Usage(_Rec):
    """Token counts of one generation: prompt, the prompt tokens served from the prefix cache,
    and generated (completion) tokens; with speculative decoding, the tokens drafted and the
    drafts accepted (each accepted draft is a completion token that cost no decode step of its
    own)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


class Timings(_Rec):
    """Seconds queued before admission, time to first token (TTFT, from receipt), decode rate in
    tokens per second after the first token, and total seconds from receipt to Done."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_s: float = 0.0


class Done(_Msg, tag="done"):
    """Generate ``request_id`` finished: ``finish_reason`` is "stop" (a stop string, or the end
    of a grammar), "eos" (the model's end-of-generation token), or "length" (max_tokens or the
    context); usage and timings. A cancelled or failed generation ends with ``Error`` instead."""

    request_id: str
    finish_reason: str
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)


class Error(_Msg, tag="error"):
    """Request ``request_id`` failed with ``code`` and a human ``message`` (never a traceback).
    ``request_id`` is "" when the failing frame could not be read. ``param`` names the request
    field that was refused (e.g. "temperature", "max_tokens", "prompt") when one was; None
    otherwise."""

    code: ErrorCode
    request_id: str = ""
    message: str = ""
    param: str | None = None


class TokenizeResult(_Msg, tag="tokenize_result"):
    """Token ids of a Tokenize."""

    request_id: str = ""
    tokens: list[int] = msgspec.field(default_factory=list)


class ModelInfo(_Rec):
    """A served model: ``id`` (its name in requests), engine, context length and vocabulary size
    (tokens), and how many workers serve it. What its engine reports of the weights ("" / 0 when it
    does not, or no worker of it runs): ``family`` (the architecture, e.g. ``gemma3``),
    ``parameters`` (count), ``quantization`` (``Q4_K_M``), ``file_bytes`` (the model file's size)
    and ``digest`` (the engine's model id: a hex digest of the file)."""

    id: str
    engine: str = ""
    context_length: int = 0
    vocab_size: int = 0
    workers: int = 0
    family: str = ""
    parameters: int = 0
    quantization: str = ""
    file_bytes: int = 0
    digest: str = ""


class ModelsResult(_Msg, tag="models_result"):
    """Answer to Models."""

    request_id: str = ""
    models: list[ModelInfo] = msgspec.field(default_factory=list)


class HealthResult(_Msg, tag="health_result"):
    """Answer to Health: ``status`` "ok", "starting", "degraded" (some worker down or stalled),
    "draining" or "stopping"; workers handshaken / configured; the daemon's version; ``reason``
    says why the status is not "ok" (e.g. "worker 1: cannot load model ...: not a GGUF file")."""

    request_id: str = ""
    status: str = "ok"
    workers_ready: int = 0
    workers_total: int = 0
    version: str = ""
    reason: str = ""


REQUESTS: tuple[type, ...] = (Generate, Cancel, Resume, Tokenize, Models, Health)
"""Client API requests (client -> daemon)."""
REPLIES: tuple[type, ...] = (
    Accepted,
    Queued,
    Tokens,
    Done,
    Error,
    TokenizeResult,
    ModelsResult,
    HealthResult,
)
"""Client API replies (daemon -> client); Error also answers control requests."""
