"""The ``Embedder``'s chunked inputs (``worker/engines/llamacpp/embed.py``, Link W EMBED with
``input_id``): a long input embedded in chunks, its KV kept between the calls and the chunks'
pooled means weighted by their lengths, equals its one-pass embedding; misuse of the chunk
protocol gets a typed error, changes nothing and leaves the embedder usable; packed embeddings
run beside an open input (in the cells it leaves) and neither disturbs the other."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from basertd.schema.abi import Status
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.embed import Embedder
from basertd.worker.engines.llamacpp.model import LlamaModel

MAX = 256


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def embedder(request, tiny_gguf, tiny_gemma3_gguf):
    model = LlamaModel(tiny_gguf if request.param == "llama" else tiny_gemma3_gguf)
    e = Embedder(model, max_tokens=MAX, max_inputs=4, n_threads=1)
    yield e
    e.close()


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 290, n).astype(np.uint32)


def chunked(e: Embedder, toks: np.ndarray, size: int, input_id: int = 7) -> np.ndarray:
    pieces = [toks[i : i + size] for i in range(0, len(toks), size)]
    for k, piece in enumerate(pieces[:-1]):
        assert e.embed_chunk(input_id, k, piece, last=False) is None
    out = e.embed_chunk(input_id, len(pieces) - 1, pieces[-1], last=True)
    assert out is not None and e.open_input == 0
    return out


@pytest.mark.parametrize(("n", "size"), [(MAX, 64), (200, 128), (130, 1), (100, 100)])
def test_chunks_give_the_one_pass_embedding(embedder, n, size):
    toks = tokens(n, seed=n)
    one = embedder.embed([toks])[0]
    got = chunked(embedder, toks, size)
    assert got.shape == (embedder.dim,) and abs(float(np.linalg.norm(got)) - 1) < 1e-5
    # measured: max |diff| ~ 2e-8 for 64..128-token chunks (1e-8 on the default model, 1,024
    # tokens in chunks of 128); 1-token chunks run other kernels (a matrix-vector product), ~2e-4
    # apart, cosine 1 - 1.2e-7: the batch-shape noise test_http_embeddings allows (1e-3)
    assert float(one @ got) >= 0.9999 and np.allclose(got, one, atol=1e-3)


def test_without_the_kept_kv_the_chunks_would_differ(embedder):
    # guards the test above: each chunk alone (no earlier KV) is another vector
    toks = tokens(MAX, seed=1)
    alone = np.mean([embedder.embed([toks[i : i + 64]])[0] for i in range(0, MAX, 64)], axis=0)
    alone /= np.linalg.norm(alone)
    assert float(alone @ embedder.embed([toks])[0]) < 0.999


def test_misuse_is_refused_and_changes_nothing(embedder):
    toks = tokens(192, seed=2)
    want = embedder.embed([toks])[0]
    pieces = [toks[:64], toks[64:128], toks[128:]]

    def refused(status, call, *args):
        with pytest.raises(EngineError) as err:
            call(*args)
        assert err.value.status == status, err.value

    refused(Status.ERR_UNKNOWN_HANDLE, embedder.embed_chunk, 5, 1, pieces[1], False)  # never opened
    refused(Status.REJECT_BOUNDS, embedder.embed_chunk, 0, 0, pieces[0], False)  # id 0
    assert embedder.embed_chunk(5, 0, pieces[0], last=False) is None
    refused(Status.REJECT_BOUNDS, embedder.embed_chunk, 5, 2, pieces[2], True)  # out of order
    refused(Status.EBUSY, embedder.embed_chunk, 5, 0, pieces[0], False)  # chunk 0 again: open already
    refused(Status.EBUSY, embedder.embed_chunk, 6, 0, pieces[0], False)  # a second input
    refused(Status.EBUSY, embedder.embed, [tokens(MAX - 63, seed=8)])  # no room beside input 5
    refused(Status.ERR_UNKNOWN_HANDLE, embedder.embed_chunk, 6, 1, pieces[1], False)  # another's chunk
    refused(Status.REJECT_BOUNDS, embedder.embed_chunk, 5, 1, np.array([], np.uint32), False)
    refused(Status.REJECT_BOUNDS, embedder.embed_chunk, 5, 1, np.array([10**6], np.uint32), False)
    refused(Status.REJECT_BOUNDS, embedder.embed_chunk, 5, 1, tokens(MAX, seed=3), False)  # past MAX
    refused(Status.ERR_UNKNOWN_HANDLE, embedder.embed_cancel, 6)
    assert embedder.open_input == 5
    # every refusal left input 5 as it was: it finishes with the one-pass vector
    assert embedder.embed_chunk(5, 1, pieces[1], last=False) is None
    got = embedder.embed_chunk(5, 2, pieces[2], last=True)
    assert got is not None and np.allclose(got, want, atol=1e-5)
    refused(Status.ERR_UNKNOWN_HANDLE, embedder.embed_chunk, 5, 3, pieces[0], True)  # finished


def test_embeddings_beside_an_open_input_match_their_own_and_leave_it_intact(embedder):
    toks = tokens(192, seed=5)
    pieces = [toks[:96], toks[96:160], toks[160:]]
    short = [tokens(n, seed=10 + n) for n in (20, 44, 9, 17, 30)]
    # the same calls without an open input: beside one, 3 sequences a call (sequence 0 is its)
    # Another grouping changes the batch shape, and the vectors by float noise (~2e-4).
    alone = np.concatenate([embedder.embed(short[:3]), embedder.embed(short[3:])])
    want = chunked_as(embedder, pieces, input_id=10)
    assert embedder.embed_chunk(11, 0, pieces[0], last=False) is None
    beside = embedder.embed(short)  # 120 tokens in the 160 cells input 11 leaves
    assert np.allclose(beside, alone, atol=1e-5)  # measured: 4e-7 (the cells' offsets)
    assert embedder.embed_chunk(11, 1, pieces[1], last=False) is None
    with pytest.raises(EngineError) as err:  # 96 cells left
        embedder.embed([short[0], tokens(97, seed=9)])
    assert err.value.status == Status.EBUSY and embedder.open_input == 11
    assert np.allclose(embedder.embed(short[:2]), alone[:2], atol=1e-5)
    got = embedder.embed_chunk(11, 2, pieces[2], last=True)
    assert got is not None and np.allclose(got, want, atol=1e-6)  # measured: equal
    assert np.allclose(embedder.embed(short[:3]), alone[:3], atol=1e-6)


def chunked_as(e: Embedder, pieces: list[np.ndarray], input_id: int) -> np.ndarray:
    for k, piece in enumerate(pieces[:-1]):
        assert e.embed_chunk(input_id, k, piece, last=False) is None
    out = e.embed_chunk(input_id, len(pieces) - 1, pieces[-1], last=True)
    assert out is not None
    return out


def test_a_cancelled_input_frees_the_embedder(embedder):
    toks = tokens(128, seed=4)
    assert embedder.embed_chunk(9, 0, toks[:64], last=False) is None
    embedder.embed_cancel(9)
    assert embedder.open_input == 0
    with pytest.raises(EngineError) as err:
        embedder.embed_chunk(9, 1, toks[64:], last=True)
    assert err.value.status == Status.ERR_UNKNOWN_HANDLE
    assert np.allclose(chunked(embedder, toks, 64, input_id=10), embedder.embed([toks])[0], atol=1e-5)


def test_a_context_length_off_the_256_cell_grid_embeds(tiny_gguf):
    """llama.cpp pads the embeddings context to whole 256-cell blocks; a ubatch smaller than that
    made its mean-pooling graph abort the process (GGML_ASSERT ggml_can_mul_mat). Run in a child
    so an abort fails this test, not the suite."""
    code = (
        "import numpy as np\n"
        "from basertd.worker.engines.llamacpp.embed import Embedder\n"
        "from basertd.worker.engines.llamacpp.model import LlamaModel\n"
        f"m = LlamaModel({str(tiny_gguf)!r})\n"
        "for n in (250, 300, 100):\n"
        "    e = Embedder(m, max_tokens=n, max_inputs=4, n_threads=1)\n"
        "    full = (np.arange(n) % 280 + 3).astype(np.uint32)\n"
        "    v = e.embed([full, full[:9]])\n"
        "    assert v.shape[0] == 2 and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)\n"
        "    e.close()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
