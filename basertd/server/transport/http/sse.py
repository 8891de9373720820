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
