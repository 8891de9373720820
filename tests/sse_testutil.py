"""Server-sent events as the HTTP tests read them: each event's fields (``id``, ``event``,
``data``) as a dict, comment lines (``: ...``) skipped."""

from __future__ import annotations

import httpx


def sse_fields(text: str) -> list[dict[str, str]]:
    """The fields of every event in ``text`` (whole events, blank-line separated)."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(ln.split(": ", 1) for ln in block.split("\n") if ": " in ln and not ln.startswith(":"))
        if fields:
            out.append(fields)
    return out


def read_events(r: httpx.Response, n: int) -> list[dict[str, str]]:
    """Read events of the streamed response ``r`` until there are at least ``n`` (or it ends)."""
    got: list[dict[str, str]] = []
    buf = ""
    for chunk in r.iter_text():
        buf += chunk
        while "\n\n" in buf:
            block, buf = buf.split("\n\n", 1)
            got += sse_fields(block + "\n\n")
        if len(got) >= n:
            break
    return got
