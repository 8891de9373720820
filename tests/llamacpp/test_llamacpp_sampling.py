"""Host-side sampling of the llama.cpp engine (worker/engines/llamacpp/sampling.py), without a model:
the counter-based RNG, every filter against a naive reference, penalties, bias and logprobs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.schema.abi import MAX_TOP_LOGPROBS, Sampling, SamplingFlag
from basertd.schema.tick import SamplingParams
from basertd.worker.engines.llamacpp.sampling import (
    SamplerConfig,
    _top_p_keep,
    adjusted_row,
    draw,
    logprobs,
    select,
    top_k_ids,
)

GUMBEL = Sampling.GPU_GUMBEL


def cfg(**kw) -> SamplerConfig:
    kw.setdefault("mode", GUMBEL)
    return SamplerConfig(**kw)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


# --- the counter-based RNG (ABI rules 67, 73) ---------------------------------------------------


def test_draw_is_a_pure_function_of_the_counter():
    assert [draw(c) for c in range(100)] == [draw(c) for c in range(100)]
    assert len({draw(c) for c in range(1000)}) == 1000
    assert draw(2**64 + 5) == draw(5)  # u64 wrap
    assert all(0.0 <= draw(c) < 1.0 for c in range(1000))


def test_draw_is_uniform():
    u = np.sort([draw((7 << 32) + c) for c in range(20000)])
    ecdf = np.arange(1, u.size + 1) / u.size
    assert np.max(np.abs(ecdf - u)) < 0.015  # Kolmogorov-Smirnov distance, n = 20000


def test_resumed_stream_draws_what_the_uninterrupted_stream_drew():
    """rng_counter_base = seed + resumed length: position j of the uninterrupted lane and position
    j - k of the resumed lane use the same counter, hence the same token."""
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(50).astype(np.float32) for _ in range(12)]
    c = cfg(temperature=0.9, top_p=0.95)
    seed = 42 << 32
    whole = [select(r, c, draw(seed + j)) for j, r in enumerate(rows)]
    k = 5
    resumed = [select(r, c, draw(seed + k + j)) for j, r in enumerate(rows[k:])]
    assert resumed == whole[k:]
    other_seed = [select(r, c, draw((43 << 32) + j)) for j, r in enumerate(rows)]
    assert other_seed != whole


# --- selection ------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_on_ties():
    row = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert select(row, SamplerConfig(), 0.7) == 1
    assert select(row, cfg(temperature=0.0), 0.7) == 1  # GUMBEL at temperature 0 is greedy
    assert select(row, SamplerConfig(temperature=1.0), 0.7) == 1  # GPU_GREEDY ignores params


def naive_select(row: np.ndarray, c: SamplerConfig, u: float) -> int:
    """Reference: full sort, llama.cpp order top-k -> top-p -> min-p -> temperature, inverse CDF
    over the survivors in id order."""
    ids = np.arange(row.size)
    order = sorted(ids, key=lambda i: (-row[i], i))
    keep = list(order)
    if 0 < c.top_k < row.size:
        keep = keep[: c.top_k]
    if 0 < c.top_p < 1:
        p = softmax(row[keep])
        cum, cut = 0.0, len(keep)
        for j, pj in enumerate(p):
            cum += pj
            if cum >= c.top_p:
                cut = j + 1
                break
        keep = keep[:cut]
    if c.min_p > 0:
        m = max(row[keep])
        keep = [i for i in keep if row[i] >= m + np.log(c.min_p)]
    keep = sorted(keep)
    w = np.exp((row[keep].astype(np.float64) - max(row[keep])) / c.temperature)
    cdf = np.cumsum(w)
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(keep[min(j, len(keep) - 1)])


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.integers(2, 400),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 50),
    top_p=st.one_of(st.just(0.0), st.floats(0.05, 0.999)),
    min_p=st.one_of(st.just(0.0), st.floats(0.001, 0.5)),
    counter=st.integers(0, 2**64 - 1),
)
def test_select_matches_a_naive_full_sort(seed, vocab, temperature, top_k, top_p, min_p, counter):
    row = (np.random.default_rng(seed).standard_normal(vocab) * 3).astype(np.float32)
    c = cfg(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    u = draw(counter)
    assert select(row, c, u) == naive_select(row, c, u)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.integers(2, 20_000),
    k=st.integers(1, 120),
    shape=st.sampled_from(["normal", "on_stride", "off_stride", "masked", "grammar", "ties"]),
)
def test_top_k_ids_are_the_k_largest(seed, vocab, k, shape):
    """``top_k_ids`` keeps exactly the ``k`` largest entries, whatever the row: the sampled
    entries the largest (the fallback), large values away from them, most of the row masked to
    -inf, a grammar's mask that leaves a few entries (fewer or more than ``k``) finite, and ties at
    the k-th value (any of the tied ids, as argpartition)."""
    k = min(k, vocab - 1) if vocab > 1 else 0
    if k < 1:
        return
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(vocab) * 3).astype(np.float32)
    if shape == "on_stride":  # the sampled entries are the largest: too few reach the threshold
        row[::64] += 50.0
    elif shape == "off_stride":  # the largest values sit where the stride never looks
        row[np.arange(vocab) % 64 != 0] += 50.0
        row[np.arange(vocab) % 64 == 0] -= 50.0
    elif shape == "masked":
        row[rng.random(vocab) < 0.95] = -np.inf
    elif shape == "grammar":
        allowed = rng.choice(vocab, size=min(vocab, int(rng.integers(1, 2 * k + 2))), replace=False)
        row[np.setdiff1d(np.arange(vocab), allowed)] = -np.inf
    elif shape == "ties":
        row = np.round(row).astype(np.float32)
    ids = top_k_ids(row, k)
    assert ids.shape == (k,) and np.unique(ids).size == k
    kth = np.sort(row)[vocab - k]
    assert np.all(row[ids] >= kth)  # every kept entry is at least the k-th largest value
    assert np.count_nonzero(row > kth) <= k  # and nothing larger than it was left out
    assert set(np.flatnonzero(row > kth)) <= set(ids.tolist())


def test_top_p_widens_its_window_past_64_candidates():
    row = np.zeros(5000, np.float32)  # flat: top-p 0.5 needs 2500 candidates
    row[:10] += np.linspace(0.001, 0.01, 10, dtype=np.float32)
    ids, _ = _top_p_keep(None, row, 0.5)
    assert 2499 <= ids.size <= 2501


def test_sampled_tokens_follow_the_tempered_distribution():
    row = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    c = cfg(temperature=0.7)
    n = 30000
    counts = np.bincount([select(row, c, draw(c_)) for c_ in range(n)], minlength=row.size)
    assert np.max(np.abs(counts / n - softmax(row / 0.7))) < 0.01


def test_filters_only_ever_pick_survivors():
    rng = np.random.default_rng(3)
    row = rng.standard_normal(1000).astype(np.float32)
    top3 = set(np.argsort(-row)[:3].tolist())
    picked = {select(row, cfg(temperature=2.0, top_k=3), draw(c)) for c in range(500)}
    assert picked == top3  # 500 draws at temperature 2 reach all three
    p = softmax(row)
    floor = 0.2 * p.max()
    picked = {select(row, cfg(temperature=1.0, min_p=0.2), draw(c)) for c in range(500)}
    assert all(p[t] >= floor * (1 - 1e-6) for t in picked)


# --- penalties, bias, logprobs ----------------------------------------------------------------------


def test_penalties_touch_only_history_tokens():
    row = np.array([2.0, -2.0, 1.0, 0.5, 3.0], np.float32)
    hist = np.array([0, 1, 2, 2, 4], np.int32)  # tokens 2, 2, 4 were generated (gen_start 2)
    out = adjusted_row(row, cfg(temperature=1.0, repeat_penalty=2.0), hist, 2)
    np.testing.assert_allclose(out, [1.0, -4.0, 0.5, 0.5, 1.5])
    out = adjusted_row(row, cfg(temperature=1.0, freq_penalty=0.5, presence_penalty=0.25), hist, 2)
    np.testing.assert_allclose(out, [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5, 3.0 - 0.5 - 0.25])
    assert row.tolist() == [2.0, -2.0, 1.0, 0.5, 3.0]  # the input row is never written


def test_greedy_lanes_read_the_row_in_place_and_ignore_penalties():
    row = np.arange(5, dtype=np.float32)
    c = SamplerConfig.from_admit(Sampling.GPU_GREEDY, SamplingParams(repeat_penalty=3.0), 0)
    assert c.reads_row_in_place
    assert adjusted_row(row, c, np.array([4], np.int32), 0) is row


def test_logit_bias_is_added_before_selection():
    row = np.zeros(6, np.float32)
    c = SamplerConfig(
        bias_ids=np.array([4, 4, 1], np.int32), bias_values=np.array([1.0, 2.0, 0.5], np.float32)
    )
    out = adjusted_row(row, c, np.zeros(0, np.int32), 0)
    assert out[4] == 3.0 and out[1] == 0.5
    assert select(out, c, 0.0) == 4


def test_from_admit_reads_flags_and_logprob_count():
    c = SamplerConfig.from_admit(
        GUMBEL, SamplingParams(temperature=0.5, top_k=7, flags=SamplingFlag.IGNORE_EOS), want_logprobs=6
    )
    assert c.ignore_eos and c.top_k == 7 and c.n_logprobs == 5 and c.sampled
    assert SamplerConfig.from_admit(GUMBEL, SamplingParams(), 0).n_logprobs == -1
    assert SamplerConfig.from_admit(GUMBEL, SamplingParams(), 1).n_logprobs == 0


@pytest.mark.parametrize("n_top", [0, 1, 5, MAX_TOP_LOGPROBS, 50])
def test_logprobs_match_log_softmax(n_top):
    rng = np.random.default_rng(n_top)
    row = rng.standard_normal(300).astype(np.float32)
    ref = np.log(softmax(row))
    lp, ids, lps = logprobs(row, 17, n_top)
    assert lp == pytest.approx(ref[17], abs=1e-5)
    k = min(n_top, MAX_TOP_LOGPROBS)
    assert ids.tolist() == np.argsort(-ref, kind="stable")[:k].tolist()
    np.testing.assert_allclose(lps, ref[ids.astype(np.int64)], atol=1e-5)
    assert ids.dtype == np.uint32 and lps.dtype == np.float32
