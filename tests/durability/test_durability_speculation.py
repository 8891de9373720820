"""A request's ``speculation`` survives the write-ahead log (``RequestRecord.speculation``): a real
journal on a real state directory gives it back after a reopen, a record written before the field
existed reads as "auto", and the restart admission (``frontend.restart.requeue``) queues the
recovered request with it (the fleet, metrics and drainer faked: only what requeue calls)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec

from basertd.schema import client as api
from basertd.server.durability import durable
from basertd.server.durability.wal_disk import open_journal
from basertd.server.durability.wal_format import RequestRecord
from basertd.server.frontend import restart
from basertd.server.request.tokenizer import BytesTokenizer


def _record(rid: str, speculation: str) -> RequestRecord:
    gen = api.Generate(request_id=rid, prompt_tokens=[1, 2, 3], max_tokens=8, speculation=speculation)
    return RequestRecord.from_generate(gen, [1, 2, 3], 99, t_accepted=0.0, extra={durable.CLIENT_ID: rid})


def test_the_journal_keeps_speculation_across_a_reopen(tmp_path: Path) -> None:
    with open_journal(tmp_path) as j:
        for rid, mode in (("off", "off"), ("named", "prompt-lookup"), ("auto", "auto")):
            j.accepted(_record(rid, mode))
        j.commit()
    with open_journal(tmp_path) as j:
        got = {u.record.request_id: u.record for u in j.recovered.unfinished}
    assert {rid: r.speculation for rid, r in got.items()} == {
        "off": "off",
        "named": "prompt-lookup",
        "auto": "auto",
    }
    assert durable.Durability.generate_of(got["off"], "off").speculation == "off"


def test_a_record_without_the_field_reads_as_auto() -> None:
    """Records journaled before ``speculation`` existed (msgpack maps without the key)."""
    old = msgspec.to_builtins(_record("old", "off"))
    del old["speculation"]
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=RequestRecord)
    assert back.speculation == "auto"
    assert durable.Durability.generate_of(back, "old").speculation == "auto"


class OneWorker:
    """A fleet of one worker, ``member``: what ``requeue`` asks of ``Fleet``."""

    def __init__(self, member: SimpleNamespace) -> None:
        self.member = member

    def route(self, model: str) -> int:
        return 0

    def route_prefix(self, wid: int, prompt: list[int]) -> int:
        return wid

    def __getitem__(self, wid: int) -> SimpleNamespace:
        return self.member


def test_the_restart_admission_queues_the_recovered_request_with_its_speculation() -> None:
    records = [_record("off", "off"), _record("named", "prompt-lookup")]
    submitted = []
    member = SimpleNamespace(
        tokenizer=BytesTokenizer(),
        config=SimpleNamespace(context_length=256),
        scheduler=SimpleNamespace(
            core=SimpleNamespace(check_admission=lambda *a, **kw: None), submit=submitted.append
        ),
    )
    fleet = OneWorker(member)
    durability = SimpleNamespace(
        unfinished=lambda: [(r, [], r.request_id) for r in records],
        sink_for=lambda record, inner: inner,
        generate_of=durable.Durability.generate_of,
        grammar_of=durable.Durability.grammar_of,
        restore=lambda req, sink, record, tokens: None,
    )
    metrics = SimpleNamespace(
        tracing=SimpleNamespace(begin=lambda key: None), request_resumed=lambda why: None
    )
    drainer = SimpleNamespace(accepted=lambda req: None)
    assert restart.requeue(durability, fleet, metrics, drainer) == 2
    assert [(r.request_id, r.speculation) for r in submitted] == [("off", "off"), ("named", "prompt-lookup")]
