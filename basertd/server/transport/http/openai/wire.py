"""OpenAI's wire shapes: the request bodies of ``/v1/completions``, ``/v1/chat/completions``,
``/tokenize`` and ``/detokenize`` (msgspec structs; an unknown field is a 400 naming it,
``body.decode``) and the response objects built from the front end's replies.

Responses: ``text_completion`` / ``chat.completion`` objects and their ``*.chunk`` stream events
(``Shape``), ``finish_reason`` "stop" (a stop string or the end-of-generation token) or "length",
``usage`` with ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache).
``logprobs`` objects (``Logprobs``): completions ``{tokens, token_logprobs, top_logprobs,
text_offset}``, chat ``{content: [{token, logprob, bytes, top_logprobs}], refusal}``; a token's
text is its own piece (its exact bytes in ``bytes``), and a streamed chunk carries the entries of
the tokens whose text it completes (a token inside an unfinished UTF-8 character waits).
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from basertd.schema import client as api
from basertd.server.transport.http import tool_calls
from basertd.server.transport.http.extensions import Extensions


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``include_usage``: a last chunk with the usage; ``continuous_usage_stats`` (vLLM's): the
    usage so far in every chunk."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class Common(Extensions, kw_only=True, forbid_unknown_fields=True):
    """The fields both generation endpoints share; the other servers' extension fields accepted at
    their no-op values come from ``Extensions`` (``extensions.check``)."""

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
    speculation: str | None = None
    qos: str | None = None
    response_format: Any = None
    grammar: str | None = None
    regex: str | None = None


class CompletionRequest(Common):
    """``POST /v1/completions``."""

    prompt: str | list[Any] | None = None
    logprobs: int | None = None
    echo: bool | None = None


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


class ChatRequest(Common):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /tokenize``: llama-server's ``content`` / ``add_special`` or vLLM's ``prompt`` /
    ``add_special_tokens``, or vLLM's chat form: ``messages`` (rendered with the chat template),
    ``add_generation_prompt`` (default true), ``continue_final_message`` (false only)."""

    messages: list[Message] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    content: str | None = None
    prompt: str | None = None
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    model: str = ""
    with_pieces: bool | None = None


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /detokenize``."""

    tokens: list[int]
    model: str = ""


def finish_reason(done: api.Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def usage_of(
    prompt: int, cached: int, completion: int, drafted: int = 0, accepted: int = 0
) -> dict[str, Any]:
    """OpenAI's usage object. With speculative decoding (``drafted`` > 0), drafts accepted and
    rejected go in ``completion_tokens_details`` under the names OpenAI uses for predicted
    outputs (``accepted_prediction_tokens``, ``rejected_prediction_tokens``)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if drafted:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return out


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

    def __init__(self, chat: bool, piece: Callable[[int], bytes], offset: int = 0) -> None:
        self.chat = chat
        self.piece = piece
        self._pending: list[api.TokenLogprob] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = offset  # characters before the first token (an echoed prompt's)

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

    def prompt_object(
        self,
        tokens: list[int],
        logprobs: list[float],
        top_ids: list[list[int]],
        top_logprobs: list[list[float]],
    ) -> dict[str, Any]:
        """The completions object of a prompt's ``tokens`` (echo): the first token's logprob and
        alternatives ``None``, token i's those of position i-1 of the scores."""
        first = api.TokenLogprob(id=tokens[0], logprob=0.0)
        rest = [
            api.TokenLogprob(
                id=t,
                logprob=lp,
                top=[api.TopLogprob(id=i, logprob=v) for i, v in zip(ids, vals, strict=True)],
            )
            for t, lp, ids, vals in zip(tokens[1:], logprobs, top_ids, top_logprobs, strict=True)
        ]
        obj = self._completion([first, *rest])
        obj["token_logprobs"][0] = None
        obj["top_logprobs"][0] = None
        return obj

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
        return {"role": "assistant", "content": tool_calls.content_of(self.tools, text) or None}, finish

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
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk of choice ``index`` (``logprobs``: the object of its tokens;
        ``calls``: complete tool calls, sent as ``delta.tool_calls`` with their indexes;
        ``usage``: the usage so far with ``include_usage``, null without
        ``continuous_usage_stats``)."""
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
            obj["usage"] = usage
        return obj

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = self._head("chat.completion.chunk" if self.chat else "text_completion")
        obj["choices"] = []
        obj["usage"] = usage
        return obj
