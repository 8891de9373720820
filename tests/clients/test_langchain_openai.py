"""langchain-openai's ``ChatOpenAI`` against a real daemon on the tiny GGUF (``conftest.py``), over
``/v1/chat/completions`` and, with ``use_responses_api=True``, ``/v1/responses``: ``bind_tools``
with a required tool gives ``tool_calls`` whose arguments validate against the tool's pydantic
model (no ``invalid_tool_calls``), and ``with_structured_output`` (its default ``json_schema``
method and ``function_calling``) returns a validated object."""

from __future__ import annotations

from typing import Literal

import pytest
from conftest import MODEL, TIMEOUT_S
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class GetWeather(BaseModel):
    """The weather of a city."""

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


class Report(BaseModel):
    sky: Literal["sunny", "rainy"]
    temp: int = Field(ge=-40, le=50)


APIS = {"chat": False, "responses": True}


def chat(daemon, api: str) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=daemon.http_url + "/v1",
        api_key="unused",
        max_tokens=200,
        max_retries=0,
        timeout=TIMEOUT_S,
        use_responses_api=APIS[api],
    )


@pytest.mark.parametrize("api", list(APIS))
def test_bind_tools_with_a_required_tool_gives_calls_that_validate(daemon, api):
    message = chat(daemon, api).bind_tools([GetWeather], tool_choice="required").invoke("Weather in Paris?")
    assert message.invalid_tool_calls == [] and message.tool_calls
    for call in message.tool_calls:
        assert call["name"] == "GetWeather" and call["id"]
        GetWeather.model_validate(call["args"])


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_a_validated_object(daemon, api, method):
    out = chat(daemon, api).with_structured_output(Report, method=method).invoke("Report the weather.")
    assert isinstance(out, Report)
