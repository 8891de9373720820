"""``logprobs`` and ``logit_bias`` end to end with the official ``openai`` package: real daemons on
the reference engine (bytes vocabulary, its own logprobs) and on the tiny GGUF (llama.cpp, whose
logit bias changes the tokens); the chosen token's logprob is checked against a plain llama.cpp
context's log-softmax of the same row."""

from __future__ import annotations

import math
import time

import numpy as np
import openai
import pytest
from daemon_harness import Daemon
from serving_harness import engine_stats, ref_toml, tiny_toml

HTTP = '[http]\nlisten = ["127.0.0.1:0"]\n'


def _client(d: Daemon) -> openai.OpenAI:
    addr = next(a for a in d.http_addresses() if not a.startswith("unix:"))
    return openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref():
    cfg = ref_toml(lanes=2, context=512, grant=2, worker='chat_template = "chatml"') + HTTP
    with Daemon(cfg) as d, _client(d) as c:
        c.daemon = d
        yield c


def check_alternatives(chosen: float, tops: list[float], k: int, greedy: bool) -> None:
    assert len(tops) == k
    assert all(math.isfinite(v) and v <= 0.0 for v in [chosen, *tops])
    assert tops == sorted(tops, reverse=True)
    if greedy and k:
        assert chosen == pytest.approx(tops[0], abs=1e-6)  # greedy picks the most likely token


def test_completion_logprobs_streamed_and_not_agree(ref):
    full = ref.completions.create(model="", prompt="hello there", max_tokens=12, temperature=0, logprobs=3)
    (choice,) = full.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == full.usage.completion_tokens
    for chosen, token, tops in zip(lp.token_logprobs, lp.tokens, lp.top_logprobs, strict=True):
        check_alternatives(chosen, list(tops.values()), len(tops), greedy=True)
        assert 1 <= len(tops) <= 3 and max(tops, key=tops.get) == token  # dict keys may collide
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(
        ref.completions.create(
            model="", prompt="hello there", max_tokens=12, temperature=0, logprobs=3, stream=True
        )
    )
    got = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for g in got for t in g.tokens] == lp.tokens
    assert [v for g in got for v in g.token_logprobs] == lp.token_logprobs
    assert [o for g in got for o in g.text_offset] == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    zero = ref.completions.create(model="", prompt="hello there", max_tokens=4, temperature=0, logprobs=0)
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[:4]
    assert zero.choices[0].logprobs.top_logprobs == [{}] * 4
    plain = ref.completions.create(model="", prompt="hello there", max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_bytes_and_alternatives(ref):
    msgs = [{"role": "user", "content": "hi"}]
    full = ref.chat.completions.create(
        model="", messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=4
    )
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for e in content:
        check_alternatives(e.logprob, [t.logprob for t in e.top_logprobs], 4, greedy=True)
        assert e.top_logprobs[0].bytes == e.bytes
    text = full.choices[0].message.content
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == text
    chunks = list(
        ref.chat.completions.create(
            model="", messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=4, stream=True
        )
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob, e.bytes) for e in streamed] == [
        (e.token, e.logprob, e.bytes) for e in content
    ]
    for c in chunks:  # a chunk's logprobs are the tokens of its own text
        if c.choices and c.choices[0].delta.content and c.choices[0].logprobs:
            own = bytes(b for e in c.choices[0].logprobs.content for b in e.bytes)
            assert own.decode("utf-8", "replace") == c.choices[0].delta.content
    sampled = ref.chat.completions.create(
        model="", messages=msgs, max_tokens=6, temperature=0.8, seed=3, logprobs=True
    )
    for e in sampled.choices[0].logprobs.content:
        assert math.isfinite(e.logprob) and e.logprob <= 0 and e.top_logprobs == []


def test_native_tokens_carry_one_entry_per_id(ref):
    with ref.daemon.client() as c:
        s = c.stream("hello", max_tokens=6, temperature=0, logprobs=2)
        msgs = list(s)
    assert sum(len(m.ids) for m in msgs) == 6
    for m in msgs:
        assert [e.id for e in m.logprobs] == m.ids
        assert all(len(e.top) == 2 and e.top[0].id == e.id for e in m.logprobs)


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
        ("completions", {"logit_bias": {"x5": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_bad_values_are_400(ref, kind, fields, param):
    with pytest.raises(openai.BadRequestError, match=param):
        if kind == "chat":
            ref.chat.completions.create(
                model="", messages=[{"role": "user", "content": "x"}], max_tokens=2, **fields
            )
        else:
            ref.completions.create(model="", prompt="x", max_tokens=2, **fields)
    assert ref.completions.create(model="", prompt="x", max_tokens=1).choices[0].finish_reason == "length"


# --- llama.cpp: the bias reaches the sampler; logprobs match a plain context --------------------------


@pytest.fixture(scope="module")
def gguf(tiny_gguf):
    with Daemon(tiny_toml(tiny_gguf, lanes=2, context=256) + HTTP) as d, _client(d) as c:
        c.daemon = d
        c.model_path = tiny_gguf
        yield c


PROMPT = "The quick brown fox"


def greedy_ids(c: openai.OpenAI, n: int, **fields) -> list[int]:
    """Token ids of a native Generate of ``PROMPT`` (greedy unless ``fields`` say otherwise)."""
    with c.daemon.client() as native:
        return native.generate(PROMPT, max_tokens=n, ignore_eos=True, **{"temperature": 0, **fields}).ids


def test_logit_bias_bans_and_forces_tokens(gguf):
    base = greedy_ids(gguf, 8)
    banned = base[0]
    ids = greedy_ids(gguf, 8, logit_bias={banned: -100.0})
    assert banned not in ids and ids != base
    first = gguf.completions.create(model="", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    out = gguf.completions.create(
        model="", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0, logit_bias={str(banned): -100}
    )
    assert out.choices[0].logprobs.tokens != first.choices[0].logprobs.tokens  # HTTP's keys reach it too
    forced = base[1] if base[1] != base[0] else base[0] + 1
    assert greedy_ids(gguf, 6, logit_bias={forced: 100.0}) == [forced] * 6
    assert greedy_ids(gguf, 6, logit_bias={forced: 100.0}, temperature=1.0, seed=5) == [forced] * 6
    with gguf.daemon.client() as native:
        piece = native.generate(PROMPT, max_tokens=1, temperature=0, logit_bias={forced: 100.0}).text
    text = (
        gguf.completions.create(
            model="", prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
        )
        .choices[0]
        .text
    )
    assert piece and text == piece * 3
    assert greedy_ids(gguf, 8) == base  # a bias is per request: nothing stays behind


def test_gguf_logprobs_equal_a_plain_llama_context(gguf):
    with gguf.daemon.client() as native:
        prompt = native.tokenize(PROMPT)
        s = native.stream(prompt_tokens=prompt, max_tokens=1, temperature=0, logprobs=5)
        (entry,) = [e for m in s for e in m.logprobs]
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llamacpp"))
    from lc_harness import BareLlama

    params = dict(n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=1, n_threads=1, n_threads_batch=1)
    bare = BareLlama(gguf.model_path, params)
    try:
        (row,) = bare.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    finally:
        bare.close()
    row = row.astype(np.float64)
    lsm = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    assert entry.id == int(np.argmax(row))
    assert entry.logprob == pytest.approx(lsm[entry.id], abs=2e-3)
    assert [t.id for t in entry.top][:1] == [entry.id]
    for t in entry.top:
        assert t.logprob == pytest.approx(lsm[t.id], abs=2e-3)
    assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)


def live_biases(d: Daemon, expected: int | None = 0, timeout: float = 15.0) -> int:
    """The worker's live logit-bias tables once they equal ``expected`` (None: at least one)."""
    deadline = time.monotonic() + timeout
    while True:
        live = engine_stats(d)[0].get("live_logit_biases")
        assert live is not None, "the engine reports no live_logit_biases"
        if (live >= 1) if expected is None else (live == expected):
            return live
        assert time.monotonic() < deadline, f"live logit-bias tables {live}, expected {expected}"
        time.sleep(0.05)


def test_bias_tables_are_freed_on_every_exit_path(gguf):
    d = gguf.daemon
    bias = {5: 1.0, 6: -2.0}
    greedy_ids(gguf, 3, logit_bias=bias)  # Done
    live_biases(d)
    with d.client() as native:  # cancelled while running: live until then
        s = native.stream(PROMPT, max_tokens=200, temperature=0, ignore_eos=True, logit_bias=bias)
        next(iter(s))
        live_biases(d, None)
        s.cancel()
    live_biases(d)
    stream = gguf.completions.create(
        model="", prompt=PROMPT, max_tokens=200, temperature=0, stream=True, logit_bias={"5": 1}
    )
    next(iter(stream))  # the client goes away mid-stream
    stream.close()
    live_biases(d)
    out = gguf.completions.create(
        model="", prompt=PROMPT, max_tokens=20, temperature=0, stop=[" "], logit_bias={"5": 1}
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    live_biases(d)
