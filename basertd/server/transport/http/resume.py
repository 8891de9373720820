"""Resuming an SSE stream with ``Last-Event-ID`` (DESIGN.md "Front ends, durability, ...").

Every event of a resumable streamed HTTP response (one choice, no tools, durability on) carries
``id: <resume key>:<tokens so far>``, where the resume key is the request's durable
``resume_id`` (``basertd.server.durability.durable``), also sent at once as the response header
``X-Basertd-Resume-Key`` (so a client that has no event yet can resume with ``<key>:0``). A
client that lost the connection sends the same request again with the header
``Last-Event-ID: <key>:<n>`` (as a browser's ``EventSource`` does) and gets the events after its
first ``n`` tokens, without the request being run again: ``follow`` asks the front end
(``FrontendPort.follow``) for the durable tokens after ``n`` (their text as the live stream sent
it), then the live stream, then the end. What the dialect needs to shape the rest (its response
id, model, options: the *context*, with the endpoint ``kind``) was journaled with the request, so
this works after a restart of the daemon too (SIGTERM hand-over or crash). Streams that are not
resumable (durability off, several choices, tools) number their events ``<request id>:<n>``.

The key is bound to the requester that sent the request (``basertd.server.request.requester``:
the same API key, or the same peer uid on a Unix listener); another requester gets 403. The key
never appears in the access log (which names the request id). Resumes are rate-limited per
requester (``[durability] resumes_per_s``; 429 over it).

A disconnect normally cancels the request at once; with ``[http] resume_grace_s`` > 0 a streamed
request whose client went away keeps running that many seconds for a reconnect (then is
cancelled unless a resumed stream follows it). Errors: 400 for a malformed ``Last-Event-ID``, 404
for a key this daemon does not know (never resumable, expired, another endpoint's, or durability
off), 403 for another requester's, 400 when ``n`` is past the tokens the daemon has.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from basertd.schema.client import ErrorCode
from basertd.server.request.record import AdmissionError
from basertd.server.transport.http.auth import requester_of
from basertd.server.transport.http.errors import HttpError, bad_request
from basertd.server.transport.http.port import FrontendPort, ResumedPort, StreamPort

HEADER = "Last-Event-ID"
KEY_HEADER = "X-Basertd-Resume-Key"
"""Response header of a resumable stream: its resume key."""
KIND = "kind"
"""Context key of the endpoint that shaped the stream (a resume must come to the same one)."""


def parse(value: str) -> tuple[str, int]:
    """``(resume key, token count)`` of a ``Last-Event-ID`` value. Raises 400."""
    rid, sep, n = value.strip().rpartition(":")
    if not sep or not rid or not n.isdigit():
        message = f"{HEADER} must be '<resume key>:<token count>' (an event's id), got {value!r}"
        raise bad_request(message, HEADER)
    return rid, int(n)


def context_of(kind: str, **state: Any) -> dict[str, Any]:
    """The resume context a dialect journals with a resumable stream of endpoint ``kind``."""
    return {KIND: kind, **state}


def key_of(stream: StreamPort) -> str:
    """The resume key of an admitted stream ("" when it is not resumable: durability off)."""
    return stream.accepted.resume_id if stream.accepted is not None else ""


async def follow(frontend: FrontendPort, request: web.Request, kind: str) -> tuple[str, ResumedPort, int]:
    """``(key, stream, after)`` for the ``Last-Event-ID`` of ``request`` at endpoint ``kind``
    (module docstring). Raises ``HttpError`` 400 / 404, or ``AdmissionError`` (403, 429, ...)."""
    key, after = parse(request.headers[HEADER])
    try:
        stream = await frontend.follow(key, after, requester_of(request))
    except AdmissionError as exc:
        if exc.code is not ErrorCode.NOT_FOUND:
            raise
        stream = None
    if stream is None or stream.context.get(KIND) != kind:
        if stream is not None:
            await stream.aclose()
        raise HttpError(
            404,
            f"no stream {key!r} to resume here (unknown, expired, another endpoint's, or durability is off)",
            param=HEADER,
            code="not_found",
        )
    return key, stream, after


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
