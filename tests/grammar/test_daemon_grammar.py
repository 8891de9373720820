"""Grammar-constrained lanes through the daemon (DESIGN.md "Link W", ABI rule 74) on the tiny GGUF:
the native API's ``response_format`` / ``grammar`` / ``regex`` are compiled at admission (a bad
spec is INVALID_REQUEST before anything is queued); the scheduler creates the grammar on the
worker, admits the lane with it and frees it on every exit path (the engine's live handle count
returns to 0); a constrained lane preempted (QoS) or whose worker is SIGKILLed resumes with
``grammar_replay`` and continues token-exact against an uninterrupted constrained run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import jsonschema
import msgspec
import pytest
from daemon_harness import Daemon
from serving_harness import access_lines, tiny_toml

from basertd.client import AsyncClient, ClientError
from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.server.durability import durable
from basertd.server.durability.wal_format import RequestRecord
from basertd.server.request import grammar
from basertd.server.request.record import GenerationRequest, sampler_for
from basertd.server.request.tokenizer import BytesTokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
LONG_REGEX = "[a-z]{30}( [a-z]{30}){2}"
"""A long constrained output (about 90 characters, tens of tokens), so preemptions and kills land
in the middle of it."""


def wait_grammars(d: Daemon, expected: int = 0, timeout: float = 15.0) -> int:
    """Until the worker's engine reports ``expected`` live grammar handles (PONG stats)."""
    deadline = time.monotonic() + timeout
    while True:
        (w,) = d.workers()
        n = w.engine_stats.get("grammar_handles", -1)
        if n == expected and w.state == "ready":
            return n
        assert time.monotonic() < deadline, (n, w.state)
        time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    with Daemon(tiny_toml(tiny_gguf, lanes=1, grant=1, context=512)) as d:
        yield d


def test_json_schema_output_validates_and_the_handle_is_freed(daemon):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with daemon.client() as c:
        outs = [
            c.generate(p, response_format=fmt, max_tokens=200, temperature=t, seed=3)
            for p, t in (("a person:", 0.0), ("someone", 0.8))
        ]
        obj = c.generate("anything", response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    for out in outs:
        assert out.finish_reason == "stop", out  # the grammar's finish, as clients see it
        jsonschema.validate(json.loads(out.text), PERSON)
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    wait_grammars(daemon, 0)


def test_a_constrained_output_cut_by_max_tokens_ends_length(daemon):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with daemon.client() as c:
        out = c.generate("a person:", response_format=fmt, max_tokens=3, temperature=0)
    assert out.finish_reason == "length", out  # a prefix of the object, never claimed complete
    assert out.text.startswith("{") and len(out.ids) == 3
    with pytest.raises(ValueError):
        json.loads(out.text)
    wait_grammars(daemon, 0)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}}, "schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"regex": "a", "grammar": 'start: "a"'}, "at most one"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_bad_specs_are_invalid_requests_before_queuing(daemon, fields, needle):
    with daemon.client() as c, pytest.raises(ClientError) as info:
        c.generate("x", max_tokens=4, **fields)
    assert info.value.code == ErrorCode.INVALID_REQUEST and needle in info.value.message, info.value
    (w,) = daemon.workers()
    assert w.queue_depth == 0 and w.lanes_busy == 0


def test_cancelled_constrained_lane_frees_its_grammar(daemon):
    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:
            # far longer than the context allows: it runs until cancelled
            s = await c.stream("go", regex="[a-z]{2000}", max_tokens=400, temperature=0.0)
            it = s.__aiter__()
            await it.__anext__()
            (w,) = await asyncio.to_thread(daemon.workers)
            await s.cancel()
            with pytest.raises(ClientError) as info:
                async for _ in it:
                    pass
            return w, info.value

    running, err = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert err.code == ErrorCode.CANCELLED  # it was still running when the stats were taken
    assert running.engine_stats["grammar_handles"] == 1  # the lane's, while it ran
    wait_grammars(daemon, 0)


def _uninterrupted(d: Daemon, prompt: str) -> list[int]:
    with d.client() as c:
        out = c.generate(prompt, regex=LONG_REGEX, max_tokens=200, temperature=0.0)
    assert out.finish_reason == "stop" and len(out.ids) > 12, out
    return out.ids


def test_a_preempted_constrained_lane_resumes_token_exact(daemon):
    expected = _uninterrupted(daemon, "the long one")

    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:
            s = await c.stream(
                "the long one",
                request_id="long",
                regex=LONG_REGEX,
                max_tokens=200,
                temperature=0.0,
                qos="batch",
            )
            got = []
            it = s.__aiter__()
            while len(got) < 4:
                got += (await it.__anext__()).ids
            inter = await c.generate(
                "quick", request_id="quick", regex="[0-9]{3}", max_tokens=20, temperature=0
            )
            async for t in it:
                got += t.ids
            return got, s.done, inter

    got, done, inter = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert access_lines(daemon)["long"]["preemptions"] >= 1
    assert got == expected and done.finish_reason == "stop"
    assert inter.text.isdigit() and len(inter.text) == 3
    wait_grammars(daemon, 0)


def test_a_constrained_lane_whose_worker_is_killed_resumes_token_exact(daemon):
    expected = _uninterrupted(daemon, "crash me")
    (w0,) = daemon.workers()

    async def scenario():
        async with await AsyncClient.connect(daemon.socket) as c:
            s = await c.stream(
                "crash me", request_id="crashed", regex=LONG_REGEX, max_tokens=200, temperature=0
            )
            got = []
            it = s.__aiter__()
            while len(got) < 4:
                got += (await it.__anext__()).ids
            os.kill(w0.pid, signal.SIGKILL)
            async for t in it:
                got += t.ids
            return got, s.done

    got, done = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert len(expected) >= 4 and got == expected and done.finish_reason == "stop"
    assert access_lines(daemon)["crashed"]["crash_resumes"] == 1
    (w1,) = daemon.workers()
    assert w1.pid != w0.pid
    wait_grammars(daemon, 0)


def test_a_constrained_requests_log_record_keeps_its_grammar():
    """A request re-run from the write-ahead log after a restart stays constrained: its record's
    ``extra`` carries the spec through the log's msgpack encoding."""
    spec = grammar.spec_from_request(regex=LONG_REGEX)
    gen = api.Generate(request_id="c", prompt="x", regex=LONG_REGEX)
    req = GenerationRequest(
        request_id="c",
        prompt=[1, 2],
        max_tokens=4,
        sampler=sampler_for(gen),
        sink=None,  # type: ignore[arg-type]
        tokenizer=BytesTokenizer(),
        grammar=spec,
    )
    extra = durable._extra(gen, req)
    rec = RequestRecord.from_generate(gen, [1, 2], 7, t_accepted=0.0, extra=extra)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(rec), type=RequestRecord)
    assert grammar.GrammarSpec(*back.extra[durable.GRAMMAR]) == spec
    assert back.extra[durable.CLIENT_ID] == "c"
    plain = GenerationRequest(
        request_id="p",
        prompt=[1],
        max_tokens=4,
        sampler=sampler_for(gen),
        sink=None,
        tokenizer=BytesTokenizer(),
    )
    assert durable.GRAMMAR not in durable._extra(gen, plain)
