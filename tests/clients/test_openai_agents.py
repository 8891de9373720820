"""The openai-agents SDK against a real daemon on the tiny GGUF (``conftest.py``): its default
model (``OpenAIResponsesModel``, over ``/v1/responses``) with the default client pointed at
basertd, and ``OpenAIChatCompletionsModel`` (over ``/v1/chat/completions``). An agent with one
function tool under ``tool_choice="required"`` calls it with arguments that validate and finishes
on the tool's result; an agent with a pydantic ``output_type`` (strict ``json_schema``) ends with
a validated object, streamed. Tracing is off (nothing leaves the box)."""

from __future__ import annotations

import asyncio
from typing import Literal

import agents
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
from conftest import MODEL, TIMEOUT_S
from pydantic import BaseModel, Field


class Report(BaseModel):
    sky: Literal["sunny", "rainy"]
    temp: int = Field(ge=-40, le=50)


def weather_agent(calls: list[str], model: object = MODEL) -> Agent:
    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    return Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=model,  # type: ignore[arg-type]
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=200),
        tool_use_behavior="stop_on_first_tool",
    )


def run_with_client(daemon, fn):
    """``fn(client)`` with an ``AsyncOpenAI`` on the daemon as the SDK's default client."""

    async def main():
        agents.set_tracing_disabled(True)
        client = openai.AsyncOpenAI(
            base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
        )
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_default_openai_api("responses")
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


def test_the_default_responses_model_runs_an_agent_with_a_required_tool(daemon):
    calls: list[str] = []
    result = run_with_client(daemon, lambda _c: Runner.run(weather_agent(calls), "Weather in Paris?"))
    (city,) = calls
    assert city in ("Paris", "Oslo") and result.final_output == f"sunny in {city}"
    (raw,) = result.raw_responses
    assert raw.response_id.startswith("resp_")  # the Responses API answered it
    assert [item.type for item in raw.output] == ["function_call"]


def test_the_chat_completions_model_runs_the_same_agent(daemon):
    calls: list[str] = []

    async def fn(client):
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        return await Runner.run(weather_agent(calls, model), "Weather in Oslo?")

    result = run_with_client(daemon, fn)
    (city,) = calls
    assert result.final_output == f"sunny in {city}"


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
def test_an_output_type_ends_with_a_validated_object(daemon, streamed):
    agent = Agent(
        name="reporter",
        instructions="Report the weather.",
        model=MODEL,
        output_type=Report,
        model_settings=ModelSettings(max_tokens=200),
    )

    async def fn(_client):
        if not streamed:
            return await Runner.run(agent, "Report")
        result = Runner.run_streamed(agent, "Report")
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
        return result

    result = run_with_client(daemon, fn)
    assert isinstance(result.final_output, Report)
