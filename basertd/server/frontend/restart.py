"""Restart admission: the unfinished requests of a recovered write-ahead log queued again
(DESIGN.md "Front ends, durability, ...": "Crash = preemption; acceptance is durable").

``requeue(durability, fleet, metrics, drainer)`` turns each unfinished record
(``Durability.unfinished``) into a ``GenerationRequest`` through the same routing and admission
as a new request — ``Fleet.route`` to a worker serving its model, ``Fleet.route_prefix`` to the
peer holding its longest cached prefix, ``SchedulerCore.check_admission`` for the context window and
KV pool — except that the queue caps are not applied: the request was acknowledged before the
restart, and refusing it now would lose it. Its durable tokens count as delivered
(``Durability.restore``), so it resumes with ``decode_replay`` (ABI rules 71-73) and its replies
go to whoever ``Resume``\\ s it. A request that can no longer run (its model is not served, its
prompt no longer fits) ends with that ``Error``, journaled.
"""

from __future__ import annotations

import structlog

from basertd.schema import client as api
from basertd.server.durability.durable import Durability
from basertd.server.fleet import Fleet
from basertd.server.frontend.access import ObservedSink
from basertd.server.frontend.drain import Drainer
from basertd.server.observe.metrics import Metrics
from basertd.server.request.record import AdmissionError, GenerationRequest, sampler_for

log = structlog.get_logger("basertd.restart")


class Detached:
    """The transport sink of a request re-run after a restart: no client until one Resumes it."""

    closed = False

    def send(self, msg: object) -> None:
        pass


def requeue(durability: Durability, fleet: Fleet, metrics: Metrics, drainer: Drainer) -> int:
    """Queue every unfinished request of the recovered log (module docstring). Returns how many
    were queued (those whose durable tokens already ended them finish at once, not counted)."""
    queued = 0
    for record, tokens, client_id in durability.unfinished():
        observed = ObservedSink(Detached(), client_id, metrics, drainer)
        sink = durability.sink_for(record, observed)
        prompt = list(record.prompt)
        try:
            wid = fleet.route_prefix(fleet.route(record.model), prompt)
            m = fleet[wid]
            m.scheduler.core.check_admission(len(prompt), record.max_tokens, record.qos, acknowledged=True)
        except AdmissionError as exc:
            sink.send(api.Error(code=exc.code, request_id=client_id, message=f"after a restart: {exc}"))
            continue
        gen = durability.generate_of(record, client_id)
        req = GenerationRequest(
            request_id=client_id,
            prompt=prompt,
            max_tokens=record.max_tokens,
            sampler=sampler_for(gen, m.tokenizer.vocab_size),
            sink=sink,
            tokenizer=m.tokenizer,
            stop=list(record.stop),
            qos=record.qos,
            stream=record.stream,
            grammar=durability.grammar_of(record),
        )
        observed.attach(req)
        ended = durability.restore(req, sink, record, tokens)
        metrics.request_resumed("restart")
        log.info(
            "request_resumed",
            after="restart",
            resume_id=record.request_id,
            request_id=client_id,
            worker_id=wid,
            durable_tokens=len(tokens),
        )
        if ended is not None:
            req.worker_id = wid
            req.finish(ended)
            continue
        m.scheduler.submit(req)
        queued += 1
    return queued
