"""The operator's web page at ``/`` on the HTTP listeners, and the JSON it polls (DESIGN.md "Operators").

Routes (``OpsView(source, fallback).routes()``):

- ``GET /``: the page (``static/index.html``) for a browser (``Accept`` names ``text/html``);
  any other client gets ``fallback`` (Ollama's ``GET /``, "Ollama is running"), so Ollama clients
  that probe the root keep working. Public, like ``/health``: the page holds no data.
- ``GET /ui/{name}``: the page's script and style sheet (``static/``, package data), public.
  Only the files listed in ``STATIC`` are served; anything else is 404.
- ``GET /v1/basertd/overview?history_s=N``: the live picture the page draws, the same
  ``basertd.schema.control.OverviewResult`` as ``basertctl top`` (``observe.overview``), with
  ``N`` seconds (0..``HISTORY_S``, default ``DEFAULT_HISTORY_S``) of per-second series. Behind the
  same API-key check as every API route (``auth``). A bad ``history_s`` is a 400.

The page needs no build step and reaches nothing outside the daemon: plain JavaScript, charts
drawn on canvases, the playground streaming from the daemon's own OpenAI routes
(``/v1/completions``, ``/v1/chat/completions``) with the key the operator typed (kept in the
browser's ``localStorage``; ``/#key=...`` sets it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

from basertd.schema import control
from basertd.server.observe.windows import HISTORY_S
from basertd.server.transport.http import static
from basertd.server.transport.http.body import json_response
from basertd.server.transport.http.errors import HttpError

OverviewSource = Callable[[int], control.OverviewResult]
"""The live picture with ``history_s`` seconds of series (``ControlService.overview``)."""

STATIC = {
    "index.html": "text/html",
    "opsview.js": "application/javascript",
    "opsview.css": "text/css",
}
"""The page's files (``static/``) and their content types."""
PUBLIC_PATHS = ("/", "/ui/")
"""Paths served without an API key (the page itself; its data needs the key)."""
OVERVIEW_PATH = "/v1/basertd/overview"
DEFAULT_HISTORY_S = 300


def is_public(path: str) -> bool:
    """True for the page and its static files (module docstring)."""
    return path == "/" or path.startswith("/ui/")


def _load(name: str) -> bytes:
    return resources.files(static).joinpath(name).read_bytes()


class OpsView:
    """The page's routes (module docstring) over ``source`` (the overview) and ``fallback`` (the
    handler of a non-browser ``GET /``)."""

    def __init__(
        self, source: OverviewSource, fallback: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> None:
        self.source = source
        self.fallback = fallback
        self.files = {name: _load(name) for name in STATIC}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/", self.index),
            web.get("/ui/{name}", self.static),
            web.get(OVERVIEW_PATH, self.overview),
        ]

    async def index(self, request: web.Request) -> web.StreamResponse:
        if "text/html" not in request.headers.get("Accept", ""):
            return await self.fallback(request)
        return self._file("index.html")

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise HttpError(404, f"no file {name!r} in the page", code="not_found")
        return self._file(name)

    def _file(self, name: str) -> web.Response:
        return web.Response(
            body=self.files[name],
            content_type=STATIC[name],
            charset="utf-8",
            headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
        )

    async def overview(self, request: web.Request) -> web.Response:
        raw = request.query.get("history_s", str(DEFAULT_HISTORY_S))
        try:
            history_s = int(raw)
        except ValueError:
            history_s = -1
        if not 0 <= history_s <= HISTORY_S:
            raise HttpError(
                400,
                f"history_s must be an integer within 0..{HISTORY_S}, got {raw!r}",
                code="invalid_request",
            )
        return json_response(self.source(history_s))
