"""Chat templates: rendered prompts token-exact against llama.cpp's own rendering
(``llama_chat_apply_template``) for templates it knows, the sandbox, ``raise_exception``, and
where a worker's template comes from."""

from __future__ import annotations

import ctypes

import llama_cpp
import pytest

from basertd.server.request.tokenizer import GgufTokenizer
from basertd.server.transport.http.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_template_text,
    shipped_templates,
    template_source,
)

CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  what is the answer?  "},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "and ünïcödé ✓?"},
    ],
]


def llama_render(template: str, messages: list[dict], add_ass: bool = True) -> str:
    """llama.cpp's built-in rendering of ``messages`` for the template it detects in ``template``."""
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        arr[i].role, arr[i].content = role, content
    size = 4096
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(messages), add_ass, buf, size)
    assert 0 < n < size, n
    return buf.raw[:n].decode()


@pytest.fixture(scope="module")
def tok(tiny_gguf):
    t = GgufTokenizer(str(tiny_gguf))
    yield t
    t.close()


def test_shipped_templates_are_installed():
    assert {"gemma", "chatml"} <= set(shipped_templates())


@pytest.mark.parametrize("name", ["gemma", "chatml"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_token_exact_against_llama_cpp(tok, name, conv):
    messages = CONVERSATIONS[conv]
    source = load_template_text(name)
    bos = tok.token_text(tok.bos_id)
    ours = ChatTemplate(source, bos_token=bos, eos_token=tok.token_text(tok.eos_id))
    text = ours.render(messages, add_generation_prompt=True)
    theirs = llama_render(source, messages)  # llama.cpp's built-ins never write BOS
    mine = tok.encode(text, add_bos=ours.needs_bos(text))
    ref = tok.encode(theirs, add_bos=tok.add_bos)
    if name == "gemma":
        assert text.startswith(bos) and not ours.needs_bos(text)
    assert mine == ref, (text, theirs)


@pytest.mark.realmodel
def test_default_model_uses_the_shipped_gemma_template(default_model):
    t = GgufTokenizer(str(default_model))
    try:
        assert t.meta("tokenizer.chat_template") is None  # the base model carries none
        source = template_source("", t.meta("tokenizer.chat_template"), default_model=True)
        tmpl = ChatTemplate(source, bos_token=t.token_text(t.bos_id), eos_token=t.token_text(t.eos_id))
        for messages in CONVERSATIONS:
            text = tmpl.render(messages)
            mine = t.encode(text, add_bos=tmpl.needs_bos(text))
            assert mine == t.encode(llama_render(source, messages), add_bos=True)
            assert mine.count(t.bos_id) == 1
        end_of_turn = t.encode("<end_of_turn>", add_bos=False)
        assert len(end_of_turn) == 1  # one special token: llama.cpp ends generation at it
    finally:
        t.close()


def test_raise_exception_and_bad_templates():
    gemma = ChatTemplate(load_template_text("gemma"), bos_token="<bos>")
    with pytest.raises(ChatTemplateError, match="alternate"):
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="failed"):
        ChatTemplate("{{ messages[5]['x'] }}").render([])
    # the sandbox: no reaching Python internals
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([])
    helpers = ChatTemplate("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}")
    assert helpers.render([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]|4'


def test_template_source_rules(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert template_source(str(f), "gguf's", default_model=True) == f.read_text()
    assert template_source("", "gguf's", default_model=True) == "gguf's"
    assert template_source("", None, default_model=True) == load_template_text("gemma")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        template_source("", None, default_model=False)
    with pytest.raises(ChatTemplateError, match="neither"):
        template_source(str(tmp_path / "missing"), None, default_model=False)
