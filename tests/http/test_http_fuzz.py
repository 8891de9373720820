"""Bad input over HTTP: 10,000 random and mutated JSON bodies, each answered with a 4xx OpenAI
error object, over one keep-alive connection to a real daemon (reference engine), which then
still serves. Every body is invalid by construction (a wrong type or range, an unknown field,
broken JSON, a non-object), so none may start a generation."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from daemon_harness import Daemon
from serving_harness import ref_toml

N_BODIES = 10_000

VALID = {
    "/v1/completions": {"model": "", "prompt": "hi", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [10, 11]},
}
BAD_VALUES = [
    None, True, -1, 0, 2**70, -(2**70), 1e308, -1e308, "x", "", [], {}, [None], [-5], [[1, "a"]],
    {"a": 1}, 3.5, "\ud800", "interactive!", [1e9], [[]],
]  # fmt: skip
BAD_FIELDS = {
    "/v1/completions": {
        "prompt": [None, 5, [], [[]], [1.5], [True], [[1], "a"], {"a": 1}, [2**40], [-1], ""],
        "max_tokens": [0, -1, 2**40, "2", 1.5, True],
        "temperature": [-1, 1e9, "hot", [1]],
        "top_p": [-0.1, 1.5, "x"],
        "top_k": [-2, 2**40, 1.5],  # -1 is "off" (vLLM, SGLang)
        "min_p": [2.0, -1],
        "n": [0, 100, -1, "3"],
        "seed": [-(2**70), 2**70, "s"],
        "stop": [5, [1], ["x"] * 40, ["y" * 1000]],
        "logprobs": [21, -1, "5", 1.5],
        "logit_bias": [{"1": 500}, 7, {"x": 1}, {"1": "a"}, {"-1": 1}, {"99999999": 1}],
        "stream": ["yes", 1],
        "stream_options": [{"include_usage": True}, {"bogus": 1}, 5],
        "presence_penalty": [3, -3],
        "frequency_penalty": [3, -3],
        "repetition_penalty": [0, -1, 1000],
        "qos": ["vip", 5],
        "model": ["no-such-model", 5, "m" * 300],
        "echo": ["yes", 5],
        "suffix": ["s"],
        "best_of": [2],
        "user": [5],
    },
    "/v1/chat/completions": {
        "messages": [[], None, "hi", [{"role": "robot", "content": "x"}], [{"content": "x"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user", "content": "x", "extra": 1}]],
        "max_completion_tokens": [0, -5, "x"],
        "logprobs": ["yes", 3],
        "top_logprobs": [3, -1],
        "tools": [[]],
        "response_format": [{"type": "xml"}, "json", {"type": "json_schema", "json_schema": {"schema": 5}}],
    },
    "/tokenize": {"content": [5, None, ["x"]], "add_special": ["no"], "bogus": [1]},
    "/detokenize": {"tokens": [None, ["a"], [-1], [10**6], "x"], "bogus": [1]},
}  # fmt: skip


def bad_body(rng: random.Random) -> tuple[str, bytes]:
    path = rng.choice(list(VALID))
    body = dict(VALID[path])
    kind = rng.randrange(6)
    if kind == 0:  # a field set to a value it refuses
        field = rng.choice(list(BAD_FIELDS[path]))
        body[field] = rng.choice(BAD_FIELDS[path][field])
        if field == "stream_options":
            body.pop("stream", None)
        raw = json.dumps(body)
    elif kind == 1:  # an unknown field with any value
        body["x_" + "".join(rng.choices("abcdefghij", k=6))] = rng.choice(BAD_VALUES)
        raw = json.dumps(body)
    elif kind == 2:  # a required field removed, or every field of the wrong type
        if path == "/v1/completions":
            body.pop("prompt")
        elif path == "/v1/chat/completions":
            body.pop("messages")
        elif path == "/tokenize":
            body.pop("content")
        else:
            body.pop("tokens")
        raw = json.dumps(body)
    elif kind == 3:  # broken JSON: truncated or with bytes flipped
        raw = json.dumps(body)
        cut = rng.randrange(1, len(raw) - 1)
        raw = raw[:cut] if rng.random() < 0.5 else raw[:cut] + rng.choice('{}[]",:\\\x00') + raw[cut + 1 :]
        try:
            json.loads(raw)
            raw = raw + "}"  # still valid: make sure it is not
        except ValueError:
            pass
    elif kind == 4:  # not an object
        raw = json.dumps(rng.choice([None, 1, "s", [], [body], True, 1.5]))
    else:  # random bytes
        return path, bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    return path, raw.encode("utf-8", "surrogatepass")


@pytest.mark.slow
def test_ten_thousand_bad_bodies_get_4xx_and_the_daemon_keeps_serving():
    cfg = ref_toml(lanes=2, context=256, ref={"tick_delay_us": 0}) + '[http]\nlisten = ["127.0.0.1:0"]\n'
    with Daemon(cfg) as d:
        url = "http://" + d.http_addresses()[0]
        rng = random.Random(1234)
        with httpx.Client(base_url=url, timeout=30) as c:
            statuses: dict[int, int] = {}
            for i in range(N_BODIES):
                path, body = bad_body(rng)
                r = c.post(path, content=body, headers={"Content-Type": "application/json"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert 400 <= r.status_code < 500, (i, path, body, r.status_code, r.text)
                err = r.json()["error"]
                assert err["message"] and err["type"] and "Traceback" not in err["message"]
            assert set(statuses) <= {400, 404}, statuses
            ok = c.post("/v1/completions", json=VALID["/v1/completions"])
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        d.wait_idle()  # the last request's lane retires in the plan after its Done
        rows = d.workers()
        assert all(r.lanes_busy == 0 and r.queue_depth == 0 for r in rows), rows
        assert all(r.respawns == 0 for r in rows), rows
