"""The ``openai`` package's Responses API (``client.responses.*``) against a real daemon on the tiny
GGUF (``conftest.py``): a forced function call whose arguments validate against the tool's
schema, its output sent back through ``previous_response_id``, a strict ``json_schema`` output
that validates, and the same streamed with ``responses.stream``. (The chat and completions
endpoints through this package are tests/http/test_http_openai.py and test_http_structured.py.)"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import MODEL, TIMEOUT_S

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": CITY}
REPORT = {
    "type": "object",
    "properties": {
        "sky": {"enum": ["sunny", "rainy"]},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
    },
    "required": ["sky", "temp"],
}


@pytest.fixture(scope="module")
def oai(daemon):
    with openai.OpenAI(
        base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
    ) as c:
        yield c


def test_a_forced_call_validates_and_its_output_continues_the_stored_conversation(oai):
    first = oai.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=200
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    fmt = {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}
    second = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        tools=[WEATHER],
        text={"format": fmt},
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 3},
    )  # under auto the output is another call or the formatted answer
    assert second.status == "completed" and second.usage.input_tokens > first.usage.input_tokens
    (item,) = second.output
    if item.type == "function_call":
        jsonschema.validate(json.loads(item.arguments), CITY)
    else:
        jsonschema.validate(json.loads(second.output_text), {**REPORT, "additionalProperties": False})
    assert oai.responses.retrieve(second.id).output == second.output


def test_a_streamed_strict_schema_and_a_streamed_call(oai):
    fmt = {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}
    with oai.responses.stream(model=MODEL, input="Report", text={"format": fmt}, max_output_tokens=200) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), REPORT)
    with oai.responses.stream(
        model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=200
    ) as s:
        final = s.get_final_response()
    (call,) = final.output
    jsonschema.validate(json.loads(call.arguments), CITY)
