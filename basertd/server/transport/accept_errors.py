"""Failed accepts logged once per burst, not once per attempt.

When the process runs out of descriptors (EMFILE / ENFILE) or kernel memory, asyncio's accept loop
reports each failed ``accept()`` through the loop's exception handler — up to a listener's backlog
of times per readiness, every second, each with a traceback — for the native socket and every HTTP
listener alike. ``install(loop)`` puts ``AcceptErrorLog`` in front of the loop's exception handler:
the first failure of a burst is one ``accept_failed`` warning (errno, message, what to do), the
ones that follow within ``QUIET_S`` of each other are only counted, and the end of the burst is one
``accept_recovered`` line with the count. asyncio itself keeps retrying the listener once a second;
every other exception context goes to the handler that was there before (or asyncio's default).
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import structlog

log = structlog.get_logger("basertd.api")

QUIET_S = 5.0
"""Seconds without a failed accept that end a burst."""
ACCEPT_MESSAGE = "socket.accept() out of system resource"
"""The context message asyncio's selector loop reports a failed accept with."""


class AcceptErrorLog:
    """The loop exception handler of the module docstring; ``previous``: the handler it wraps
    (None: asyncio's default). ``failures``: failed accepts of the burst in progress."""

    def __init__(self, previous: Any = None) -> None:
        self.previous = previous
        self.failures = 0
        self.last = 0.0
        self._check: asyncio.TimerHandle | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_MESSAGE:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.last = loop.time()
        self.failures += 1
        if self.failures == 1:
            exc = context.get("exception")
            code = getattr(exc, "errno", None)
            log.warning(
                "accept_failed",
                errno=errno.errorcode.get(code, code) if code is not None else None,
                error=str(exc),
                hint="out of descriptors or memory: connections wait in the listen backlog; lower "
                "[limits] / [http] max_connections or raise LimitNOFILE",
            )
            self._check = loop.call_later(QUIET_S, self._end_of_burst, loop)

    def _end_of_burst(self, loop: asyncio.AbstractEventLoop) -> None:
        quiet_for = loop.time() - self.last
        if quiet_for < QUIET_S:
            self._check = loop.call_later(QUIET_S - quiet_for, self._end_of_burst, loop)
            return
        log.info("accept_recovered", failed_accepts=self.failures)
        self.failures = 0
        self._check = None


def install(loop: asyncio.AbstractEventLoop) -> AcceptErrorLog:
    """Put an ``AcceptErrorLog`` in front of ``loop``'s exception handler (once; idempotent)."""
    current = loop.get_exception_handler()
    if isinstance(current, AcceptErrorLog):
        return current
    handler = AcceptErrorLog(current)
    loop.set_exception_handler(handler)
    return handler
