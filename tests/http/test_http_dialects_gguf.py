"""Anthropic's Messages API and Ollama's API, through the official ``anthropic`` and ``ollama``
packages, on llama.cpp workers serving the tiny random-weight GGUFs (``tests/tinymodel.py``): one
daemon per module with a ``llama`` worker (the shipped ``chatml`` template) and a ``gemma3`` worker
(the shipped ``gemma`` template, which writes BOS itself), one llama.cpp thread each.

Every answer is checked against the native API (``basertd.client``) given the same rendered prompt
as token ids (``GgufTokenizer`` of the same file, BOS added only when the template did not write
it): greedy text, prompt and completion token counts, and the finish reason."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest
from daemon_harness import Daemon
from proc_testutil import wait_until

from basertd.server.request.tokenizer import GgufTokenizer
from basertd.server.transport.http.chat_template import ChatTemplate, load_template_text

T0 = {"temperature": 0}
"""Greedy (the anthropic SDK takes sampling fields only through extra_body)."""
TEMPLATES = {"tiny-llama": "chatml", "tiny-gemma3": "gemma"}
"""Model id (the GGUF's stem) -> the shipped template its worker is configured with."""
MODELS = list(TEMPLATES)
MSGS = [{"role": "user", "content": "hello world"}]
SYSTEM = "be brief"


@pytest.fixture(scope="module")
def paths(tiny_gguf, tiny_gemma3_gguf):
    return {"tiny-llama": tiny_gguf, "tiny-gemma3": tiny_gemma3_gguf}


@pytest.fixture(scope="module")
def daemon(paths):
    workers = "".join(
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{paths[m]}"\nlanes = 2\ncontext_length = 512\n'
        f'threads = 1\nchat_template = "{TEMPLATES[m]}"\n'
        for m in MODELS
    )
    cfg = workers + '[scheduler]\ndecode_grant = 4\ndecode_tick_s = 0\n[http]\nlisten = ["127.0.0.1:0"]\n'
    with Daemon(cfg) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


@pytest.fixture(scope="module")
def native(daemon):
    with daemon.client() as c:
        yield c


@pytest.fixture(scope="module")
def claude(daemon):
    with anthropic.Anthropic(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def olla(daemon):
    return ollama.Client(host=daemon.http_url, timeout=60)


@pytest.fixture(scope="module")
def prompt_ids(paths):
    """``prompt_ids(model, messages) -> token ids`` of the rendered conversation, as the HTTP front
    end must build them (a template that writes BOS gets no second one)."""
    toks = {m: GgufTokenizer(str(p)) for m, p in paths.items()}

    def ids(model: str, messages: list[dict]) -> list[int]:
        tok = toks[model]
        bos, eos = tok.token_text(tok.bos_id), tok.token_text(tok.eos_id)
        tmpl = ChatTemplate(load_template_text(TEMPLATES[model]), bos_token=bos, eos_token=eos)
        text = tmpl.render(messages, add_generation_prompt=True)
        out = tok.encode(text, add_bos=tmpl.needs_bos(text))
        assert out.count(tok.bos_id) == 1 and out[0] == tok.bos_id
        return out

    yield ids
    for t in toks.values():
        t.close()


ARCH = {"tiny-llama": "llama", "tiny-gemma3": "gemma3"}
"""Model id -> the GGUF's ``general.architecture``."""


def test_the_models_are_served(daemon, native, olla, paths):
    assert sorted(m.id for m in native.models().models) == sorted(MODELS)
    assert sorted(m.model for m in olla.list().models) == sorted(f"{m}:latest" for m in MODELS)
    for m in MODELS:
        assert olla.show(m).template == load_template_text(TEMPLATES[m])


def test_ollama_lists_each_model_with_its_weights(native, olla, paths):
    """``/api/tags`` and ``/api/show`` give each model's own family, parameter count,
    quantization, file size and digest, as its engine reports them."""
    infos = {m.id: m for m in native.models().models}
    for tag in olla.list().models:
        model = tag.model.removesuffix(":latest")
        info = infos[model]
        assert info.family == ARCH[model] and info.parameters > 0 and info.quantization
        assert tag.size == paths[model].stat().st_size == info.file_bytes
        assert tag.digest == info.digest and len(tag.digest) == 32
        d = tag.details
        assert d.family == ARCH[model] and d.families == [ARCH[model]]
        assert d.quantization_level == info.quantization and d.parameter_size
        shown = olla.show(model)  # the model asked for, not the first one served
        assert shown.details.family == ARCH[model] and shown.details.quantization_level == info.quantization
        assert shown.modelinfo["general.architecture"] == ARCH[model]
        assert shown.modelinfo["general.parameter_count"] == info.parameters


@pytest.mark.parametrize("model", MODELS)
def test_anthropic_matches_the_native_api(native, claude, prompt_ids, model):
    ids = prompt_ids(model, [{"role": "system", "content": SYSTEM}, *MSGS])
    ref = native.generate(prompt_tokens=ids, model=model, max_tokens=12, temperature=0)
    assert ref.usage.prompt_tokens == len(ids)
    full = claude.messages.create(model=model, system=SYSTEM, messages=MSGS, max_tokens=12, extra_body=T0)
    assert full.model == model and full.content[0].text == ref.text
    assert full.stop_reason == {"length": "max_tokens", "eos": "end_turn"}[ref.finish_reason]
    u = full.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(ids)
    assert u.output_tokens == ref.usage.completion_tokens
    counted = claude.messages.count_tokens(model=model, system=SYSTEM, messages=MSGS)
    assert counted.input_tokens == len(ids)

    types, deltas, end = [], [], None
    for ev in claude.messages.create(
        model=model,
        system=[{"type": "text", "text": SYSTEM}],
        messages=MSGS,
        max_tokens=12,
        extra_body=T0,
        stream=True,
    ):
        types.append(ev.type)
        if ev.type == "content_block_delta":
            deltas.append(ev.delta.text)
        elif ev.type == "message_delta":
            end = ev
    assert "".join(deltas) == ref.text
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert end.delta.stop_reason == full.stop_reason and end.usage.output_tokens == u.output_tokens
    assert end.usage.input_tokens + end.usage.cache_read_input_tokens == len(ids)
    with claude.messages.stream(model=model, system=SYSTEM, messages=MSGS, max_tokens=12, extra_body=T0) as s:
        assert "".join(s.text_stream) == ref.text
        final = s.get_final_message()
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == u.output_tokens


@pytest.mark.parametrize("model", MODELS)
def test_ollama_matches_the_native_api(native, olla, prompt_ids, model):
    opts = {**T0, "num_predict": 12}
    msgs = [{"role": "system", "content": SYSTEM}, *MSGS]
    ids = prompt_ids(model, msgs)
    ref = native.generate(prompt_tokens=ids, model=model, max_tokens=12, temperature=0)
    done_reason = {"length": "length", "eos": "stop"}[ref.finish_reason]

    chat = olla.chat(model=model, messages=msgs, options=opts)
    assert chat.message.content == ref.text and chat.done_reason == done_reason
    assert chat.prompt_eval_count == len(ids) and chat.eval_count == ref.usage.completion_tokens
    chunks = list(olla.chat(model=f"{model}:latest", messages=msgs, options=opts, stream=True))
    assert "".join(c.message.content for c in chunks) == ref.text
    assert [c.done for c in chunks].count(True) == 1 and chunks[-1].done_reason == done_reason
    assert chunks[-1].prompt_eval_count == len(ids) and chunks[-1].eval_count == ref.usage.completion_tokens

    gen = olla.generate(model=model, system=SYSTEM, prompt=MSGS[0]["content"], options=opts)
    assert gen.response == ref.text and gen.prompt_eval_count == len(ids)
    parts = list(
        olla.generate(model=model, system=SYSTEM, prompt=MSGS[0]["content"], options=opts, stream=True)
    )
    assert "".join(p.response for p in parts) == ref.text and parts[-1].eval_count == gen.eval_count


@pytest.mark.parametrize("model", MODELS)
def test_stop_sequences(native, claude, olla, prompt_ids, model):
    msgs = [{"role": "user", "content": "the world is"}]
    ids = prompt_ids(model, msgs)
    base = native.generate(prompt_tokens=ids, model=model, max_tokens=24, temperature=0, ignore_eos=True).text
    ascii_pair = [base[i : i + 2] for i in range(3, len(base) - 1)]
    stop = next(p for p in ascii_pair if p.isascii() and p.isalnum())  # not a U+FFFD of a split byte
    head = base[: base.index(stop)]

    cut = claude.messages.create(
        model=model, messages=msgs, max_tokens=24, stop_sequences=[stop], extra_body=T0
    )
    if cut.stop_reason == "end_turn":  # the model drew its end-of-generation token before the stop
        pytest.skip(f"{model} ends greedily before {stop!r}")
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop and cut.content[0].text == head
    with claude.messages.stream(
        model=model, messages=msgs, max_tokens=24, stop_sequences=["\x00never", stop], extra_body=T0
    ) as s:
        assert "".join(s.text_stream) == head
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop

    opts = {**T0, "num_predict": 24, "stop": [stop]}
    chat = olla.chat(model=model, messages=msgs, options=opts)
    assert chat.done_reason == "stop" and chat.message.content == head
    chunks = list(olla.chat(model=model, messages=msgs, options=opts, stream=True))
    assert "".join(c.message.content for c in chunks) == head and chunks[-1].done_reason == "stop"


def test_anthropic_cache_read_on_a_repeated_prefix(daemon, claude, prompt_ids):
    model = "tiny-llama"
    system = "a long shared system prompt that is worth caching across requests " * 3
    ids = prompt_ids(model, [{"role": "system", "content": system}, *MSGS])
    first = claude.messages.create(model=model, system=system, messages=MSGS, max_tokens=2, extra_body=T0)

    def published() -> bool:  # the first prompt's pages reach the cache when its lane retires
        rows = json.loads(daemon.ctl("--json", "cache", "ls").stdout)
        return any(
            r["head"] == ids[: len(r["head"])] and r["prefix_tokens"] >= len(ids) // 16 * 16 for r in rows
        )

    wait_until(published, 60, interval=0.2, what="the first request's prompt in the prefix cache")
    again = claude.messages.create(model=model, system=system, messages=MSGS, max_tokens=2, extra_body=T0)
    assert again.usage.cache_read_input_tokens > 0, (first.usage, again.usage)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(ids)
    assert again.content[0].text == first.content[0].text


def test_a_greedy_completion_applies_its_penalties(daemon):
    """OpenAI's ``frequency_penalty`` at temperature 0 changes the argmax (the penalised row's, as
    vLLM and llama.cpp's server take it): the random-weight model loops greedily, the penalty
    breaks the loop, and the same request twice gives the same text."""
    c = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def text(**kw) -> list[int]:
        r = c.completions.create(model="tiny-llama", prompt="abc", max_tokens=32, temperature=0, logprobs=0,
                                 extra_body={"ignore_eos": True}, **kw)  # fmt: skip
        return r.choices[0].logprobs.tokens

    plain, pen = text(), text(frequency_penalty=2.0)
    assert pen != plain and pen == text(frequency_penalty=2.0)
    most = lambda toks: max(toks.count(t) for t in set(toks))  # noqa: E731
    assert most(pen) < most(plain), (plain, pen)
