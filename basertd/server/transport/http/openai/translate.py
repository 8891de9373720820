"""OpenAI request bodies to the front end's ``Generate`` (DESIGN.md "Client API").

A field we do not serve or a wrong type is a 400 naming the field (``body.decode``), never silently
ignored; other servers' extension fields (``skip_special_tokens``, ``best_of``, ...) are accepted at
their no-op values only (``extensions``); ``echo`` on completions is ``openai/echo.py``.
``logprobs`` (completions: 0..20 alternatives; chat: ``logprobs`` true with ``top_logprobs``
0..20) and ``logit_bias`` (token-id strings to a bias in [-100, 100], at most 300) map to the
``Generate`` fields of the same names.
Extensions: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``speculation``
(``Generate.speculation``: "auto", "off" or a strategy name; drafts accepted and rejected come back
in ``usage.completion_tokens_details``) and ``qos`` (also the header ``X-Basertd-QoS``).

Structured outputs (``basertd.server.request.grammar``): ``response_format`` ``{"type": "json_object"}``
or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, and the extensions
``grammar`` (Lark) and ``regex``, on both endpoints; an invalid one is a 400 with llguidance's
message. Chat tool calls (``basertd.server.transport.http.tool_calls``): ``tools``, ``tool_choice``,
``parallel_tool_calls``; a call comes back as ``message.tool_calls`` (streamed: one
``delta.tool_calls`` chunk per call once the call is complete) with ``finish_reason``
"tool_calls"; assistant ``tool_calls`` and ``role: tool`` messages go back into the template.
"""

from __future__ import annotations

from typing import Any

import msgspec

from basertd.schema import client as api
from basertd.schema.abi import MAX_TOP_LOGPROBS
from basertd.server.request.grammar import GrammarSpec
from basertd.server.transport.http import extensions, tool_calls
from basertd.server.transport.http.errors import bad_request
from basertd.server.transport.http.openai.wire import ChatRequest, Common, Message, usage_of

MAX_N = 16
"""Most choices one request may ask for (``n``)."""

MAX_PROMPTS = 64
"""Most prompts one completions request may batch."""

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to the rest of the context."""


def stops_of(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompts_of(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request: a string, a list of strings, a list of token ids or
    a list of token-id lists. Raises 400 (empty prompt, mixed or wrong element types)."""
    if prompt is None:
        raise bad_request("prompt is required", "prompt", code="empty_prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt", code="empty_prompt")
    if all(isinstance(p, str) for p in prompt):
        out: list[str | list[int]] = list(prompt)
    elif all(_is_id(p) for p in prompt):
        out = [list(prompt)]
    elif all(isinstance(p, list) and all(_is_id(t) for t in p) for p in prompt):
        out = [list(p) for p in prompt]
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "prompt",
        )
    if len(out) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}", "prompt")
    return out


def check_fields(req: Common) -> None:
    """400 for ``n``, ``logprobs`` / ``top_logprobs`` and ``logit_bias`` keys out of their forms
    (``logprobs_of``, ``logit_bias_of``), and for another server's extension field at a value we
    would not honour (``extensions.check``); the value ranges are the limits table's."""
    extensions.check(req, chat=isinstance(req, ChatRequest))
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {n}", "n")
    logprobs_of(req)
    logit_bias_of(req)


def logprobs_of(req: Common) -> int | None:
    """``Generate.logprobs``: None (off) or the top alternatives per token, 0..MAX_TOP_LOGPROBS.
    Completions: ``logprobs``; chat: ``top_logprobs`` (default 0) when ``logprobs`` is true.
    Raises 400 for values out of range, or chat ``top_logprobs`` without ``logprobs``."""
    if isinstance(req, ChatRequest):
        if not req.logprobs:
            if req.top_logprobs is not None:
                raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
            return None
        value, field = (0 if req.top_logprobs is None else req.top_logprobs), "top_logprobs"
    else:
        value, field = getattr(req, "logprobs", None), "logprobs"
        if value is None:
            return None
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{field} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value}", field)
    return value


def logit_bias_of(req: Common) -> dict[int, float]:
    """``logit_bias`` with integer token ids (OpenAI sends the ids as JSON object keys). Raises
    400 for a key that is not a decimal token id; ids and values are checked at admission."""
    out: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        text = key.strip()
        if not text.isdigit() or not text.isascii():
            raise bad_request(f"logit_bias keys are token ids, got {key!r}", "logit_bias")
        out[int(text)] = value
    return out


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request with ``seed`` (u64): choice 0 keeps it (so the
    first of ``n`` choices is the ``n`` = 1 answer), each other a u64 mixed from both (splitmix64's
    finalizer), so ``n`` choices with one seed differ and are reproducible."""
    if choice == 0:
        return seed
    z = (seed + choice * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def generate_of(
    req: Common,
    request_id: str,
    *,
    prompt: str | list[int],
    max_tokens: int,
    qos: str,
    stream: bool,
    tool_spec: GrammarSpec | None = None,
    choice: int = 0,
) -> api.Generate:
    """The ``Generate`` of one choice (the limits table checks the values at admission).
    Structured output: the request's ``response_format`` / ``grammar`` / ``regex`` (validated at
    admission, an invalid one is a 400), or ``tool_spec``, the grammar of its tool calls (a 400
    when the request also asks for one of those). ``choice``: the index among the prompt's ``n``
    choices; with a ``seed`` each gets its own (``choice_seed``)."""
    structured: dict[str, Any] = {
        "response_format": req.response_format,
        "grammar": req.grammar,
        "regex": req.regex,
    }
    if tool_spec is not None:
        rf = req.response_format
        if req.grammar is not None or req.regex is not None or (rf is not None and rf != {"type": "text"}):
            raise bad_request(
                "a tool call constrains the output: response_format, grammar and regex cannot be "
                "combined with tools unless tool_choice is 'none'",
                "tool_choice",
            )
        structured = {"response_format": None, "grammar": None, "regex": None}
        structured.update(tool_calls.generate_fields(tool_spec))
    seed = req.seed
    if seed is not None and seed < 0:
        if seed < -(1 << 63):
            raise bad_request(f"seed must be a signed or unsigned 64-bit integer, got {seed}", "seed")
        seed &= (1 << 64) - 1  # OpenAI clients send signed 64-bit seeds
    if seed is not None:
        seed = choice_seed(seed, choice)
    return api.Generate(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_tokens=prompt if isinstance(prompt, list) else None,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=extensions.top_k_of(req.top_k),
        min_p=req.min_p or 0.0,
        repeat_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        seed=seed,
        stop=stops_of(req.stop),
        qos=qos,  # type: ignore[arg-type]
        ignore_eos=bool(req.ignore_eos),
        speculation=req.speculation or "auto",
        stream=stream,
        model=req.model,
        logprobs=logprobs_of(req),
        logit_bias=logit_bias_of(req),
        **structured,
    )


def message_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as a chat template sees them: content a string (text parts joined with a newline).
    Raises 400 for an empty list or a part that is not text."""
    if not messages:
        raise bad_request("messages is empty", "messages", code="empty_prompt")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content[{j}]: only text parts are served, got type {part.type!r}",
                        f"messages[{i}].content[{j}].type",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    f"messages[{i}]: only assistant messages carry tool_calls", f"messages[{i}].tool_calls"
                )
            d["tool_calls"] = [msgspec.to_builtins(c) for c in m.tool_calls]
        elif m.role == "tool" and m.tool_call_id is None:
            raise bad_request(
                f"messages[{i}]: a tool message needs tool_call_id", f"messages[{i}].tool_call_id"
            )
        out.append(d)
    return out


def usage(dones: list[api.Done], n: int) -> dict[str, Any]:
    """Usage over the choices: prompt tokens counted once per prompt (every n-th choice)."""
    prompt = sum(d.usage.prompt_tokens for d in dones[::n])
    cached = sum(d.usage.cached_tokens for d in dones[::n])
    completion = sum(d.usage.completion_tokens for d in dones)
    drafted = sum(d.usage.draft_tokens for d in dones)
    accepted = sum(d.usage.accepted_draft_tokens for d in dones)
    return usage_of(prompt, cached, completion, drafted, accepted)
