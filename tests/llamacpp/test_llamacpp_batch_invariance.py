"""Greedy output against batch composition (tiny models, unified KV cache): the same greedy prompts
decoded alone and among 7 others. llama.cpp's sums depend on the batch (matmul tiling by batch
size, attention over the cache's cells), so outputs may part at near-ties; the measured rate is
bounded here so that a change making it worse fails (bench/bench_prefill_layout.py measures the
default model in both KV layouts)."""

from __future__ import annotations

import numpy as np
import pytest
from lc_harness import generate, ignore_eos

N_NEW = 40


def _prompts(n: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(0)
    return {i + 1: [1, *rng.integers(3, 293, 150 + 13 * i).tolist()] for i in range(n)}


def _parting(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.parametrize("model", ["tiny_gguf", "tiny_gemma3_gguf"])
def test_greedy_alone_vs_among_seven_others(make_engine, request, model):
    path = request.getfixturevalue(model)
    prompts = _prompts(8)
    kw = {t: {"params": ignore_eos()} for t in prompts}
    _, coord = make_engine(path, context_length=512)
    together = generate(coord, prompts, N_NEW, admit_kw=kw)
    parts = []
    for tag, p in prompts.items():
        _, c1 = make_engine(path, context_length=512)
        alone = generate(c1, {tag: p}, N_NEW, admit_kw={tag: kw[tag]})
        assert len(alone[tag]) == len(together[tag]) == N_NEW
        parts.append(_parting(alone[tag], together[tag]))
    parted = [p for p in parts if p is not None]
    print(f"{model}: {len(parted)}/8 lanes part, at tokens {sorted(parted)}")
    # Measured: tiny llama 1/8 (token 35), tiny gemma3 0/8. Bound: at most 2 of 8, none before 16.
    assert len(parted) <= 2
    assert all(p >= 16 for p in parted)
