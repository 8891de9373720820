"""Resuming an SSE stream with ``Last-Event-ID`` (DESIGN.md "Front ends, durability, ...").

Every event of a streamed HTTP response carries ``id: <request id>:<tokens so far>``. A client that
lost the connection sends the same request again with the header ``Last-Event-ID: <id>:<n>`` (as a
browser's ``EventSource`` does) and gets the events after its first ``n`` tokens, without the
request being run again: the server maps the request id to the durable ``resume_id`` the front end
gave it (``ResumeIndex``) and follows it with ``FrontendPort.follow(resume_id, n)``
(``basertd.server.durability.durable`` in the daemon): the durable tokens after ``n`` (their text
as the live stream would have sent it), then the live stream, then the end.

A disconnect normally cancels the request at once; with ``[http] resume_grace_s`` > 0 a streamed
request whose client went away keeps running that many seconds for a reconnect (then is
cancelled unless a resumed stream follows it). Errors: 400 for a malformed ``Last-Event-ID``, 404
for an id this server does not know (never streamed here, forgotten, or durability off), 400 when
``n`` is past the tokens the daemon has.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from basertd.server.transport.http.errors import HttpError, bad_request
from basertd.server.transport.http.port import StreamPort

HEADER = "Last-Event-ID"
MAX_ENTRIES = 65536
"""Streams remembered for resuming (the oldest are forgotten first)."""


@dataclass
class Entry:
    """One resumable stream: its ``resume_id``, the endpoint ``kind`` that shaped it and what that
    endpoint needs to shape the rest (``state``)."""

    resume_id: str
    kind: str
    state: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)


def parse(value: str) -> tuple[str, int]:
    """``(request id, token count)`` of a ``Last-Event-ID`` value. Raises 400."""
    rid, sep, n = value.strip().rpartition(":")
    if not sep or not rid or not n.isdigit():
        raise bad_request(f"{HEADER} must be '<request id>:<token count>', got {value!r}", HEADER)
    return rid, int(n)


class ResumeIndex:
    """Request ids of streams this server sent, mapped to their durable ``resume_id``
    (bounded: ``MAX_ENTRIES``, oldest first out)."""

    def __init__(self, limit: int = MAX_ENTRIES) -> None:
        self.limit = limit
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def remember(self, request_id: str, kind: str, state: dict[str, Any], resume_id: str = "") -> None:
        """Record stream ``request_id`` (nothing when ``resume_id`` is "": durability off)."""
        if not resume_id:
            return
        self._entries[request_id] = Entry(resume_id, kind, state)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def lookup(self, value: str, kind: str) -> tuple[str, Entry, int]:
        """``(request id, entry, after)`` of a ``Last-Event-ID`` for endpoint ``kind``. Raises 400
        (malformed) or 404 (unknown here)."""
        rid, after = parse(value)
        entry = self._entries.get(rid)
        if entry is None or entry.kind != kind:
            raise HttpError(
                404,
                f"no stream {rid!r} to resume here (unknown, forgotten, or durability is off)",
                param=HEADER,
                code="not_found",
            )
        return rid, entry, after


async def close_later(stream: StreamPort, grace_s: float) -> None:
    """Cancel ``stream``'s request ``grace_s`` after its client went away, unless it ended or a
    resumed stream follows it (then check again each ``grace_s`` until none does)."""
    while grace_s > 0 and not stream.finished:
        await asyncio.sleep(grace_s)
        if not stream.followed:
            break
    await stream.aclose()


class Releaser:
    """Closes the streams of finished or abandoned handlers; a resumable stream's request keeps
    running ``grace_s`` seconds for a reconnect (``close_later``)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._closers: set[asyncio.Future[None]] = set()

    async def release(self, streams: list[StreamPort], resumable: bool) -> None:
        for s in streams:
            if resumable and self.grace_s > 0:
                task = asyncio.ensure_future(close_later(s, self.grace_s))
                self._closers.add(task)
                task.add_done_callback(self._closers.discard)
            else:
                await s.aclose()
