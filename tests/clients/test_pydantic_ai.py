"""pydantic-ai against a real daemon on the tiny GGUF (``conftest.py``), with its
``OpenAIResponsesModel`` (``/v1/responses``) and ``OpenAIChatModel`` (``/v1/chat/completions``):
the default structured output (an output tool the model must call), ``NativeOutput`` (a strict
``json_schema`` format), and an agent with a function tool beside its output tool. Each run ends
with an output pydantic validated; every tool call's arguments validated too (pydantic-ai
retries a call whose arguments do not, so a run with no retry proves they all did)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from conftest import MODEL
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.messages import ModelResponse, RetryPromptPart, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits


class Report(BaseModel):
    sky: Literal["sunny", "rainy"]
    temp: int = Field(ge=-40, le=50)


SETTINGS = ModelSettings(max_tokens=200)
KINDS = {"responses": OpenAIResponsesModel, "chat": OpenAIChatModel}


def run(daemon, kind: str, agent_of, prompt: str = "Report the weather."):
    """``agent_of(model).run(prompt)`` with a fresh provider on the daemon (its own event loop)."""

    async def main():
        provider = OpenAIProvider(base_url=daemon.http_url + "/v1", api_key="unused")
        model = KINDS[kind](MODEL, provider=provider)
        result = await agent_of(model).run(prompt, usage_limits=UsageLimits(request_limit=12))
        await provider.client.close()
        return result

    return asyncio.run(main())


def retries(result) -> list[RetryPromptPart]:
    return [
        p for m in result.all_messages() for p in getattr(m, "parts", []) if isinstance(p, RetryPromptPart)
    ]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("native", [False, True], ids=["tool_output", "native_output"])
def test_structured_output_validates(daemon, kind, native):
    output = NativeOutput(Report) if native else Report
    result = run(daemon, kind, lambda m: Agent(m, output_type=output, model_settings=SETTINGS))
    assert isinstance(result.output, Report) and retries(result) == []
    calls = [p for m in result.all_messages() if isinstance(m, ModelResponse) for p in m.parts]
    assert any(isinstance(p, ToolCallPart) for p in calls) != native  # the output tool, or a format


def test_a_function_tool_beside_the_output_tool(daemon):
    seen: list[str] = []

    def agent_of(model):
        agent = Agent(model, output_type=Report, model_settings=SETTINGS)

        async def once(ctx, tool_def):  # offered until called: a random model cannot loop on it
            return None if seen else tool_def

        @agent.tool_plain(prepare=once)
        def get_weather(city: Literal["Paris", "Oslo"]) -> str:
            """The weather of a city."""
            seen.append(city)
            return f"sunny in {city}"

        return agent

    result = run(daemon, "responses", agent_of, "Weather in Paris?")
    assert isinstance(result.output, Report) and retries(result) == []
    parts = [p for m in result.all_messages() if isinstance(m, ModelResponse) for p in m.parts]
    names = [p.tool_name for p in parts if isinstance(p, ToolCallPart)]
    assert "final_result" in names and set(names) <= {"get_weather", "final_result"}
    assert all(city in ("Paris", "Oslo") for city in seen)
