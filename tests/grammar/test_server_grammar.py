"""The coordinator's grammar layer (basertd.server.request.grammar): request fields to specs,
compiled by ``SpecCompiler`` in its child processes; tool-call grammars and the tool-call parser;
specs run on the tiny GGUF through the engine."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import msgspec
import pytest
from lc_harness import admit, make_prompt
from schemas import schemas

from basertd.schema import link
from basertd.schema.abi import Finish, Sampling
from basertd.schema.client import ErrorCode
from basertd.schema.tick import LaneDecode, LanePrefill, LaneRetire, SamplingParams
from basertd.server.frontend.spec_compiler import SpecCompiler
from basertd.server.observe.metrics import Metrics
from basertd.server.request import grammar as sg


def compiled(spec: sg.GrammarSpec | None) -> sg.GrammarSpec | None:
    """``spec`` through a fresh ``SpecCompiler`` (one child process), as admission compiles it."""

    async def main() -> sg.GrammarSpec | None:
        compiler = SpecCompiler(Metrics(), processes=1, timeout_s=30.0, max_pending=4, memory_bytes=2 << 30)
        try:
            return None if spec is None else await compiler.compile(spec)
        finally:
            await compiler.close()

    return asyncio.run(main())


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


def test_response_formats_become_specs():
    assert sg.spec_from_request() is None
    assert sg.spec_from_request(response_format={"type": "text"}) is None
    obj = sg.spec_from_request(response_format={"type": "json_object"})
    assert obj.kind == "json_schema" and json.loads(obj.text) == {"type": "object"}
    js = sg.spec_from_request(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
        }
    )
    assert js.kind == "json_schema" and json.loads(js.text) == WEATHER
    assert sg.spec_from_request(grammar='start: "a" | "b"') == sg.GrammarSpec("lark", 'start: "a" | "b"')
    assert sg.spec_from_request(regex="[0-9]+") == sg.GrammarSpec("regex", "[0-9]+")
    for s in schemas(100):
        spec = sg.spec_from_request(
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": s}}
        )
        assert json.loads(spec.text) == s


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}}, "strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}}, "/x"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "schema"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
        ({"response_format": "json"}, "object"),
        ({"grammar": "start: nothing_here"}, "nothing_here"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"regex": 5}, "regex"),
        ({"grammar": "start: a", "regex": "a"}, "at most one"),
    ],
)
def test_invalid_requests_are_typed_errors_with_the_library_message(kw, needle):
    with pytest.raises(sg.GrammarRequestError) as ex:
        compiled(sg.spec_from_request(**kw))
    assert needle in str(ex.value)
    assert ex.value.code == ErrorCode.INVALID_REQUEST


def test_grammar_create_carries_the_kind_and_old_senders_mean_json_schema():
    msg = sg.GrammarSpec("lark", 'start: "x"').to_message()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=link.GrammarCreate) == msg
    old = msgspec.msgpack.encode(['{"type":"object"}'])  # a sender without the kind field
    assert msgspec.msgpack.decode(old, type=link.GrammarCreate).kind == "json_schema"


@pytest.mark.parametrize(
    ("tools", "choice", "needle"),
    [
        ("nope", None, "array"),
        ([{"type": "retrieval"}], None, "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "name"),
        ([TOOLS[0], TOOLS[0]], None, "duplicate"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
            None,
            "parameters",
        ),
        (TOOLS, {"type": "function", "function": {"name": "get_stock"}}, "unknown function"),
        (TOOLS, "sometimes", "tool_choice"),
        (None, "required", "needs tools"),
    ],
)
def test_malformed_tools_and_choices_are_typed_errors(tools, choice, needle):
    with pytest.raises(sg.GrammarRequestError) as ex:
        compiled(sg.tool_grammar(tools, choice))
    assert needle in str(ex.value)


def test_tool_choice_none_and_no_tools_leave_the_output_free():
    assert sg.tool_grammar(None) is None
    assert sg.tool_grammar(TOOLS, "none") is None


def test_parse_tool_calls():
    assert sg.parse_tool_calls("It is sunny.") is None
    assert sg.parse_tool_calls('{"name": "f"}') is None
    assert sg.parse_tool_calls('{"name": "f", "arguments": {}, "x": 1}') is None
    assert sg.parse_tool_calls("{broken") is None
    (c,) = sg.parse_tool_calls(' {"name": "get_time", "arguments": {"tz": "UTC"}}\n')
    assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
    assert c["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    calls = sg.parse_tool_calls('[{"name":"a","arguments":{}},{"name":"b","arguments":{"k":[1]}}]')
    assert [x["function"]["name"] for x in calls] == ["a", "b"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"k": [1]}
    assert calls[0]["id"] != calls[1]["id"]
    assert sg.parse_tool_calls('{"name":"a","arguments":{}}', tool_names={"b"}) is None
    assert "get_weather" in sg.tools_preamble(sg.parse_tools(TOOLS), "required")


def _generate(eng, coord, handles: list[int], n: int = 400, bias: int = 0) -> list[tuple[str, int]]:
    """Run one lane per handle (alternately greedy and sampled; the first half with logit-bias
    handle ``bias``) to its finish; (text, finish) per lane."""
    tags = list(range(1, len(handles) + 1))
    admits = []
    for t, h in zip(tags, handles, strict=True):
        kw = {"grammar_handle": h, "logit_bias_handle": bias if t <= len(tags) // 2 else 0}
        if t % 2 == 0:
            kw |= {
                "sampling": Sampling.GPU_GUMBEL,
                "params": SamplingParams(temperature=0.8),
                "rng_counter_base": t,
            }
        admits.append(admit(t, coord.prompt(make_prompt(t, 6)), **kw))
    out = {t: [] for t in tags}
    fin: dict[int, int] = {}
    ev = coord.tick(
        admits=admits,
        prefills=[LanePrefill(lane_tag=t, token_offset=0, token_count=6) for t in tags],
        decodes=[LaneDecode(lane_tag=t, max_new_tokens=8) for t in tags],
    )
    while True:
        assert not ev.faults
        for e in ev.emits:
            out[e.lane_tag] += coord.read(e.token_ref) if e.n_tokens else []
            if e.finish or len(out[e.lane_tag]) >= n:
                fin[e.lane_tag] = e.finish
        live = [t for t in tags if t not in fin]
        if not live:
            break
        ev = coord.tick(decodes=[LaneDecode(lane_tag=t, max_new_tokens=8) for t in live])
    coord.tick(retires=[LaneRetire(lane_tag=t) for t in tags])
    res = []
    for t in tags:
        toks = out[t][:-1] if fin[t] == Finish.EOS else out[t]
        res.append((eng.detokenize(toks).decode("utf-8", "replace"), fin[t]))
    return res


def _check_call(call: dict) -> None:
    params = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_and_named_tool_grammars_generate_valid_calls(make_engine, parallel):
    eng, coord = make_engine()
    required = sg.tool_grammar(TOOLS, "required", parallel_tool_calls=parallel, max_calls=3)
    named = sg.tool_grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}}, parallel)
    handles = [eng.grammar_create(s.text, s.kind) for s in (required, required, required, named)]
    assert all(handles)
    outs = _generate(eng, coord, handles)
    for i, (text, fin) in enumerate(outs):
        assert fin == Finish.GRAMMAR, text
        calls = sg.parse_tool_calls(text, {"get_weather", "get_time"})
        assert calls, text
        assert text.lstrip().startswith("[") == (parallel and i < 3)
        for c in calls:
            _check_call(c)
        if i == 3:
            assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_auto_tool_grammar_gives_text_or_a_valid_call(make_engine):
    eng, coord = make_engine()
    auto = sg.tool_grammar(TOOLS, "auto", parallel_tool_calls=False)
    assert auto.kind == "lark"
    h = eng.grammar_create(auto.text, auto.kind)
    assert h
    # Half the lanes are pushed towards "{" by a logit bias (applied after the grammar's mask).
    brace = eng.logit_bias_create(eng.tokenize(b"{", False)[-1:], [40.0])
    outs = _generate(eng, coord, [h] * 8, n=200, bias=brace)
    assert sum(text.startswith("{") for text, _ in outs) >= 4
    for text, fin in outs:
        calls = sg.parse_tool_calls(text)
        if text.startswith("{"):
            assert fin == Finish.GRAMMAR and calls, text
            _check_call(calls[0])
        else:
            assert calls is None and (text == "" or not text[0].isspace())


def _ref_chain(n: int) -> dict:
    """A schema whose ``$ref``s form a chain ``n`` long (llguidance overflows its native stack on
    ~2,500 of them, far below any size cap)."""
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_a_ref_chain_deeper_than_the_bound_is_a_typed_error_not_a_crash():
    from basertd.server.request.schema_depth import MAX_REF_DEPTH, ref_depth

    for n in (MAX_REF_DEPTH, 2_600, 20_000):
        with pytest.raises(sg.GrammarRequestError, match="too deep") as ex:
            sg.spec_from_request(
                response_format={"type": "json_schema", "json_schema": {"schema": _ref_chain(n)}}
            )
        assert ex.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(sg.GrammarRequestError, match="too deep"):
        sg.parse_tools([{"type": "function", "function": {"name": "f", "parameters": _ref_chain(3_000)}}])
    # a chain well inside the bound compiles; recursion (a tree of itself) adds no depth
    assert compiled(sg.schema_spec(_ref_chain(100))).kind == "json_schema"
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    assert ref_depth(tree) == 4 and compiled(sg.schema_spec(tree)).kind == "json_schema"
    assert ref_depth(_ref_chain(10)) == 13  # root, $defs, d0..d10
    # JSON nested past the parser's recursion limit is a typed error too
    with pytest.raises(sg.GrammarRequestError, match="not JSON"):
        sg.validate_spec("json_schema", "[" * 100_000 + "]" * 100_000)
