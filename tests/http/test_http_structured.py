"""Structured outputs and tool calls over the HTTP APIs, through the official ``openai``,
``anthropic`` and ``ollama`` packages, on llama.cpp workers serving the tiny random-weight GGUFs
(``tests/tinymodel.py``): a ``llama`` worker with the shipped ``chatml`` template and a ``gemma3``
worker with the shipped ``gemma`` template (which insists on alternating user/model turns, so tool
turns take the text form). One daemon per module, one llama.cpp thread each.

Every constrained output parses and validates with ``jsonschema``; tool calls validate against
their tool's parameter schema, streamed and not; bad schemas, grammars, tool lists and choices
are 400s with the reason, and the daemon keeps serving. One ``realmodel`` test runs a JSON-schema
chat and a required tool call on the default model (``pytest -s`` prints both)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from daemon_harness import Daemon

from basertd.client import ClientError
from basertd.schema.client import ErrorCode
from basertd.server.request import grammar
from basertd.server.transport.http import tool_calls
from basertd.server.transport.http.chat_template import ChatTemplate, ChatTemplateError, load_template_text

MODELS = {"tiny-llama": "chatml", "tiny-gemma3": "gemma"}
MAX = 256
"""Room for every schema below (bounded strings and arrays) to finish under the grammar."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {"enum": ["red", "green", 3, None]},
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "inner": {
                "type": "object",
                "properties": {"code": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"}},
                "required": ["code"],
                "additionalProperties": False,
            },
        },
        "required": ["ok", "inner"],
        "additionalProperties": False,
    },
]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
PARAMS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "hello world"}]
PARALLEL_MAX = 1200
"""Room for the most parallel calls a request may make (``tool_calls.MAX_PARALLEL_CALLS``)."""


@pytest.fixture(scope="module")
def daemon(tiny_gguf, tiny_gemma3_gguf):
    paths = {"tiny-llama": tiny_gguf, "tiny-gemma3": tiny_gemma3_gguf}
    workers = "".join(
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{paths[m]}"\nlanes = 2\ncontext_length = 4096\n'
        f'threads = 1\nchat_template = "{t}"\n'
        for m, t in MODELS.items()
    )
    with Daemon(workers + '[http]\nlisten = ["127.0.0.1:0"]\n') as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


@pytest.fixture(scope="module")
def oai(daemon):
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def chat_text(oai, model, stream, **kw):
    """(content, finish_reason) of one chat, streamed or not."""
    if not stream:
        r = oai.chat.completions.create(model=model, messages=MSGS, max_tokens=MAX, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, finish = [], None
    for ch in oai.chat.completions.create(model=model, messages=MSGS, max_tokens=MAX, stream=True, **kw):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
    return "".join(parts), finish


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_json_schemas_on_chat_and_completions(oai, model, stream):
    for k, schema in enumerate(SCHEMAS):
        seed = {"temperature": 1.0, "seed": 100 + k}
        text, finish = chat_text(oai, model, stream, response_format=rf(schema), **seed)
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
        if stream:
            out = oai.completions.create(
                model=model,
                prompt="x",
                max_tokens=MAX,
                stream=True,
                extra_body={"response_format": rf(schema), **seed},
            )
            text = "".join(c.choices[0].text for c in out if c.choices)
        else:
            r = oai.completions.create(
                model=model, prompt="x", max_tokens=MAX, extra_body={"response_format": rf(schema), **seed}
            )
            text = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), schema)
    # any object: a random model may write one key until max_tokens, so only finished ones parse
    for seed in range(4):
        text, finish = chat_text(
            oai, model, stream, response_format={"type": "json_object"}, temperature=1.0, seed=seed
        )
        assert text.startswith("{") and finish in ("stop", "length")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


def test_grammar_and_regex_extensions(oai):
    r = oai.chat.completions.create(
        model="tiny-llama", messages=MSGS, max_tokens=64, extra_body={"regex": "(yes|no)-[0-9]{2}"}
    )
    assert r.choices[0].message.content[:-3] in ("yes", "no") and r.choices[0].message.content[-2:].isdigit()
    lark = 'start: "say " WORD\nWORD: /[a-z]{1,5}/\n'
    r = oai.completions.create(model="tiny-gemma3", prompt="x", max_tokens=64, extra_body={"grammar": lark})
    assert r.choices[0].text.startswith("say ") and r.choices[0].text[4:].isalpha()


def calls_of(oai, model, stream, **kw):
    """(tool_calls as [(id, name, arguments str)], finish_reason, content) of one chat."""
    kw.setdefault("max_tokens", PARALLEL_MAX)
    if not stream:
        r = oai.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, **kw)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert all(c.type == "function" for c in m.tool_calls or [])
        return calls, r.choices[0].finish_reason, m.content
    calls, finish, parts = {}, None, []
    for ch in oai.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        parts.append(d.content or "")
        for tc in d.tool_calls or []:
            prev = calls.get(tc.index, ("", "", ""))
            calls[tc.index] = (
                tc.id or prev[0],
                (tc.function.name or "") if tc.function else prev[1],
                prev[2] + ((tc.function.arguments or "") if tc.function else ""),
            )
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, "".join(parts) or None


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_required_and_named_tool_choice(oai, model, stream):
    for seed in range(3):
        calls, finish, content = calls_of(
            oai, model, stream, tool_choice="required", temperature=1.0, seed=seed
        )
        assert finish == "tool_calls" and calls and not content
        for cid, name, args in calls:
            assert cid.startswith("call_") and name in PARAMS
            jsonschema.validate(json.loads(args), PARAMS[name])
    named = {"type": "function", "function": {"name": "add"}}
    calls, finish, _ = calls_of(oai, model, stream, tool_choice=named, temperature=1.0, seed=9)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0][1] == "add"
    jsonschema.validate(json.loads(calls[0][2]), ADD)
    one = calls_of(
        oai, model, stream, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3
    )
    assert one[1] == "tool_calls" and len(one[0]) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_auto_gives_text_or_a_call(daemon, oai, stream):
    for seed in range(4):
        calls, finish, content = calls_of(oai, "tiny-llama", stream, temperature=1.0, seed=seed)
        if calls:
            assert finish == "tool_calls" and not content
            for _, name, args in calls:
                jsonschema.validate(json.loads(args), PARAMS[name])
        else:
            assert content and content[0] not in "{[ \n" and finish in ("stop", "length")
    # the random model opens with text; a bias towards "[" (parallel calls) makes it open a call
    bracket = httpx.post(
        daemon.http_url + "/tokenize", json={"content": "[", "add_special": False, "model": "tiny-llama"}
    )
    tid = bracket.json()["tokens"][-1]  # SPM may put a word-start piece first
    # llama-server's field adds no BOS unless asked; vLLM's (prompt) adds it unless told not to
    no_bos = httpx.post(daemon.http_url + "/tokenize", json={"content": "[", "model": "tiny-llama"}).json()
    bos = httpx.post(daemon.http_url + "/tokenize", json={"prompt": "[", "model": "tiny-llama"}).json()
    assert no_bos["tokens"] == bracket.json()["tokens"] and bos["tokens"][1:] == no_bos["tokens"]
    piece = httpx.post(daemon.http_url + "/detokenize", json={"tokens": [tid], "model": "tiny-llama"})
    assert piece.json()["content"].strip() == "["
    for seed in range(2):
        calls, finish, content = calls_of(
            oai, "tiny-llama", stream, temperature=1.0, seed=seed, logit_bias={str(tid): 100}
        )
        assert finish == "tool_calls" and calls and not content
        for _, name, args in calls:
            jsonschema.validate(json.loads(args), PARAMS[name])
    _, finish, content = calls_of(oai, "tiny-llama", stream, tool_choice="none", temperature=0, max_tokens=8)
    assert finish in ("stop", "length") and content


@pytest.mark.parametrize("model", list(MODELS))
def test_tool_results_go_back_into_the_template(oai, model):
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo","unit":"c"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":1,"b":2}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": "3"},
    ]
    r = oai.chat.completions.create(
        model=model,
        messages=history,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=PARALLEL_MAX,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    plain = oai.chat.completions.create(model=model, messages=history, max_tokens=4, temperature=0)
    assert plain.usage.prompt_tokens > 20 and plain.choices[0].message.tool_calls is None


TOOLS_TEMPLATE = (
    "{% if tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments }}]"
    "{% endfor %}"
    "{% if m.tool_call_id %}[FOR {{ m.tool_call_id }}]{% endif %}{% endfor %}<assistant>"
)


def render(template, messages, plan):
    """``tool_calls.render`` with each rendering in this process (the daemon's go to a child)."""

    async def inline(t, m, **kw):
        return t.render(m, **kw)

    return asyncio.run(tool_calls.render(inline, template, messages, plan))


def test_tools_render_natively_or_in_the_text_form():
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
        {"role": "user", "content": "thanks"},
    ]
    plan = tool_calls.plan_of(TOOLS, "auto", None)
    native = ChatTemplate(TOOLS_TEMPLATE)
    assert native.uses_tools
    text = render(native, history, plan)
    assert text.startswith("[TOOLS]" + json.dumps(TOOLS, ensure_ascii=False))
    assert '[CALL call_1 get_weather {"city":"Oslo"}]' in text and "<tool>3 degrees[FOR call_1]" in text
    gemma = ChatTemplate(load_template_text("gemma"), bos_token="<bos>")
    assert not gemma.uses_tools
    with pytest.raises(ChatTemplateError):  # it insists on alternating roles
        gemma.render(history)
    text = render(gemma, history, plan)
    preamble = grammar.tools_preamble(plan.tools, "auto")
    assert text.startswith("<bos><start_of_turn>user\n" + preamble)
    assert '<start_of_turn>model\n{"name":"get_weather","arguments":{"city":"Oslo"}}<end_of_turn>' in text
    assert (
        "<start_of_turn>user\nResult of get_weather (call call_1):\n3 degrees\n\nthanks<end_of_turn>" in text
    )
    assert render(gemma, history[:1], None) == gemma.render(history[:1])


BAD_RF = [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
    },
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}}},
    {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
    {"type": "xml"},
]


def test_bad_requests_are_400_and_the_daemon_keeps_serving(oai):
    for bad in BAD_RF:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=4, response_format=bad)
        assert err.value.status_code == 400
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(
                model="tiny-llama", prompt="x", max_tokens=4, extra_body={"response_format": bad}
            )
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        oai.chat.completions.create(
            model="tiny-llama", messages=MSGS, max_tokens=4, extra_body={"regex": "("}
        )
    with pytest.raises(openai.BadRequestError, match="grammar"):
        oai.completions.create(
            model="tiny-llama", prompt="x", max_tokens=4, extra_body={"grammar": "start: ??"}
        )
    with pytest.raises(openai.BadRequestError, match="unknown function 'nope'"):
        oai.chat.completions.create(
            model="tiny-llama",
            messages=MSGS,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    malformed = [
        [],
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"name": "has space"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
        "tools",
    ]
    for tools in malformed:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="tiny-llama", messages=MSGS, tools=tools, max_tokens=4)
        assert err.value.status_code == 400 and "tools" in str(err.value)
    for choice in ("sometimes", {"type": "function"}, 5):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            oai.chat.completions.create(
                model="tiny-llama", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=4
            )
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(model="tiny-llama", messages=MSGS, tool_choice="required", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.chat.completions.create(
            model="tiny-llama",
            messages=MSGS,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        oai.chat.completions.create(model="tiny-llama", messages=[*MSGS, {"role": "tool", "content": "x"}])
    ok = oai.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_ollama_format(daemon, stream):
    client = ollama.Client(host=daemon.http_url, timeout=60)
    for k, fmt in enumerate([PERSON, SCHEMAS[1]]):
        opts = {"temperature": 1.0, "seed": k, "num_predict": MAX}
        if stream:
            text = "".join(
                p.message.content
                for p in client.chat(
                    model="tiny-gemma3", messages=MSGS, format=fmt, options=opts, stream=True
                )
            )
            gen = "".join(
                p.response
                for p in client.generate(
                    model="tiny-llama", prompt="x", format=fmt, options=opts, stream=True
                )
            )
        else:
            r = client.chat(model="tiny-gemma3", messages=MSGS, format=fmt, options=opts)
            assert r.done_reason == "stop"
            text = r.message.content
            gen = client.generate(model="tiny-llama", prompt="x", format=fmt, options=opts).response
        for out in (text, gen):
            value = json.loads(out)
            if fmt == "json":
                assert isinstance(value, dict)
            else:
                jsonschema.validate(value, fmt)
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(
            model="tiny-llama", prompt="x", format={"type": "integer", "minimum": 5, "maximum": 1}
        )
    assert err.value.status_code == 400 and "minimum" in err.value.error


A_TOOLS = [
    {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER},
    {"name": "add", "input_schema": ADD},
]


@pytest.fixture(scope="module")
def claude(daemon):
    with anthropic.Anthropic(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.parametrize("model", list(MODELS))
def test_anthropic_tool_use(claude, model):
    kw = {"model": model, "messages": MSGS, "tools": A_TOOLS, "max_tokens": PARALLEL_MAX}
    for _ in range(2):
        r = claude.messages.create(**kw, tool_choice={"type": "any"}, extra_body={"temperature": 1.0})
        assert r.stop_reason == "tool_use" and r.content
        for block in r.content:
            assert block.type == "tool_use" and block.id.startswith("toolu_")
            jsonschema.validate(block.input, PARAMS[block.name])
    named = {"type": "tool", "name": "add", "disable_parallel_tool_use": True}
    with claude.messages.stream(**kw, tool_choice=named, extra_body={"temperature": 1.0}) as st:
        events = [ev.type for ev in st]
        final = st.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].name == "add" and "content_block_start" in events
    jsonschema.validate(final.content[0].input, ADD)
    history = [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}]},
    ]
    r = claude.messages.create(
        model=model, messages=history, tools=A_TOOLS, max_tokens=4, extra_body={"temperature": 0}
    )
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens > 20
    none = claude.messages.create(**{**kw, "max_tokens": 4}, tool_choice={"type": "none"})
    assert none.content[0].type == "text" and none.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError, match="unknown function"):
        claude.messages.create(**kw, tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        claude.messages.create(**{**kw, "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]})
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        claude.messages.create(**kw, tool_choice={"type": "sometimes"})


@pytest.mark.realmodel
def test_json_schema_chat_on_the_default_model(default_model):
    cfg = (
        '[[workers]]\nengine = "llamacpp"\nlanes = 1\ncontext_length = 512\nthreads = 1\n'
        '[http]\nlisten = ["127.0.0.1:0"]\n'
    )
    with Daemon(cfg, ready_timeout=180) as d:
        url = "http://" + d.http_addresses()[0] + "/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=180) as c:
            r = c.chat.completions.create(
                model="",
                messages=[{"role": "user", "content": "Describe a person as JSON."}],
                response_format=rf(PERSON),
                max_tokens=MAX,
                temperature=0,
            )
            call = c.chat.completions.create(
                model="",
                messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=MAX,
                temperature=0,
            )
    print("\njson_schema:", r.choices[0].message.content, "\ntool call:", call.choices[0].message.tool_calls)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert call.choices[0].finish_reason == "tool_calls"
    (tc,) = call.choices[0].message.tool_calls
    jsonschema.validate(json.loads(tc.function.arguments), PARAMS[tc.function.name])


def test_a_2600_deep_ref_chain_is_a_400_on_every_api_and_the_daemon_keeps_serving(daemon, oai, claude):
    """A ``$ref`` chain 2,600 long (91 KB of flat JSON) once killed the coordinator with SIGSEGV
    inside llguidance; every door now answers it as a bad request."""
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2_600)}
    defs["d2600"] = {"type": "string"}
    chain = {"$defs": defs, "$ref": "#/$defs/d0"}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": chain}}
    with pytest.raises(openai.BadRequestError, match="too deep"):
        oai.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=4, response_format=rf)
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=daemon.http_url, timeout=60).chat(model="tiny-llama", messages=MSGS, format=chain)
    assert err.value.status_code == 400 and "too deep" in str(err.value)
    with pytest.raises(anthropic.BadRequestError, match="too deep"):
        claude.messages.create(
            model="tiny-llama",
            messages=MSGS,
            max_tokens=4,
            tools=[{"name": "f", "input_schema": chain}],
        )
    with daemon.client() as c:
        with pytest.raises(ClientError, match="too deep") as err:
            c.generate("x", max_tokens=4, response_format=rf)
        assert err.value.code == ErrorCode.INVALID_REQUEST
        assert c.generate("x", max_tokens=2, temperature=0.0).usage.completion_tokens == 2
    ok = oai.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert daemon.proc.poll() is None
