"""Resuming an SSE stream with ``Last-Event-ID`` (DESIGN.md "Front ends, durability, ...").

Every event of a streamed HTTP response carries ``id: <request id>:<tokens so far>``. A client that
lost the connection sends the same request again with the header ``Last-Event-ID: <id>:<n>`` (as a
browser's ``EventSource`` does) and gets the events after its first ``n`` tokens, without the
request being run again: the server maps the request id to the durable ``resume_id`` the front end
gave it (``ResumeIndex``) and follows it with ``Frontend.resume(resume_id, n, sink)``
(``basertd.server.durability.durable``): the durable tokens after ``n`` (their text as the live stream would
have sent it), then the live stream, then the end.

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

from basertd.schema import client as api
from basertd.server.frontend.admission import Frontend
from basertd.server.frontend.streams import GenerationStream, QueueSink
from basertd.server.transport.http.errors import HttpError, bad_request

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


class ResumedStream:
    """The replies of a resumed request as an async iterator (like ``GenerationStream``): Tokens
    after ``after``, then the live ones, ending after Done or Error. ``accepted`` is its Accepted.
    ``aclose()`` stops following (the request itself runs on)."""

    def __init__(self, sink: QueueSink, accepted: api.Accepted) -> None:
        self._sink = sink
        self.accepted = accepted
        self._ended = False

    def __aiter__(self) -> Any:
        return self._iterate()

    async def _iterate(self) -> Any:
        while not self._ended:
            msg = await self._sink.queue.get()
            if isinstance(msg, (api.Done, api.Error)):
                self._ended = True
            yield msg

    async def aclose(self) -> None:
        self._ended = True
        self._sink.close()

    async def __aenter__(self) -> ResumedStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def follow(frontend: Frontend, resume_id: str, after: int) -> ResumedStream:
    """Follow ``resume_id`` after ``after`` tokens. Raises ``AdmissionError`` (NOT_FOUND,
    INVALID_REQUEST, SHUTTING_DOWN) from ``Frontend.resume``."""
    sink = QueueSink()
    frontend.resume(resume_id, after, sink)
    first = sink.queue.get_nowait()
    assert isinstance(first, api.Accepted), first
    return ResumedStream(sink, first)


async def close_later(stream: GenerationStream, grace_s: float) -> None:
    """Cancel ``stream``'s request ``grace_s`` after its client went away, unless it ended or a
    resumed stream follows it (then check again each ``grace_s`` until none does)."""
    while grace_s > 0 and not stream.request.finished:
        await asyncio.sleep(grace_s)
        subscribers = getattr(stream.request.sink, "subscribers", None) or []
        if not any(not s.closed for s in subscribers):
            break
    await stream.aclose()
