"""Structured, content-free JSON logs of the worker process (DESIGN.md "Operators": observability).

``configure(worker_id, level)`` sends one JSON object per line to stderr, each carrying ``event``,
``level``, ``timestamp`` (ISO 8601, UTC), ``worker_id`` and ``pid``. The coordinator inherits or
collects the worker's stderr, so the lines reach the journal next to its own.

Content-free: logs describe what happened (counts, codes, sizes, ids), never what was said. As a
guard against a careless call site, ``drop_content`` replaces the value of any key that names
content (``CONTENT_KEYS``: prompt, text, tokens, ...) with ``"<redacted>"`` before rendering.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

from basertd.json_logs import route_stdlib

CONTENT_KEYS = frozenset(
    {"prompt", "text", "tokens", "token_ids", "completion", "content", "messages", "data", "logits", "body"}
)
"""Keys whose values would carry request content; they are always redacted."""

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def drop_content(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: redact the values of ``CONTENT_KEYS`` (never log request content)."""
    for key in CONTENT_KEYS.intersection(event_dict):
        event_dict[key] = "<redacted>"
    return event_dict


def level_names() -> tuple[str, ...]:
    """The accepted ``--log-level`` names."""
    return tuple(_LEVELS)


def configure(
    worker_id: int, level: str = "info", stream: Any = None
) -> structlog.typing.FilteringBoundLogger:
    """Configure structlog for this process and return a logger bound to ``worker_id`` and the pid.

    ``level``: one of ``level_names()`` (raises KeyError otherwise). ``stream``: where the lines go
    (default ``sys.stderr``). Idempotent enough to call once per process at startup."""
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    pid = os.getpid()

    def ours(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        event_dict.update(worker_id=worker_id, pid=pid)
        return event_dict

    # llama.cpp's warnings (``basertd.llamacpp``) and other ``logging`` records: JSON lines as well
    route_stdlib(_LEVELS[level], [ours, stamp, drop_content, structlog.processors.format_exc_info], stream)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            drop_content,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=stream if stream is not None else sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger("basertd.worker").bind(worker_id=worker_id, pid=pid)
