"""A ``RequestSink`` for tests of the coordinator's request path: it keeps every message it is
sent (``sent``), in order; ``ids()`` the token ids of its Tokens, ``end()`` the Done / Error that
ended it (None while none)."""

from __future__ import annotations

from basertd.schema import client as api


class Sink:
    """A request sink that keeps every message."""

    def __init__(self) -> None:
        self.sent: list = []
        self.closed = False

    def send(self, msg) -> None:
        self.sent.append(msg)

    def ids(self) -> list[int]:
        return [i for m in self.sent if isinstance(m, api.Tokens) for i in m.ids]

    def end(self):
        return self.sent[-1] if self.sent and isinstance(self.sent[-1], (api.Done, api.Error)) else None
