"""Bounded numbers in JSON-schema grammars (basertd/json_bounds.py): which nodes are
narrowed, that the schema's own bounds win, and that the compiled grammar (llguidance, the tiny
GGUF's tokenizer) refuses runaway digits and exponents while every schema still compiles."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from matching import accepts
from schemas import schemas

from basertd import grammar_compile as grammar_mod
from basertd.json_bounds import FRACTION_STEP, NUMBER_LIMIT, bound_numbers
from basertd.worker.engines.llamacpp.grammar import GrammarSpecError, compile_spec

DEFAULTS = {"minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}


def test_typed_numbers_are_narrowed_where_a_narrower_subschema_narrows_the_whole():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "number"},
            "i": {"type": "integer"},
            "ni": {"type": ["number", "null"]},
            "arr": {"type": "array", "items": {"$ref": "#/$defs/d"}},
            "tup": {"type": "array", "prefixItems": [{"type": "integer"}]},
            "any": {"anyOf": [{"type": "number"}, {"type": "string"}]},
            "neg": {"not": {"type": "number"}},
            "cond": {"if": {"type": "number"}, "then": {"type": "number"}},
            "free": {"minimum": 3},
        },
        "additionalProperties": {"type": "integer"},
        "$defs": {"d": {"type": "number", "maximum": 5}},
    }
    before = copy.deepcopy(schema)
    out = bound_numbers(schema)
    assert schema == before  # a copy; the input is untouched
    p = out["properties"]
    assert p["n"] == {"type": "number", **DEFAULTS, "multipleOf": FRACTION_STEP}
    assert p["i"] == {"type": "integer", **DEFAULTS}
    assert p["ni"]["multipleOf"] == FRACTION_STEP and p["ni"]["minimum"] == -NUMBER_LIMIT
    d = {"type": "number", "maximum": 5, "minimum": -NUMBER_LIMIT, "multipleOf": FRACTION_STEP}
    assert out["$defs"]["d"] == d
    assert p["tup"]["prefixItems"][0] == {"type": "integer", **DEFAULTS}
    assert p["any"]["anyOf"][0]["minimum"] == -NUMBER_LIMIT and p["any"]["anyOf"][1] == {"type": "string"}
    assert out["additionalProperties"] == {"type": "integer", **DEFAULTS}
    # Narrowing under not / if would widen what validates; untyped nodes stay any value.
    assert p["neg"] == before["properties"]["neg"]
    assert p["cond"] == before["properties"]["cond"]
    assert p["free"] == {"minimum": 3}
    assert bound_numbers(True) is True and bound_numbers({}) == {}


def test_the_schemas_own_bounds_win_and_no_bound_empties_a_range():
    assert bound_numbers({"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.25}) == {
        "type": "number",
        "exclusiveMinimum": 0,
        "multipleOf": 0.25,
        "maximum": NUMBER_LIMIT,
    }
    assert bound_numbers({"type": "integer", "minimum": 10**20}) == {"type": "integer", "minimum": 10**20}
    assert bound_numbers({"type": "number", "maximum": -(10**20)}) == {
        "type": "number",
        "maximum": -(10**20),
        "multipleOf": FRACTION_STEP,
    }
    # A range too narrow for a multiple of the step keeps the schema's own digits.
    tiny = {"type": "number", "minimum": 0.5e-9, "maximum": 1.5e-9}
    assert bound_numbers(tiny) == tiny


def test_compiled_numbers_refuse_runaway_digits_and_exponents(tokenizer):
    num, ints = {"type": "number"}, {"type": "object", "properties": {"i": {"type": "integer"}}}
    for text in ("0", "-12.25", "0.123456789", "9007199254740991", "-9007199254740990.5"):
        assert accepts(tokenizer, num, text), text
        jsonschema.validate(json.loads(text), num)
    runaway = ("0.1234567891", "8.0808080808080808", "1e5", "9007199254740992", "-9007199254740991.5")
    for text in (*runaway, "123456789012345678901"):
        assert not accepts(tokenizer, num, text), text
    assert accepts(tokenizer, ints, '{"i":-42}') and not accepts(tokenizer, ints, '{"i":90071992547409910}')
    # The schema's own bounds and steps are kept as given.
    assert accepts(tokenizer, {"type": "number", "multipleOf": 0.5, "minimum": 1e17}, "100000000000000000.5")


def test_every_test_schema_compiles_bounded_and_bad_schemas_still_fail():
    for s in schemas(100):
        bounded = json.loads(compile_spec("json_schema", json.dumps(s)))["grammars"][0]["json_schema"]
        assert {k: v for k, v in bounded.items() if k != "x-guidance"} == bound_numbers(s)
    with pytest.raises(GrammarSpecError):
        compile_spec("json_schema", '{"type": "strin"}')


def test_a_schema_that_does_not_compile_bounded_compiles_as_given(monkeypatch):
    monkeypatch.setattr(grammar_mod, "bound_numbers", lambda s: {"type": "wat"})
    g = json.loads(compile_spec("json_schema", '{"type": "number"}'))
    assert g["grammars"][0]["json_schema"]["type"] == "number"
    assert "multipleOf" not in g["grammars"][0]["json_schema"]


def test_tool_choice_auto_bounds_the_numbers_of_the_tool_schema_it_inlines():
    from basertd.server.request.grammar import tool_grammar

    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
            },
        }
    ]
    spec = tool_grammar(tools, "auto")
    assert spec is not None and spec.kind == "lark"
    assert f'"maximum":{NUMBER_LIMIT}' in spec.text and '"multipleOf":1e-09' in spec.text
