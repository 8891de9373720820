"""The llama.cpp engine on the default model, Gemma 3 270M Q4_K_M (marked ``realmodel``): facts,
token-exactness against a bare llama.cpp loop (1 and 8 lanes), a prefix-seeded lane against a cold
one, and a preempted sampled lane resuming identically. Kept short: one thread, a few dozen tokens."""

from __future__ import annotations

import llama_cpp as L
import pytest
from lc_harness import BareLlama, Coordinator, admit, first_divergence, generate, ignore_eos
from test_llamacpp_tick import sampled_run

from basertd.schema.tick import LaneDecode, LanePrefill, LaneRetire
from basertd.worker.engines.llamacpp import LlamaCppEngine
from basertd.worker.engines.llamacpp.model import model_digest

pytestmark = pytest.mark.realmodel

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A haiku about autumn leaves:",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
]


@pytest.fixture(scope="module")
def gemma(default_model, make_engine_module):
    return make_engine_module(default_model)


@pytest.fixture(scope="module")
def make_engine_module():
    made = []

    def make(path, **kw):
        kw.setdefault("lanes", 8)
        kw.setdefault("context_length", 256)
        eng = LlamaCppEngine(path, n_threads=1, **kw)
        coord = Coordinator(eng, logits_slots=2)
        made.append((eng, coord))
        return eng, coord

    yield make
    for eng, coord in made:
        eng.close()
        coord.close()


def test_default_model_facts(gemma, default_model):
    eng, _ = gemma
    info = eng.info()
    assert info.vocab_size == 262144 and info.bos_token_id == 2 and info.add_bos
    assert {1, 106} <= set(info.eos_token_ids)
    assert info.extra["n_swa"] == "512" and info.extra["arch"] == "gemma3"
    assert info.model_id == model_digest(default_model) and len(info.model_id) == 32
    assert info.tokenizer.kind == "gguf" and info.tokenizer.path == str(default_model)
    toks = eng.tokenize(b"Hello world", True)
    assert toks[0] == 2 and eng.detokenize(toks[1:]) == b"Hello world"
    (space,) = eng.state_spaces()
    assert space.bytes_per_token == 18 * 1 * (256 + 256) * 2 and space.name == "kv-swa512"


def test_gemma_greedy_is_token_exact_with_a_bare_loop(gemma, record_property):
    eng, coord = gemma
    prompts = [eng.tokenize(t.encode(), True) for t in TEXTS]
    bare = BareLlama(eng.model.path, eng.context_params())
    try:
        ref8, _ = bare.greedy(prompts, 12)
        L.llama_memory_clear(L.llama_get_memory(bare.ctx), True)
        ref1, _ = bare.greedy(prompts[:1], 24)
    finally:
        bare.close()
    tags = {i + 1: p for i, p in enumerate(prompts)}
    out = generate(coord, tags, 12, admit_kw={t: {"params": ignore_eos()} for t in tags})
    assert [out[t] for t in tags] == ref8
    out1 = generate(coord, {1: prompts[0]}, 24, admit_kw={1: {"params": ignore_eos()}})
    assert out1[1] == ref1[0]
    record_property("gemma_first_lane_text", eng.detokenize(ref1[0]).decode("utf-8", "replace"))


def test_gemma_seeded_lane_agrees_with_a_cold_one(gemma, record_property):
    eng, coord = gemma
    system = eng.tokenize(b"You are a helpful assistant. Answer briefly and precisely. " * 4, True)
    question = eng.tokenize(b" Question: what is the largest planet? Answer:", False)
    generate(coord, {1: system}, 1, publish=True)
    n = len(system) // eng.page * eng.page
    assert eng.stats()["cache_entries"] == 1
    prompt = system + question
    h = eng.seed_acquire(coord.prompt(prompt), n, 0)
    ev = coord.tick(
        admits=[admit(2, coord.prompt(prompt), seed_handle=h, params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=2, token_offset=n, token_count=len(prompt) - n)],
        decodes=[LaneDecode(lane_tag=2, max_new_tokens=16)],
    )
    warm = coord.read(ev.emits[0].token_ref)
    coord.tick(retires=[LaneRetire(lane_tag=2)])
    assert eng.stats()["cached_tokens_total"] == n
    bare = BareLlama(eng.model.path, eng.context_params())
    try:
        ref, margins = bare.greedy([prompt], 16)
    finally:
        bare.close()
    at = first_divergence(warm, ref[0], margins[0], 0.05)
    record_property("gemma_seeded_vs_cold_divergence", str(at))


def test_gemma_preempted_sampled_lane_resumes_identically(gemma):
    eng, coord = gemma
    prompt = eng.tokenize(b"Write one sentence about the ocean:", True)
    base = 1234 << 32
    whole = sampled_run(coord, 11, prompt, 10, base)
    resumed = sampled_run(coord, 12, prompt, 10, base, preempt_at=4)
    assert resumed == whole
    assert eng.lanes == {}
