"""Bodies of every HTTP dialect: reading a request's (an empty body is a 400), decoding it with
msgspec into a dialect's wire struct (an unknown field or a wrong type is a 400 naming the field,
never silently ignored), the QoS class of a request, and response ids.

Errors are ``HttpError`` (``basertd.server.transport.http.errors``); each dialect's middleware
shape renders them (OpenAI's, Anthropic's, Ollama's)."""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec
from aiohttp import web

from basertd.schema.client import QosClass
from basertd.server.transport.http.errors import bad_request

QOS_HEADER = "X-Basertd-QoS"
QOS_NAMES = tuple(q.value for q in QosClass)
EMPTY_BODY = "the request body is empty (a JSON object is expected)"

_json = msgspec.json.Encoder()

_UNKNOWN = re.compile(r"unknown field `([^`]+)`(?: - at `\$([^`]*)`)?")
_AT = re.compile(r" - at `\$\.?([^`]*)`")


async def read(request: web.Request) -> bytes:
    """The body of ``request``. Raises a 400 ``HttpError`` when it is empty."""
    body = await request.read()
    if not body:
        raise bad_request(EMPTY_BODY)
    return body


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode ``body`` as ``kind``. Raises a 400 ``HttpError`` naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
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
