"""Prompt log-probabilities (``echo: true`` with ``logprobs`` on ``/v1/completions``) on a
llama.cpp worker serving the tiny GGUF, through the ``openai`` package: each prompt token's
logprob after the first matches llama-cpp-python's own loop over the same tokens (every row's
logits, log-softmax), the first is ``null``, the echoed text starts each choice, and a
loglikelihood request the way lm-eval's ``local-completions`` sends it (``echo``, ``logprobs: 1``,
``max_tokens: 1``) ranks a context's continuations by the sum of their tokens' logprobs, as the
plain loop does."""

from __future__ import annotations

import httpx
import llama_cpp
import numpy as np
import openai
import pytest
from daemon_harness import Daemon

PROMPT = "the quick brown fox jumps over the lazy dog and the cat"


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    workers = f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gguf}"\nlanes = 2\ncontext_length = 256\n'
    workers += "threads = 1\n"
    with Daemon(workers + '[http]\nlisten = ["127.0.0.1:0"]\n') as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def plain(tiny_gguf):
    """log P(token i+1 | tokens 0..i) from llama-cpp-python's high-level loop (logits_all)."""
    llm = llama_cpp.Llama(str(tiny_gguf), logits_all=True, n_ctx=256, n_threads=1, verbose=False)

    def score(tokens: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(tokens)
        rows = np.array(llm.scores[: len(tokens)], np.float64)
        peak = rows.max(axis=1)
        lse = peak + np.log(np.exp(rows - peak[:, None]).sum(axis=1))
        return rows[np.arange(len(tokens) - 1), tokens[1:]] - lse[:-1]

    yield score
    llm.close()


def tokens_of(daemon, text: str) -> list[int]:
    return httpx.post(daemon.http_url + "/tokenize", json={"prompt": text}).json()[
        "tokens"
    ]  # BOS, as prompts


def test_prompt_logprobs_match_a_plain_llama_cpp_loop(daemon, client, plain):
    toks = tokens_of(daemon, PROMPT)
    out = client.completions.create(
        model="", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0
    )
    (c,) = out.choices
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    lp = c.logprobs
    n = len(toks)
    assert len(lp.token_logprobs) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = np.array(lp.token_logprobs[1:n])
    assert np.allclose(got, plain(toks), atol=0.02)  # another batch shape: ~1e-3 apart
    for i in range(1, n):
        top = lp.top_logprobs[i]
        assert len(top) <= 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-4
    assert lp.text_offset[n] == len(PROMPT)  # the generated tokens count on after the echo
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 3


def test_echo_alone_and_bounds(daemon, client):
    out = client.completions.create(model="", prompt=["a b", "c d e"], echo=True, max_tokens=0, logprobs=0)
    assert [c.text for c in out.choices] == ["a b", "c d e"]
    assert all(c.finish_reason == "length" for c in out.choices) and out.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="", prompt="x", max_tokens=0)  # 0 only with echo
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="", prompt="x", echo=True, logprobs=21, max_tokens=1)


def test_a_loglikelihood_request_as_lm_eval_sends_it_ranks_like_the_plain_loop(daemon, client, plain):
    context = "the quick brown fox jumps over the"
    choices = [" lazy dog", " moon", " cat and the hat"]
    ctx = tokens_of(daemon, context)
    ours, theirs = [], []
    for cont in choices:
        whole = tokens_of(daemon, context + cont)
        r = client.completions.create(
            model="", prompt=whole, echo=True, logprobs=1, max_tokens=1, temperature=0
        )
        lps = r.choices[0].logprobs.token_logprobs[len(ctx) : len(whole)]  # lm-eval: [ctxlen:-1]
        ours.append(sum(lps))
        theirs.append(float(plain(whole)[len(ctx) - 1 :].sum()))
    assert np.allclose(ours, theirs, atol=0.05)
    assert int(np.argmax(ours)) == int(np.argmax(theirs))
