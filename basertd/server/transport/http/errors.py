"""OpenAI error objects and the HTTP status a client library maps each failure to.

A failure is an ``HttpError`` (status, message, type, param, code, extra headers); its body is
``{"error": {"message", "type", "param", "code"}}``. Statuses: 400 invalid request / context
length exceeded / empty prompt, 401 missing or wrong API key, 403 refused peer, 404 unknown model
or route, 405 wrong method, 413 body too large, 429 queue full (with ``Retry-After``), 503
draining / shutting down / no worker (with ``Retry-After``), 500 internal (never a traceback).
"""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from basertd.schema.client import ErrorCode
from basertd.server.request.record import AdmissionError

RETRY_AFTER_S = 1
"""Seconds a 429 or a 503 (draining, shutting down, no worker) asks the client to wait
(``Retry-After``); a router that reads it retries, elsewhere or later."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

STATUS_OF: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.EMPTY_PROMPT: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.PROTOCOL_ERROR: 400,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
    ErrorCode.WORKER_FAILED: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.DRAINING: 503,
    ErrorCode.TIMEOUT: 504,
}
"""HTTP status of each typed front-end error."""


class HttpError(Exception):
    """A request that fails with ``status`` (module docstring). ``param`` names the offending
    request field when there is one; ``code`` is a machine-readable reason (the front end's
    ``ErrorCode`` value for refusals it raised); ``close``: the connection closes after the answer
    (``Connection: close``), for a request whose body was left unread or unreadable, which the
    connection cannot go on past."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.close = close
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> HttpError:
    """A 400 naming ``param``."""
    return HttpError(400, message, param=param, code=code)


def from_code(code: ErrorCode | str, message: str) -> HttpError:
    """The ``HttpError`` of a typed front-end error (``STATUS_OF``)."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    return HttpError(STATUS_OF.get(ec, 500), message, code=ec.value)


PARAM_NAMES: dict[str, dict[str, str]] = {
    "/v1/chat/completions": {"prompt": "messages", "prompt_tokens": "messages", "logprobs": "top_logprobs"},
    "/v1/completions": {"prompt_tokens": "prompt"},
    "/v1/responses": {
        "prompt": "input",
        "prompt_tokens": "input",
        "max_tokens": "max_output_tokens",
        "logprobs": "top_logprobs",
        "response_format": "text.format",
    },
    "/v1/embeddings": {"prompt": "input", "prompt_tokens": "input"},
}
"""Per OpenAI-shaped endpoint, the request field each ``Generate`` field it translates into came
from, where the names differ (a refusal's ``param`` names the client's field)."""


_REQUEST_PREFIX = re.compile(r"^request '[^']*': ")

PARAM_ALIASES = web.RequestKey("param_aliases", dict)
"""A request's own names for fields it sent under another of their names (chat's
``max_completion_tokens`` for ``max_tokens``), set by its handler, used by ``from_admission``."""


def from_admission(exc: AdmissionError, path: str = "", aliases: dict[str, str] | None = None) -> HttpError:
    """The ``HttpError`` of a refusal at admission of a request to ``path``; its ``param`` is the
    refused field as that endpoint names it (``PARAM_NAMES``), or as the request named it
    (``aliases``: the message then says that name too). A model not served is OpenAI's
    ``model_not_found``, as ``GET /v1/models/{model}`` answers it. The message leaves out the
    ``request '<id>': `` the front end starts a refusal with: over HTTP that id is the server's
    own, never shown to the client."""
    err = from_code(exc.code, _REQUEST_PREFIX.sub("", exc.message, count=1))
    if exc.code is ErrorCode.NOT_FOUND and exc.param == "model":
        err.code = "model_not_found"
    if exc.param is not None:
        alias = (aliases or {}).get(exc.param)
        if alias is not None:
            err.param = alias
            err.message = re.sub(rf"\b{re.escape(exc.param)}\b", alias, err.message)
        else:
            err.param = PARAM_NAMES.get(path, {}).get(exc.param, exc.param)
    return err
