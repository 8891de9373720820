"""The Responses API's wire shapes: the body of ``POST /v1/responses`` and its input items (msgspec
structs; an unknown field or a wrong type is a 400 naming it, ``body.decode``), and the objects
built from the front end's replies: the ``response`` object, its output items (``message`` with
one ``output_text`` part, ``function_call``) and ``usage`` (``input_tokens``, ``output_tokens``,
``input_tokens_details.cached_tokens``: prompt tokens served from the prefix cache; with
speculative decoding ``output_tokens_details`` also has ``accepted_prediction_tokens`` and
``rejected_prediction_tokens``, the names of Chat Completions' usage).

Status: ``completed``; ``incomplete`` with ``incomplete_details.reason`` "max_output_tokens" when
the output was cut; ``failed`` with ``error {code, message}`` when the generation failed after it
was accepted. Ids: ``resp_``, ``msg_`` and ``fc_`` followed by 32 hex digits; a function call's
``call_id`` is ``call_`` and 24 hex digits (``grammar.new_call_id``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from basertd.schema import client as api


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    """``text``: ``format`` ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "name", "schema", "strict", "description"}``; ``verbosity``."""

    format: Any = None
    verbosity: str | None = None


class Reasoning(msgspec.Struct, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/responses`` (``translate`` checks the values; ``seed``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``priority``, ``qos`` and ``speculation`` are extensions). ``input``
    items are read one by one (``translate.conversation_of``)."""

    model: str = ""
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: Any = None
    qos: str | None = None
    speculation: str | None = None


# --- input items ---------------------------------------------------------------------------------


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    """An ``input_text`` / ``output_text`` content part (the only parts served)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


ITEM_TYPES: dict[str, type[msgspec.Struct]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
"""The input item types served, by their ``type`` (an item without one is a message)."""
TEXT_PART_TYPES = ("input_text", "output_text")


# --- output --------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """``<prefix>_<32 hex digits>`` (``resp``, ``msg``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant ``message`` output item with one ``output_text`` part (``[]`` while in progress
    and empty)."""
    content = [] if status == "in_progress" and not text else [text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A ``function_call`` output item of an OpenAI chat ``tool_calls`` entry ``call`` (its ``id``
    becomes ``call_id``); in progress its ``arguments`` are ""."""
    fn = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if status == "completed" else "",
    }


def usage_of(done: api.Done) -> dict[str, Any]:
    """The ``usage`` object of an ended request (module docstring)."""
    u = done.usage
    details: dict[str, int] = {"reasoning_tokens": 0}
    if u.draft_tokens:
        details["accepted_prediction_tokens"] = u.accepted_draft_tokens
        details["rejected_prediction_tokens"] = u.draft_tokens - u.accepted_draft_tokens
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": details,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


class Shape:
    """Builds one response's ``response`` objects: ``echo`` holds the request fields the object
    repeats (instructions, tools, tool_choice, text, temperature, ...)."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any]) -> None:
        self.id = response_id
        self.model = model
        self.echo = echo
        self.created_at = int(time.time())

    def object(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        *,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object in ``status`` with ``output`` items."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage if done else None,
            **self.echo,
        }
