"""Request traces (``observe.tracing``).

In process, the daemon's tracer swapped for one over the SDK's in-memory exporter: a streamed
OpenAI completion sent with a W3C ``traceparent`` becomes a child trace of the caller with its
admission, queue, prefill, decode and tick spans in time order, and a SIGKILL of its worker in
the middle adds one ``resume_after_crash`` span that ends when the next token arrives; a request
without ``traceparent`` starts a trace of its own. As a process: ``[tracing] otlp_endpoint`` makes
the real daemon export over OTLP/HTTP to a collector (a small aiohttp receiver decoding the
protobuf); without it the SDK is not even imported and nothing is recorded."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web
from daemon_harness import Daemon
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from ops_harness import ref_worker
from proc_testutil import wait_until

from basertd.server.config import ConfigError, parse_config
from basertd.server.config_sections import TracingConfig
from basertd.server.observe.tracing import Tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _config(base: Path) -> object:
    return parse_config(
        {
            "runtime_dir": str(base / "rt"),
            "state_dir": str(base / "state"),
            "http": {"listen": ["127.0.0.1:0"]},
            "scheduler": {"decode_grant": 1, "decode_tick_s": 0},
            "workers": [
                {
                    "engine": "basert",
                    "lanes": 2,
                    "context_length": 512,
                    "ref_config": {"vocab_size": 259, "eos_period": 0, "tick_delay_us": 20000},
                }
            ],
        }
    )


async def _stream(url: str, headers: dict[str, str], on_token=None) -> list[str]:
    """One streamed completion of 40 tokens; ``on_token(n)`` after the n-th event."""
    body = {"prompt": "trace me", "max_tokens": 40, "temperature": 0, "stream": True}
    texts = []
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            texts.append(json.loads(line[5:])["choices"][0]["text"])
            if on_token is not None:
                await on_token(len(texts))
    return texts


def test_spans_of_a_traced_request_with_a_worker_crash_and_of_an_untraced_one():
    from basertd.server.daemon import Daemon as InProcessDaemon

    base = Path(tempfile.mkdtemp(prefix="brt-tr-", dir="/tmp"))
    exporter = InMemorySpanExporter()

    async def scenario() -> tuple[list[str], list[str], int]:
        daemon = InProcessDaemon(_config(base))
        await daemon.start()
        try:
            daemon.metrics.tracing = Tracing(SimpleSpanProcessor(exporter))
            await asyncio.wait_for(daemon.slots[0].ready(), 60)
            url = "http://" + daemon.http.addresses[0]
            old_pid = daemon.slots[0].proc.pid

            async def crash_once(n: int) -> None:
                if n == 10:
                    os.kill(daemon.slots[0].proc.pid, signal.SIGKILL)

            traced = await _stream(url, {"traceparent": TRACEPARENT}, crash_once)
            untraced = await _stream(url, {})
            return traced, untraced, old_pid
        finally:
            await daemon.stop()

    try:
        traced, untraced, _ = asyncio.run(scenario())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert "".join(traced) == "".join(untraced)  # the crash cost nothing: same greedy text
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "basertd.request"]
    assert len(roots) == 2
    root = next(r for r in roots if r.parent is not None)
    other = next(r for r in roots if r.parent is None)
    # the caller's trace and span
    assert f"{root.context.trace_id:032x}" == TRACE_ID and f"{root.parent.span_id:016x}" == PARENT_ID
    assert other.context.trace_id != root.context.trace_id
    assert root.attributes["basertd.api"] == "openai" and root.attributes["basertd.crash_resumes"] == 1
    assert root.attributes["basertd.completion_tokens"] == 40 and root.attributes["basertd.finish_reason"]
    assert root.status.is_ok
    assert [e.name for e in root.events] == ["accepted"]
    mine = [s for s in spans if s.context.trace_id == root.context.trace_id and s is not root]
    by_name: dict[str, list] = {}
    for s in mine:
        by_name.setdefault(s.name, []).append(s)
    for phase in ("admission", "queue", "prefill", "decode"):
        (span,) = by_name[phase]
        assert span.parent.span_id == root.context.span_id, phase
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time, phase
    order = [by_name[p][0] for p in ("admission", "queue", "prefill", "decode")]
    for a, b in itertools.pairwise(order):
        assert a.end_time <= b.start_time + 1000, (a.name, b.name)  # 1 µs of clock rounding
    phase_ids = {by_name[p][0].context.span_id for p in ("prefill", "decode")}
    ticks = by_name["tick"]
    assert len(ticks) == root.attributes["basertd.ticks"] >= 20  # ≥ 40 tokens at 1 per tick, two incarnations
    assert all(t.parent.span_id in phase_ids for t in ticks)
    (resume,) = by_name["resume_after_crash"]
    assert resume.parent.span_id == root.context.span_id
    decode = by_name["decode"][0]
    assert decode.start_time < resume.start_time < resume.end_time < decode.end_time
    # the untraced request: its own trace, no crash
    theirs = {s.name for s in spans if s.context.trace_id == other.context.trace_id}
    assert {
        "admission",
        "queue",
        "prefill",
        "decode",
        "tick",
    } <= theirs and "resume_after_crash" not in theirs


class Collector:
    """An OTLP/HTTP traces receiver on a loopback port, in a thread: ``spans`` decoded so far."""

    def __init__(self) -> None:
        self.spans: list = []
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(30)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def traces(request: web.Request) -> web.Response:
            msg = ExportTraceServiceRequest()
            msg.ParseFromString(await request.read())
            for rs in msg.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
            return web.Response(body=b"", content_type="application/x-protobuf")

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/v1/traces", traces)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = self.runner.addresses[0][1]
            ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_the_daemon_exports_over_otlp_when_an_endpoint_is_set():
    collector = Collector()
    try:
        cfg = ref_worker(lanes=2, delay_us=2000) + (
            f'[http]\nlisten = ["127.0.0.1:0"]\n'
            f'[tracing]\notlp_endpoint = "http://127.0.0.1:{collector.port}/v1/traces"\n'
            'service_name = "basertd-test"\n'
        )
        with Daemon(cfg) as d:
            url = "http://" + d.http_addresses()[0]
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": "export me", "max_tokens": 5, "temperature": 0},
                headers={"traceparent": TRACEPARENT},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        # the stop flushed the batch processor
        wait_until(lambda: any(s.name == "basertd.request" for s in collector.spans), 30, what="export")
    finally:
        collector.close()
    root = next(s for s in collector.spans if s.name == "basertd.request")
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID
    names = {s.name for s in collector.spans if s.trace_id == root.trace_id}
    assert {"admission", "queue", "prefill", "decode", "tick"} <= names


def test_tracing_off_records_nothing_and_imports_no_sdk():
    off = Tracing.start(TracingConfig())
    assert not off.enabled and off.begin(1) is None
    off.tick(0, 1.0, 2.0)
    off.crashed(1, 0, 2.0)  # no error, nothing kept
    probe = (
        "import sys, basertd.server.daemon, basertd.server.observe.tracing as t; "
        "t.Tracing.start(t.TracingConfig()); "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        parse_config({"tracing": {"otlp_endpoint": "collector:4318"}})


def _finished(key: int, worker_id: int, admitted: float, first: float, finished: float) -> object:
    """A finished request as ``Tracing.end`` reads it (times in monotonic seconds)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        key=key,
        request_id=f"r{key}",
        worker_id=worker_id,
        qos="interactive",
        prompt=[1, 2, 3],
        cached_tokens=0,
        generated=[4, 5],
        finish_reason="length",
        preemptions=0,
        crash_resumes=0,
        t_received=admitted - 0.2,
        t_admitted=admitted,
        t_first_token=first,
        t_finished=finished,
    )


def _tick_spans(
    exporter: InMemorySpanExporter, request_id: str
) -> tuple[list[tuple[str, float, float]], int]:
    """(phase, start s, end s) of each tick span of the trace of ``request_id``, and its root's
    ``basertd.ticks``."""
    spans = exporter.get_finished_spans()
    (root,) = [
        s for s in spans if s.name == "basertd.request" and s.attributes["basertd.request_id"] == request_id
    ]
    mine = {s.context.span_id: s for s in spans if s.context.trace_id == root.context.trace_id}
    ticks = sorted(
        (t.start_time, mine[t.parent.span_id].name, round(t.attributes["basertd.tick_s"], 6))
        for t in mine.values()
        if t.name == "tick"
    )
    return [(phase, length, start) for start, phase, length in ticks], root.attributes["basertd.ticks"]


def test_each_tick_is_in_one_phase_and_the_tick_a_request_ended_in_is_waited_for():
    """The tick that delivered the first token mid-tick is under prefill only (it was counted in
    both phases); a request that ends inside a tick is traced once that tick's end is recorded,
    with the tick in it (its last tick was missing)."""
    exporter = InMemorySpanExporter()
    tracing = Tracing(SimpleSpanProcessor(exporter))
    t0 = 1000.0
    for a, b in ((t0, t0 + 0.5), (t0 + 0.5, t0 + 1.5), (t0 + 1.5, t0 + 2.0)):
        tracing.tick(0, a, b)
    # first token at t0 + 1.0, inside the second tick; the end at t0 + 2.3, inside a tick in flight
    req = _finished(1, 0, t0, t0 + 1.0, t0 + 2.3)
    trace = tracing.begin(1)
    tracing.end(req, trace, "openai", None)
    assert exporter.get_finished_spans() == ()  # waits for the tick it ended in
    tracing.tick(1, t0 + 2.0, t0 + 2.6)  # another worker's tick does not end it
    assert exporter.get_finished_spans() == ()
    tracing.tick(0, t0 + 2.0, t0 + 2.6)
    ticks, counted = _tick_spans(exporter, "r1")
    assert [(phase, length) for phase, length, _ in ticks] == [
        ("prefill", 0.5),
        ("prefill", 1.0),
        ("decode", 0.5),
        ("decode", 0.6),
    ]
    assert counted == 4
    # a worker that never records the tick (it died in it): built after PENDING_MAX_S, without it
    req2 = _finished(2, 0, t0 + 3.0, t0 + 3.1, t0 + 3.2)
    tracing.end(req2, tracing.begin(2), "openai", None)
    assert not [s for s in exporter.get_finished_spans() if s.attributes.get("basertd.request_id") == "r2"]
    later = _finished(3, 1, t0 + 20.0, t0 + 20.1, t0 + 20.2)  # any request ending later flushes it
    tracing.end(later, tracing.begin(3), "openai", None)
    assert _tick_spans(exporter, "r2")[1] == 0
    tracing.close()
