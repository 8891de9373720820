"""A long embedding input over HTTP goes to the worker in chunks of ``EMBED_PART_TOKENS``
(``BetweenTicks.embed_chunked``, Link W EMBED with ``input_id``), on a llama.cpp worker serving the tiny
GGUF with a 2,048-token context: its vector equals llama-cpp-python's one-pass embedding, a
generation stream on the same worker gets tokens between the chunks, short inputs go between them,
and a worker killed in the middle of one is a preemption (the request is answered all the same)."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import llama_cpp
import numpy as np
import openai
import pytest
from daemon_harness import Daemon
from proc_testutil import wait_until

from basertd.schema import control
from basertd.server.frontend.embeddings import EMBED_PART_TOKENS

CTX = 2048


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    workers = (
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gguf}"\n'
        f"lanes = 2\ncontext_length = {CTX}\nthreads = 1\n"
    )
    with Daemon(workers + '[http]\nlisten = ["127.0.0.1:0"]\n') as d:
        d.http_url = "http://" + d.http_addresses()[0]
        d.model = httpx.get(d.http_url + "/v1/models").json()["data"][0]["id"]
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_a_long_input_in_chunks_is_its_one_pass_embedding(daemon, client, tiny_gguf):
    text = "the cat sat on the mat and looked at a dog " * 45
    ids = httpx.post(daemon.http_url + "/tokenize", json={"prompt": text, "model": daemon.model}).json()[
        "tokens"
    ]
    assert 8 * EMBED_PART_TOKENS < len(ids) <= CTX  # 9 or more chunks
    llm = llama_cpp.Llama(
        str(tiny_gguf),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_ctx=CTX,
        n_batch=CTX,
        n_ubatch=CTX,
        n_threads=1,
        verbose=False,
    )
    try:
        want = np.array(llm.embed(text, normalize=True), np.float32)
    finally:
        llm.close()
    out = client.embeddings.create(model=daemon.model, input=[text, "hello world"])
    got = np.array([d.embedding for d in out.data], np.float32)
    by_ids = np.array(client.embeddings.create(model=daemon.model, input=[ids]).data[0].embedding, np.float32)
    # measured: max |diff| ~ 2e-8 against the one-pass vector (tests/llamacpp/test_llamacpp_embed_chunks.py)
    assert float(got[0] @ want) >= 0.9999 and np.allclose(got[0], want, atol=1e-4)
    assert np.allclose(by_ids, got[0], atol=1e-6)  # by token ids: the same chunks
    hello = httpx.post(daemon.http_url + "/tokenize", json={"prompt": "hello world", "model": daemon.model})
    assert out.usage.prompt_tokens == len(ids) + len(hello.json()["tokens"])
    short = client.embeddings.create(model=daemon.model, input="hello world").data[0].embedding
    assert np.allclose(got[1], short, atol=1e-3)  # a short input packed beside long ones


def test_a_stream_gets_tokens_between_the_chunks(daemon, client):
    """Decode ticks interleave with the chunks: the worker serves Link W requests in arrival order,
    and the scheduler's next TICK_SUBMIT is queued while a chunk runs, so it runs before the next
    chunk. Counted, not timed: the token deltas the stream receives while the embedding request
    is in flight (one-pass, the worker would tick only before and after it)."""
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 290, CTX)]
    chunks = -(-CTX // EMBED_PART_TOKENS)
    deltas: list[int] = []  # the count of embeddings in flight at each delta's arrival
    in_flight = [0]
    started = threading.Event()

    def stream() -> None:
        for _ in client.completions.create(
            model=daemon.model,
            prompt="once upon a time",
            max_tokens=CTX - 64,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            deltas.append(in_flight[0])
            started.set()
            if len(deltas) > 2 and not in_flight[0] and done.is_set():
                break

    done = threading.Event()
    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(60)
    during = []
    for _ in range(3):  # three long inputs, one after another
        before = len(deltas)
        in_flight[0] = 1
        out = client.embeddings.create(model=daemon.model, input=[ids])
        in_flight[0] = 0
        during.append(len(deltas) - before)
        assert len(out.data[0].embedding) > 0
    done.set()
    t.join(120)
    # 16 chunks each, 45 gaps between chunks in all. Measured: 109 deltas in flight (37, 37, 35);
    # sent in one EMBED as before, 11 (6, 2, 3), from the ticks before and after it
    assert sum(during) >= 2 * chunks, (during, chunks)


def test_short_inputs_are_served_between_the_chunks_of_a_long_one(daemon, client):
    """A short embedding request sent while a long input is in chunks goes between two of its
    chunks (in the cells the open input leaves) instead of waiting for all of them. Counted, not
    timed: short requests answered while the long one is in flight; one at a time, so each waits
    at most one chunk. Waiting behind the whole input, at most two would be (one sent before its
    first chunk, one racing its answer)."""
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 290, CTX)]
    alone = np.array(client.embeddings.create(model=daemon.model, input="hello world").data[0].embedding)
    done = threading.Event()
    out: dict = {}

    def long() -> None:
        out["long"] = client.embeddings.create(model=daemon.model, input=[ids]).data[0].embedding
        done.set()

    t = threading.Thread(target=long, daemon=True)
    t.start()
    during, shorts = 0, []
    while not done.is_set():
        shorts.append(client.embeddings.create(model=daemon.model, input="hello world").data[0].embedding)
        during += not done.is_set()
    t.join(120)
    assert during >= 4, (during, -(-CTX // EMBED_PART_TOKENS))
    assert all(np.allclose(s, alone, atol=1e-5) for s in shorts)  # beside the open input: the same
    again = client.embeddings.create(model=daemon.model, input=[ids]).data[0].embedding
    assert np.allclose(out["long"], again, atol=1e-6)  # and the long input was not disturbed


def test_a_worker_killed_during_a_long_input_is_a_preemption(daemon, client):
    """SIGKILL the worker while a long input is between its chunks (a short request answered
    while it is in flight says it is open): the request is still answered, by the respawned
    worker, with the vector the input has without a kill (``BetweenTicks``: sent again whole)."""
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 290, CTX)]
    want = np.array(client.embeddings.create(model=daemon.model, input=[ids]).data[0].embedding)
    pid = daemon.workers()[0].pid
    out: dict = {}
    done = threading.Event()

    def long() -> None:
        try:
            out["long"] = client.embeddings.create(model=daemon.model, input=[ids]).data[0].embedding
        except Exception as exc:
            out["error"] = exc
        done.set()

    t = threading.Thread(target=long, daemon=True)
    t.start()
    client.embeddings.create(model=daemon.model, input="hello")  # goes between two of its chunks
    assert not done.is_set(), "the long input ended before a short one came back"
    os.kill(pid, signal.SIGKILL)
    t.join(120)
    assert "error" not in out, out
    assert np.allclose(out["long"], want, atol=1e-6)
    assert daemon.workers()[0].pid != pid
    assert any(e["event"] == "between_ticks_resent" for e in daemon.log_events())


def in_flight(daemon: Daemon) -> int:
    with daemon.client() as c:
        return c.request(control.Overview()).in_flight


def test_a_stop_waits_for_the_embeddings_being_served(tiny_gguf):
    """SIGTERM while an embedding request runs: the stop's drain waits for it (it is in flight,
    though it holds no lane), the client gets its vectors, and the daemon exits 0. It used to
    drain at once and close the connection under the request."""
    workers = (
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gguf}"\n'
        f"lanes = 2\ncontext_length = {CTX}\nthreads = 1\n"
    )
    inputs = [[int(t) for t in np.random.default_rng(k).integers(3, 290, CTX)] for k in range(4)]
    with Daemon(workers + '[http]\nlisten = ["127.0.0.1:0"]\n') as d:
        url = "http://" + d.http_addresses()[0]
        out: dict = {}

        def embed() -> None:
            out["r"] = httpx.post(url + "/v1/embeddings", json={"model": "", "input": inputs}, timeout=120)

        t = threading.Thread(target=embed, daemon=True)
        t.start()
        wait_until(lambda: in_flight(d) == 1, timeout=30, what="the embedding request in flight")
        d.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert d.proc.wait(60) == 0
        r = out["r"]
        assert r.status_code == 200 and len(r.json()["data"]) == 4, r.text[:300]
        started = [e for e in d.log_events() if e["event"] == "drain_started"]
        assert started and started[0]["in_flight"] == 1, started
        assert any(e["event"] == "drained" for e in d.log_events())
