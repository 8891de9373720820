"""The Responses API (``/v1/responses``) against the fake front end of
``test_http_dialects_fake.py``: no daemon, no worker. The ``openai`` package's
``client.responses.create`` / ``client.responses.stream`` / ``retrieve`` / ``delete`` drive the
real ``HttpServer``; each test checks what the client parsed and the ``Generate`` the dialect
built (prompt rendered with the ``chatml`` template, constraint, sampling)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient
from test_http_dialects_fake import CALL_TEXT, CONTEXT, MODEL, FakeFrontend, ids, post, run, text_of

from basertd.schema.client import ErrorCode
from basertd.server.transport.http.responses.store import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
"""A Responses function tool (flat: no ``function`` object); ``strict`` left out reads as true."""


def client_of(client: TestClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)


def prompt_of(fake: FakeFrontend, k: int = -1) -> str:
    return text_of(fake.gens[k][0].prompt_tokens)


def test_text_input_and_instructions_answer_a_completed_response_with_usage():
    fake = FakeFrontend(cached=2)

    async def fn(client: TestClient) -> Any:
        async with client_of(client) as c:
            return await c.responses.create(
                model=MODEL,
                input="hi",
                instructions="be brief",
                max_output_tokens=40,
                temperature=0.25,
                top_p=0.5,
            )

    r = run(fake, fn)
    (gen, api_name) = fake.gens[0]
    assert api_name == "responses" and gen.request_id == r.id and r.id.startswith("resp_")
    assert prompt_of(fake) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (gen.max_tokens, gen.temperature, gen.top_p, gen.response_format) == (40, 0.25, 0.5, None)
    assert r.status == "completed" and r.output_text == "Hello, world!" and r.model == MODEL
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    n = len(ids("Hello, world!"))
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        len(gen.prompt_tokens),
        n,
        len(gen.prompt_tokens) + n,
    )
    assert r.usage.input_tokens_details.cached_tokens == 2 and r.instructions == "be brief"


def test_message_items_with_parts_and_max_output_tokens_default_to_the_rest_of_the_context():
    fake = FakeFrontend(finish="length")
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b", "annotations": []}]},
        {"role": "user", "content": "c"},
    ]
    status, out = post(fake, "/v1/responses", {"input": items})
    assert status == 200
    prompt = prompt_of(fake)
    for role, text in (("developer", "rules"), ("user", "a"), ("assistant", "b"), ("user", "c")):
        assert f"<|im_start|>{role}\n{text}<|im_end|>" in prompt
    assert fake.gens[0][0].max_tokens == CONTEXT - len(ids(prompt))
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete"


def test_the_stream_is_the_apis_events_in_order_and_the_client_assembles_the_response():
    fake = FakeFrontend(queued=1)

    async def fn(client: TestClient) -> Any:
        async with client_of(client) as c:
            kinds, deltas = [], []
            async with c.responses.stream(model=MODEL, input="hi") as s:
                async for event in s:
                    kinds.append(event.type)
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                final = await s.get_final_response()
            return kinds, deltas, final

    kinds, deltas, final = run(fake, fn)
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert deltas == ["Hello,", " world!"] and final.output_text == "Hello, world!"
    assert final.status == "completed" and final.usage.output_tokens == len(ids("Hello, world!"))
    assert fake.gens[0][0].stream and fake.streams[0].closed


def test_a_function_call_comes_back_as_an_item_and_its_output_goes_back_into_the_template():
    fake = FakeFrontend(reply=CALL_TEXT)

    async def fn(client: TestClient) -> Any:
        async with client_of(client) as c:
            first = await c.responses.create(
                model=MODEL, input="weather in Paris?", tools=[WEATHER], tool_choice="required"
            )
            (call,) = first.output
            fake.reply = "It is sunny."
            second = await c.responses.create(
                model=MODEL,
                input=[
                    {"role": "user", "content": "weather in Paris?"},
                    call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
                ],
                tools=[WEATHER],
            )
            return first, second

    first, second = run(fake, fn)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert first.status == "completed" and first.output_text == ""
    schema = fake.gens[0][0].response_format["json_schema"]["schema"]
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"]["additionalProperties"] is False  # strict by default
    prompt = prompt_of(fake)
    assert '{"name":"get_weather","arguments":{"city":"Paris"}}' in prompt  # the call, text form
    assert f"Result of get_weather (call {call.call_id}):\nsunny, 21 C" in prompt
    assert second.output_text == "It is sunny." and fake.gens[1][0].grammar is not None  # auto


def test_a_streamed_function_call_is_its_items_events():
    fake = FakeFrontend(reply=CALL_TEXT)

    async def fn(client: TestClient) -> Any:
        async with client_of(client) as c:
            kinds, args = [], []
            async with c.responses.stream(model=MODEL, input="hi", tools=[WEATHER]) as s:
                async for event in s:
                    kinds.append(event.type)
                    if event.type == "response.function_call_arguments.delta":
                        args.append(event.delta)
                return kinds, args, await s.get_final_response()

    kinds, args, final = run(fake, fn)
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (item,) = final.output
    assert item.type == "function_call" and json.loads("".join(args)) == json.loads(item.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_output_tokens_is_incomplete_with_no_output(stream):
    fake = FakeFrontend(reply='{"name": "get_weather", "arguments": {"ci', finish="length")
    body = {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    if not stream:
        status, out = post(fake, "/v1/responses", body)
        assert status == 200 and out["status"] == "incomplete" and out["output"] == []
        return

    async def fn(client: TestClient) -> Any:
        async with client_of(client) as c:
            events = [e async for e in await c.responses.create(model=MODEL, stream=True, **body)]
            return events

    events = run(fake, fn)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.incomplete"]
    assert events[-1].response.output == [] and events[-1].response.incomplete_details.reason == (
        "max_output_tokens"
    )


def test_json_schema_format_is_the_constraint_and_strict_closes_its_objects():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
    }

    def constraint(strict: bool | None) -> dict[str, Any]:
        fake = FakeFrontend(reply='{"a":{"b":1}}')
        fmt: dict[str, Any] = {"type": "json_schema", "name": "out", "schema": schema}
        if strict is not None:
            fmt["strict"] = strict
        status, out = post(fake, "/v1/responses", {"input": "hi", "text": {"format": fmt}})
        assert status == 200 and json.loads(out["output"][0]["content"][0]["text"]) == {"a": {"b": 1}}
        assert out["text"]["format"] == fmt
        return fake.gens[0][0].response_format["json_schema"]["schema"]

    closed = constraint(True)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert constraint(False) == schema and constraint(None) == schema
    fake = FakeFrontend()
    status, _ = post(fake, "/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert status == 200 and fake.gens[0][0].response_format == {"type": "json_object"}


def test_tools_under_auto_with_a_format_answer_a_call_or_the_formatted_json():
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "name": "out", "schema": schema, "strict": True}
    fake = FakeFrontend(reply='{"answer":"sunny"}')
    status, out = post(fake, "/v1/responses", {"input": "hi", "tools": [WEATHER], "text": {"format": fmt}})
    assert status == 200 and out["output"][0]["type"] == "message"
    assert json.loads(out["output"][0]["content"][0]["text"]) == {"answer": "sunny"}
    lark = fake.gens[0][0].grammar
    assert lark.startswith("start: call | answer\n") and '"get_weather"' in lark and '"answer"' in lark
    fake = FakeFrontend(reply=CALL_TEXT)
    status, out = post(fake, "/v1/responses", {"input": "hi", "tools": [WEATHER], "text": {"format": fmt}})
    assert status == 200 and out["output"][0]["type"] == "function_call"


def test_previous_response_id_continues_a_stored_conversation_and_store_false_keeps_nothing():
    fake = FakeFrontend()

    async def fn(client: TestClient) -> Any:
        async with client_of(client) as c:
            first = await c.responses.create(model=MODEL, input="one", instructions="first rules")
            second = await c.responses.create(model=MODEL, input="two", previous_response_id=first.id)
            got = await c.responses.retrieve(second.id)
            unstored = await c.responses.create(model=MODEL, input="x", store=False)
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(unstored.id)
            with pytest.raises(openai.BadRequestError) as err:
                await c.responses.create(model=MODEL, input="y", previous_response_id=unstored.id)
            await c.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await c.responses.delete(first.id)
            return first, second, got, unstored, err.value

    first, second, got, unstored, err = run(fake, fn)
    assert prompt_of(fake, 1) == (
        "<|im_start|>user\none<|im_end|>\n<|im_start|>assistant\nHello, world!<|im_end|>\n"
        "<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n"
    )  # the first's instructions are not carried over
    assert second.previous_response_id == first.id and got.id == second.id
    assert got.output_text == "Hello, world!" and got.usage.input_tokens == second.usage.input_tokens
    assert unstored.store is False and err.code == "previous_response_not_found"
    assert err.body["param"] == "previous_response_id" and len(fake.gens) == 3  # nothing ran for it


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"background": True}, "background"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, None),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"priority": 1}, "priority"),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_field(body, param):
    fake = FakeFrontend()
    status, out = post(fake, "/v1/responses", {"input": "hi", **body})
    assert status == 400 and out["error"]["type"] == "invalid_request_error", out
    if param is not None:
        assert out["error"]["param"] == param, out
    else:
        assert out["error"]["param"].startswith("input[0]"), out
    assert fake.gens == []


def test_the_same_fields_at_their_no_op_values_are_accepted():
    body = {
        "input": "hi",
        "reasoning": {"effort": "none"},
        "background": False,
        "include": ["reasoning.encrypted_content"],
        "truncation": "disabled",
        "service_tier": "auto",
        "top_logprobs": 0,
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "metadata": {"k": "v"},
        "user": "u",
        "prompt_cache_key": "p",
        "parallel_tool_calls": False,
        "stream_options": {"include_obfuscation": False},
        "tools": [],
    }
    fake = FakeFrontend()
    status, out = post(fake, "/v1/responses", body)
    assert status == 200 and out["metadata"] == {"k": "v"} and out["parallel_tool_calls"] is False
    gen = fake.gens[0][0]
    assert (gen.response_format, gen.grammar, gen.regex) == (None, None, None)  # tools: [] is no tools


def test_the_body_sglangs_gateway_forwards_is_served():
    """SGLang's gateway (smg) re-serialises a Responses request with its sampling defaults:
    ``priority`` 0, ``top_k`` -1 (off), ``min_p`` 0 and ``repetition_penalty`` 1, ``store``,
    ``stream`` null. All are served: top_k off, the others as sent."""
    body = {
        "input": "Hi",
        "max_output_tokens": 4,
        "model": MODEL,
        "store": True,
        "stream": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "priority": 0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    fake = FakeFrontend()
    status, out = post(fake, "/v1/responses", body)
    assert status == 200, out
    gen = fake.gens[0][0]
    assert (gen.top_k, gen.min_p, gen.repeat_penalty, gen.max_tokens) == (0, 0.0, 1.0, 4)
    status, out = post(fake, "/v1/responses", {**body, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2})
    assert status == 200 and fake.gens[1][0].top_k == 5
    assert (fake.gens[1][0].min_p, fake.gens[1][0].repeat_penalty) == (0.1, 1.2)
    status, out = post(fake, "/v1/responses", {**body, "top_k": -2})  # on to the limits check
    assert fake.gens[2][0].top_k == -2


def test_a_failure_is_a_typed_error_before_a_stream_and_response_failed_during_one():
    status, out = post(FakeFrontend(error_first=ErrorCode.WORKER_FAILED), "/v1/responses", {"input": "hi"})
    assert status == 503 and out["error"]["code"] == "worker_failed"
    status, out = post(FakeFrontend(), "/v1/responses", {"input": "hi", "model": "nope"})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    fake = FakeFrontend(fail=ErrorCode.WORKER_FAILED)

    async def fn(client: TestClient) -> Any:
        async with client_of(client) as c:
            return [e async for e in await c.responses.create(model=MODEL, input="hi", stream=True)]

    events = run(fake, fn)
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "server_error" and "crashed" in events[-1].response.error.message
    assert [e.type for e in events].count("response.output_text.delta") == 1 and fake.streams[0].closed


def test_the_store_is_bounded_by_entries_and_bytes_dropping_the_least_recently_used():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for k in range(3):
        assert store.put({"id": f"r{k}"}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and len(store) == 2
    store.get("r1")  # now the most recently used
    store.put({"id": "r3"}, [])
    assert store.get("r2") is None and store.get("r1") is not None
    assert not store.put({"id": "big"}, [{"role": "user", "content": "x" * 20_000}])  # alone over
    assert store.get("r1") is not None and store.get("r3") is not None
    bytes_store = ResponseStore(max_entries=100, max_bytes=10_000)
    for name in ("a", "b"):
        assert bytes_store.put({"id": name}, [{"role": "user", "content": "x" * 6_000}])
    assert bytes_store.get("a") is None and len(bytes_store) == 1
    assert bytes_store.get("b").size == bytes_store.bytes <= 10_000
    assert bytes_store.delete("b") and not bytes_store.delete("b") and bytes_store.bytes == 0


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/render"])
def test_max_output_tokens_refusals_name_the_field_the_client_sent(path):
    fake = FakeFrontend()
    for bad in (0, 2**32):  # the front end's limits (check_generate), render included
        status, out = post(fake, path, {"input": "hi", "max_output_tokens": bad})
        assert status == 400 and out["error"]["param"] == "max_output_tokens", out
        message = out["error"]["message"]
        assert message == f"max_output_tokens must be an integer in [1, 4294967295], got {bad}"
    status, out = post(fake, "/v1/responses", {"input": "hi", "max_output_tokens": CONTEXT})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert out["error"]["param"] == "max_output_tokens"
    assert "max_output_tokens" in out["error"]["message"] and "max_tokens" not in out["error"]["message"]
