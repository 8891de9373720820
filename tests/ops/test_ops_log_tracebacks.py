"""The daemon's JSON log keeps tracebacks (``basertd.server.daemon.configure_logging``): a line
logged with ``exc_info`` (``log.exception``, the supervisor's and the committer's failures) carries
the traceback in an ``exception`` field instead of dropping it; and the lines of processes sharing
the log file never run into one another."""

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


WRITER = """
import os, sys, time
import structlog
if sys.argv[1] == "daemon":
    from basertd.server.daemon import configure_logging
    configure_logging("info")
    log = structlog.get_logger("basertd.test")
else:
    from worker.logging import configure
    log = configure(0, "info")
go = sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.001)
for i in range(4000):
    log.info("line_written", i=i, who=sys.argv[1])
"""


def test_the_daemon_and_its_worker_share_a_log_file_line_by_line(tmp_path):
    """The coordinator and its workers inherit one stderr (``daemon.log`` under the tests, the
    journal's pipe under systemd): each JSON line must reach it in one ``write(2)``, or two
    processes' lines interleave into one that no log reader parses."""
    log_path, go = tmp_path / "daemon.log", tmp_path / "go"
    with open(log_path, "ab") as log:
        procs = [
            subprocess.Popen([sys.executable, "-c", WRITER, who, str(go)], stderr=log)
            for who in ("daemon", "worker", "daemon")
        ]
        go.touch()
        for proc in procs:
            assert proc.wait(timeout=120) == 0
    lines = log_path.read_text().splitlines()
    parsed = [json.loads(x) for x in lines]  # a merged line raises JSONDecodeError
    assert len(parsed) == 3 * 4000
    assert {x["who"] for x in parsed} == {"daemon", "worker"}
