"""The Python client library for the basertd Unix socket (DESIGN.md "Client API").

``Client`` is blocking (one request at a time per connection); ``AsyncClient`` multiplexes any
number of generations over one connection. Both raise ``ClientError`` (with an ``ErrorCode``) for
a refused or failed request and ``ConnectionLost`` when the daemon goes away::

    from basertd.client import Client
    with Client() as c:                      # $BASERTD_SOCKET or the default socket
        for delta in c.stream("Once upon a time", max_tokens=32, temperature=0):
            print(delta.text, end="", flush=True)
"""

from basertd.client._common import ClientError, Completion, ConnectionLost
from basertd.client.aio import AsyncClient, AsyncStream
from basertd.client.sync import Client, Stream
from basertd.schema.client import ErrorCode

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Client",
    "ClientError",
    "Completion",
    "ConnectionLost",
    "ErrorCode",
    "Stream",
]
