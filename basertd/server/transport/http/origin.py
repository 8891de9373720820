"""Who may reach a loopback HTTP listener from a browser: the ``Host`` and ``Origin`` checks.

A loopback TCP listener is reachable by every local user and by any web page a local browser
opens: through DNS rebinding (a page of ``evil.example`` whose name then resolves to 127.0.0.1
talks to the daemon as ``Host: evil.example``) and through cross-site "simple" requests (a
``text/plain`` or form POST sent by a page of another site, which needs no CORS preflight). So, for
a request that arrived over TCP on a loopback address:

- ``Host`` (when present) must name a loopback host — ``localhost`` or a ``*.localhost`` name,
  an address in 127.0.0.0/8, ``::1`` — or one of ``[http] allowed_hosts``; any port;
- ``Origin`` (sent by browsers, never by curl or the API client libraries) must have such a host;
  a POST (any method but GET and HEAD) without ``Origin`` whose ``Sec-Fetch-Site`` says
  ``cross-site`` is refused too.

Either refusal is a 403 (``host_not_allowed`` / ``origin_not_allowed``) naming the header, before
anything runs. Unix-socket listeners (no browser reaches them) and non-loopback TCP listeners
(which require an API key, ``auth``) are not checked. Local users are not kept out by this: close
the door with a Unix listener and ``socket_mode``, or ``api_key_file`` (README).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from aiohttp import web
from yarl import URL

from basertd.server.transport.http.errors import HttpError


def host_of(value: str) -> str:
    """The host part of a ``Host`` header value (``name``, ``name:port``, ``[v6]:port``), lowered,
    without a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        host = value[1 : value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        host = value.partition(":")[0]
    else:
        host = value
    return host.rstrip(".")


def is_loopback_name(host: str) -> bool:
    """``localhost``, ``*.localhost`` (RFC 6761), or a loopback IP literal."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    return _loopback_ip(host)


def _loopback_ip(text: str) -> bool:
    """A loopback IP literal, an IPv4-mapped IPv6 one (``::ffff:127.0.0.1``) included."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def on_loopback_tcp(request: web.BaseRequest) -> bool:
    """True when ``request`` came over TCP to a loopback address of this host."""
    transport = request.transport
    if transport is None:
        return False
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    local = transport.get_extra_info("sockname")
    return isinstance(local, tuple) and bool(local) and _loopback_ip(str(local[0]))


class HostPolicy:
    """The checks of the module docstring; ``allowed_hosts``: extra host names (``[http]
    allowed_hosts``)."""

    def __init__(self, allowed_hosts: Iterable[str] = ()) -> None:
        self.allowed = frozenset(host_of(h) for h in allowed_hosts)

    def allows(self, host: str) -> bool:
        """Whether ``host`` (from ``host_of``) may be served."""
        return is_loopback_name(host) or host in self.allowed

    def check(self, request: web.BaseRequest) -> None:
        """Raise a 403 ``HttpError`` unless ``request`` passes (module docstring)."""
        if not on_loopback_tcp(request):
            return
        host = request.headers.get("Host")
        if host is not None and not self.allows(host_of(host)):
            raise HttpError(
                403,
                f"Host {host!r} is not served on this loopback listener (DNS rebinding guard); "
                "add the name to http.allowed_hosts to serve it",
                param="Host",
                code="host_not_allowed",
            )
        origin = request.headers.get("Origin")
        if origin is not None:
            try:
                origin_host = URL(origin).host or ""
            except ValueError:
                origin_host = ""
            if not self.allows(host_of(origin_host)):
                raise HttpError(
                    403,
                    f"requests from the web page of Origin {origin!r} are refused on this loopback "
                    "listener (cross-site request guard); add its host to http.allowed_hosts to allow it",
                    param="Origin",
                    code="origin_not_allowed",
                )
        elif (
            request.method not in ("GET", "HEAD")
            and request.headers.get("Sec-Fetch-Site", "") == "cross-site"
        ):
            raise HttpError(
                403,
                "a cross-site browser request without Origin is refused on this loopback listener",
                param="Origin",
                code="origin_not_allowed",
            )
