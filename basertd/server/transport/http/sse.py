"""Server-sent events as the OpenAI streaming endpoints frame them: one ``data: <json>`` event per
chunk, each with an ``id: <request id>:<tokens so far>`` line (a resume point), ending with
``data: [DONE]``."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: Any, event_id: str | None = None) -> bytes:
    """One SSE event carrying ``data`` as JSON."""
    head = b"id: " + event_id.encode() + b"\n" if event_id else b""
    return head + b"data: " + _encode(data) + b"\n\n"


def comment(text: str) -> bytes:
    """An SSE comment line (bytes a client sees before its first token, e.g. a queue notice),
    without a blank line of its own: it joins the next event's block, where every parser ignores
    it. A blank line after it would end an empty block, which the ``openai`` SDK's decoder turns
    into an event with empty data once an ``id:`` line has been seen, and then fails to parse."""
    return b": " + text.encode() + b"\n"
