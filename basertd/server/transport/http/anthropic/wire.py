"""Anthropic's Messages API wire shapes: the request bodies of ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (msgspec structs; any unknown field is a 400 naming it), the
``message`` object, its content blocks and usage, named SSE events, and Anthropic's error object.

Responses: a ``message`` object with one ``text`` content block (or ``tool_use`` blocks),
``stop_reason`` ``end_turn`` (the end-of-generation token), ``max_tokens``, ``stop_sequence``
(with ``stop_sequence`` set to the string that matched) or ``tool_use``, ``usage`` with
``input_tokens`` (prompt tokens not served from the prefix cache), ``cache_read_input_tokens``
(served from it; the sum is the prompt length) and ``output_tokens``; with speculative decoding
also ``draft_tokens`` and ``accepted_draft_tokens`` (the native API's names: an extension,
present only when the request drafted). A failure is
``{"type": "error", "error": {"type", "message"}}`` (``ERROR_TYPES`` by status).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from basertd.schema import client as api
from basertd.server.transport.http import sse
from basertd.server.transport.http.errors import HttpError

TEXT_BLOCK = {"type": "text", "text": ""}


PATHS = ("/v1/messages", "/v1/messages/count_tokens")


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error ``type`` of each status we answer."""


def error_body(err: HttpError) -> dict[str, Any]:
    """Anthropic's error object for ``err``."""
    etype = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": err.message}}


class Block(msgspec.Struct):
    """A content block: ``text``, ``tool_use`` (assistant turns) or ``tool_result`` (user turns);
    other types' fields decode, then are refused by type."""

    type: str
    text: str | None = None
    cache_control: dict[str, Any] | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Any = None
    is_error: bool | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class CountRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/messages/count_tokens``."""

    model: str = ""
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None


class MessagesRequest(CountRequest, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/messages``."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    qos: str | None = None
    speculation: str | None = None


def usage_of(done: api.Done | None, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    """The ``usage`` object (module docstring): from ``done`` when the request ended, else from
    the counts so far."""
    cached = done.usage.cached_tokens if done is not None else 0
    prompt = done.usage.prompt_tokens if done is not None else prompt_tokens
    out = {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": done.usage.completion_tokens if done is not None else output_tokens,
    }
    if done is not None and done.usage.draft_tokens:
        out["draft_tokens"] = done.usage.draft_tokens
        out["accepted_draft_tokens"] = done.usage.accepted_draft_tokens
    return out


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_blocks(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tool_use`` content blocks of OpenAI ``tool_calls`` (ids ``toolu_`` + 24 hex digits)."""
    return [
        {
            "type": "tool_use",
            "id": "toolu_" + c["id"].removeprefix("call_"),
            "name": c["function"]["name"],
            "input": json.loads(c["function"]["arguments"]),
        }
        for c in calls
    ]


def message_object(
    mid: str,
    model: str,
    text: str,
    reason: str | None,
    stop: str | None,
    usage: dict[str, int],
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    if calls:
        content = tool_use_blocks(calls)
    else:
        content = [{"type": "text", "text": text}] if text or reason is not None else []
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": usage,
    }


def event(name: str, data: dict[str, Any], event_id: str | None = None) -> bytes:
    """One named SSE event (``event: <name>``, optional ``id:``, ``data: <json>``)."""
    return b"event: " + name.encode() + b"\n" + sse.event(data, event_id)
