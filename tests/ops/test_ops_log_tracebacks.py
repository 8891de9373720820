"""The daemon's JSON log keeps tracebacks (``basertd.server.daemon.configure_logging``): a line
logged with ``exc_info`` (``log.exception``, the supervisor's and the committer's failures) carries
the traceback in an ``exception`` field instead of dropping it."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import structlog
from basertd.server.daemon import configure_logging
configure_logging("info")
log = structlog.get_logger("basertd.test")
try:
    {}["missing"]
except KeyError:
    log.exception("something_failed", worker_id=3)
"""


def test_an_exception_line_carries_its_traceback():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    (line,) = [json.loads(x) for x in out.stderr.splitlines() if x.startswith("{")]
    assert line["event"] == "something_failed" and line["level"] == "error" and line["worker_id"] == 3
    assert line["exception"].startswith("Traceback (most recent call last):"), line
    assert "KeyError: 'missing'" in line["exception"], line
