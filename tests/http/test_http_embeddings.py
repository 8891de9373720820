"""Embeddings over HTTP (``/v1/embeddings``, Ollama's ``/api/embed`` and ``/api/embeddings``)
through the ``openai`` and ``ollama`` packages, on a llama.cpp worker serving the tiny GGUF and a
reference-engine worker (which serves none). The vectors are compared with llama-cpp-python's own
embedding loop on the same file (mean pooling, normalised); batched inputs give the vectors of
single ones; a generation on the same worker runs on while embeddings are served between its
ticks."""

from __future__ import annotations

import base64
import re

import httpx
import llama_cpp
import numpy as np
import ollama
import openai
import pytest
from daemon_harness import Daemon

TEXTS = ["hello world", "the cat sat on the mat", "hello world", "a b c d e f g"]


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    workers = (
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gguf}"\n'
        "lanes = 2\ncontext_length = 256\nthreads = 1\n"
        '[[workers]]\nengine = "basert"\nlanes = 2\ncontext_length = 128\n'
    )
    with Daemon(workers + '[http]\nlisten = ["127.0.0.1:0"]\n') as d:
        d.http_url = "http://" + d.http_addresses()[0]
        models = httpx.get(d.http_url + "/v1/models").json()["data"]
        d.llama_model, d.ref_model = (m["id"] for m in models)
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def reference(path, texts):
    llm = llama_cpp.Llama(
        str(path),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_ctx=256,
        n_threads=1,
        verbose=False,
    )
    try:
        return np.array(llm.embed(texts, normalize=True), np.float32)
    finally:
        llm.close()


def test_openai_embeddings_match_llama_cpps_own_loop(daemon, client, tiny_gguf):
    out = client.embeddings.create(model=daemon.llama_model, input=TEXTS)  # the package asks for base64
    got = np.array([d.embedding for d in sorted(out.data, key=lambda d: d.index)], np.float32)
    assert got.shape[0] == len(TEXTS) and np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert np.allclose(got, reference(tiny_gguf, TEXTS), atol=1e-4)
    assert (
        np.allclose(got[0], got[2], atol=1e-5) and float(got[0] @ got[1]) < 0.9999
    )  # batch rows: ~1e-6 apart
    counts = [
        len(
            httpx.post(daemon.http_url + "/tokenize", json={"prompt": t, "model": daemon.llama_model}).json()[
                "tokens"
            ]
        )
        for t in TEXTS
    ]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(counts)
    floats = httpx.post(
        daemon.http_url + "/v1/embeddings",
        json={"model": daemon.llama_model, "input": TEXTS[1], "encoding_format": "float"},
    ).json()
    # alone vs among 4: another batch shape, another matmul order (~1e-4 apart on the tiny model)
    assert np.allclose(floats["data"][0]["embedding"], got[1], atol=1e-3)
    ids = httpx.post(
        daemon.http_url + "/tokenize", json={"prompt": TEXTS[1], "model": daemon.llama_model}
    ).json()["tokens"]
    by_ids = client.embeddings.create(model=daemon.llama_model, input=[ids])
    assert np.allclose(by_ids.data[0].embedding, floats["data"][0]["embedding"], atol=1e-6)


def test_a_batch_of_32_gives_the_vectors_of_single_inputs(daemon, client):
    texts = [f"sentence number {i} " * (1 + i % 5) for i in range(32)]
    batch = client.embeddings.create(model=daemon.llama_model, input=texts)
    single = [
        client.embeddings.create(model=daemon.llama_model, input=t).data[0].embedding for t in texts[:4]
    ]
    assert np.allclose([d.embedding for d in batch.data[:4]], single, atol=1e-3)
    assert [d.index for d in batch.data] == list(range(32))


def test_ollama_embed_and_embeddings(daemon, client):
    c = ollama.Client(host=daemon.http_url, timeout=60)
    out = c.embed(model=daemon.llama_model, input=TEXTS[:2])
    assert len(out.embeddings) == 2 and out.prompt_eval_count > 0
    want = client.embeddings.create(model=daemon.llama_model, input=TEXTS[:2])
    assert np.allclose(out.embeddings, [d.embedding for d in want.data], atol=1e-6)
    legacy = c.embeddings(model=daemon.llama_model, prompt=TEXTS[0])
    assert np.allclose(legacy.embedding, out.embeddings[0], atol=1e-6)
    long = "word " * 2000  # over the 256-token context: truncated by default, refused without
    assert len(c.embed(model=daemon.llama_model, input=long).embeddings[0]) == len(out.embeddings[0])
    with pytest.raises(ollama.ResponseError) as err:
        c.embed(model=daemon.llama_model, input=long, truncate=False)
    assert err.value.status_code == 400 and "context" in str(err.value)


@pytest.mark.parametrize(
    ("body", "phrase"),
    [
        ({"input": []}, "input must be"),
        ({"input": [""]}, "input[0] is empty"),
        ({"input": "x", "dimensions": 7}, "dimensions must be"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "word " * 2000}, "context length"),
        ({"input": [[1, 2, 10**9]]}, "outside the vocabulary"),
        ({"input": ["x"] * 257}, "at most 256"),
        ({"input": "x", "colour": 1}, "colour"),
    ],
)
def test_bad_embedding_requests_are_400s(daemon, body, phrase):
    r = httpx.post(daemon.http_url + "/v1/embeddings", json={"model": daemon.llama_model, **body}, timeout=60)
    assert r.status_code == 400 and phrase in r.json()["error"]["message"], r.text


def test_a_worker_without_embeddings_says_so(daemon):
    r = httpx.post(
        daemon.http_url + "/v1/embeddings", json={"model": daemon.ref_model, "input": "x"}, timeout=60
    )
    assert r.status_code == 400 and "serves no embeddings" in r.json()["error"]["message"]


def test_a_generation_runs_on_while_its_worker_embeds(daemon, client):
    stream = client.completions.create(
        model=daemon.llama_model,
        prompt="once upon a time",
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it)
    for _ in range(3):
        assert len(client.embeddings.create(model=daemon.llama_model, input=TEXTS).data) == len(TEXTS)
    rest = list(it)
    assert rest[-1].choices[0].finish_reason == "length"
    assert base64  # the base64 path is what the openai package used above


def admission_errors(daemon) -> float:
    text = httpx.get(daemon.http_url + "/metrics", timeout=60).text
    return sum(
        float(v)
        for v in re.findall(r'^basertd_admission_errors_total\{code="invalid_request"\} (\S+)$', text, re.M)
    )


def test_an_embedding_request_counts_once_and_logs_one_access_line(daemon, client):
    """``basertctl status``'s requests: one per embeddings request answered (however many
    inputs and parts it took), none for a refused one; the refusals are admission errors. Each
    request, answered or refused, ends with one content-free ``access`` line."""
    before, refused = daemon.status().requests_total, admission_errors(daemon)
    lines = len(daemon.log_events())
    out = client.embeddings.create(model=daemon.llama_model, input=TEXTS)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=daemon.llama_model, input="")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=daemon.llama_model, input=TEXTS, dimensions=7)
    assert daemon.status().requests_total == before + 1
    assert admission_errors(daemon) == refused + 2
    access = [e for e in daemon.log_events()[lines:] if e.get("event") == "access"]
    assert [(e["kind"], e["api"], e.get("error_code")) for e in access] == [
        ("embedding", "openai", None),
        ("embedding", "openai", "invalid_request"),
        ("embedding", "openai", "invalid_request"),
    ], access
    answered = access[0]
    assert answered["inputs"] == len(TEXTS) and answered["prompt_tokens"] == out.usage.prompt_tokens
    assert answered["worker_id"] == 0 and answered["total_s"] > 0
    text = " ".join(map(str, access))
    assert not any(t in text for t in TEXTS)  # content-free


def test_dimensions_are_checked_before_anything_is_embedded(daemon, client):
    """The engine reports its embeddings' size (capability ``embedding_dim``), so a request for
    other ``dimensions`` is refused before its inputs are looked at, let alone embedded: its
    refusal names ``dimensions`` even when an input is also bad; the model's own size is served."""
    dim = len(client.embeddings.create(model=daemon.llama_model, input="x").data[0].embedding)
    assert client.embeddings.create(model=daemon.llama_model, input="x", dimensions=dim).data
    for dialect, body in (
        ("/v1/embeddings", {"input": [[1, 2, 10**9]], "dimensions": dim // 2}),
        ("/api/embed", {"input": "word " * 2000, "truncate": False, "dimensions": dim // 2}),
    ):
        r = httpx.post(daemon.http_url + dialect, json={"model": daemon.llama_model, **body}, timeout=60)
        assert r.status_code == 400 and f"dimensions must be {dim}" in r.text, r.text
