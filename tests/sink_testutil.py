"""A ``RequestSink`` for tests of the coordinator's request path: it keeps every message it is
sent (``sent``), in order; ``ids()`` the token ids of its Tokens, ``end()`` the Done / Error that
ended it (None while none). ``journaled_request`` a request whose replies go through a
``Durability``."""

from __future__ import annotations

from basertd.schema import client as api
from basertd.server.durability.durable import Durability
from basertd.server.request.record import GenerationRequest, sampler_for
from basertd.server.request.tokenizer import BytesTokenizer


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


def journaled_request(
    dur: Durability, sink: Sink, rid: str = "a", max_tokens: int = 10_000
) -> GenerationRequest:
    """A journaled greedy request for prompt "hi" whose replies go through ``dur`` to ``sink``;
    its Accepted sent (held until its commit returns)."""
    gen = api.Generate(request_id=rid, prompt="hi", max_tokens=max_tokens, temperature=0.0, seed=1)
    tok = BytesTokenizer()
    req = GenerationRequest(
        request_id=rid,
        prompt=tok.encode("hi", add_bos=False),
        max_tokens=max_tokens,
        sampler=sampler_for(gen),
        sink=sink,
        tokenizer=tok,
    )
    accepted = dur.wrap(gen, req.prompt, req, sink)  # req.sink is now the journaling sink
    req.sink.send(accepted)
    return req
