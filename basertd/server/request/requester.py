"""Who sent a request: the *requester* a request, its stream and its resume id are bound to
(DESIGN.md "Operators"; README "Who may resume what").

A requester is a short string fixed at admission from what the transport verified, never from
what the client says about itself:

- ``uid:<n>``: a Unix-socket peer, native or HTTP (the kernel's ``SO_PEERCRED`` uid), so one user
  is one requester on both doors;
- ``key:<32 hex digits>``: an HTTP client on TCP with an API key (the first 128 bits of a
  domain-separated SHA-256 of the key: the journal and the logs never hold the key itself);
- ``anonymous``: an HTTP client on a TCP listener without ``api_key_file`` (loopback only): every
  local user is this one requester, so such listeners give no isolation between local users.

The journal keeps the requester with the request (``RequestRecord.client``), so a ``Resume`` or a
``Last-Event-ID`` is answered only for the same requester, after a restart too.
"""

from __future__ import annotations

import hashlib

ANONYMOUS = "anonymous"
"""The requester of a keyless TCP listener."""
UNBOUND = ""
"""The requester of a record journaled before requesters were kept: any requester may resume it."""


def of_uid(uid: int) -> str:
    """The requester of a Unix-socket peer with kernel uid ``uid``."""
    return f"uid:{uid}"


def of_api_key(key: bytes) -> str:
    """The requester of an HTTP client that presented ``key`` (module docstring)."""
    return "key:" + hashlib.sha256(b"basertd requester\0" + key).hexdigest()[:32]


def cache_salt(requester: str) -> int:
    """The prefix-cache salt of ``requester`` under ``[cache] isolate_by_api_key``: a u64 of its
    own for an API key, 0 (the shared cache) for any other requester."""
    if not requester.startswith("key:"):
        return 0
    return (
        int.from_bytes(hashlib.sha256(b"basertd cache salt\0" + requester.encode()).digest()[:8], "little")
        or 1
    )


def may_follow(bound_to: str, requester: str, *, operator: bool = False) -> bool:
    """Whether ``requester`` (an operator when ``operator``) may read or resume a request bound to
    requester ``bound_to``."""
    return operator or bound_to in (UNBOUND, requester)
