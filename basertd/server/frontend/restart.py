"""Restart admission: the unfinished requests of a recovered write-ahead log queued again
(DESIGN.md "Front ends, durability, ...": "Crash = preemption; acceptance is durable").

``requeue(durability, fleet, metrics, drainer)`` turns each unfinished record
(``Durability.unfinished``) into a ``GenerationRequest`` through the same routing and admission
as a new request — the field limits (``check_generate``), the vocabulary of the worker it routes
to (prompt and logit-bias ids), its structured-output spec compiled again
(``request.grammar.validate_spec``), ``Fleet.route`` to a worker serving its model,
``Fleet.route_prefix`` to the peer holding its longest cached prefix,
``SchedulerCore.check_admission`` for the context window and KV pool — except that the queue caps
are not applied: the request was acknowledged before the restart, and refusing it now would lose
it, and its ``speculation`` is not checked against the ``[speculation]`` config again (a strategy
no longer registered simply decodes plainly, ``sched.speculation.strategy_for``). Its durable
tokens count as delivered (``Durability.restore``), so it resumes with
``decode_replay`` (ABI rules 71-73) and its replies go to whoever ``Resume``\\ s it. A request
that no longer passes after a configuration change (its model is not served, its prompt no longer
fits the context, its ids or the ids it generated are outside the new vocabulary, its grammar no
longer compiles) is never
run: it ends with that typed ``Error`` ("after a restart: ..."), journaled.
"""

from __future__ import annotations

import structlog

from basertd.schema import client as api
from basertd.server.durability.durable import API, Durability
from basertd.server.durability.wal_format import RequestRecord
from basertd.server.fleet import Fleet
from basertd.server.frontend.access import ObservedSink
from basertd.server.frontend.drain import Drainer
from basertd.server.frontend.limits import check_generate, check_logit_bias, check_prompt_tokens
from basertd.server.observe.metrics import Metrics
from basertd.server.request.grammar import GrammarRequestError, validate_spec
from basertd.server.request.record import AdmissionError, GenerationRequest, sampler_for

log = structlog.get_logger("basertd.restart")


class Detached:
    """The transport sink of a request re-run after a restart: no client until one Resumes it."""

    closed = False

    def send(self, msg: object) -> None:
        pass


def _admit(
    durability: Durability, fleet: Fleet, gen: api.Generate, record: RequestRecord, generated: list[int]
) -> int:
    """The worker a recovered request goes to, after the checks a new request passes (module
    docstring) but the queue caps, and with its durable ``generated`` tokens in the worker's
    vocabulary too (the resume replays them, ABI rule 71). Raises ``AdmissionError``."""
    check_generate(gen)
    spec = durability.grammar_of(record)
    if spec is not None:
        try:
            validate_spec(spec.kind, spec.text)
        except GrammarRequestError as exc:
            raise AdmissionError(exc.code, str(exc)) from None
    prompt = list(record.prompt)
    wid = fleet.route(record.model)
    vocab = fleet[wid].tokenizer.vocab_size
    check_logit_bias(gen, vocab)
    check_prompt_tokens(prompt, vocab, fleet[wid].config.context_length)
    check_prompt_tokens(generated, vocab, len(generated), what="tokens generated before the restart")
    wid = fleet.route_prefix(wid, prompt)
    fleet[wid].scheduler.core.check_admission(len(prompt), record.max_tokens, record.qos, acknowledged=True)
    return wid


def requeue(durability: Durability, fleet: Fleet, metrics: Metrics, drainer: Drainer) -> int:
    """Queue every unfinished request of the recovered log (module docstring). Returns how many
    were queued (those whose durable tokens already ended them finish at once, not counted)."""
    queued = 0
    for record, tokens, client_id in durability.unfinished():
        api_name = str(record.client.get(API, "native"))  # logs from before the key: native
        observed = ObservedSink(Detached(), client_id, metrics, drainer, api_name=api_name)
        sink = durability.sink_for(record, observed)
        prompt = list(record.prompt)
        gen = durability.generate_of(record, client_id)
        try:
            wid = _admit(durability, fleet, gen, record, list(tokens))
        except AdmissionError as exc:
            sink.send(api.Error(code=exc.code, request_id=client_id, message=f"after a restart: {exc}"))
            continue
        m = fleet[wid]
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
            speculation=gen.speculation,
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
