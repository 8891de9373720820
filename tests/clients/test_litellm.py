"""litellm against a real daemon on the tiny GGUF (``conftest.py``) through three of its providers:
``openai/`` (``/v1/chat/completions``) and ``anthropic/`` (``/v1/messages``) with a required tool
give OpenAI-shaped ``tool_calls`` whose arguments validate; ``ollama_chat/`` (``/api/chat``, whose
API has no ``tool_choice``: tools are offered under ``auto``) accepts the tools and a conversation
with a call and its result, answering a message litellm parses (a call, if the random model makes
one, validates). The model cost map is read from the package, never fetched."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from conftest import MODEL, TIMEOUT_S

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather of a city", "parameters": CITY},
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def base_of(daemon, provider: str) -> str:
    return daemon.http_url + "/v1" if provider == "openai" else daemon.http_url


def complete(daemon, provider: str, **kw):
    return litellm.completion(
        model=f"{provider}/{MODEL}",
        api_base=base_of(daemon, provider),
        api_key="unused",
        max_tokens=200,
        timeout=TIMEOUT_S,
        num_retries=0,
        **kw,
    )


def validated_calls(message) -> list:
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), CITY)
    return message.tool_calls or []


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_required_tool_gives_calls_that_validate(daemon, provider):
    r = complete(daemon, provider, messages=ASK, tools=TOOLS, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(validated_calls(r.choices[0].message)) == 1
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


def test_ollama_chat_accepts_tools_and_a_tool_turn(daemon):
    r = complete(daemon, "ollama_chat", messages=ASK, tools=TOOLS)
    validated_calls(r.choices[0].message)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
    }
    turns = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = complete(daemon, "ollama_chat", messages=turns, tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    validated_calls(r.choices[0].message)
