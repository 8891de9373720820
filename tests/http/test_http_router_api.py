"""What routers and other servers' SDKs send and poll, against a real daemon on the reference
engine (README "Extension fields", docs/scale-out.md): the extension-field table (no-op values
accepted, any other value a 400 naming field and value, nothing queued), vLLM's
``continuous_usage_stats``, ``/server_info`` / ``/model_info`` / ``/get_load``, vLLM's render
endpoints and chat ``/tokenize`` (the token ids the request would run with), ``"model":
"unknown"``, ``vllm:lora_requests_info``, and a drain that turns ``/health`` 503 before it
refuses work."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from daemon_harness import Daemon
from proc_testutil import wait_until
from serving_harness import ref_toml

from basertd.server.transport.http.extensions import NO_OP

REF = {"vocab_size": 259, "eos_token": 2, "eos_period": 0, "tick_delay_us": 2000}
SYSTEM = "You are a careful assistant. " * 4
MSGS = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi."}]

# what vllm-router 0.1.17 and sglang-router 0.3.2 add to every body they forward
ROUTER_COMPLETION = {
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
ROUTER_CHAT = {
    **{k: v for k, v in ROUTER_COMPLETION.items() if k != "echo"},
    "logprobs": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
}


def config(extra: str = "", ref: dict | None = None) -> str:
    return (
        ref_toml(lanes=2, context=512, grant=4, ref=ref or REF, worker='chat_template = "chatml"')
        + extra
        + '[http]\nlisten = ["127.0.0.1:0"]\n'
    )


@pytest.fixture(scope="module")
def daemon():
    with Daemon(config()) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        d.model = httpx.get(d.http_url + "/v1/models").json()["data"][0]["id"]
        yield d


def post(d: Daemon, path: str, body: dict) -> httpx.Response:
    return httpx.post(d.http_url + path, json=body, timeout=60)


def requests_done(d: Daemon) -> int:
    return sum(1 for e in d.log_events() if e.get("event") == "access")


def test_router_bodies_are_served_unchanged(daemon):
    for stream in (False, True):
        r = post(
            daemon,
            "/v1/completions",
            {"prompt": "Hello", "max_tokens": 3, "stream": stream, **ROUTER_COMPLETION},
        )
        assert r.status_code == 200, r.text
        r = post(
            daemon,
            "/v1/chat/completions",
            {"messages": MSGS, "max_tokens": 3, "stream": stream, **ROUTER_CHAT},
        )
        assert r.status_code == 200, r.text
        assert "[DONE]" in r.text if stream else r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("no_stop_trim", True),
        ("skip_special_tokens", False),
        ("best_of", 3),
        ("min_tokens", 2),
        ("stop_token_ids", [5]),
        ("use_beam_search", True),
        ("cache_prompt", False),
        ("priority", 1),
        ("return_hidden_states", 0),  # a number is not the boolean it equals
        ("mirostat", 2),
    ],
)
def test_an_extension_field_at_another_value_is_a_400_naming_it(daemon, field, value):
    before = requests_done(daemon)
    r = post(daemon, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_value"
    assert f"'{field}' = {json.dumps(value)}" in err["message"]
    assert json.dumps(NO_OP[field][0]) in err["message"]  # the value served
    assert requests_done(daemon) == before


def test_every_no_op_value_of_the_table_is_accepted(daemon):
    chat_only = {"echo", "continue_final_message", "add_generation_prompt", "separate_reasoning"}
    chat_only |= {"stream_reasoning", "include_reasoning", "chat_template", "chat_template_kwargs"}
    chat_only |= {"documents", "reasoning_effort", "add_special_tokens"}
    noop = {k: v[0] for k, v in NO_OP.items() if v}
    nulls = {k: None for k, v in NO_OP.items() if not v}
    cmpl = {k: v for k, v in {**noop, **nulls}.items() if k not in chat_only}
    r = post(daemon, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **cmpl})
    assert r.status_code == 200, r.text
    r = post(daemon, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **noop, **nulls})
    assert r.status_code == 200, r.text
    r = post(daemon, "/v1/completions", {"prompt": "Hi", "continue_final_message": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(daemon):
    c = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        c.completions.create(
            model=daemon.model,
            prompt="Count:",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    with_text = [ch for ch in chunks if ch.choices and ch.choices[0].text]
    assert with_text and all(ch.usage is not None for ch in chunks)
    done = [ch.usage.completion_tokens for ch in with_text]
    assert done == sorted(done) and done[-1] == 6 and chunks[-1].usage.completion_tokens == 6
    assert {ch.usage.prompt_tokens for ch in chunks} == {chunks[-1].usage.prompt_tokens}
    # without continuous_usage_stats: null usage until the last chunk
    plain = list(
        c.completions.create(
            model=daemon.model,
            prompt="Count:",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_the_polled_endpoints_answer_in_the_routers_shapes(daemon):
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(daemon.http_url + path).json()
        assert info["served_model_name"] == info["model_id"] == daemon.model
        assert info["dp_size"] == 1 and info["max_running_requests"] == 2 and info["kv_block_size"] == 16
        assert "model_path" not in info  # a router would load a tokenizer from it
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(daemon.http_url + path).json()["is_generation"] is True
    load = httpx.get(daemon.http_url + "/get_load").json()
    assert load == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "dp_rank": 0}
    seen: list[dict] = []
    polls: list[dict] = []
    body = {"prompt": "A long one", "max_tokens": 400}
    t = threading.Thread(target=lambda: seen.append(post(daemon, "/v1/completions", body).json()))
    t.start()

    def running() -> dict | None:
        polls.append(x := httpx.get(daemon.http_url + "/get_load").json())
        return x if x["num_tokens"] else None  # a queued request holds no KV yet

    busy = wait_until(running, 30, what="the request running on a lane")
    t.join(60)
    assert busy["num_reqs"] == busy["load"] == 1 and busy["num_waiting_reqs"] == 0 and seen[0]["choices"]
    # every poll adds up: queued or running, never both, never more than the one request
    assert all(p["load"] == p["num_reqs"] <= 1 and p["num_waiting_reqs"] <= p["num_reqs"] for p in polls)
    assert all(p["num_tokens"] == 0 for p in polls if p["num_waiting_reqs"])


def test_render_gives_the_token_ids_and_sampling_params_the_request_would_run_with(daemon):
    body = {"messages": MSGS, "max_tokens": 5, "temperature": 0.5, "top_k": 7, "seed": 3, **ROUTER_CHAT}
    before = requests_done(daemon)
    r = post(daemon, "/v1/chat/completions/render", body)
    assert r.status_code == 200, r.text
    g = r.json()
    sp = g["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["top_k"], sp["seed"]) == (5, 0.5, 7, 3)
    assert g["model"] == daemon.model and g["token_ids"]
    tok = post(
        daemon, "/tokenize", {"model": daemon.model, "messages": MSGS, "continue_final_message": False}
    )
    assert tok.status_code == 200 and tok.json()["tokens"] == g["token_ids"]
    ran = post(daemon, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}).json()
    assert ran["usage"]["prompt_tokens"] == len(g["token_ids"])
    assert requests_done(daemon) == before + 1  # render and tokenize queued nothing

    r = post(
        daemon, "/v1/completions/render", {"prompt": ["abc", "de"], "max_tokens": 2, **ROUTER_COMPLETION}
    )
    want = [post(daemon, "/tokenize", {"prompt": p}).json()["tokens"] for p in ("abc", "de")]
    assert r.status_code == 200 and [x["token_ids"] for x in r.json()] == want and len(want[0]) >= 3
    bad = post(daemon, "/v1/chat/completions/render", {"messages": MSGS, "echo": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"
    # a render refuses what the request itself would be refused for (the front end's limits)
    for path, body in (
        ("/v1/chat/completions/render", {"messages": MSGS, "temperature": 500}),
        ("/v1/chat/completions/render", {"messages": MSGS, "max_completion_tokens": 0}),
        ("/v1/completions/render", {"prompt": "abc", "top_p": 2}),
        ("/v1/responses/render", {"input": MSGS, "max_output_tokens": 0}),
    ):
        bad = post(daemon, path, body)
        field = next(k for k in body if k not in ("messages", "prompt", "input"))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (path, bad.text)
        assert bad.json()["error"]["message"].startswith(field), bad.text
    # a response's render (vllm-router's cache-aware policy asks it): the prompt /v1/responses runs
    resp = {"input": MSGS, "max_output_tokens": 3, "temperature": 0.5}
    before = requests_done(daemon)
    r = post(daemon, "/v1/responses/render", resp)
    assert r.status_code == 200, r.text
    g = r.json()
    assert g["sampling_params"]["max_tokens"] == 3 and g["model"] == daemon.model
    ran = post(daemon, "/v1/responses", resp).json()
    assert ran["usage"]["input_tokens"] == len(g["token_ids"]) > 0
    assert requests_done(daemon) == before + 1  # the render queued nothing
    cont = post(daemon, "/tokenize", {"messages": MSGS, "continue_final_message": True})
    assert cont.status_code == 400 and cont.json()["error"]["param"] == "continue_final_message"


def test_model_unknown_goes_to_the_default_model_and_a_wrong_name_stays_a_404(daemon):
    r = post(daemon, "/v1/completions", {"model": "unknown", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == daemon.model
    r = post(daemon, "/v1/chat/completions", {"model": "unknown", "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200
    assert post(daemon, "/v1/completions", {"model": "unknowns", "prompt": "Hi"}).status_code == 404


def test_metrics_carry_lora_requests_info(daemon):
    text = httpx.get(daemon.http_url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="0"' in line and 'running_lora_adapters=""' in line


def test_a_drain_turns_health_503_before_it_refuses_work():
    with Daemon(config("[operators]\ndrain_grace_s = 3.0\n")) as d:
        url = "http://" + d.http_addresses()[0]
        out: list = []
        t = threading.Thread(target=lambda: out.append(d.ctl("drain", "--timeout", "10")))
        t.start()
        wait_until(lambda: httpx.get(url + "/health").status_code == 503, 10, what="health 503")
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text  # the grace: still served
        refused = wait_until(
            lambda: (
                (x := httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)).status_code
                == 503
                and x
            ),
            10,
            what="refused after the grace",
        )
        assert refused.json()["error"]["code"] == "draining" and refused.headers["Retry-After"] == "1"
        t.join(30)
        assert out[0].returncode == 0, out[0].stderr
        assert d.ctl("resume").returncode == 0


def test_a_stopping_daemon_ends_its_open_streams_with_an_error_event():
    """What a router forwards to the client when the daemon can still say why the stream ends."""
    # 50 ms ticks of 4 tokens: the 500-token stream outlives the 0.5 s drain several times over
    d = Daemon(config("[operators]\ndrain_timeout_s = 0.5\n", ref={**REF, "tick_delay_us": 50_000}))
    try:
        url = "http://" + d.http_addresses()[0]
        lines: list[str] = []
        body = {"prompt": "Hi", "max_tokens": 500, "stream": True}

        def read() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(x for x in r.iter_lines() if x)

        t = threading.Thread(target=read)
        t.start()
        wait_until(lambda: httpx.get(url + "/get_load").json()["load"] == 1, 30, what="the stream runs")
        d.stop()  # SIGTERM: the drain times out while the stream runs
        t.join(30)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert err["code"] == "shutting_down", err
    except BaseException:
        d.kill()
        raise
