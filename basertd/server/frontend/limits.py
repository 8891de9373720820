"""The limits table: every value a Generate may carry, checked at admission before anything is
queued (DESIGN.md "Client API"; the same table serves the native API and every HTTP dialect, which
build a ``Generate`` first).

Integers are checked against their wire type in the tick ABI (``top_k`` is a u32 in the sampling
record, the RNG seed a u64, token ids below the vocabulary size); floats must be finite and inside
their range; lists are bounded. Values that are legal but meaningless are normalised the way other
servers do it: a ``top_k`` at or above the vocabulary size disables the filter (0). A refusal is
``AdmissionError(INVALID_REQUEST)`` whose message names the field and its range, or
``EMPTY_PROMPT`` for an empty prompt, or ``CONTEXT_LENGTH_EXCEEDED`` when the prompt cannot fit
the context whatever its tokenization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from basertd.schema import client as api
from basertd.schema.abi import MAX_TOP_LOGPROBS
from basertd.schema.client import ErrorCode
from basertd.server.request.record import AdmissionError

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
MAX_REQUEST_ID_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_GRAMMAR_CHARS = 1 << 20
"""Longest ``grammar`` / ``regex`` a Generate may carry, and longest ``response_format`` once
encoded as JSON (characters): a spec is compiled at admission, so its size is bounded."""
MAX_LOGIT_BIAS = 300
"""Most ``logit_bias`` entries one Generate may carry (OpenAI's bound)."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""Inclusive range of one ``logit_bias`` value (added to the logit; -100 bans the token)."""
MAX_TOKEN_BYTES_GGUF = 256
"""Upper bound of the bytes one token of a GGUF vocabulary stands for, special-token text included
(the longest piece of the default model's 262,144-token vocabulary is 48 bytes)."""


@dataclass(frozen=True)
class Limit:
    """One numeric field: ``lo``/``hi`` inclusive bounds (None: unbounded on that side);
    ``lo_open`` makes the lower bound exclusive; ``integer`` fields are whole numbers."""

    field: str
    lo: float | None
    hi: float | None
    integer: bool = False
    lo_open: bool = False
    note: str = ""

    def describe(self) -> str:
        fmt = (lambda v: f"{int(v)}") if self.integer else (lambda v: f"{v:g}")
        lo = "-inf" if self.lo is None else fmt(self.lo)
        hi = "+inf" if self.hi is None else fmt(self.hi)
        left = "(" if self.lo_open else "["
        return f"{left}{lo}, {hi}]"

    def check(self, value: float | int | None, request_id: str) -> None:
        if value is None:
            return
        bad = not math.isfinite(value) if isinstance(value, float) else False
        if not bad and self.lo is not None:
            bad = value <= self.lo if self.lo_open else value < self.lo
        if not bad and self.hi is not None:
            bad = value > self.hi
        if bad:
            kind = "an integer" if self.integer else "a finite number"
            raise AdmissionError(
                ErrorCode.INVALID_REQUEST,
                f"request {request_id!r}: {self.field} must be {kind} in {self.describe()}, got {value!r}",
                self.field,
            )


GENERATE_LIMITS: tuple[Limit, ...] = (
    Limit("max_tokens", 1, U32_MAX, integer=True, note="then prompt + max_tokens <= context_length"),
    Limit("temperature", 0.0, 100.0, note="0 = greedy"),
    Limit("top_p", 0.0, 1.0, note="1 = off"),
    Limit("top_k", 0, U32_MAX, integer=True, note="u32; 0 = off; >= vocabulary size = off"),
    Limit("min_p", 0.0, 1.0, note="0 = off"),
    Limit("repeat_penalty", 0.0, 100.0, lo_open=True, note="1 = off"),
    Limit("frequency_penalty", -2.0, 2.0, note="0 = off"),
    Limit("presence_penalty", -2.0, 2.0, note="0 = off"),
    Limit("seed", 0, U64_MAX, integer=True, note="u64; folded to the 32-bit RNG stream key"),
    Limit("logprobs", 0, MAX_TOP_LOGPROBS, integer=True, note="None = off; top alternatives per token"),
)
"""Every numeric field of ``Generate`` with its bounds (README "Limits" lists them)."""


def _invalid(request_id: str, message: str, param: str | None = None) -> AdmissionError:
    return AdmissionError(ErrorCode.INVALID_REQUEST, f"request {request_id!r}: {message}", param)


def check_generate(gen: api.Generate) -> None:
    """Check every field of ``gen`` against ``GENERATE_LIMITS`` and the list bounds (module
    docstring). Raises ``AdmissionError``; changes nothing."""
    rid = gen.request_id
    if not rid:
        raise _invalid(rid, "request_id is empty", "request_id")
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise AdmissionError(
            ErrorCode.INVALID_REQUEST,
            f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters",
            "request_id",
        )
    if (gen.prompt is None) == (gen.prompt_tokens is None):
        raise _invalid(rid, "give exactly one of prompt and prompt_tokens", "prompt")
    if (gen.prompt is not None and gen.prompt == "") or (
        gen.prompt_tokens is not None and not gen.prompt_tokens
    ):
        raise AdmissionError(ErrorCode.EMPTY_PROMPT, f"request {rid!r}: the prompt is empty", "prompt")
    if len(gen.model) > MAX_MODEL_CHARS:
        raise _invalid(rid, f"model is longer than {MAX_MODEL_CHARS} characters", "model")
    for limit in GENERATE_LIMITS:
        limit.check(getattr(gen, limit.field), rid)
    bias = gen.logit_bias
    if len(bias) > MAX_LOGIT_BIAS:
        raise _invalid(rid, f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    lo, hi = LOGIT_BIAS_RANGE
    for token, value in bias.items():
        if token < 0 or token > U32_MAX:
            raise _invalid(rid, f"logit_bias: token id {token} is not a token id", "logit_bias")
        if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
            raise _invalid(
                rid,
                f"logit_bias[{token}] must be a finite number in [{lo:g}, {hi:g}], got {value!r}",
                "logit_bias",
            )
    if len(gen.stop) > MAX_STOPS:
        raise _invalid(rid, f"stop: at most {MAX_STOPS} stop strings, got {len(gen.stop)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in gen.stop):
        raise _invalid(rid, f"stop: each stop string is at most {MAX_STOP_CHARS} characters", "stop")
    for name in ("grammar", "regex"):
        text = getattr(gen, name)
        if text is not None and len(text) > MAX_GRAMMAR_CHARS:
            raise _invalid(rid, f"{name} is longer than {MAX_GRAMMAR_CHARS} characters", name)
    if gen.response_format is not None and len(msgspec.json.encode(gen.response_format)) > MAX_GRAMMAR_CHARS:
        message = f"response_format is longer than {MAX_GRAMMAR_CHARS} bytes as JSON"
        raise _invalid(rid, message, "response_format")


def check_logit_bias(gen: api.Generate, vocab_size: int) -> None:
    """Refuse ``logit_bias`` token ids outside ``[0, vocab_size)`` (INVALID_REQUEST); the entry
    count and values were checked by ``check_generate``."""
    bad = [t for t in gen.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise _invalid(
            gen.request_id,
            f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
            "logit_bias",
        )


def max_token_bytes(tokenizer: object) -> int:
    """Upper bound of the bytes one token of ``tokenizer`` covers in a prompt."""
    return 1 if getattr(tokenizer, "kind", "") == "bytes" else MAX_TOKEN_BYTES_GGUF


def check_prompt_bytes(
    text: str, context_length: int, tokenizer: object, *, what: str = "prompt", param: str = "prompt"
) -> None:
    """Refuse, before tokenizing, a text that cannot fit ``context_length`` tokens whatever its
    tokenization: CONTEXT_LENGTH_EXCEEDED naming ``param``. Costs O(1) for the usual case
    (characters <= bytes)."""
    bound = context_length * max_token_bytes(tokenizer)
    if len(text) > bound or (len(text) * 4 > bound and len(text.encode("utf-8", "surrogatepass")) > bound):
        raise AdmissionError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the {what} ({len(text)} characters) cannot fit the context length "
            f"({context_length} tokens of at most {max_token_bytes(tokenizer)} bytes)",
            param,
        )


def check_prompt_tokens(
    tokens: list[int],
    vocab_size: int,
    max_len: int,
    *,
    what: str = "prompt_tokens",
    param: str = "prompt_tokens",
) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` (INVALID_REQUEST) and lists longer than
    ``max_len`` (CONTEXT_LENGTH_EXCEEDED), naming ``param``."""
    if len(tokens) > max_len:
        message = f"{what} holds {len(tokens)} tokens, over the limit ({max_len})"
        raise AdmissionError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, message, param)
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        message = f"{what}: token ids outside the vocabulary (0..{vocab_size - 1})"
        raise AdmissionError(ErrorCode.INVALID_REQUEST, message, param)
