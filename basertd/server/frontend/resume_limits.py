"""How often one requester may resume (``[durability] resumes_per_s``, ``resume_burst``).

A ``Resume`` (native) or a ``Last-Event-ID`` request (HTTP) re-sends a request's tokens and text:
cheap once the text is cached (``basertd.server.durability.replay``), but never free. Each
requester (``basertd.server.request.requester``) has a token bucket of ``burst`` resumes refilled
at ``rate`` per second; a resume over it is refused ``queue_full`` with the seconds to wait, so a
flood from one client cannot take the event loop from everyone else's generations. Buckets of
requesters idle long enough to be full again are forgotten (at most ``MAX_REQUESTERS`` kept).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from basertd.schema.client import ErrorCode
from basertd.server.request.record import AdmissionError

MAX_REQUESTERS = 65536
"""Buckets kept at most (the least recently used is forgotten first: it starts full again)."""


class ResumeLimiter:
    """Token buckets per requester (module docstring). ``rate``: resumes per second refilled;
    ``burst``: the bucket's size; ``clock``: monotonic seconds."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # level, at
        self.refused = 0

    def take(self, requester: str) -> None:
        """Spend one resume of ``requester``'s bucket. Raises ``AdmissionError(QUEUE_FULL)``
        naming the seconds until one is available."""
        now = self.clock()
        level, at = self._buckets.pop(requester, (float(self.burst), now))
        level = min(float(self.burst), level + (now - at) * self.rate)
        if level < 1.0:
            self._buckets[requester] = (level, now)
            self.refused += 1
            wait = (1.0 - level) / self.rate if self.rate > 0 else float("inf")
            raise AdmissionError(
                ErrorCode.QUEUE_FULL, f"too many resumes from this requester: retry in {wait:.2f} s"
            )
        self._buckets[requester] = (level - 1.0, now)
        while len(self._buckets) > MAX_REQUESTERS:
            self._buckets.popitem(last=False)
