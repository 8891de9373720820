"""Anthropic's Messages API driven by the official ``anthropic`` package against a real daemon
(reference engine, bytes vocabulary, the shipped ``chatml`` template), one daemon per module;
SSE resume with ``Last-Event-ID`` (``resume_grace_s``) on the OpenAI and Anthropic streams."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest
from daemon_harness import Daemon
from proc_testutil import wait_until
from serving_harness import ref_toml
from sse_testutil import read_events, sse_fields

KEY = "sk-ant-test-0123"
GRACE_S = 1.0
T0 = {"temperature": 0}
"""Greedy (this SDK takes sampling fields only through extra_body)."""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("anthropic")
    keys = base / "keys"
    keys.write_text(f"{KEY}\n")
    cfg = ref_toml(
        lanes=4,
        context=512,
        grant=1,
        queue_limit=6,
        ref={"tick_delay_us": 5000},
        worker='chat_template = "chatml"',
        scheduler="lane_caps = {background = 1}",
    ) + (
        f'[http]\nlisten = ["127.0.0.1:0"]\napi_key_file = "{keys}"\nmax_body_bytes = 65536\n'
        f"resume_grace_s = {GRACE_S}\n"
    )
    with Daemon(cfg) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with anthropic.Anthropic(base_url=daemon.http_url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def rendered(system: str, user: str) -> str:
    sys_part = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_part}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def wait_idle(daemon, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(r.lanes_busy == 0 and r.queue_depth == 0 for r in daemon.workers()):
        assert time.monotonic() < deadline, [(r.lanes_busy, r.queue_depth) for r in daemon.workers()]
        time.sleep(0.02)


def test_message_stream_and_native_agree(daemon, client):
    msgs = [{"role": "user", "content": "hi"}]
    full = client.messages.create(model="", system="be brief", messages=msgs, max_tokens=8, extra_body=T0)
    assert full.type == "message" and full.role == "assistant" and full.id.startswith("msg_")
    assert full.stop_reason == "max_tokens" and full.stop_sequence is None
    (block,) = full.content
    assert block.type == "text" and block.text
    prompt = rendered("be brief", "hi")
    u = full.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(prompt.encode()) and u.output_tokens == 8
    with daemon.client() as native:
        ref = native.generate(prompt, max_tokens=8, temperature=0)
    assert ref.text == block.text and ref.usage.prompt_tokens == len(prompt.encode())
    assert ref.usage.completion_tokens == u.output_tokens
    types = []
    text = []
    events = client.messages.create(
        model="",
        system=[{"type": "text", "text": "be brief"}],
        messages=msgs,
        max_tokens=8,
        extra_body=T0,
        stream=True,
    )
    for ev in events:
        types.append(ev.type)
        if ev.type == "content_block_delta":
            text.append(ev.delta.text)
        if ev.type == "message_delta":
            assert ev.delta.stop_reason == "max_tokens" and ev.usage.output_tokens == 8
    assert "".join(text) == block.text
    assert types[:2] == ["message_start", "content_block_start"]  # the SDK yields no ping
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    with client.messages.stream(model="", messages=msgs, system="be brief", max_tokens=8, extra_body=T0) as s:
        assert "".join(s.text_stream) == block.text
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    counted = client.messages.count_tokens(model="", system="be brief", messages=msgs)
    assert counted.input_tokens == len(prompt.encode())


def test_stop_sequences_and_prefill(client):
    msgs = [{"role": "user", "content": "xyz"}]
    base = client.messages.create(model="", messages=msgs, max_tokens=16, extra_body=T0).content[0].text
    stop = base[5:7]
    cut = client.messages.create(model="", messages=msgs, max_tokens=16, extra_body=T0, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == base[: base.index(stop)]
    with client.messages.stream(
        model="", messages=msgs, max_tokens=16, extra_body=T0, stop_sequences=["\x00never", stop]
    ) as s:
        assert "".join(s.text_stream) == cut.content[0].text
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    head = base[:3].rstrip()
    prefilled = client.messages.create(
        model="", messages=[*msgs, {"role": "assistant", "content": head}], max_tokens=4, extra_body=T0
    )
    assert prefilled.usage.input_tokens + prefilled.usage.cache_read_input_tokens == len(
        (rendered("", "xyz") + head).encode()
    )


def test_cache_read_on_a_repeated_prefix(client):
    system = "a long shared system prompt that is worth caching across requests " * 3
    msgs = [{"role": "user", "content": "q"}]
    first = client.messages.create(model="", system=system, messages=msgs, max_tokens=2, extra_body=T0)
    again = client.messages.create(model="", system=system, messages=msgs, max_tokens=2, extra_body=T0)
    assert again.usage.cache_read_input_tokens > 0, (first.usage, again.usage)
    total = len(rendered(system, "q").encode())
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def test_error_classes(daemon, client):
    ok = {"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        client.messages.create(**ok, tools=[{"name": "bad name", "input_schema": {"type": "object"}}])
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError, match="only text blocks"):
        client.messages.create(model="", max_tokens=2, messages=[{"role": "user", "content": [img]}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(**{**ok, "max_tokens": 0})
    with pytest.raises(anthropic.BadRequestError, match="bogus"):
        client.messages.create(**ok, extra_body={"bogus": 1})
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(**{**ok, "messages": []})
    assert err.value.body["error"]["type"] == "invalid_request_error" and err.value.body["type"] == "error"
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client.messages.create(**{**ok, "messages": [{"role": "user", "content": "x" * 600}]})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**ok, "model": "nope"})
    bad = anthropic.Anthropic(base_url=daemon.http_url, api_key="wrong", max_retries=0)
    with bad, pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(**ok)
    assert err.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=daemon.http_url, auth_token=KEY, max_retries=0)
    with bearer:
        assert bearer.messages.create(**ok).usage.output_tokens == 2
    with pytest.raises(anthropic.ContentTooLargeError):
        client.messages.create(**{**ok, "messages": [{"role": "user", "content": "y" * 70000}]})
    bg = {"X-Basertd-QoS": "background"}
    held = [
        client.messages.create(**{**ok, "max_tokens": 400}, stream=True, extra_headers=bg) for _ in range(7)
    ]
    try:
        with pytest.raises(anthropic.RateLimitError) as err:
            client.messages.create(**ok, extra_headers=bg)
        assert err.value.response.headers["Retry-After"] == "1"
        assert err.value.body["error"]["type"] == "rate_limit_error"
    finally:
        for s in held:
            s.close()
    wait_idle(daemon, timeout=GRACE_S + 5)
    assert daemon.ctl("drain", "--timeout", "0").returncode == 0
    try:
        with pytest.raises(anthropic.ServiceUnavailableError) as err:
            client.messages.create(**ok)
        assert err.value.body["error"]["type"] == "overloaded_error"
    finally:
        assert daemon.ctl("resume").returncode == 0


def test_disconnect_frees_the_lane_after_the_grace(daemon):
    body = {"model": "", "max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    with httpx.stream(
        "POST", daemon.http_url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30
    ) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: message_start"
        names = [ln for ln in (next(lines) for _ in range(9)) if ln.startswith("event: ")]
        assert names == ["event: content_block_start", "event: ping"], names
        # message_start goes out on acceptance, which can come before the scheduler's next plan
        # admits the request to a lane: wait for the lane
        wait_until(lambda: daemon.workers()[0].lanes_busy == 1, 10, interval=0.02, what="the lane busy")
    t0 = time.monotonic()
    wait_idle(daemon, timeout=GRACE_S + 3)
    assert time.monotonic() - t0 < GRACE_S + 1.0
    access = [e for e in daemon.log_events() if e.get("event") == "access" and e.get("api") == "anthropic"]
    assert access and access[-1].get("completion_tokens", 0) < 400


def read_then_drop(url: str, body: dict, n_events: int) -> tuple[list[dict[str, str]], str]:
    """Read ``n_events`` events of a stream, then drop the connection: (events, last id)."""
    with httpx.stream("POST", url, json=body, headers={"x-api-key": KEY}, timeout=30) as r:
        got = read_events(r, n_events)
    return got, next(e["id"] for e in reversed(got) if "id" in e)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_last_event_id_resumes_without_rerunning(daemon, path):
    msgs = [{"role": "user", "content": "resume me"}]
    body: dict = {"model": "", "max_tokens": 40, "temperature": 0, "stream": True}
    body |= {"prompt": "resume me"} if path == "/v1/completions" else {"messages": msgs}
    url = daemon.http_url + path
    whole = sse_fields(httpx.post(url, json=body, headers={"x-api-key": KEY}, timeout=30).text)

    def text_of(events: list[dict[str, str]]) -> str:
        out = []
        for e in events:
            if e.get("data", "[DONE]") == "[DONE]":
                continue
            d = json.loads(e["data"])
            if path == "/v1/messages":
                out.append(d.get("delta", {}).get("text", "") if d["type"] == "content_block_delta" else "")
            elif path == "/v1/completions":
                out.append(d["choices"][0]["text"] if d["choices"] else "")
            else:
                out.append(d["choices"][0]["delta"].get("content") or "" if d["choices"] else "")
        return "".join(out)

    before = len(daemon.log_events())
    head, last_id = read_then_drop(url, body, 8)
    assert int(last_id.rsplit(":", 1)[1]) < 40
    time.sleep(0.1)
    rest = httpx.post(url, json=body, headers={"x-api-key": KEY, "Last-Event-ID": last_id}, timeout=30)
    assert rest.status_code == 200, rest.text
    tail = sse_fields(rest.text)
    assert text_of(head) + text_of(tail) == text_of(whole)
    assert [e for e in tail if "id" in e][-1]["id"].endswith(":40")
    access = [e for e in daemon.log_events()[before:] if e.get("event") == "access"]
    assert len(access) == 1 and access[0].get("completion_tokens") == 40  # run once, never again
    bad = httpx.post(url, json=body, headers={"x-api-key": KEY, "Last-Event-ID": "nope:3"}, timeout=30)
    assert bad.status_code == 404
    bad = httpx.post(url, json=body, headers={"x-api-key": KEY, "Last-Event-ID": "garbage"}, timeout=30)
    assert bad.status_code == 400
    rid = last_id.rsplit(":", 1)[0]
    past = httpx.post(url, json=body, headers={"x-api-key": KEY, "Last-Event-ID": f"{rid}:99"}, timeout=30)
    assert past.status_code == 400
