"""OpenAI request bodies to the front end's ``Generate``, and its replies back to OpenAI's shapes.

Requests decode with msgspec into the structs below; a field we do not serve (``echo``,
``suffix``, ``best_of``, ...) or a wrong type is a 400 naming the field, never silently
ignored. ``logprobs`` (completions: 0..20 alternatives; chat: ``logprobs`` true with
``top_logprobs`` 0..20) and ``logit_bias`` (token-id strings to a bias in [-100, 100], at most 300)
map to the ``Generate`` fields of the same names. Extensions: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos`` and ``qos`` (also the header ``X-Basertd-QoS``).

Structured outputs (``basertd.server.request.grammar``): ``response_format`` ``{"type": "json_object"}``
or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, and the extensions
``grammar`` (Lark) and ``regex``, on both endpoints; an invalid one is a 400 with llguidance's
message. Chat tool calls (``basertd.server.transport.http.tool_calls``): ``tools``, ``tool_choice``,
``parallel_tool_calls``; a call comes back as ``message.tool_calls`` (streamed: one
``delta.tool_calls`` chunk per call once the call is complete) with ``finish_reason``
"tool_calls"; assistant ``tool_calls`` and ``role: tool`` messages go back into the template.

Responses: ``text_completion`` / ``chat.completion`` objects and their ``*.chunk`` stream events,
``finish_reason`` "stop" (a stop string or the end-of-generation token) or "length", ``usage``
with ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache).
``logprobs`` objects (``Logprobs``): completions ``{tokens, token_logprobs, top_logprobs,
text_offset}``, chat ``{content: [{token, logprob, bytes, top_logprobs}], refusal}``; a token's
text is its own piece (its exact bytes in ``bytes``), and a streamed chunk carries the entries of
the tokens whose text it completes (a token inside an unfinished UTF-8 character waits).
"""

from __future__ import annotations

import codecs
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from basertd.schema import client as api
from basertd.schema.abi import MAX_TOP_LOGPROBS
from basertd.schema.client import QosClass
from basertd.server.request.grammar import GrammarSpec
from basertd.server.transport.http import tool_calls
from basertd.server.transport.http.errors import bad_request

QOS_HEADER = "X-Basertd-QoS"
QOS_NAMES = tuple(q.value for q in QosClass)
MAX_N = 16
"""Most choices one request may ask for (``n``)."""
MAX_PROMPTS = 64
"""Most prompts one completions request may batch."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to the rest of the context."""


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    qos: str | None = None
    response_format: Any = None
    grammar: str | None = None
    regex: str | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[Any] | None = None
    logprobs: int | None = None


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


_UNKNOWN = re.compile(r"unknown field `([^`]+)`(?: - at `\$([^`]*)`)?")
_AT = re.compile(r" - at `\$\.?([^`]*)`")


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode ``body`` as ``kind``. Raises a 400 ``HttpError`` naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _UNKNOWN.search(text)
        if m:
            where = (m.group(2) or "").lstrip(".")
            field = f"{where}.{m.group(1)}" if where else m.group(1)
            raise bad_request(f"unsupported field {field!r}: this server does not serve it", field) from None
        at = _AT.search(text)
        param = at.group(1) if at else None
        raise bad_request(
            f"invalid request body: {_AT.sub('', text)}" + (f" (at {param})" if param else ""), param
        ) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None


def qos_of(req: _Common, header: str | None) -> QosClass:
    """The QoS class: the header, else the body's ``qos``, else interactive. 400 for others."""
    for value, where in ((header, QOS_HEADER), (req.qos, "qos")):
        if value is not None:
            if value not in QOS_NAMES:
                raise bad_request(f"{where} must be one of {', '.join(QOS_NAMES)}, got {value!r}", "qos")
            return QosClass(value)
    return QosClass.INTERACTIVE


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


def check_fields(req: _Common) -> None:
    """400 for ``n``, ``logprobs`` / ``top_logprobs`` and ``logit_bias`` keys out of their forms
    (``logprobs_of``, ``logit_bias_of``); the value ranges are the limits table's."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {n}", "n")
    logprobs_of(req)
    logit_bias_of(req)


def logprobs_of(req: _Common) -> int | None:
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


def logit_bias_of(req: _Common) -> dict[int, float]:
    """``logit_bias`` with integer token ids (OpenAI sends the ids as JSON object keys). Raises
    400 for a key that is not a decimal token id; ids and values are checked at admission."""
    out: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        text = key.strip()
        if not text.isdigit() or not text.isascii():
            raise bad_request(f"logit_bias keys are token ids, got {key!r}", "logit_bias")
        out[int(text)] = value
    return out


def generate_of(
    req: _Common,
    request_id: str,
    *,
    prompt: str | list[int],
    max_tokens: int,
    qos: str,
    stream: bool,
    tool_spec: GrammarSpec | None = None,
) -> api.Generate:
    """The ``Generate`` of one choice (the limits table checks the values at admission).
    Structured output: the request's ``response_format`` / ``grammar`` / ``regex`` (validated at
    admission, an invalid one is a 400), or ``tool_spec``, the grammar of its tool calls (a 400
    when the request also asks for one of those)."""
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
    return api.Generate(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_tokens=prompt if isinstance(prompt, list) else None,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repeat_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        seed=seed,
        stop=stops_of(req.stop),
        qos=qos,  # type: ignore[arg-type]
        ignore_eos=bool(req.ignore_eos),
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(done: api.Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def usage_of(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _completion_token(piece: bytes) -> str:
    """A completions ``tokens`` entry: the piece as text, or ``bytes:\\xNN...`` when it is not
    whole UTF-8 (OpenAI's form)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class Logprobs:
    """The ``logprobs`` objects of one choice, built from the ``TokenLogprob`` entries of its
    Tokens. ``piece(id)`` is the token's bytes (``Tokenizer.piece``). Streamed, ``add`` collects
    entries and ``take`` returns the object of those collected so far (None when none), so each
    chunk carries its own tokens; ``text_offset`` (completions) counts characters of the generated
    text before each token, across chunks."""

    def __init__(self, chat: bool, piece: Callable[[int], bytes]) -> None:
        self.chat = chat
        self.piece = piece
        self._pending: list[api.TokenLogprob] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def add(self, entries: list[api.TokenLogprob] | None) -> None:
        if entries:
            self._pending.extend(entries)

    def take(self) -> dict[str, Any] | None:
        """The object of the entries added since the last ``take``; None when there are none."""
        if not self._pending:
            return None
        entries, self._pending = self._pending, []
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[api.TokenLogprob]) -> dict[str, Any]:
        def item(tid: int, logprob: float) -> dict[str, Any]:
            b = self.piece(tid)
            return {"token": b.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(b)}

        content = []
        for e in entries:
            d = item(e.id, e.logprob)
            d["top_logprobs"] = [item(t.id, t.logprob) for t in e.top]
            content.append(d)
        return {"content": content, "refusal": None}

    def _completion(self, entries: list[api.TokenLogprob]) -> dict[str, Any]:
        tokens, offsets, tops = [], [], []
        for e in entries:
            b = self.piece(e.id)
            tokens.append(_completion_token(b))
            offsets.append(self._chars)
            self._chars += len(self._utf8.decode(b))
            top: dict[str, float] = {}
            for t in e.top:
                top.setdefault(_completion_token(self.piece(t.id)), t.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


Choice = tuple[str, str, "dict[str, Any] | None"]
"""One finished choice: (text, finish_reason, logprobs object or None)."""


class Shape:
    """Builds one endpoint's response objects (``chat`` selects chat.completion)."""

    def __init__(
        self, chat: bool, response_id: str, model: str, tools: tool_calls.ToolPlan | None = None
    ) -> None:
        self.chat = chat
        self.id = response_id
        self.model = model
        self.tools = tools
        self.created = int(time.time())

    def tool_stream(self) -> tool_calls.ToolStream | None:
        """The stream filter of one choice of a request with tools (None without)."""
        return tool_calls.ToolStream(self.tools) if self.tools is not None else None

    def message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """A chat choice's ``message`` and finish reason: the text's tool calls when it is one."""
        calls = tool_calls.parse(self.tools, text) if self.tools is not None else None
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, finish

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed response of ``(text, finish_reason, logprobs)`` choices in index order."""
        out = self._head("chat.completion" if self.chat else "text_completion")
        if self.chat:
            out["choices"] = []
            for i, (text, fr, lp) in enumerate(choices):
                message, fr = self.message(text, fr)
                out["choices"].append({"index": i, "message": message, "logprobs": lp, "finish_reason": fr})
        else:
            out["choices"] = [
                {"index": i, "text": text, "logprobs": lp, "finish_reason": fr}
                for i, (text, fr, lp) in enumerate(choices)
            ]
        out["usage"] = usage
        return out

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None = None,
        *,
        role: bool = False,
        include_usage: bool = False,
        logprobs: dict[str, Any] | None = None,
        calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk of choice ``index`` (``logprobs``: the object of its tokens;
        ``calls``: complete tool calls, sent as ``delta.tool_calls`` with their indexes)."""
        if self.chat:
            obj = self._head("chat.completion.chunk")
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            obj = self._head("text_completion")
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj["choices"] = [choice]
        if include_usage:
            obj["usage"] = None
        return obj

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = self._head("chat.completion.chunk" if self.chat else "text_completion")
        obj["choices"] = []
        obj["usage"] = usage
        return obj
