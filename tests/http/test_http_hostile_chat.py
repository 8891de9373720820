"""Hostile chats over HTTP against a real daemon (``transport.http.templates``): a chat template
renders in a child process under ``[compile]`` limits, so a template that loops on a request's
messages is a 400 naming the limit after ``template_timeout_s`` while other connections are served
at once, and one that prints without end stops at ``template_max_chars``; ``tools`` over
``max_tools`` or ``max_tools_bytes`` is a 400 naming the cap.

The worker is the C reference engine with a template file whose loops run only for the message
``spin`` (or print without end for ``print``), so normal chats render as usual. ``pytest -s``
prints the probe latencies measured while the template loops.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest
from daemon_harness import Daemon

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.content == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if m.content == 'print' %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endif %}"
    "<{{ m.role }}>{{ m.content }}\n"
    "{% endfor %}<assistant>"
)
TIMEOUT_S = 1.5
MAX_TOOLS = 3
MAX_TOOLS_BYTES = 2048
MAX_MESSAGES = 50


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "spin.jinja"
    path.write_text(TEMPLATE)
    cfg = (
        f'[[workers]]\nengine = "basert"\nlanes = 2\ncontext_length = 2048\nchat_template = "{path}"\n'
        f"[compile]\ntemplate_timeout_s = {TIMEOUT_S}\ntemplate_max_chars = 65536\n"
        f"max_tools = {MAX_TOOLS}\nmax_tools_bytes = {MAX_TOOLS_BYTES}\nmax_messages = {MAX_MESSAGES}\n"
        '[http]\nlisten = ["127.0.0.1:0"]\n'
    )
    with Daemon(cfg) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


@pytest.fixture(scope="module")
def oai(daemon):
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def chat(oai, content: str, **kw):
    return oai.chat.completions.create(
        model="", messages=[{"role": "user", "content": content}], max_tokens=2, **kw
    )


def test_a_template_that_loops_is_a_400_within_the_limit_while_other_connections_are_served(daemon, oai):
    latencies: list[float] = []
    done = threading.Event()
    ready = threading.Event()

    def probe() -> None:
        with (
            daemon.client() as c,
            openai.OpenAI(
                base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=30
            ) as other,
        ):
            chat(other, "hello")  # the clients' first calls (imports, connects) are not the daemon's
            c.generate("hi", max_tokens=2)
            ready.set()
            while not done.is_set():
                for fn in (c.health, lambda: chat(other, "hello"), lambda: c.generate("hi", max_tokens=2)):
                    t = time.monotonic()
                    fn()
                    latencies.append(time.monotonic() - t)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    assert ready.wait(60)
    t = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, "spin")
    took = time.monotonic() - t
    done.set()
    thread.join(30)
    assert "time limit" in str(err.value) and "chat template" in str(err.value), err.value
    assert TIMEOUT_S <= took < TIMEOUT_S + 5.0, took
    print(
        f"\nlooping template: 400 after {took:.2f} s; {len(latencies)} probes, worst "
        f"{max(latencies) * 1000:.0f} ms"
    )
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
    assert chat(oai, "hello").choices[0].finish_reason == "length"  # the pool serves on


def test_a_template_that_prints_without_end_stops_at_the_output_limit(daemon, oai):
    with pytest.raises(openai.BadRequestError, match="longer than 65536 characters"):
        chat(oai, "print")
    assert chat(oai, "hello").choices[0].finish_reason == "length"


def tool(name: str, description: str = "") -> dict:
    params = {"type": "object", "properties": {"x": {"type": "integer"}}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def test_tools_over_the_count_or_byte_cap_are_400s_naming_the_cap(daemon, oai):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, "hello", tools=[tool(f"f{i}") for i in range(MAX_TOOLS + 1)])
    assert f"at most {MAX_TOOLS} tools" in str(err.value), err.value
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, "hello", tools=[tool("f", "d" * MAX_TOOLS_BYTES)])
    assert f"at most {MAX_TOOLS_BYTES} bytes of tools" in str(err.value), err.value
    body = {
        "model": "",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}],
        "tools": [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(MAX_TOOLS + 1)],
    }
    req = urllib.request.Request(
        daemon.http_url + "/v1/messages",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "anthropic-version": "2023-06-01"},
    )
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(req, timeout=30)
    assert http_err.value.code == 400 and f"at most {MAX_TOOLS} tools" in http_err.value.read().decode()
    # within the caps: served (the reference engine takes the tool grammar's JSON schema)
    out = chat(oai, "hello", tools=[tool("f")], tool_choice="required")
    assert out.choices[0].finish_reason in ("length", "tool_calls", "stop")


def test_a_chat_over_the_message_cap_is_a_400_naming_it_on_every_dialect(daemon, oai):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}] * (MAX_MESSAGES // 2)
    turns.append({"role": "user", "content": "hi"})
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_MESSAGES} messages"):
        oai.chat.completions.create(model="", messages=turns, max_tokens=2)
    for path, extra in (("/v1/messages", {"max_tokens": 2}), ("/api/chat", {"stream": False})):
        req = urllib.request.Request(
            daemon.http_url + path,
            data=json.dumps({"model": "", "messages": turns, **extra}).encode(),
            headers={"content-type": "application/json", "anthropic-version": "2023-06-01"},
        )
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(req, timeout=30)
        assert http_err.value.code == 400, path
        assert f"at most {MAX_MESSAGES} messages" in http_err.value.read().decode(), path
    assert chat(oai, "hello").choices[0].finish_reason == "length"
