"""Who may use the HTTP API.

TCP: with ``[http] api_key_file`` set, every request but ``GET /health`` carries
``Authorization: Bearer <key>`` with one of the file's keys (one per line; blank lines and ``#``
comments ignored), compared in constant time (``hmac.compare_digest``); without a key file only
loopback listeners exist (``HttpConfig.insecure_listeners``) and every request is allowed.
Unix socket: like the native socket, the socket's mode decides who can connect, and the peer's
kernel credentials (``SO_PEERCRED``) must be readable; no API key is needed.

``check`` returns the request's *requester* (``basertd.server.request.requester``): the peer's
uid on a Unix socket, the API key's digest on TCP with keys, ``anonymous`` on a keyless TCP
listener (every local user alike). Requests, their streams and ``Last-Event-ID`` resumes are
bound to it.
"""

from __future__ import annotations

import hmac
import socket
from pathlib import Path

from aiohttp import web

from basertd.server.config import ConfigError
from basertd.server.request import requester
from basertd.server.transport.http.errors import HttpError
from basertd.server.transport.peercred import peer_credentials


class ApiKeyError(ConfigError):
    """The key file cannot be read or holds no key."""


def load_api_keys(path: str) -> list[bytes]:
    """The keys of ``path`` (module docstring). Raises ``ApiKeyError``."""
    try:
        text = Path(path).expanduser().read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyError(f"api_key_file {path}: cannot read: {exc}") from None
    keys = [line.strip().encode() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not keys:
        raise ApiKeyError(f"api_key_file {path}: holds no key")
    return keys


class Authorizer:
    """Checks one request's transport and headers (module docstring). ``keys`` empty: TCP
    requests need no key."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    def check(self, sock: socket.socket | None, authorization: str | None, *, public: bool) -> str:
        """The requester of a request that may proceed (module docstring; ``anonymous`` for a
        ``public`` path on TCP). Raises ``HttpError`` 401/403 otherwise."""
        if sock is not None and sock.family == socket.AF_UNIX:
            uid = peer_credentials(sock).uid
            if uid < 0:
                raise HttpError(403, "the peer's credentials cannot be read", code="permission_denied")
            return requester.of_uid(uid)
        if public or not self.keys:
            return requester.ANONYMOUS
        if not authorization:
            raise HttpError(401, "missing API key: send Authorization: Bearer <key>", code="invalid_api_key")
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode("utf-8", "replace")
        ok = False
        for key in self.keys:  # every key is compared: the time does not say which one matched
            ok |= hmac.compare_digest(given, key)
        if scheme.lower() != "bearer" or not ok:
            raise HttpError(401, "invalid API key", code="invalid_api_key")
        return requester.of_api_key(given)


REQUESTER = web.RequestKey("requester", str)
"""The ``web.Request`` key under which the middleware stores the request's requester."""


def requester_of(request: web.Request) -> str:
    """The requester the middleware found for ``request`` (``anonymous`` when none was set: a
    handler run without the middleware, as in the dialect tests)."""
    return request.get(REQUESTER, requester.ANONYMOUS)
