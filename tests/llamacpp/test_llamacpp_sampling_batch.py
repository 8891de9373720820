"""Batched host sampling: ``select_batch`` over a step's 2-D logits equals ``select`` row by row,
and the engine's tokens with batched selection equal the per-lane path (tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lc_harness import admit, make_prompt

from basertd.schema.abi import Sampling, SamplingFlag
from basertd.schema.tick import LaneDecode, LanePrefill, SamplingParams
from basertd.worker.engines.llamacpp import sampling
from basertd.worker.engines.llamacpp.sampling import SamplerConfig, draw, select, select_batch

GREEDY = SamplerConfig()


def _mixed(rng: np.random.Generator, n: int) -> list[SamplerConfig]:
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            out.append(GREEDY)
        else:
            out.append(
                SamplerConfig(
                    mode=Sampling.GPU_GUMBEL,
                    temperature=float(rng.choice([0.0, 0.5, 1.0, 1.7])),
                    top_k=int(rng.choice([0, 1, 5, 40])),
                    top_p=float(rng.choice([0.0, 0.5, 0.9])),
                    min_p=float(rng.choice([0.0, 0.05])),
                )
            )
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), vocab=st.integers(2, 700), ties=st.booleans())
def test_select_batch_equals_select_row_by_row(seed, n, vocab, ties):
    rng = np.random.default_rng(seed)
    rows = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    if ties:  # argmax ties resolve to the lowest id in both paths
        rows = np.round(rows).astype(np.float32)
    cfgs = _mixed(rng, n)
    us = [draw(int(rng.integers(0, 2**63))) for _ in range(n)]
    got = select_batch(rows, cfgs, us)
    assert got.tolist() == [select(rows[i], cfgs[i], us[i]) for i in range(n)]


def test_select_batch_all_greedy_is_one_argmax_without_copies():
    rows = np.random.default_rng(1).normal(size=(8, 300)).astype(np.float32)
    np.testing.assert_array_equal(select_batch(rows, [GREEDY] * 8, [0.0] * 8), rows.argmax(axis=1))
    with pytest.raises(ValueError):
        select_batch(rows, [GREEDY] * 7, [0.0] * 8)


def test_engine_tokens_equal_the_per_lane_path(make_engine, monkeypatch):
    # The same plans with select_batch replaced by a per-row loop over select give the same tokens.
    def run(per_row: bool) -> dict[int, list[int]]:
        if per_row:
            monkeypatch.setattr(
                sampling,
                "select_batch",
                lambda rows, cfgs, us: np.array([select(rows[i], cfgs[i], us[i]) for i in range(len(cfgs))]),
            )
        eng, coord = make_engine()
        ie = SamplingFlag.IGNORE_EOS
        gumbel = Sampling.GPU_GUMBEL
        params = [
            {"params": SamplingParams(flags=ie)},
            {"sampling": gumbel, "params": SamplingParams(temperature=0.9, top_k=20, flags=ie)},
            {"sampling": gumbel, "params": SamplingParams(temperature=0.7, repeat_penalty=1.3, flags=ie)},
            {"sampling": gumbel, "params": SamplingParams(temperature=0.0, flags=ie)},
        ]
        admits = [
            admit(
                t + 1,
                coord.prompt(make_prompt(t + 20, 9 + t)),
                rng_counter_base=(t + 5) << 32,
                **params[t % 4],
            )
            for t in range(8)
        ]
        coord.tick(
            admits=admits,
            prefills=[
                LanePrefill(lane_tag=a.lane_tag, token_offset=0, token_count=a.prompt.count) for a in admits
            ],
        )
        out: dict[int, list[int]] = {}
        for _ in range(6):
            ev = coord.tick(decodes=[LaneDecode(lane_tag=t, max_new_tokens=3) for t in eng.lanes])
            for tag, toks in coord.tokens_of(ev).items():
                out.setdefault(tag, []).extend(toks)
        return out

    batched = run(False)
    assert sum(len(v) for v in batched.values()) > 8 * 10
    assert run(True) == batched
