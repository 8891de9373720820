"""The HTTP dialects (OpenAI, Anthropic, Ollama) against a fake front end: no daemon, no worker.

``FakeFrontend`` implements ``basertd.server.transport.http.port.FrontendPort`` with the reference
byte vocabulary (``BytesTokenizer``: token ``3 + b`` per UTF-8 byte) and a scripted reply per
request; each test drives the real ``HttpServer`` routes and middleware through aiohttp's
``TestServer`` / ``TestClient`` (and the real ``openai`` / ``anthropic`` / ``ollama`` clients
pointed at it) and checks the wire bytes and the ``Generate`` the dialect built. The end-to-end
tests against a daemon are the other files of this folder.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai._streaming import SSEDecoder

from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.server.config_sections import HttpConfig
from basertd.server.frontend.admission import Frontend
from basertd.server.frontend.embeddings import Embeddings
from basertd.server.frontend.limits import check_generate
from basertd.server.frontend.scoring import PromptScores
from basertd.server.frontend.streams import GenerationStream, ResumedStream
from basertd.server.observe.snapshot import WorkerSnapshot
from basertd.server.request import grammar
from basertd.server.request.grammar import GrammarSpec
from basertd.server.request.record import AdmissionError
from basertd.server.request.tokenizer import BytesTokenizer
from basertd.server.states import HealthStatus, SlotState
from basertd.server.transport.http import port, resume
from basertd.server.transport.http.app import HttpServer
from basertd.server.workers.limits import WorkerLimits

MODEL = "fake-model"
CONTEXT = 4096
TOK = BytesTokenizer()
CHAT_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def text_of(tokens: list[int]) -> str:
    return b"".join(TOK.piece(t) for t in tokens).decode("utf-8", "replace")


@dataclass(frozen=True)
class Inputs:
    configured: str = "chatml"
    own: str | None = None
    default_model: bool = False
    bos_token: str = ""
    eos_token: str = ""


class FakeStream:
    """A ``StreamPort`` over a list of replies."""

    def __init__(
        self,
        request_id: str,
        replies: list[Any],
        accepted: api.Accepted | None,
        context: dict[str, Any] | None = None,
    ) -> None:
        self.accepted = accepted
        self.context = dict(context or {})
        self._rid = request_id
        self._replies = list(replies)
        self._ended = False
        self.closed = False
        self.cancelled = False

    @property
    def request_id(self) -> str:
        return self._rid

    @property
    def finished(self) -> bool:
        return self._ended

    @property
    def followed(self) -> bool:
        return False

    def piece(self, token_id: int) -> bytes:
        return TOK.piece(token_id)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while self._replies and not self._ended:
            msg = self._replies.pop(0)
            if isinstance(msg, (api.Done, api.Error)):
                self._ended = True
            yield msg

    async def aclose(self) -> None:
        self.cancelled = not self._ended
        self.closed = True

    async def __aenter__(self) -> FakeStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass
class FakeFrontend:
    """A ``FrontendPort``: every request answers ``reply`` (split in two Tokens) then Done.

    ``finish``: Done's finish reason; ``hidden_stop``: a stop string whose tokens end the output
    but not its text (as the scheduler delivers a matched stop); ``cached``: prompt tokens served
    from the prefix cache; ``fail``: an Error after the first Tokens; ``error_first``: only an
    Error; ``queued``: a Queued notice first; ``resume_id``: the Accepted's durable id."""

    reply: str = "Hello, world!"
    finish: str = "stop"
    hidden_stop: str = ""
    cached: int = 0
    fail: ErrorCode | None = None
    error_first: ErrorCode | None = None
    queued: int | None = None
    resume_id: str = ""
    inputs: Inputs = field(default_factory=Inputs)
    gens: list[tuple[api.Generate, str]] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    follows: list[tuple[str, int]] = field(default_factory=list)
    embed_apis: list[str] = field(default_factory=list)
    bound: tuple[str, dict[str, Any]] = ("", {})
    """The requester and resume context the last admitted request was bound to."""

    async def compile_spec(self, model: str, qos: str, spec: GrammarSpec) -> GrammarSpec:
        """The fake has no compiler: every spec compiles as its first candidate."""
        return GrammarSpec(spec.kind, spec.text, label=spec.label)

    def route(self, model: str) -> int:
        if model not in ("", MODEL):
            raise AdmissionError(
                ErrorCode.NOT_FOUND, f"model {model!r} is not served here (served: {MODEL})", "model"
            )
        return 7

    def context_length(self, worker: int) -> int:
        assert worker == 7
        return CONTEXT

    def model_name(self, worker: int) -> str:
        assert worker == 7
        return MODEL

    def template_inputs(self, worker: int) -> Inputs:
        return self.inputs

    def models(self) -> list[api.ModelInfo]:
        return [api.ModelInfo(id=MODEL, engine="llamacpp", context_length=CONTEXT, vocab_size=TOK.vocab_size)]

    def health(self) -> tuple[HealthStatus, str]:
        return HealthStatus.OK, ""

    def workers_ready(self) -> int:
        return 1

    def metrics_exposition(self) -> str:
        return "# TYPE basertd_fake gauge\nbasertd_fake 1\n"

    def worker_snapshots(self) -> list[WorkerSnapshot]:
        limits = WorkerLimits(CONTEXT, 4, 4, 16, 4 * CONTEXT, CONTEXT)
        zeros = dict.fromkeys(
            ("ticks_run", "plans_rejected", "requests_done", "prefill_tokens", "decode_tokens"), 0
        )
        zeros.update(dict.fromkeys(("preemptions", "checkpoints", "crash_resumes", "yields_requested"), 0))
        return [
            WorkerSnapshot(
                worker_id=7,
                taken_at=0.0,
                state=SlotState.READY,
                pid=1,
                respawns=0,
                last_error="",
                limits=limits,
                lanes=(),
                queues=(),
                mem=None,
                stall_reason=None,
                prefix_caching=True,
                **zeros,
            )
        ]

    async def tokenize(self, model: str, text: str, *, add_special: bool = True) -> list[int]:
        self.route(model)
        return ids(text)

    async def detokenize(self, model: str, tokens: list[int]) -> str:
        self.route(model)
        return text_of(tokens)

    async def control_texts(self, model: str, texts: list[str]) -> frozenset[str]:
        self.route(model)
        return frozenset()  # the fake's byte vocabulary has no control token

    async def tokenize_parts(
        self, model: str, parts: list[tuple[str, bool]], *, add_special: bool
    ) -> list[int]:
        self.route(model)
        return ids("".join(text for text, _ in parts))

    def pieces(self, model: str, tokens: list[int]) -> list[bytes]:
        self.route(model)
        return [TOK.piece(t) for t in tokens]

    async def score(self, model: str, tokens: list[int], top_k: int) -> PromptScores:
        """Token i+1 scores -(i+1)/10 after tokens 0..i; the alternatives are the token itself."""
        self.route(model)
        n = len(tokens) - 1
        lps = np.array([-(i + 1) / 10 for i in range(n)], np.float32)
        top = np.array([[t] * top_k for t in tokens[1:]], np.uint32).reshape(n, top_k)
        return PromptScores(lps, top, np.repeat(lps[:, None], top_k, axis=1))

    async def embed(
        self,
        model: str,
        inputs: list[Any],
        *,
        truncate: bool = False,
        dimensions: int | None = None,
        api_name: str = "native",
    ) -> Embeddings:
        """Unit vectors of 8 dimensions: each input's byte histogram folded mod 8; ``api_name``
        recorded in ``embed_apis``."""
        self.embed_apis.append(api_name)
        self.route(model)
        if dimensions not in (None, 8):
            raise AdmissionError(ErrorCode.INVALID_REQUEST, "dimensions must be 8", "dimensions")
        lists = [ids(x) if isinstance(x, str) else list(x) for x in inputs]
        vecs = np.zeros((len(lists), 8), np.float32)
        for i, toks in enumerate(lists):
            np.add.at(vecs[i], np.array(toks) % 8, 1.0)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        return Embeddings(vecs, sum(map(len, lists)), 7)

    def _replies(self, gen: api.Generate, prompt_len: int, after: int = 0) -> list[Any]:
        rid = gen.request_id
        out: list[Any] = []
        if self.queued is not None:
            out.append(api.Queued(request_id=rid, position=self.queued, qos=gen.qos))
        if self.error_first is not None:
            return [*out, api.Error(code=self.error_first, request_id=rid, message="the worker failed")]
        half = len(self.reply) // 2
        total = 0
        for k, part in enumerate((self.reply[:half], self.reply[half:])):
            tokens = ids(part)
            total += len(tokens)
            if total <= after:
                continue
            logprobs = None
            if gen.logprobs is not None:
                logprobs = [
                    api.TokenLogprob(
                        id=t, logprob=-0.5, top=[api.TopLogprob(id=t, logprob=-0.5)][: gen.logprobs]
                    )
                    for t in tokens
                ]
            out.append(api.Tokens(request_id=rid, ids=tokens, text=part, logprobs=logprobs))
            if k == 0 and self.fail is not None:
                return [*out, api.Error(code=self.fail, request_id=rid, message="the worker crashed")]
        completion = total + len(ids(self.hidden_stop))
        if self.hidden_stop:
            out.append(api.Tokens(request_id=rid, ids=ids(self.hidden_stop), text=""))
        usage = api.Usage(prompt_tokens=prompt_len, cached_tokens=self.cached, completion_tokens=completion)
        timings = api.Timings(queue_s=0.125, ttft_s=0.25, total_s=1.5)  # exact in binary
        return [*out, api.Done(request_id=rid, finish_reason=self.finish, usage=usage, timings=timings)]

    async def stream(
        self,
        gen: api.Generate,
        *,
        api_name: str,
        requester: str = "",
        context: dict[str, Any] | None = None,
    ) -> FakeStream:
        self.gens.append((gen, api_name))
        self.bound = (requester, dict(context or {}))
        check_generate(gen)  # the field limits, as admission checks them
        self.route(gen.model)
        prompt = gen.prompt_tokens if gen.prompt_tokens is not None else ids(gen.prompt or "")
        if len(prompt) + gen.max_tokens > CONTEXT:
            raise AdmissionError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt ({len(prompt)}) + max_tokens ({gen.max_tokens}) exceed the context ({CONTEXT})",
                "prompt" if len(prompt) >= CONTEXT else "max_tokens",  # as the scheduler names it
            )
        accepted = api.Accepted(
            request_id=gen.request_id, prompt_tokens=len(prompt), resume_id=self.resume_id
        )
        s = FakeStream(gen.request_id, self._replies(gen, len(prompt)), accepted)
        self.streams.append(s)
        return s

    async def follow(self, resume_id: str, after: int, requester: str) -> FakeStream:
        self.follows.append((resume_id, after))
        if resume_id != self.resume_id or not resume_id:
            raise AdmissionError(ErrorCode.NOT_FOUND, f"no request {resume_id!r}")
        owner, context = self.bound
        if owner != requester:
            raise AdmissionError(ErrorCode.PERMISSION_DENIED, f"{resume_id!r} belongs to another requester")
        gen, _ = self.gens[-1]
        prompt_len = len(gen.prompt_tokens or ids(gen.prompt or ""))
        accepted = api.Accepted(request_id=resume_id, prompt_tokens=prompt_len, resume_id=resume_id)
        return FakeStream(resume_id, self._replies(gen, prompt_len, after), accepted, context)


Call = Callable[[TestClient], Awaitable[Any]]


def run(fake: FakeFrontend, fn: Call, **config: Any) -> Any:
    """``fn(client)`` against an ``HttpServer`` over ``fake`` on a loopback TestServer."""

    async def main() -> Any:
        server = HttpServer(HttpConfig(listen=[], **config), fake)  # type: ignore[arg-type]
        try:
            async with TestClient(TestServer(server.app)) as client:
                return await fn(client)
        finally:
            await server.templates.close()

    return asyncio.run(main())


def post(fake: FakeFrontend, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """``(status, JSON body)`` of one POST (``body`` bytes are sent as they are)."""

    async def fn(client: TestClient) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await client.post(path, data=data, headers=headers or {})
        return r.status, await r.json(content_type=None)

    return run(fake, fn)


def post_raw(
    fake: FakeFrontend, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    async def fn(client: TestClient) -> tuple[int, str]:
        r = await client.post(path, json=body, headers=headers or {})
        return r.status, await r.text()

    return run(fake, fn)


def sse(text: str) -> list[dict[str, str]]:
    """The events of an SSE body: ``{"id", "event", "data"}`` fields of each, comments as ``": "``."""
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        e: dict[str, str] = {}
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            e[key] = value
        out.append(e)
    return out


def datas(events: list[dict[str, str]]) -> list[Any]:
    return [json.loads(e["data"]) for e in events if "data" in e and e["data"] != "[DONE]"]


# --- the port ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("impl", "proto"),
    [
        (Frontend, port.FrontendPort),
        (GenerationStream, port.StreamPort),
        (ResumedStream, port.StreamPort),
        (FakeFrontend, port.FrontendPort),
        (FakeStream, port.StreamPort),
    ],
)
def test_the_front_ends_types_have_every_member_of_the_port(impl, proto):
    members = typing._get_protocol_attrs(proto)  # type: ignore[attr-defined]
    assert {"stream", "follow", "route", "piece"} & members
    for name in members - {"accepted"}:  # an attribute each instance sets
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        want, have = getattr(proto, name), getattr(impl, name)
        if inspect.isfunction(want):
            assert inspect.iscoroutinefunction(want) == inspect.iscoroutinefunction(have), name
            want_p, have_p = inspect.signature(want).parameters, inspect.signature(have).parameters
            assert list(have_p)[: len(want_p)] == list(want_p), name
            assert all(have_p[p].default is not inspect.Parameter.empty for p in list(have_p)[len(want_p) :])
        else:
            assert isinstance(have, property), name
    if proto is port.StreamPort:
        assert "self.accepted = accepted" in inspect.getsource(impl.__init__)


def test_the_http_code_reads_the_front_end_only_through_the_port():
    from pathlib import Path

    import basertd.server.transport.http as pkg

    root = Path(pkg.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for needle in (".fleet", ".scheduler", "frontend.admission", "frontend.streams", "stream.request"):
            assert needle not in text or path.name == "port.py", f"{path.relative_to(root)} reads {needle}"


def test_the_releaser_closes_at_once_or_after_the_grace_for_a_resumable_stream():
    async def main() -> tuple[bool, bool, bool, bool]:
        releaser = resume.Releaser(0.01)
        now, later = FakeStream("a", [], None), FakeStream("b", [], None)
        await releaser.release([now], False)
        await releaser.release([later], True)
        closed_now, closed_at_once = now.closed, later.closed
        await asyncio.sleep(0.1)
        return closed_now, closed_at_once, later.closed, later.cancelled

    assert asyncio.run(main()) == (True, False, True, True)


# --- OpenAI --------------------------------------------------------------------------------------


def test_completions_translate_the_body_and_answer_a_text_completion():
    fake = FakeFrontend(cached=2)
    body = {"model": MODEL, "prompt": "hi", "temperature": 0.5, "top_k": 4, "stop": "x", "seed": -1}
    status, out = post(fake, "/v1/completions", body)
    assert status == 200
    (gen, api_name), (s,) = fake.gens[0], fake.streams
    assert api_name == "openai" and gen.prompt == "hi" and gen.prompt_tokens is None
    assert (gen.max_tokens, gen.temperature, gen.top_k, gen.stop, gen.seed) == (
        16,
        0.5,
        4,
        ["x"],
        (1 << 64) - 1,
    )
    assert gen.request_id == out["id"] + "-0" and out["id"].startswith("cmpl-") and s.closed
    assert out["object"] == "text_completion" and out["model"] == MODEL
    assert out["choices"] == [
        {"index": 0, "text": "Hello, world!", "logprobs": None, "finish_reason": "stop"}
    ]
    n = len(ids("Hello, world!"))
    assert out["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": n,
        "total_tokens": 2 + n,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_completions_batch_prompts_and_choices_and_count_each_prompt_once():
    fake = FakeFrontend()
    status, out = post(fake, "/v1/completions", {"prompt": ["ab", "cde"], "n": 2, "max_tokens": 3})
    assert status == 200
    assert [g.request_id.rsplit("-", 1)[1] for g, _ in fake.gens] == ["0", "1", "2", "3"]
    assert [g.prompt for g, _ in fake.gens] == ["ab", "ab", "cde", "cde"]
    assert all(g.max_tokens == 3 for g, _ in fake.gens)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 2 + 3
    assert out["usage"]["completion_tokens"] == 4 * len(ids("Hello, world!"))


def test_completions_token_id_prompts_go_as_prompt_tokens():
    fake = FakeFrontend()
    status, out = post(fake, "/v1/completions", {"prompt": [[5, 6], [7, 8, 9]]})
    assert status == 200 and len(out["choices"]) == 2
    assert [(g.prompt, g.prompt_tokens) for g, _ in fake.gens] == [(None, [5, 6]), (None, [7, 8, 9])]
    status, out = post(fake, "/v1/completions", {"prompt": ["ab", [5, 6]]})
    assert status == 400 and out["error"]["param"] == "prompt" and len(fake.gens) == 2


def test_completions_stream_with_usage_numbers_each_event_by_tokens_so_far():
    fake = FakeFrontend()
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    status, text = post_raw(fake, "/v1/completions", body)
    assert status == 200
    events = sse(text)
    assert events[-1] == {"data": "[DONE]"}
    rid = fake.gens[0][0].request_id
    n1, n = len(ids("Hello,")), len(ids("Hello, world!"))
    assert [e["id"] for e in events[:-1]] == [f"{rid}:{n1}", f"{rid}:{n}", f"{rid}:{n}", f"{rid}:{n}"]
    chunks = datas(events)
    assert [c["choices"][0]["text"] for c in chunks[:3]] == ["Hello,", " world!", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "stop"]
    assert all(c["usage"] is None for c in chunks[:3]) and chunks[3]["choices"] == []
    assert chunks[3]["usage"]["completion_tokens"] == n and chunks[3]["usage"]["prompt_tokens"] == 2


def test_chat_renders_the_template_and_defaults_max_tokens_to_the_rest_of_the_context():
    fake = FakeFrontend(finish="length")
    status, out = post(fake, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    gen = fake.gens[0][0]
    assert text_of(gen.prompt_tokens) == CHAT_PROMPT
    assert gen.max_tokens == CONTEXT - len(ids(CHAT_PROMPT))
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello, world!"}
    assert choice["finish_reason"] == "length"


def test_chat_stream_sends_the_role_then_content_then_the_finish():
    fake = FakeFrontend(queued=3)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 20}
    status, text = post_raw(fake, "/v1/chat/completions", body)
    assert status == 200
    events = sse(text)
    # an SSE comment line, in the block of the event after it: no empty event for the openai SDK
    assert any(e.get("") == "queued at position 3" and "data" in e for e in events), events
    decoded = list(SSEDecoder().iter_bytes(iter([text.encode()])))
    assert decoded and all(e.data for e in decoded)
    chunks = datas(events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["id"].endswith(":0")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello, world!"
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and text.endswith("data: [DONE]\n\n")


def test_chat_logprobs_carry_each_tokens_piece_and_bytes():
    fake = FakeFrontend(reply="ok")
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    status, out = post(fake, "/v1/chat/completions", body)
    assert status == 200 and fake.gens[0][0].logprobs == 1
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["o", "k"]
    assert content[0] == {
        "token": "o",
        "logprob": -0.5,
        "bytes": [ord("o")],
        "top_logprobs": [{"token": "o", "logprob": -0.5, "bytes": [ord("o")]}],
    }


def test_chat_tools_constrain_the_output_and_come_back_as_tool_calls():
    fake = FakeFrontend(reply=CALL_TEXT)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
    }
    status, out = post(fake, "/v1/chat/completions", body)
    assert status == 200
    gen = fake.gens[0][0]
    assert gen.response_format is not None or gen.grammar is not None
    assert "get_weather" in text_of(gen.prompt_tokens)  # the preamble names the tool
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_chat_tools_stream_one_tool_calls_chunk_once_the_call_is_complete():
    fake = FakeFrontend(reply=CALL_TEXT)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL], "stream": True}
    status, text = post_raw(fake, "/v1/chat/completions", body)
    assert status == 200
    deltas = [c["choices"][0]["delta"] for c in datas(sse(text))]
    assert not any(d.get("content") for d in deltas)  # the call's JSON is never streamed as text
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert datas(sse(text))[-1]["choices"][0]["finish_reason"] == "tool_calls"


CUT_CALL = '{"name": "get_weather", "arguments": {"ci'
"""A call cut by max_tokens: no complete call, and no text either."""


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_cut_by_max_tokens_is_length_with_no_content_pretending_to_be_text(choice):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL], "tool_choice": choice}
    status, out = post(FakeFrontend(reply=CUT_CALL, finish="length"), "/v1/chat/completions", body)
    assert status == 200
    (c,) = out["choices"]
    assert c["finish_reason"] == "length" and c["message"]["content"] is None
    assert "tool_calls" not in c["message"]
    status, text = post_raw(
        FakeFrontend(reply=CUT_CALL, finish="length"), "/v1/chat/completions", {**body, "stream": True}
    )
    chunks = datas(sse(text))
    assert status == 200 and not any(ch["choices"][0]["delta"].get("content") for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Under "auto" text that is no call is content, as before.
    status, out = post(
        FakeFrontend(reply="sunny", finish="length"), "/v1/chat/completions", {**body, "tool_choice": "auto"}
    )
    assert out["choices"][0]["message"]["content"] == "sunny"


def test_messages_a_cut_call_is_max_tokens_with_no_text():
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    fake = FakeFrontend(reply=CUT_CALL, finish="length")
    status, out = post(fake, "/v1/messages", msg_body(tools=[tool], tool_choice={"type": "any"}))
    assert status == 200 and out["stop_reason"] == "max_tokens"
    assert all(b.get("text", "") == "" for b in out["content"]) and not any(
        b["type"] == "tool_use" for b in out["content"]
    )


def test_parallel_calls_are_bounded_by_the_tools_offered():
    def schema_of(tools):
        fake = FakeFrontend(reply=CALL_TEXT)
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
        assert post(fake, "/v1/chat/completions", body)[0] == 200  # parallel_tool_calls defaults to true
        return fake.gens[0][0].response_format["json_schema"]["schema"]

    one = schema_of([WEATHER_TOOL])
    assert one["type"] == "object" and one["properties"]["name"] == {"const": "get_weather"}  # one call
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    two = schema_of([WEATHER_TOOL, time_tool])
    assert two["type"] == "array" and (two["minItems"], two["maxItems"]) == (1, 2)


def test_chat_structured_output_passes_to_the_generate_and_refuses_tools_with_it():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    fake = FakeFrontend(reply='{"a": 1}')
    msgs = [{"role": "user", "content": "hi"}]
    status, out = post(fake, "/v1/chat/completions", {"messages": msgs, "response_format": rf})
    assert status == 200 and fake.gens[0][0].response_format == rf
    assert out["choices"][0]["message"]["content"] == '{"a": 1}'
    status, out = post(
        fake, "/v1/chat/completions", {"messages": msgs, "response_format": rf, "tools": [WEATHER_TOOL]}
    )
    assert status == 400 and out["error"]["param"] == "tool_choice"


@pytest.mark.parametrize(
    ("body", "param", "phrase"),
    [
        (b"", None, "the request body is empty"),
        (b"{not json", None, "not valid JSON"),
        (json.dumps({"prompt": "x", "suffix": "s"}).encode(), "suffix", "unsupported field 'suffix'"),
        (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), "max_tokens", "invalid request body"),
        (json.dumps({"prompt": "x", "n": 99}).encode(), "n", "n must be an integer"),
        (json.dumps({"prompt": []}).encode(), "prompt", "the prompt is empty"),
        (
            json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}).encode(),
            "stream_options",
            "only",
        ),
        (json.dumps({"prompt": "x", "logit_bias": {"abc": 1}}).encode(), "logit_bias", "token ids"),
    ],
)
def test_openai_bad_bodies_are_typed_400s_naming_the_field(body, param, phrase):
    fake = FakeFrontend()
    status, out = post(fake, "/v1/completions", body)
    assert status == 400 and set(out) == {"error"}
    err = out["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and phrase in err["message"]
    assert fake.gens == []


def test_openai_unknown_model_and_context_overflow_are_typed_errors():
    fake = FakeFrontend()
    status, out = post(fake, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and out["error"]["code"] == "model_not_found" and "nope" in out["error"]["message"]
    assert out["error"]["param"] == "model"
    status, out = post(fake, "/v1/completions", {"prompt": "x", "max_tokens": CONTEXT})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    assert out["error"]["type"] == "invalid_request_error"


def test_openai_errors_from_the_front_end_map_to_statuses_before_and_during_a_stream():
    status, out = post(FakeFrontend(error_first=ErrorCode.WORKER_FAILED), "/v1/completions", {"prompt": "x"})
    assert status == 503 and out["error"]["code"] == "worker_failed"
    fake = FakeFrontend(fail=ErrorCode.WORKER_FAILED)
    status, text = post_raw(fake, "/v1/completions", {"prompt": "x", "stream": True})
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    last = datas(sse(text))[-1]
    assert last["error"]["code"] == "worker_failed" and last["error"]["type"] == "service_unavailable_error"


def test_qos_comes_from_the_header_then_the_body_and_must_name_a_class():
    fake = FakeFrontend()
    assert post(fake, "/v1/completions", {"prompt": "x", "qos": "batch"})[0] == 200
    assert (
        post(fake, "/v1/completions", {"prompt": "x", "qos": "batch"}, {"X-Basertd-QoS": "interactive"})[0]
        == 200
    )
    assert [g.qos for g, _ in fake.gens] == ["batch", "interactive"]
    status, out = post(fake, "/v1/completions", {"prompt": "x", "qos": "urgent"})
    assert status == 400 and out["error"]["param"] == "qos"


def test_models_tokenize_detokenize_health_and_metrics():
    fake = FakeFrontend()

    async def fn(client: TestClient) -> None:
        r = await client.get("/v1/models")
        assert (await r.json())["data"] == [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "basertd", "max_model_len": CONTEXT}
        ]
        r = await client.get(f"/v1/models/{MODEL}")
        assert r.status == 200 and (await r.json())["id"] == MODEL
        r = await client.get("/v1/models/other")
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        r = await client.post("/tokenize", json={"content": "ab"})
        assert await r.json() == {"tokens": ids("ab"), "count": 2, "max_model_len": CONTEXT}
        r = await client.post("/detokenize", json={"tokens": ids("hé")})
        assert await r.json() == {"content": "hé", "prompt": "hé"}
        r = await client.post("/tokenize", json={})
        assert r.status == 400 and (await r.json())["error"]["param"] == "content"
        r = await client.get("/tokenizer_info")  # vLLM's, read by lm-eval's remote tokenizer
        info = await r.json()
        assert info["bos_token"] is None and info["eos_token"] is None and info["pad_token"] is None
        assert "im_start" in info["chat_template"] and info["model_max_length"] == CONTEXT
        fake.inputs = Inputs(bos_token="<s>", eos_token="</s>")
        info = await (await client.get("/tokenizer_info", params={"model": MODEL})).json()
        assert (info["bos_token"], info["eos_token"]) == ("<s>", "</s>")
        r = await client.get("/tokenizer_info", params={"model": "other"})
        assert r.status == 404, await r.text()
        r = await client.get("/health")
        assert r.status == 200 and await r.json() == {"status": "ok", "reason": "", "workers_ready": 1}
        r = await client.get("/metrics")
        assert r.content_type == "text/plain" and "basertd_fake 1" in await r.text()
        r = await client.get("/v2/nothing")
        assert r.status == 404 and "no route GET /v2/nothing" in (await r.json())["error"]["message"]

    run(fake, fn)


def test_last_event_id_resumes_a_stream_from_the_token_count():
    fake = FakeFrontend(resume_id="dur-1")
    body = {"prompt": "x", "stream": True}

    async def fn(client: TestClient) -> tuple[str, str, str]:
        first = await client.post("/v1/completions", json=body)
        whole = await first.text()
        rid = first.headers[resume.KEY_HEADER]  # the key, before any event
        assert rid == "dur-1" and sse(whole)[0]["id"] == f"{rid}:{len(ids('Hello,'))}"
        n1 = len(ids("Hello,"))
        r = await client.post("/v1/completions", json=body, headers={"Last-Event-ID": f"{rid}:{n1}"})
        rest = await r.text()
        r = await client.post("/v1/completions", json=body, headers={"Last-Event-ID": "unknown:1"})
        return whole, rest, str(r.status)

    whole, rest, unknown = run(fake, fn)
    assert fake.follows == [("dur-1", len(ids("Hello,"))), ("unknown", 1)] and unknown == "404"
    texts = [c["choices"][0]["text"] for c in datas(sse(rest))]
    assert texts == [" world!", ""]  # no re-run: one Generate only
    assert len(fake.gens) == 1 and sse(rest)[0]["id"] == sse(whole)[1]["id"]


def test_the_openai_client_package_reads_our_chat_and_completions():
    openai = pytest.importorskip("openai")
    fake = FakeFrontend(cached=1)

    async def fn(client: TestClient) -> None:
        c = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
        out = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content == "Hello, world!" and out.choices[0].finish_reason == "stop"
        assert out.usage.prompt_tokens_details.cached_tokens == 1
        stream = await c.completions.create(model=MODEL, prompt="x", stream=True)
        assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == "Hello, world!"
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model=MODEL, prompt="x", max_tokens=CONTEXT)
        assert err.value.code == "context_length_exceeded"
        await c.close()

    run(fake, fn)


# --- Anthropic -----------------------------------------------------------------------------------


def msg_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_messages_answer_a_message_with_anthropic_usage():
    fake = FakeFrontend(cached=3)
    status, out = post(fake, "/v1/messages", msg_body(system="be brief", temperature=0.2, top_k=5))
    assert status == 200
    gen, api_name = fake.gens[0]
    assert api_name == "anthropic" and gen.request_id == out["id"] and out["id"].startswith("msg_")
    prompt = text_of(gen.prompt_tokens)
    assert prompt == "<|im_start|>system\nbe brief<|im_end|>\n" + CHAT_PROMPT
    assert (gen.max_tokens, gen.temperature, gen.top_k, gen.top_p) == (32, 0.2, 5, 1.0)
    n = len(ids(prompt))
    assert out == {
        "id": out["id"],
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "Hello, world!"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": n - 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 3,
            "output_tokens": len(ids("Hello, world!")),
        },
    }


@pytest.mark.parametrize(
    ("fake", "kw", "reason", "stop"),
    [
        (FakeFrontend(finish="length"), {}, "max_tokens", None),
        (FakeFrontend(hidden_stop="END"), {"stop_sequences": ["STOP", "END"]}, "stop_sequence", "END"),
        (FakeFrontend(), {"stop_sequences": ["END"]}, "end_turn", None),
    ],
)
def test_messages_stop_reasons(fake, kw, reason, stop):
    status, out = post(fake, "/v1/messages", msg_body(**kw))
    assert status == 200 and (out["stop_reason"], out["stop_sequence"]) == (reason, stop)
    assert fake.gens[0][0].stop == kw.get("stop_sequences", [])


def test_messages_prefill_continues_the_last_assistant_turn():
    fake = FakeFrontend()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]
    status, _ = post(fake, "/v1/messages", msg_body(messages=messages))
    assert status == 200 and text_of(fake.gens[0][0].prompt_tokens) == CHAT_PROMPT + "Sure:"
    messages[-1]["content"] = "Sure: "
    status, out = post(fake, "/v1/messages", msg_body(messages=messages))
    assert status == 400 and "trailing whitespace" in out["error"]["message"]
    # a prefill alone leaves the template nothing to render it after: a clear 400, not its failure
    status, out = post(fake, "/v1/messages", msg_body(messages=[{"role": "assistant", "content": "Sure:"}]))
    assert status == 400 and "give a user message" in out["error"]["message"], out
    assert len(fake.gens) == 1


def test_messages_stream_is_anthropics_named_events():
    fake = FakeFrontend()
    status, text = post_raw(fake, "/v1/messages", msg_body(stream=True))
    assert status == 200
    events = sse(text)
    names = [e["event"] for e in events]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = [json.loads(e["data"]) for e in events]
    assert data[0]["message"]["content"] == [] and data[0]["message"]["stop_reason"] is None
    assert "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta") == "Hello, world!"
    assert data[6]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert data[6]["usage"]["output_tokens"] == len(ids("Hello, world!"))
    mid = fake.gens[0][0].request_id
    assert events[-1]["id"] == f"{mid}:{len(ids('Hello, world!'))}" and events[0]["id"] == f"{mid}:0"


def test_messages_tools_translate_to_a_constraint_and_back_to_tool_use_blocks():
    fake = FakeFrontend(reply=CALL_TEXT)
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    body = msg_body(tools=[tool], tool_choice={"type": "any"})
    status, out = post(fake, "/v1/messages", body)
    assert status == 200 and out["stop_reason"] == "tool_use"
    gen = fake.gens[0][0]
    assert gen.response_format is not None or gen.grammar is not None
    (block,) = out["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert block["name"] == "get_weather" and block["input"] == {"city": "Paris"}
    status, text = post_raw(fake, "/v1/messages", body | {"stream": True})
    data = [json.loads(e["data"]) for e in sse(text)]
    (delta,) = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert delta == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert data[-2]["delta"]["stop_reason"] == "tool_use"
    status, out = post(fake, "/v1/messages", msg_body(tool_choice={"type": "any"}))
    assert status == 400 and out["error"]["message"] == "tool_choice needs tools"


def test_messages_tool_results_go_back_into_the_template():
    fake = FakeFrontend()
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]
    status, _ = post(fake, "/v1/messages", msg_body(messages=messages, tools=[tool]))
    assert status == 200
    assert "Result of get_weather (call t1):\nsunny" in text_of(fake.gens[0][0].prompt_tokens)


def test_count_tokens_counts_the_rendered_prompt():
    status, out = post(
        FakeFrontend(), "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 200 and out == {"input_tokens": len(ids(CHAT_PROMPT))}


@pytest.mark.parametrize(
    ("body", "status", "etype", "phrase"),
    [
        (b"", 400, "invalid_request_error", "the request body is empty"),
        (
            json.dumps(msg_body(max_tokens=0)).encode(),
            400,
            "invalid_request_error",
            "max_tokens: must be >= 1",
        ),
        (
            json.dumps(msg_body(thinking={"type": "enabled"})).encode(),
            400,
            "invalid_request_error",
            "thinking",
        ),
        (json.dumps(msg_body(foo=1)).encode(), 400, "invalid_request_error", "unsupported field 'foo'"),
        (json.dumps(msg_body(model="nope")).encode(), 404, "not_found_error", "'nope' is not served"),
        (
            json.dumps(msg_body(max_tokens=CONTEXT)).encode(),
            400,
            "invalid_request_error",
            "exceed the context",
        ),
    ],
)
def test_anthropic_errors_are_anthropic_error_objects(body, status, etype, phrase):
    got, out = post(FakeFrontend(), "/v1/messages", body)
    assert got == status and out["type"] == "error" and set(out["error"]) == {"type", "message"}
    assert out["error"]["type"] == etype and phrase in out["error"]["message"]


def test_anthropic_error_during_a_stream_is_an_error_event():
    fake = FakeFrontend(fail=ErrorCode.TIMEOUT)
    status, text = post_raw(fake, "/v1/messages", msg_body(stream=True))
    events = sse(text)
    assert status == 200 and events[-1]["event"] == "error"
    assert json.loads(events[-1]["data"]) == {
        "type": "error",
        "error": {"type": "timeout_error", "message": "the worker crashed"},
    }


def test_the_anthropic_client_package_reads_our_messages():
    anthropic = pytest.importorskip("anthropic")
    fake = FakeFrontend()

    async def fn(client: TestClient) -> None:
        c = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="none", max_retries=0)
        out = await c.messages.create(
            model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "hi"}]
        )
        assert out.content[0].text == "Hello, world!" and out.stop_reason == "end_turn"
        async with c.messages.stream(
            model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            assert "".join([t async for t in stream.text_stream]) == "Hello, world!"
        with pytest.raises(anthropic.NotFoundError):
            await c.messages.create(model="nope", max_tokens=32, messages=[{"role": "user", "content": "hi"}])
        await c.close()

    run(fake, fn)


# --- Ollama --------------------------------------------------------------------------------------


def ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line]


def test_ollama_chat_streams_ndjson_and_closes_with_counts_and_durations():
    fake = FakeFrontend()
    status, text = post_raw(
        fake, "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 200
    lines = ndjson(text)
    assert [ln["done"] for ln in lines] == [False, False, True]
    assert "".join(ln["message"]["content"] for ln in lines) == "Hello, world!"
    assert all(ln["model"] == f"{MODEL}:latest" and ln["created_at"].endswith("Z") for ln in lines)
    last = lines[-1]
    assert last["done_reason"] == "stop" and last["prompt_eval_count"] == len(ids(CHAT_PROMPT))
    assert last["eval_count"] == len(ids("Hello, world!"))
    assert (last["total_duration"], last["load_duration"]) == (1_500_000_000, 0)
    assert (last["prompt_eval_duration"], last["eval_duration"]) == (125_000_000, 1_250_000_000)
    gen, api_name = fake.gens[0]
    assert api_name == "ollama" and gen.stream and text_of(gen.prompt_tokens) == CHAT_PROMPT
    assert (gen.temperature, gen.top_p, gen.top_k) == (0.8, 0.9, 40)  # Ollama's defaults
    assert gen.max_tokens == CONTEXT - len(ids(CHAT_PROMPT))


def test_ollama_generate_translates_options_raw_and_format():
    fake = FakeFrontend(finish="length")
    options = {"num_predict": 5, "temperature": 0.1, "top_k": 2, "seed": -1, "stop": ["z"], "num_ctx": 9}
    body = {"model": f"{MODEL}:latest", "prompt": "abc", "raw": True, "stream": False, "options": options}
    status, out = post(fake, "/api/generate", body | {"format": "json"})
    assert status == 200
    gen = fake.gens[0][0]
    assert gen.prompt_tokens == ids("abc") and gen.model == MODEL and not gen.stream
    assert (gen.max_tokens, gen.temperature, gen.top_k, gen.seed, gen.stop) == (5, 0.1, 2, None, ["z"])
    assert gen.response_format == {"type": "json_object"}
    assert out["response"] == "Hello, world!" and out["done"] and out["done_reason"] == "length"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    status, _ = post(fake, "/api/generate", body | {"format": schema})
    assert status == 200
    assert fake.gens[1][0].response_format == {
        "type": "json_schema",
        "json_schema": {"name": "format", "schema": schema},
    }


def test_ollama_without_a_prompt_answers_load_at_once():
    fake = FakeFrontend()
    status, out = post(fake, "/api/generate", {"model": MODEL})
    assert status == 200 and out["done_reason"] == "load" and out["response"] == "" and fake.gens == []
    status, out = post(fake, "/api/chat", {"model": MODEL, "messages": []})
    assert out["message"] == {"role": "assistant", "content": ""} and out["done_reason"] == "load"


@pytest.mark.parametrize(
    ("path", "body", "status", "phrase"),
    [
        ("/api/generate", b"", 400, "the request body is empty"),
        ("/api/generate", {"model": "nope", "prompt": "x"}, 404, "model 'nope' not found"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "images": ["aa"]}, 400, "images is not supported"),
        (
            "/api/chat",
            {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["a"]}]},
            400,
            "images",
        ),
        (
            "/api/chat",
            {"model": MODEL, "tools": [{}], "messages": [{"role": "user", "content": "x"}]},
            400,
            "tools[0] must be",
        ),
        ("/api/chat", {"model": MODEL, "think": True, "messages": []}, 400, "think is not supported"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"num_predict": 0}}, 400, "num_predict"),
        (
            "/api/generate",
            {"model": MODEL, "prompt": "x", "options": {"mirostat": 1}},
            400,
            "options.mirostat",
        ),
        ("/api/generate", {"model": MODEL, "prompt": "x", "format": 3}, 400, "format must be"),
        (
            "/api/generate",
            {"model": MODEL, "prompt": "x", "options": {"num_predict": CONTEXT}},
            400,
            "exceed",
        ),
        ("/api/pull", {"model": MODEL}, 501, "pull is not available"),
    ],
)
def test_ollama_errors_are_ollama_error_objects(path, body, status, phrase):
    fake = FakeFrontend()
    got, out = post(fake, path, body if isinstance(body, bytes) else json.dumps(body).encode())
    assert got == status and set(out) == {"error"} and phrase in out["error"]


def test_ollama_error_during_a_stream_is_an_error_line():
    status, text = post_raw(
        FakeFrontend(fail=ErrorCode.WORKER_FAILED), "/api/generate", {"model": MODEL, "prompt": "x"}
    )
    lines = ndjson(text)
    assert status == 200 and lines[-1] == {"error": "the worker crashed"} and not lines[0]["done"]


def test_ollama_model_endpoints():
    fake = FakeFrontend()

    async def fn(client: TestClient) -> None:
        assert await (await client.get("/")).text() == "Ollama is running"
        assert await (await client.get("/api/version")).json() == {"version": "0.9.0"}
        (tag,) = (await (await client.get("/api/tags")).json())["models"]
        assert (
            tag["name"] == f"{MODEL}:latest" and tag["details"]["format"] == "gguf" and "modified_at" in tag
        )
        (ps,) = (await (await client.get("/api/ps")).json())["models"]
        assert ps["context_length"] == CONTEXT and ps["expires_at"].startswith("9999")
        show = await (await client.post("/api/show", json={"model": f"{MODEL}:latest"})).json()
        assert show["model_info"] == {"general.context_length": CONTEXT, "vocab_size": TOK.vocab_size}
        assert "<|im_start|>" in show["template"]
        r = await client.delete("/api/delete", json={"model": MODEL})
        assert r.status == 501

    run(fake, fn)


def test_a_worker_without_a_chat_template_is_a_400_in_each_dialect():
    fake = FakeFrontend(inputs=Inputs(configured=""))
    status, out = post(fake, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and out["error"]["code"] == "chat_template"
    status, out = post(fake, "/v1/messages", msg_body())
    assert status == 400 and out["error"]["type"] == "invalid_request_error"
    status, out = post(fake, "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "has no chat template" in out["error"]
    status, out = post(fake, "/api/generate", {"model": MODEL, "prompt": "x", "raw": True, "stream": False})
    assert status == 200  # raw prompts need no template


def test_the_ollama_client_package_reads_our_chat():
    ollama = pytest.importorskip("ollama")
    fake = FakeFrontend()

    async def fn(client: TestClient) -> None:
        c = ollama.AsyncClient(host=str(client.make_url("")))
        out = await c.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert out.message.content == "Hello, world!" and out.done_reason == "stop"
        parts = [p.message.content async for p in await c.chat(model=MODEL, messages=[], stream=True)]
        assert parts == [""]  # no messages: the load answer
        with pytest.raises(ollama.ResponseError) as err:
            await c.generate(model="nope", prompt="x")
        assert err.value.status_code == 404

    run(fake, fn)


def test_ollama_tools_come_back_as_tool_calls_and_results_go_back_into_the_template():
    ollama = pytest.importorskip("ollama")
    fake = FakeFrontend(reply=CALL_TEXT)

    async def fn(client: TestClient) -> None:
        c = ollama.AsyncClient(host=str(client.make_url("")))
        msgs = [{"role": "user", "content": "weather in Paris?"}]
        out = await c.chat(model=MODEL, messages=msgs, tools=[WEATHER_TOOL])
        (call,) = out.message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
        assert out.message.content == "" and out.done_reason == "stop"
        lines = [p async for p in await c.chat(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], stream=True)]
        assert not any(p.message.content for p in lines)  # the call's JSON is never streamed as text
        (streamed,) = [p for p in lines if p.message.tool_calls]
        assert streamed.message.tool_calls[0].function.arguments == {"city": "Paris"} and lines[-1].done
        turns = [
            *msgs,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
        ]
        fake.reply = "It is sunny."
        out = await c.chat(model=MODEL, messages=turns, tools=[WEATHER_TOOL])
        assert out.message.content == "It is sunny." and not out.message.tool_calls
        prompt = text_of(fake.gens[-1][0].prompt_tokens)
        assert "Result of get_weather" in prompt and "sunny, 21 C" in prompt and '"city":"Paris"' in prompt
        out = await c.chat(model=MODEL, messages=msgs)  # the client sends tools: [] without tools
        assert out.message.content == "It is sunny."

    run(fake, fn)


def test_embeddings_in_openais_and_ollamas_shapes():
    fake = FakeFrontend()
    status, out = post(fake, "/v1/embeddings", {"input": ["ab", "ab", "b"], "encoding_format": "float"})
    assert status == 200 and [d["index"] for d in out["data"]] == [0, 1, 2]
    assert out["model"] == MODEL and out["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    status, b64 = post(fake, "/v1/embeddings", {"input": ["ab"], "encoding_format": "base64"})
    raw = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
    assert np.allclose(raw, out["data"][0]["embedding"])
    status, o = post(fake, "/api/embed", {"model": MODEL, "input": "ab"})
    assert status == 200 and np.allclose(o["embeddings"][0], out["data"][0]["embedding"])
    status, o = post(fake, "/api/embeddings", {"model": MODEL, "prompt": "b"})
    assert status == 200 and np.allclose(o["embedding"], out["data"][2]["embedding"])
    status, o = post(fake, "/api/embed", {"model": "nope", "input": "ab"})
    assert status == 404 and set(o) == {"error"}  # Ollama's error shape on /api/
    assert fake.embed_apis == ["openai", "openai", "ollama", "ollama", "ollama"]  # for the access line


def test_echo_starts_each_choice_with_its_prompt_and_its_logprobs():
    fake = FakeFrontend(reply="ok")
    status, out = post(
        fake, "/v1/completions", {"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 2}
    )
    assert status == 200
    (c,) = out["choices"]
    assert c["text"] == "abok"
    lp = c["logprobs"]
    assert lp["tokens"] == ["a", "b", "o", "k"] and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"][:2] == [None, pytest.approx(-0.1)] and lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"b": pytest.approx(-0.1)}
    assert fake.gens[0][0].prompt_tokens == ids("ab")  # generated from the tokens it echoed
    status, out = post(fake, "/v1/completions", {"prompt": ["ab", "c"], "echo": True, "max_tokens": 0})
    assert status == 200 and [c["text"] for c in out["choices"]] == ["ab", "c"]
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 0 and len(fake.gens) == 1  # nothing generated
    status, text = post_raw(
        fake, "/v1/completions", {"prompt": "ab", "echo": True, "stream": True, "max_tokens": 2}
    )
    chunks = datas(sse(text))
    assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks) == "abok"
    assert chunks[0]["choices"][0]["text"] == "ab"


def test_ollama_tool_turns_may_carry_the_call_id_as_litellm_sends_them():
    fake = FakeFrontend(reply="It is sunny.")
    call = {"id": "call_7", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turns = [
        {"role": "user", "content": "weather in Paris?", "images": []},
        {"role": "assistant", "content": "", "images": [], "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C", "images": [], "tool_call_id": "call_7"},
    ]
    body = {"model": MODEL, "messages": turns, "tools": [WEATHER_TOOL], "stream": False}
    status, out = post(fake, "/api/chat", body)
    assert status == 200 and out["message"]["content"] == "It is sunny."
    prompt = text_of(fake.gens[0][0].prompt_tokens)
    assert "Result of get_weather (call call_7):\nsunny, 21 C" in prompt  # the name found by the id


OPEN = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
"""A schema as pydantic writes it: no ``additionalProperties``."""


def test_strict_true_closes_every_object_and_without_it_the_objects_that_name_their_keys():
    def schema_of(body):
        fake = FakeFrontend(reply=CALL_TEXT)
        assert post(fake, "/v1/chat/completions", body)[0] == 200
        return fake.gens[0][0].response_format["json_schema"]["schema"]

    msgs = [{"role": "user", "content": "hi"}]
    bare = {"type": "object", "properties": {"city": OPEN, "extra": {"type": "object"}}}
    for strict in (True, False, None):  # what admission compiles
        js = {"name": "city", "schema": bare, **({} if strict is None else {"strict": strict})}
        got = json.loads(grammar.spec_from_request({"type": "json_schema", "json_schema": js}).text)
        assert got["additionalProperties"] is False, (strict, got)  # llama.cpp's and xgrammar's reading
        assert got["properties"]["city"]["additionalProperties"] is False, (strict, got)
        # an object that names no keys is any object, unless strict closes it
        assert (got["properties"]["extra"].get("additionalProperties") is False) is (strict is True)
    said = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    js = {"name": "open", "schema": said}
    got = json.loads(grammar.spec_from_request({"type": "json_schema", "json_schema": js}).text)
    assert got["additionalProperties"] is True  # what a schema says wins
    fn = {"name": "get_weather", "parameters": OPEN, "strict": True}
    tool = schema_of(
        {"messages": msgs, "tools": [{"type": "function", "function": fn}], "tool_choice": "required"}
    )
    assert tool["properties"]["arguments"]["additionalProperties"] is False
    status, out = post(
        FakeFrontend(),
        "/v1/chat/completions",
        {"messages": msgs, "tools": [{"type": "function", "function": {**fn, "strict": "yes"}}]},
    )
    assert status == 400 and "strict must be a boolean" in out["error"]["message"]
