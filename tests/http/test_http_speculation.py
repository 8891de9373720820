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
    rows = daemon.status().speculation
    return sum(r.drafted_tokens for r in rows)


def accepted_requests(daemon) -> float:
    """Requests accepted and ended, over every label (``basertd_requests_total``)."""
    text = daemon.ctl("metrics").stdout
    return sum(float(v) for v in re.findall(r"^basertd_requests_total\{[^}]*\} (\S+)$", text, re.M))


def ask(clients, dialect: str, speculation, *, n: int = 16) -> None:
    """One greedy request of ``n`` tokens on ``dialect`` with ``speculation`` (None: not sent)."""
    extra = {} if speculation is None else {"speculation": speculation}
    if dialect == "anthropic":
        clients["claude"].messages.create(
            model=MODEL,
            system=SYSTEM,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=n,
            extra_body={**GREEDY, **extra},
        )
    elif dialect == "ollama":
        clients["ollama"].chat(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            options={**GREEDY, "num_predict": n, **extra},
        )
    elif dialect == "responses":
        clients["openai"].responses.create(
            model=MODEL, input=TEXT, instructions=SYSTEM, max_output_tokens=n, temperature=0, extra_body=extra
        )
    else:
        clients["openai"].chat.completions.create(
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
