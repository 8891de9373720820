"""Anthropic's Messages API and Ollama's API, through the official ``anthropic`` and ``ollama``
packages, on the default model (Gemma 3 270M Q4_K_M, llama.cpp, Gemma's shipped turn template;
marked ``realmodel``): a short greedy chat streamed and not, the same text both ways, a sensible
stop reason (the model is a base model: through the turn template it tends to restate the turn
rather than answer it, so the text itself is not checked), and cached tokens when the same prompt
comes again (DESIGN.md "Prefix cache policy"). One daemon for the module, one llama.cpp
thread. Each test prints the events of its streamed exchange (``pytest -s`` shows them)."""

from __future__ import annotations

import anthropic
import ollama
import pytest
from daemon_harness import Daemon

pytestmark = pytest.mark.realmodel

MAX = 16
SYSTEM = (
    "You are a helpful geography tutor. You answer questions about capitals, rivers and mountains "
    "with one short sentence, and you never add a greeting or a follow-up question."
)
"""Long enough that the rendered prompt fills whole prefix-cache pages."""
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def daemon(default_model):
    cfg = (
        '[[workers]]\nengine = "llamacpp"\nlanes = 2\ncontext_length = 512\nthreads = 1\n'
        '[http]\nlisten = ["127.0.0.1:0"]\n'
    )
    with Daemon(cfg, ready_timeout=180) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


def access_of(daemon, api: str) -> list[dict]:
    return [e for e in daemon.log_events() if e.get("event") == "access" and e.get("api") == api]


def test_anthropic_stream_on_the_default_model(daemon):
    msgs = [{"role": "user", "content": QUESTION}]
    greedy = {"temperature": 0}
    with anthropic.Anthropic(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120) as c:
        full = c.messages.create(model="", system=SYSTEM, messages=msgs, max_tokens=MAX, extra_body=greedy)
        text, end = [], None
        print("\nanthropic stream:")
        for ev in c.messages.create(
            model="", system=SYSTEM, messages=msgs, max_tokens=MAX, extra_body=greedy, stream=True
        ):
            print(" ", ev.to_json(indent=None))
            if ev.type == "content_block_delta":
                text.append(ev.delta.text)
            elif ev.type == "message_delta":
                end = ev
    answer = full.content[0].text
    assert answer.strip() and "".join(text) == answer
    assert full.stop_reason == ("max_tokens" if full.usage.output_tokens == MAX else "end_turn")
    assert end.delta.stop_reason == full.stop_reason and end.usage.output_tokens == full.usage.output_tokens
    assert "<end_of_turn>" not in answer and "<start_of_turn>" not in answer  # specials are never text
    prompt = full.usage.input_tokens + full.usage.cache_read_input_tokens
    assert end.usage.cache_read_input_tokens > 0, end.usage  # the same prompt again: a prefix-cache hit
    assert end.usage.input_tokens + end.usage.cache_read_input_tokens == prompt


def test_ollama_stream_on_the_default_model(daemon):
    client = ollama.Client(host=daemon.http_url, timeout=120)
    (m,) = client.list().models
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    opts = {"temperature": 0, "num_predict": MAX}
    full = client.chat(model=m.model, messages=msgs, options=opts)
    print("\nollama stream:")
    chunks = []
    for chunk in client.chat(model=m.model, messages=msgs, options=opts, stream=True):
        print(" ", chunk.model_dump_json(exclude_none=True))
        chunks.append(chunk)
    answer = full.message.content
    assert answer.strip() and "".join(c.message.content for c in chunks) == answer
    assert full.done_reason == ("length" if full.eval_count == MAX else "stop")
    last = chunks[-1]
    assert last.done and last.done_reason == full.done_reason and last.eval_count == full.eval_count
    assert last.prompt_eval_count == full.prompt_eval_count and last.eval_duration > 0
    stamps = [c.created_at for c in chunks]  # each line stamped when written
    assert stamps == sorted(stamps) and stamps[0] < stamps[-1]
    served = access_of(daemon, "ollama")[-2:]
    assert [e.get("prompt_tokens") for e in served] == [full.prompt_eval_count] * 2
    assert served[-1].get("cached_tokens", 0) > 0, served  # the same prompt again: a prefix-cache hit
