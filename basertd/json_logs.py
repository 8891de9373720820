"""Records of Python's ``logging`` module as the process's JSON log lines.

A few loggers run outside structlog: libraries', and two of ours that must also work where nothing
configured structlog (the llama.cpp log sink ``basertd.llamacpp``, which passes on llama.cpp's
warnings and errors, and the write-ahead log's ``basertd.wal``). With no handler, Python prints
such a record's bare message on stderr, one plain line among the JSON ones, which stops a reader of
the log (``journalctl -u basertd -o cat | jq``). ``route_stdlib`` gives the root logger one
handler that renders every record as one JSON object in one ``write(2)``: ``event`` the message,
``logger`` its logger's name, ``level``, the record's ``EXTRA_FIELDS``, and what the caller's
processors add (the timestamp, the worker's id). The coordinator
(``basertd.server.launch.configure_logging``) and the worker (``basertd.worker.logging.configure``)
call it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import structlog
from structlog.stdlib import ProcessorFormatter

EXTRA_FIELDS = ("error", "peer")
"""Attributes a filter may set on a record (``record.error``) that become fields of its line."""


def route_stdlib(level: int, pre_chain: Sequence[Any], stream: TextIO | None = None) -> None:
    """Send every ``logging`` record at ``level`` or above to ``stream`` (default stderr) as a JSON
    line, after ``pre_chain`` (structlog processors; the record's level and logger name come
    first). Replaces the root logger's handlers; idempotent."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(
        ProcessorFormatter(
            processor=structlog.processors.JSONRenderer(),
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                structlog.stdlib.ExtraAdder(allow=EXTRA_FIELDS),
                *pre_chain,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
