"""``strict: true`` closes every object schema that does not say otherwise
(``basertd/server/request/strict_schema.py``): the transform itself, checked with ``jsonschema``
against instances a strict reading must refuse and ones it must keep, and the compiled grammar
(llguidance, the tiny GGUF's tokenizer) refusing a key the schema does not name."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from matching import accepts

from basertd.server.request.strict_schema import close_objects

# What pydantic writes for ``class Item(BaseModel): name: str; tags: list[Tag]`` with a nested model.
PYDANTIC = {
    "$defs": {
        "Tag": {
            "properties": {"label": {"title": "Label", "type": "string"}},
            "required": ["label"],
            "title": "Tag",
            "type": "object",
        }
    },
    "properties": {
        "name": {"title": "Name", "type": "string"},
        "tags": {"items": {"$ref": "#/$defs/Tag"}, "title": "Tags", "type": "array"},
        "meta": {"anyOf": [{"type": "object", "properties": {"k": {"type": "integer"}}}, {"type": "null"}]},
    },
    "required": ["name", "tags"],
    "title": "Item",
    "type": "object",
}


def test_every_object_is_closed_and_the_input_is_untouched():
    before = copy.deepcopy(PYDANTIC)
    out = close_objects(PYDANTIC)
    assert before == PYDANTIC
    assert out["additionalProperties"] is False
    assert out["$defs"]["Tag"]["additionalProperties"] is False
    assert out["properties"]["meta"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["name"]  # a string is no object
    good = {"name": "a", "tags": [{"label": "x"}], "meta": {"k": 1}}
    jsonschema.validate(good, out)
    for extra in (
        {**good, "colour": "red"},
        {**good, "tags": [{"label": "x", "weight": 2}]},
        {**good, "meta": {"k": 1, "z": 0}},
    ):
        jsonschema.validate(extra, PYDANTIC)  # the plain reading lets it through
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, out)


def test_without_strict_only_objects_that_name_their_keys_are_closed():
    schema = {
        "type": "object",
        "properties": {"item": PYDANTIC, "anything": {"type": "object"}, "free": {"type": "object"}},
    }
    out = close_objects(schema, named_only=True)
    assert out["additionalProperties"] is False
    assert out["properties"]["item"]["additionalProperties"] is False
    assert out["properties"]["item"]["$defs"]["Tag"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["anything"]  # names no keys: any object
    jsonschema.validate({"item": {"name": "x", "tags": []}, "anything": {"k": 1}}, out)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"item": {"name": "x", "tags": [], "more": 1}}, out)


def test_what_a_schema_says_wins_and_allof_members_stay_open():
    schema = {
        "type": "object",
        "properties": {
            "open": {"type": "object", "additionalProperties": True},
            "typed": {"type": "object", "additionalProperties": {"type": "integer"}},
            "uneval": {"type": "object", "unevaluatedProperties": False},
            "both": {
                "allOf": [
                    {"properties": {"a": {"type": "string"}}},
                    {"properties": {"b": {"type": "string"}}},
                ]
            },
            "tuple": {"type": "array", "items": [{"type": "object", "properties": {"x": {}}}]},
        },
    }
    out = close_objects(schema)
    p = out["properties"]
    assert p["open"]["additionalProperties"] is True
    assert p["typed"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in p["uneval"]
    assert p["both"] == schema["properties"]["both"]  # closing a member would refuse the other's key
    jsonschema.validate({"a": "1", "b": "2"}, p["both"])
    assert p["tuple"]["items"][0]["additionalProperties"] is False
    assert close_objects(True) is True and close_objects({}) == {}


def test_a_deep_schema_costs_no_stack():
    deep: dict = {"type": "object", "properties": {}}
    node = deep
    for _ in range(5000):
        child: dict = {"type": "object", "properties": {}}
        node["properties"]["c"] = child
        node = child
    out = close_objects(deep)
    assert out["properties"]["c"]["properties"]["c"]["additionalProperties"] is False


def test_the_compiled_grammar_refuses_a_key_the_schema_does_not_name(tokenizer):
    good = json.dumps({"name": "a", "tags": []}, separators=(",", ":"))
    extra = json.dumps({"name": "a", "tags": [], "colour": "r"}, separators=(",", ":"))
    assert accepts(tokenizer, PYDANTIC, extra)
    strict = close_objects(PYDANTIC)
    assert accepts(tokenizer, strict, good) and not accepts(tokenizer, strict, extra)
