"""The ``speculation`` extension field on every HTTP dialect (``Generate.speculation``): OpenAI's
chat and completions, Anthropic's Messages (a top-level field), Ollama's ``options`` and the
Responses API (a top-level field), driven by the official ``openai``, ``anthropic`` and ``ollama``
packages against a daemon whose tiny llama.cpp worker registers prompt-lookup. "off" drafts
nothing and a strategy name drafts (the worker's counters in ``basertctl status``); an unknown
value or one of the wrong type is a 400 naming the field (and the value), and no request is
accepted."""

from __future__ import annotations

import re

import anthropic
import httpx
import ollama
import openai
import pytest
from daemon_harness import Daemon

MODEL = "tiny-llama"
SYSTEM = "be brief"
# Many distinct tokens, repeated: a generated token is likely to occur earlier (ngram_min 1)
TEXT = " ".join(f"w{i} x{i * 7 % 13}" for i in range(40)) * 2
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    cfg = (
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gguf}"\nlanes = 2\ncontext_length = 1024\n'
        'threads = 1\nchat_template = "chatml"\n[scheduler]\ndecode_grant = 8\ndecode_tick_s = 0\n'
        '[speculation]\nstrategies = ["prompt-lookup"]\nngram_min = 1\nmin_acceptance = 0.0\n'
        '[http]\nlisten = ["127.0.0.1:0"]\n'
    )
    with Daemon(cfg) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


@pytest.fixture(scope="module")
def clients(daemon):
    url = daemon.http_url
    with (
        anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60) as claude,
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as oai,
    ):
        yield {"claude": claude, "openai": oai, "ollama": ollama.Client(host=url, timeout=60)}


def drafted(daemon) -> int:
    """Drafts the workers verified, once every lane has retired: a request whose Done went out on
    a partial emit has its tick's SpecStats applied only at the tick's end."""
    rows = daemon.wait_idle().speculation
    return sum(r.drafted_tokens for r in rows)


def accepted_requests(daemon) -> float:
    """Requests accepted and ended, over every label (``basertd_requests_total``)."""
    text = daemon.ctl("metrics").stdout
    return sum(float(v) for v in re.findall(r"^basertd_requests_total\{[^}]*\} (\S+)$", text, re.M))


def ask(clients, dialect: str, speculation, *, n: int = 16):
    """One greedy request of ``n`` tokens on ``dialect`` with ``speculation`` (None: not sent);
    returns the client's response."""
    extra = {} if speculation is None else {"speculation": speculation}
    if dialect == "anthropic":
        return clients["claude"].messages.create(
            model=MODEL,
            system=SYSTEM,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=n,
            extra_body={**GREEDY, **extra},
        )
    if dialect == "ollama":
        return clients["ollama"].chat(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            options={**GREEDY, "num_predict": n, **extra},
        )
    if dialect == "responses":
        return clients["openai"].responses.create(
            model=MODEL, input=TEXT, instructions=SYSTEM, max_output_tokens=n, temperature=0, extra_body=extra
        )
    return clients["openai"].chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=n,
        temperature=0,
        extra_body=extra,
    )


def status_and_message(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, ollama.ResponseError):
        return exc.status_code, exc.error
    assert isinstance(exc, (anthropic.APIStatusError, openai.APIStatusError))
    return exc.status_code, str(exc)


DIALECTS = ["openai", "anthropic", "ollama", "responses"]
ERRORS = (anthropic.APIStatusError, openai.APIStatusError, ollama.ResponseError)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_field_reaches_the_scheduler(daemon, clients, dialect):
    """ "off" drafts nothing; the strategy's name, and auto (the field left out), draft."""
    before = drafted(daemon)
    ask(clients, dialect, "off")
    assert drafted(daemon) == before
    ask(clients, dialect, "prompt-lookup")
    named = drafted(daemon)
    assert named > before
    ask(clients, dialect, None)
    assert drafted(daemon) > named


USAGE_TOKENS = 16
"""Tokens of the usage test's requests: about two ticks (``decode_grant`` 8 rounds), so most end
on a partial emit, whose drafts so far count in the usage (the tick's SpecStats come after it)."""


def drafts_in_usage(daemon, dialect: str, speculation: str) -> tuple[int, int] | None:
    """(drafted, accepted) as one greedy request's usage reports them on ``dialect`` (None: not
    reported). Ollama's client keeps only Ollama's own fields, so its body is read as sent."""
    if dialect == "ollama":
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": TEXT}],
            "stream": False,
            "options": {**GREEDY, "num_predict": USAGE_TOKENS, "speculation": speculation},
        }
        got = httpx.post(daemon.http_url + "/api/chat", json=body, timeout=60).raise_for_status().json()
        return (got["draft_tokens"], got["accepted_draft_tokens"]) if "draft_tokens" in got else None
    raise AssertionError(dialect)


def _drafts(dialect: str, resp) -> tuple[int, int] | None:
    u = resp.usage.model_dump()
    if dialect == "anthropic":
        return (u["draft_tokens"], u["accepted_draft_tokens"]) if "draft_tokens" in u else None
    details = u.get("completion_tokens_details" if dialect == "openai" else "output_tokens_details") or {}
    if details.get("accepted_prediction_tokens") is None:
        return None
    accepted = details["accepted_prediction_tokens"]
    return accepted + details["rejected_prediction_tokens"], accepted


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_usage_counts_a_requests_drafts(daemon, clients, dialect):
    """A drafting request's usage says how many tokens it drafted and how many were accepted (no
    more than the worker verified in that time); one that did not draft says nothing of drafts."""

    def one(speculation: str) -> tuple[int, int] | None:
        if dialect == "ollama":
            return drafts_in_usage(daemon, dialect, speculation)
        return _drafts(dialect, ask(clients, dialect, speculation, n=USAGE_TOKENS))

    assert one("off") is None
    before = drafted(daemon)
    got = one("prompt-lookup")
    assert got is not None, "a drafting request's usage reports no drafts"
    n, accepted = got
    assert 0 < n <= drafted(daemon) - before and 0 <= accepted <= n, (got, drafted(daemon) - before)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_bad_value_is_a_400_naming_the_field_and_nothing_is_accepted(daemon, clients, dialect):
    before = accepted_requests(daemon)
    assert before > 0  # the requests of the test above, counted
    for value, shown in (("bogus", "'bogus'"), ("draft-model", "'draft-model'"), (7, "speculation")):
        with pytest.raises(ERRORS) as info:
            ask(clients, dialect, value, n=4)
        status, message = status_and_message(info.value)
        assert status == 400, message
        assert "speculation" in message and shown in message, message
    assert accepted_requests(daemon) == before
