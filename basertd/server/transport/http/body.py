"""Bodies of every HTTP dialect: reading a request's (an empty body is a 400, a late one a 408),
decoding it with msgspec into a dialect's wire struct (an unknown field or a wrong type is a 400
naming the field, never silently ignored), the QoS class of a request, and response ids.

Before decoding, a body is held to two bounds whatever the dialect (``check_json_bounds``): JSON
nested at most ``MAX_JSON_DEPTH`` levels (the limit of serde_json, which llguidance parses
schemas with) and numbers of at most ``MAX_NUMBER_DIGITS`` digits in a row; either breach is a 400
(``json_too_deep``, ``number_too_long``), as is anything else the decoder refuses.

Errors are ``HttpError`` (``basertd.server.transport.http.errors``); each dialect's middleware
shape renders them (OpenAI's, Anthropic's, Ollama's)."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import msgspec
import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from basertd.schema.client import QosClass
from basertd.server.transport.http.errors import HttpError, bad_request

QOS_HEADER = "X-Basertd-QoS"
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)
"""The app's ``[http] body_timeout_s`` (seconds)."""
DEFAULT_BODY_TIMEOUT_S = 60.0
QOS_NAMES = tuple(q.value for q in QosClass)
EMPTY_BODY = "the request body is empty (a JSON object is expected)"

MAX_JSON_DEPTH = 128
"""Most levels of arrays and objects a request body may nest."""
MAX_NUMBER_DIGITS = 100
"""Most digits in a row a number of a request body may have (strings excluded)."""

_json = msgspec.json.Encoder()
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))  # digits -> "0", the rest -> " "
_LONG_NUMBER = b"0" * (MAX_NUMBER_DIGITS + 1)
_NESTING = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")

_UNKNOWN = re.compile(r"unknown field `([^`]+)`(?: - at `\$([^`]*)`)?")
_AT = re.compile(r" - at `\$\.?([^`]*)`")


async def read(request: web.Request) -> bytes:
    """The body of ``request``, which must arrive within ``[http] body_timeout_s`` (the app's
    ``BODY_TIMEOUT_S``). Raises a 400 ``HttpError`` when it is empty or cannot be decoded (a
    ``Content-Encoding`` its bytes are not in), a 408 when it is late (the connection then closes,
    ``door``)."""
    timeout_s = request.config_dict.get(BODY_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout_s):
            body = await request.read()
    except TimeoutError:
        raise HttpError(
            408, f"request body incomplete after http.body_timeout_s ({timeout_s:g} s)", code="body_timeout"
        ) from None
    except web.RequestPayloadError as exc:
        cause = exc.__cause__ or exc.__context__ or exc
        reason = cause.message if isinstance(cause, BadHttpMessage) else str(cause)
        encoding = request.headers.get("Content-Encoding", "none")
        raise HttpError(
            400,
            f"the request body cannot be read as sent (Content-Encoding {encoding}): {reason}",
            param="Content-Encoding",
            code="bad_body_encoding",
            close=True,
        ) from None
    if not body:
        raise bad_request(EMPTY_BODY)
    return body


def json_depth(text: bytes) -> int:
    """Deepest nesting of arrays and objects in the JSON ``text`` (brackets inside strings do not
    count); O(len), no recursion."""
    brackets = _STRING.sub(b'""', text).translate(None, _NOT_BRACKETS).translate(_NESTING)
    if not brackets:
        return 0
    return int(np.cumsum(np.frombuffer(brackets, dtype=np.int8), dtype=np.int64).max())


def check_json_bounds(body: bytes) -> None:
    """Raise a 400 ``HttpError`` when ``body`` nests deeper than ``MAX_JSON_DEPTH`` or holds a
    number longer than ``MAX_NUMBER_DIGITS`` digits (module docstring)."""
    deep = body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
    long_digits = _LONG_NUMBER in body.translate(_DIGITS)
    if not deep and not long_digits:
        return
    if long_digits and _LONG_NUMBER in _STRING.sub(b'""', body).translate(_DIGITS):
        raise bad_request(
            f"a number in the body has more than {MAX_NUMBER_DIGITS} digits", code="number_too_long"
        )
    if deep and (depth := json_depth(body)) > MAX_JSON_DEPTH:
        raise bad_request(
            f"the body's JSON nests {depth} levels deep, more than {MAX_JSON_DEPTH}", code="json_too_deep"
        )


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode ``body`` as ``kind`` within the bounds of ``check_json_bounds``. Raises a 400
    ``HttpError`` naming the field or the bound."""
    check_json_bounds(body)
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:
        raise bad_request("the body's JSON nests too deeply to decode", code="json_too_deep") from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _UNKNOWN.search(text)
        if m:
            where = (m.group(2) or "").lstrip(".")
            field = f"{where}.{m.group(1)}" if where else m.group(1)
            raise bad_request(f"unsupported field {field!r}: this server does not serve it", field) from None
        at = _AT.search(text)
        param = at.group(1) if at else None
        raise bad_request(
            f"invalid request body: {_AT.sub('', text)}" + (f" (at {param})" if param else ""), param
        ) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None


def qos_of(qos: str | None, header: str | None) -> QosClass:
    """The QoS class: the ``X-Basertd-QoS`` header, else the body's ``qos``, else interactive.
    Raises 400 for a value that names no class."""
    for value, where in ((header, QOS_HEADER), (qos, "qos")):
        if value is not None:
            if value not in QOS_NAMES:
                raise bad_request(f"{where} must be one of {', '.join(QOS_NAMES)}, got {value!r}", "qos")
            return QosClass(value)
    return QosClass.INTERACTIVE


def new_id(prefix: str) -> str:
    """``<prefix>-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """``data`` as a msgspec-encoded JSON response."""
    return web.Response(
        body=_json.encode(data), status=status, headers=headers, content_type="application/json"
    )
