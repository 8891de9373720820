"""The OpenAI-compatible API driven by the official ``openai`` package against a real daemon
(reference engine, bytes vocabulary, the shipped ``chatml`` template), one daemon per module.

The daemon listens on 127.0.0.1 port 0 (the address comes from its log) with an API key file, and
on a Unix socket; background requests are capped at one lane and a queue of six, so a 429 can be
provoked without touching the other classes."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from daemon_harness import Daemon
from serving_harness import ref_toml

from basertd.server.sched.core import QUEUED_FIRST_S

KEY = "sk-test-0123456789"
LANES = 4


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("http")
    keys = base / "keys"
    keys.write_text(f"# test keys\n{KEY}\nsk-other\n")
    unix = base / "http.sock"
    cfg = ref_toml(
        lanes=LANES,
        context=512,
        grant=1,
        queue_limit=6,
        ref={"tick_delay_us": 5000},
        worker='chat_template = "chatml"',
        scheduler="lane_caps = {background = 1}",
    ) + (
        f'[http]\nlisten = ["127.0.0.1:0", "unix:{unix}"]\napi_key_file = "{keys}"\nmax_body_bytes = 65536\n'
    )
    with Daemon(cfg) as d:
        addrs = d.http_addresses()
        d.http_url = "http://" + next(a for a in addrs if not a.startswith("unix:"))
        d.http_unix = str(unix)
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def raw(daemon):
    with httpx.Client(base_url=daemon.http_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(id, data) of every event of an SSE body."""
    out = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln and not ln.startswith(":")]
        if not lines:
            continue
        eid = next((ln[4:] for ln in lines if ln.startswith("id: ")), None)
        data = next(ln[6:] for ln in lines if ln.startswith("data: "))
        out.append((eid, data))
    return out


def test_completion_and_its_stream_agree(client):
    full = client.completions.create(model="", prompt="hello there", max_tokens=12, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    (choice,) = full.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert full.usage.prompt_tokens == len(b"hello there")  # bytes, no BOS
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(
        client.completions.create(
            model=full.model,
            prompt="hello there",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_sse_framing_ids_and_done(raw):
    r = raw.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == (None, "[DONE]")
    counts = [int(eid.rsplit(":", 1)[1]) for eid, _ in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == 6
    rid = events[0][0].rsplit(":", 1)[0]
    assert all(eid.startswith(rid + ":") for eid, _ in events[:-1])


def test_chat_streamed_and_not(client, raw):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="", messages=msgs, max_tokens=8, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    rendered = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert full.usage.prompt_tokens == len(rendered.encode())  # the reference engine adds no BOS
    chunks = list(
        client.chat.completions.create(
            model="",
            messages=[{"role": "system", "content": [{"type": "text", "text": "be brief"}]}, msgs[1]],
            max_completion_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_share_the_prompt_and_cached_tokens_show(client):
    prompt = "a shared prefix that is long enough to be worth caching " * 3
    first = client.completions.create(model="", prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model="", prompt=prompt, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0, (first.usage, again.usage)
    three = client.completions.create(model="", prompt=prompt, max_tokens=5, n=3, temperature=0)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.text for c in three.choices}) == 1  # greedy: the same text three times
    assert three.usage.prompt_tokens == first.usage.prompt_tokens and three.usage.completion_tokens == 15
    streamed = list(
        client.completions.create(model="", prompt=[prompt, "other"], max_tokens=3, n=2, stream=True)
    )
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1, 2, 3}


def test_stop_and_seed(client):
    base = client.completions.create(model="", prompt="xyz", max_tokens=16, temperature=0).choices[0].text
    stop = base[5:7]
    cut = client.completions.create(model="", prompt="xyz", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == base[: base.index(stop)]
    streamed = client.completions.create(
        model="", prompt="xyz", max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    a = client.completions.create(model="", prompt="s", max_tokens=10, temperature=1.0, seed=42)
    b = client.completions.create(model="", prompt="s", max_tokens=10, temperature=1.0, seed=42)
    assert a.choices[0].text == b.choices[0].text
    # n choices with one seed: the first is the n = 1 answer, the others differ, a rerun repeats them
    n3 = [
        [c.text for c in client.completions.create(**params).choices]
        for params in [dict(model="", prompt="s", max_tokens=10, temperature=1.0, seed=42, n=3)] * 2
    ]
    assert n3[0] == n3[1] and n3[0][0] == a.choices[0].text
    assert len(set(n3[0])) == 3, n3[0]


def test_models_health_metrics_tokenize(daemon, client, raw):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    assert client.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    h = httpx.get(daemon.http_url + "/health")  # public: no key needed
    assert h.status_code == 200 and h.json()["status"] == "ok"
    m = raw.get("/metrics")
    assert m.status_code == 200 and "basertd_" in m.text
    t = raw.post("/tokenize", json={"content": "hi", "add_special": False}).json()
    assert t["tokens"] == [3 + ord("h"), 3 + ord("i")] and t["count"] == 2
    t2 = raw.post("/tokenize", json={"prompt": "hi"}).json()
    assert t2["tokens"] == t["tokens"]  # no BOS in this vocabulary
    d = raw.post("/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["content"] == "hi" == d["prompt"]


def test_error_classes(daemon, client):
    with pytest.raises(openai.BadRequestError, match="scores no prompts"):  # the reference engine
        client.completions.create(model="", prompt="xyz", max_tokens=2, echo=True, logprobs=1)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="", prompt="x", max_tokens=2, best_of=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens") as err:
        client.completions.create(model="", prompt="x", max_tokens=0)
    assert err.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="logprobs") as err:
        client.completions.create(model="", prompt="x", max_tokens=2, logprobs=21)
    assert err.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError, match="logit_bias") as err:
        client.completions.create(model="", prompt="x", max_tokens=2, logit_bias={"5": 101.0})
    assert err.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="", prompt="", max_tokens=2)
    assert err.value.code == "empty_prompt" and err.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="", prompt="x" * 600, max_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    # Refusals at admission name the field as the endpoint calls it (the error's ``param``).
    chat = {"model": "", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(openai.BadRequestError, match="temperature") as err:
        client.chat.completions.create(**chat, temperature=150.0)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**chat, max_tokens=600)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"
    for value, code in ((600, "context_length_exceeded"), (0, "invalid_request")):  # the field sent
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**chat, max_completion_tokens=value)
        assert err.value.code == code and err.value.param == "max_completion_tokens"
        assert "max_completion_tokens" in err.value.message and "max_tokens " not in err.value.message
        assert not err.value.message.startswith("request ")  # the server's own id is not the client's
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "x" * 600}])
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="", input="hi", max_output_tokens=600)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="", input="hi", top_p=1.5)
    assert err.value.param == "top_p"
    # top_k -1 is vLLM's and SGLang's "off" (their routers send it); other negatives are refused
    for create, kw in (
        (client.chat.completions.create, {"messages": chat["messages"], "max_tokens": 2}),
        (client.completions.create, {"prompt": "hi", "max_tokens": 2}),
        (client.responses.create, {"input": "hi", "max_output_tokens": 2}),
    ):
        assert create(model="", extra_body={"top_k": -1}, **kw)
        with pytest.raises(openai.BadRequestError) as err:
            create(model="", extra_body={"top_k": -2}, **kw)
        assert err.value.param == "top_k"
    with pytest.raises(openai.BadRequestError, match="QoS"):
        client.completions.create(model="", prompt="x", max_tokens=2, extra_headers={"X-Basertd-QoS": "vip"})
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert (err.value.code, err.value.param) == ("model_not_found", "model")  # as GET /v1/models/nope
    bad = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="sk-wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(daemon.http_url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(daemon.http_url + "/v2/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="", prompt="y" * 70000, max_tokens=2)
    assert err.value.status_code == 413 and "max_body_bytes" in err.value.message


def test_queue_full_is_429_with_retry_after(daemon, client):
    """Background: one lane, a queue of six; the eighth concurrent background request is refused."""
    bg = {"X-Basertd-QoS": "background"}
    streams = [
        client.completions.create(model="", prompt="b", max_tokens=400, stream=True, extra_headers=bg)
        for _ in range(7)
    ]
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="", prompt="b", max_tokens=4, extra_headers=bg)
        assert err.value.response.headers["Retry-After"] == "1"
        assert err.value.code == "queue_full"
        # the interactive class is untouched
        assert client.completions.create(model="", prompt="i", max_tokens=2).choices[0].text
    finally:
        for s in streams:
            s.close()
    wait_idle(daemon)


def test_a_chat_stream_that_queues_reads_whole_in_the_openai_sdk(daemon, client):
    """A chat stream's first chunk (the role) goes out at once, with an ``id:`` line; queue notices
    after it are SSE comment lines with no blank line of their own: the ``openai`` SDK's decoder
    makes an event of any blank line once it has seen an id, and then fails on its empty data."""
    bg = {"X-Basertd-QoS": "background"}  # one background lane: the second background stream queues
    holder = client.completions.create(model="", prompt="b", max_tokens=400, stream=True, extra_headers=bg)
    try:
        next(iter(holder))  # the lane is taken
        stream = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            extra_headers=bg,
        )
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        waited = 0
        while daemon.workers()[0].queue_depth == 0:  # the chat request is queued behind the holder
            assert waited < 500, "the chat stream never queued"
            time.sleep(0.01)
            waited += 1
        time.sleep(QUEUED_FIRST_S + 0.5)  # a queue notice goes out after the role chunk
        holder.close()  # the lane frees: the queued chat runs
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        holder.close()
    wait_idle(daemon)


def wait_idle(daemon, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = daemon.workers()
        if all(r.lanes_busy == 0 and r.queue_depth == 0 for r in rows):
            return
        assert time.monotonic() < deadline, [(r.lanes_busy, r.queue_depth) for r in rows]
        time.sleep(0.02)


def test_disconnect_mid_stream_frees_the_lane(daemon, raw):
    with raw.stream(
        "POST", "/v1/completions", json={"prompt": "long", "max_tokens": 400, "stream": True}
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("id: ")
        assert daemon.workers()[0].lanes_busy == 1
    # the connection is closed: the lane retires in the next plan (5 ms ticks)
    t0 = time.monotonic()
    wait_idle(daemon, timeout=2.0)
    assert time.monotonic() - t0 < 1.0
    access = [e for e in daemon.log_events() if e.get("event") == "access" and e.get("api") == "openai"]
    assert access and access[-1].get("completion_tokens", 0) < 400


def test_unix_socket_needs_no_key(daemon):
    with httpx.Client(transport=httpx.HTTPTransport(uds=daemon.http_unix), base_url="http://basertd") as c:
        assert c.get("/health").json()["status"] == "ok"
        r = c.post("/v1/completions", json={"prompt": "u", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].type"


def test_error_after_streaming_began_is_one_event_then_done(daemon, raw):
    """A stream cut by the daemon (a control-verb cancel is not exposed; a drain with a zero
    timeout cancels in-flight requests typed) ends with one error event, then [DONE]."""
    result: dict = {}

    def consume() -> None:
        with raw.stream(
            "POST", "/v1/completions", json={"prompt": "d", "max_tokens": 500, "stream": True}
        ) as r:
            result["text"] = "".join(r.iter_text())

    th = threading.Thread(target=consume)
    th.start()
    deadline = time.monotonic() + 5
    while daemon.workers()[0].lanes_busy == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ctl = daemon.ctl("drain", "--timeout", "0")
    th.join(30)
    assert "cancelled" in ctl.stdout + ctl.stderr or ctl.returncode == 0, ctl.stderr
    events = sse_events(result["text"])
    assert events[-1] == (None, "[DONE]")
    err = json.loads(events[-2][1])["error"]
    assert err["code"] in ("draining", "shutting_down", "cancelled"), err
    h = httpx.get(daemon.http_url + "/health")
    assert h.status_code == 503 and h.json()["status"] == "draining"
    undrain = daemon.ctl("resume")
    assert undrain.returncode == 0, undrain.stderr
    assert httpx.get(daemon.http_url + "/health").status_code == 200


def test_non_loopback_without_key_exits_2(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[http]\nlisten = ["0.0.0.0:8000"]\n')
    r = subprocess.run(
        [sys.executable, "-m", "basertd.cli", "serve", "--config", str(cfg)], capture_output=True, timeout=60
    )
    assert r.returncode == 2
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "api_key_file" in lines[0] and "0.0.0.0:8000" in lines[0]
    r = subprocess.run(
        [sys.executable, "-m", "basertd.cli", "serve", "--config", str(cfg), "--http", "10.1.2.3:80"],
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 2 and "10.1.2.3:80" in r.stderr.decode()


def test_a_reset_before_accepted_storm_leaves_no_lane_busy(daemon):
    """24 streamed requests whose clients reset the connection right after sending, inside the
    group-commit wait before Accepted: each is cancelled (none runs to its max_tokens for nobody)
    and the lanes are free again at once."""
    body = json.dumps({"prompt": "storm", "max_tokens": 480, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {daemon.http_url[7:]}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    host, port = daemon.http_url[7:].rsplit(":", 1)
    before = len(daemon.log_events())
    for _ in range(24):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        s.sendall(head + body)
        s.close()
    wait_idle(daemon, timeout=3.0)  # 480 tokens of 5 ms ticks is 2.4 s a request, 4 lanes
    access = [e for e in daemon.log_events()[before:] if e.get("event") == "access"]
    assert all(e.get("completion_tokens", 0) < 480 for e in access), access
    ok = httpx.post(
        daemon.http_url + "/v1/completions",
        json={"prompt": "probe", "max_tokens": 3, "temperature": 0},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
