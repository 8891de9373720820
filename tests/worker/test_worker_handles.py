"""Worker-held handles (``basertd.server.sched.handles.WorkerHandles``) against a real worker on
the reference engine: a dropped handle is freed only by ``free_pending`` and is then gone from the
worker (ABI rule 113: freeing it again is ERR_UNKNOWN_HANDLE), a refused free is logged and
forgotten, ``forget`` sends nothing, and the count follows held + pending; the grammar kind reports
it on the ``basertd_grammar_handles`` gauge, the logit-bias kind reuses one table per request."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from basertd.schema import client as api
from basertd.schema import link
from basertd.schema.abi import Status
from basertd.server.observe.metrics import Metrics
from basertd.server.request.record import GenerationRequest, sampler_for
from basertd.server.request.tokenizer import BytesTokenizer
from basertd.server.sched import logit_bias
from basertd.server.sched.grammar_handles import grammar_handles
from basertd.server.sched.handles import WorkerHandles
from basertd.server.workers.link_errors import WorkerError
from basertd.server.workers.sync_worker import SyncWorker

SCHEMA = '{"type": "object"}'


@pytest.fixture
def worker(make_spec):
    with SyncWorker(make_spec(emit_window_ms=0)) as w:
        yield w


def grammar(worker: SyncWorker) -> int:
    handle = worker.request(link.GrammarCreate(json_schema=SCHEMA)).handle
    assert handle > 0
    return handle


def freed(worker: SyncWorker, handle: int) -> bool:
    """Whether the worker no longer holds grammar ``handle`` (freeing it is refused, rule 113);
    a handle it still held is freed by the probe."""
    try:
        worker.request(link.GrammarFree(handle=handle))
    except WorkerError as exc:
        assert exc.status == Status.ERR_UNKNOWN_HANDLE
        return True
    return False


async def free_grammar(wlink, handle: int) -> None:
    await wlink.request(link.GrammarFree(handle=handle))


def test_a_dropped_handle_is_freed_between_ticks_and_a_dead_incarnations_handles_are_forgotten(worker):
    counts: list[int] = []
    handles: WorkerHandles[str] = WorkerHandles("grammar", 0, free_grammar, counts.append)
    a, b, c = grammar(worker), grammar(worker), grammar(worker)
    handles.hold("a", a)
    handles.hold("b", b)
    handles.hold("c", c)
    assert counts == [1, 2, 3] and len(handles) == 3 and handles.get("b") == b
    handles.drop("a")
    handles.drop("nobody")  # an owner without a handle: nothing to free
    assert handles.get("a") == 0 and handles.pending_free == [a] and len(handles) == 3
    assert handles.drop_where(lambda owner: owner == "b") == 1 and handles.pending_free == [a, b]
    assert worker.call(handles.free_pending(worker.link)) == 2
    assert handles.pending_free == [] and len(handles) == 1 and counts[-1] == 1
    assert freed(worker, a) and freed(worker, b)
    handles.hold("stale", a)  # the engine no longer knows it: the refusal is logged, not raised
    handles.drop("stale")
    assert worker.call(handles.free_pending(worker.link)) == 1 and len(handles) == 1
    handles.forget()  # the incarnation died: nothing is sent
    assert len(handles) == 0 and handles.get("c") == 0 and counts[-1] == 0
    assert not freed(worker, c)  # still held by the worker until now: forget sent no free
    with pytest.raises(ValueError):
        handles.hold("d", 0)


def test_a_second_handle_for_one_owner_frees_the_first():
    handles: WorkerHandles[str] = WorkerHandles("grammar", 0, free_grammar)
    handles.hold("a", 5)
    handles.hold("a", 6)
    assert handles.get("a") == 6 and handles.pending_free == [5] and len(handles) == 2


def scrape_grammar_gauge(metrics: Metrics) -> float:
    for fam in text_string_to_metric_families(metrics.exposition()):
        for s in fam.samples:
            if s.name == "basertd_grammar_handles" and s.labels == {"worker": "3"}:
                return s.value
    raise AssertionError("no basertd_grammar_handles sample for worker 3")


def make_req(bias: dict[int, float]) -> GenerationRequest:
    gen = api.Generate(request_id="r", prompt="x", max_tokens=4, temperature=0.0, logit_bias=bias)

    class Sink:
        closed = False

        def send(self, msg) -> None:
            pass

    tok = BytesTokenizer()
    return GenerationRequest(
        request_id="r",
        prompt=tok.encode("x", add_bos=False),
        max_tokens=4,
        sampler=sampler_for(gen),
        sink=Sink(),
        tokenizer=tok,
    )


def test_grammar_handles_report_the_gauge_and_bias_tables_are_reused_per_request(worker):
    metrics = Metrics()
    grammars = grammar_handles(3, metrics)
    req = make_req({5: 1.5, 6: -2.0})
    grammars.hold(req, grammar(worker))
    assert scrape_grammar_gauge(metrics) == 1
    grammars.drop(req)
    assert scrape_grammar_gauge(metrics) == 1  # held by the worker until freed
    worker.call(grammars.free_pending(worker.link))
    assert scrape_grammar_gauge(metrics) == 0

    tables = logit_bias.bias_tables(0)
    plain = make_req({})
    got, refused = worker.call(logit_bias.handles(tables, worker.link, [req, plain]))
    assert refused == [] and set(got) == {req.key} and got[req.key] > 0 and len(tables) == 1
    again, _ = worker.call(logit_bias.handles(tables, worker.link, [req]))
    assert again == got and len(tables) == 1  # a re-admission reuses the request's table
    tables.drop(req)
    worker.call(tables.free_pending(worker.link))
    with pytest.raises(WorkerError) as err:  # freed on the worker (ABI rule 113)
        worker.request(link.LogitBiasFree(handle=got[req.key]))
    assert err.value.status == Status.ERR_UNKNOWN_HANDLE
