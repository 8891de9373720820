"""The engine's measured llama_decode rate curve (``rates.RateCurve``), which a scheduler reads from
the engine's stats to size prefill chunks."""

from __future__ import annotations

import pytest
from lc_harness import admit, make_prompt

from basertd.schema.tick import LanePrefill
from basertd.worker.engines.llamacpp.rates import RateCurve, bucket


def test_buckets_and_the_weighted_mean():
    assert [bucket(n) for n in (1, 2, 3, 16, 17, 511, 512, 5000)] == [1, 2, 2, 16, 16, 256, 512, 4096]
    c = RateCurve(alpha=0.5)
    c.note(512, 1_000_000_000)  # 512 tok/s
    c.note(600, 1_000_000_000)  # 600 tok/s, same bucket: mean moves half way
    c.note(16, 0)  # ignored
    c.note(16, 100_000_000)  # 160 tok/s
    assert c.curve() == [(16, pytest.approx(160.0)), (512, pytest.approx(556.0))]
    want = {"rate_tok_s_b16": 160, "rate_calls_b16": 1, "rate_tok_s_b512": 556, "rate_calls_b512": 2}
    assert c.stats() == want
    with pytest.raises(ValueError):
        RateCurve(alpha=0.0)


def test_the_engine_times_every_llama_decode(make_engine):
    eng, coord = make_engine(yield_step_tokens=64)
    assert eng.prefill_curve() == []
    ref = coord.prompt(make_prompt(3, 200))
    coord.tick(admits=[admit(1, ref)], prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=200)])
    curve = dict(eng.prefill_curve())
    assert set(curve) == {64, 8}  # three 64-row steps and one of 8 rows
    assert all(r > 0 for r in curve.values())
    st = eng.stats()
    assert st["rate_calls_b64"] == 3 and st["rate_calls_b8"] == 1
