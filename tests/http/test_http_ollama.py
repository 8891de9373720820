"""Ollama's API driven by the official ``ollama`` package against a real daemon (reference engine,
bytes vocabulary, the shipped ``chatml`` template), one daemon per module; the daemon listens on
loopback without API keys, as Ollama does."""

from __future__ import annotations

import json
import time

import httpx
import ollama
import pytest
from daemon_harness import Daemon
from serving_harness import ref_toml

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    cfg = ref_toml(
        lanes=4,
        context=512,
        grant=1,
        queue_limit=6,
        ref={"tick_delay_us": 5000},
        worker='chat_template = "chatml"',
        scheduler="lane_caps = {background = 1}",
    ) + ('[http]\nlisten = ["127.0.0.1:0"]\nmax_body_bytes = 65536\n')
    with Daemon(cfg) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.http_url, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    (m,) = client.list().models
    return m.model


def chatml(user: str, system: str = "") -> str:
    sys_part = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_part}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def wait_idle(daemon, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(r.lanes_busy == 0 and r.queue_depth == 0 for r in daemon.workers()):
        assert time.monotonic() < deadline, [(r.lanes_busy, r.queue_depth) for r in daemon.workers()]
        time.sleep(0.02)


def test_root_version_tags_ps_show(daemon, client, model):
    r = httpx.get(daemon.http_url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert httpx.head(daemon.http_url + "/").status_code == 200
    assert httpx.get(daemon.http_url + "/api/version").json()["version"]
    assert model.endswith(":latest")
    (running,) = client.ps().models
    assert running.model == model
    shown = client.show(model)
    assert "im_start" in shown.template and "completion" in shown.capabilities
    assert shown.modelinfo["general.context_length"] == 512


def test_generate_and_chat_streamed_and_not(daemon, client, model):
    opts = {**GREEDY, "num_predict": 8}
    full = client.generate(model=model, prompt="hi", system="be brief", options=opts)
    assert full.done and full.done_reason == "length" and full.response
    assert full.prompt_eval_count == len(chatml("hi", "be brief").encode()) and full.eval_count == 8
    assert full.total_duration >= full.eval_duration > 0 and full.prompt_eval_duration > 0
    with daemon.client() as native:
        ref = native.generate(chatml("hi", "be brief"), max_tokens=8, temperature=0)
    assert ref.text == full.response and ref.usage.prompt_tokens == full.prompt_eval_count
    parts = list(client.generate(model=model, prompt="hi", system="be brief", options=opts, stream=True))
    assert "".join(p.response for p in parts) == full.response
    assert [p.done for p in parts].count(True) == 1 and parts[-1].eval_count == 8
    raw = client.generate(model=model, prompt=chatml("hi", "be brief"), raw=True, options=opts)
    assert raw.response == full.response
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.chat(model=model, messages=msgs, options=opts)
    assert chat.message.role == "assistant" and chat.message.content == full.response
    assert chat.done_reason == "length" and chat.prompt_eval_count == full.prompt_eval_count
    chunks = list(client.chat(model=model, messages=msgs, options=opts, stream=True))
    assert "".join(c.message.content for c in chunks) == chat.message.content
    assert chunks[-1].done and chunks[-1].eval_count == 8
    lines = httpx.post(
        daemon.http_url + "/api/chat", json={"model": model, "messages": msgs, "options": opts}
    ).text.splitlines()
    assert len(lines) > 2 and all(json.loads(ln)["model"] == model for ln in lines)  # NDJSON by default
    loaded = client.generate(model=model, prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_stop_seed_and_model_without_tag(client, model):
    base = client.generate(model=model, prompt="xyz", options={**GREEDY, "num_predict": 16}).response
    stop = base[5:7]
    cut = client.generate(model=model, prompt="xyz", options={**GREEDY, "num_predict": 16, "stop": [stop]})
    assert cut.done_reason == "stop" and cut.response == base[: base.index(stop)]
    sampled = {"temperature": 1.0, "seed": 7, "num_predict": 10, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    a = client.generate(model=model, prompt="s", options=sampled).response
    b = client.generate(model=model.removesuffix(":latest"), prompt="s", options=sampled).response
    assert a == b
    long = "shared prefix worth caching " * 4
    client.generate(model=model, prompt=long, options={**GREEDY, "num_predict": 2, "repeat_penalty": 1.0})
    again = client.generate(model=model, prompt=long, options={**GREEDY, "num_predict": 2, "num_ctx": 4096})
    assert again.prompt_eval_count == len(chatml(long).encode())


def test_error_classes(daemon, client, model):
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="nope", prompt="x")
    assert err.value.status_code == 404 and "nope" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=model, messages=[{"role": "user", "content": "x"}], format={"type": "nonsense"})
    assert err.value.status_code == 400 and "format" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=model, prompt="x", options={"mirostat": 2})
    assert err.value.status_code == 400 and "mirostat" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=model, prompt="x" * 600)
    assert err.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=model, prompt="x", options={"temperature": -1})
    assert err.value.status_code == 400 and "temperature" in err.value.error
    for call in (lambda: client.pull(model), lambda: client.delete(model), lambda: client.copy(model, "b")):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 501 and "configuration" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=model, prompt="y" * 70000)
    assert err.value.status_code == 413
    bg = {"X-Basertd-QoS": "background"}
    held = [
        httpx.stream(
            "POST",
            daemon.http_url + "/api/generate",
            json={"model": model, "prompt": "b", "options": {"num_predict": 400}},
            headers=bg,
        )
        for _ in range(7)
    ]
    try:
        for h in held:
            h.__enter__()
        r = httpx.post(daemon.http_url + "/api/generate", json={"model": model, "prompt": "b"}, headers=bg)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1" and "error" in r.json()
    finally:
        for h in held:
            h.__exit__(None, None, None)
    wait_idle(daemon)
    assert daemon.ctl("drain", "--timeout", "0").returncode == 0
    try:
        with pytest.raises(ollama.ResponseError) as err:
            client.generate(model=model, prompt="x")
        assert err.value.status_code == 503
    finally:
        assert daemon.ctl("resume").returncode == 0


def test_disconnect_mid_stream_frees_the_lane(daemon, model):
    opts = {"num_predict": 400, "temperature": 1.0, "top_k": 0, "top_p": 1.0}  # as the OpenAI test samples
    body = {"model": model, "prompt": "long", "options": opts}
    with httpx.stream("POST", daemon.http_url + "/api/generate", json=body, timeout=30) as r:
        first = json.loads(next(r.iter_lines()))
        assert first["done"] is False
        assert daemon.workers()[0].lanes_busy == 1
    t0 = time.monotonic()
    wait_idle(daemon, timeout=2.0)
    assert time.monotonic() - t0 < 1.0
    access = [e for e in daemon.log_events() if e.get("event") == "access" and e.get("api") == "ollama"]
    assert access and access[-1].get("completion_tokens", 0) < 400
