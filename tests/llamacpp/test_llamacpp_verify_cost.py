"""The live verify cost of speculative rounds (``verify_cost.VerifyCost``; ``speculation.pays`` and
``LaneSpec.note`` judge drafts by it): synthetic timings first, then real rounds on the tiny GGUF,
where only decode-only ``llama_decode`` calls are measured and the estimate reaches the engine's
stats."""

from __future__ import annotations

import numpy as np
import pytest
from lc_harness import admit, ignore_eos, make_prompt

from basertd.schema.tick import LaneDecode, LanePrefill, LaneRetire
from basertd.worker.engines.llamacpp.rounds import SPLIT_MIN_PREFILL_ROWS
from basertd.worker.engines.llamacpp.speculation import LaneSpec, pays
from basertd.worker.engines.llamacpp.verify_cost import (
    DEFAULT_COST,
    FIT_WINDOW,
    MIN_PLAIN,
    MIN_VERIFY,
    PLAIN_WINDOW,
    REFIT_EVERY,
    Cost,
    VerifyCost,
)
from basertd.worker.engines.lookup import LookupConfig, lookup_registration

MS = 1_000_000  # ns


def feed(cost: VerifyCost, line: Cost, plain_ms: float, rounds: int, seed: int, lanes: int = 1) -> None:
    """``rounds`` verify calls whose time is ``line.round(m)`` plain steps (m = 1 .. 8), after
    ``MIN_PLAIN`` plain calls of ``plain_ms``; each call with 5 % noise."""
    rng = np.random.default_rng(seed)
    for _ in range(MIN_PLAIN):
        cost.note(lanes, 0, int(plain_ms * MS * rng.uniform(0.95, 1.05)))
    for _ in range(rounds):
        m = int(rng.integers(1, 9))
        cost.note(lanes, m, int(plain_ms * MS * line.round(m) * rng.uniform(0.95, 1.05)))


CPU = Cost(1.27, 0.375)  # the default's shape: bench/bench_verify_cost.py on 2 cores
GPU = Cost(1.0, 0.004)  # a verify round of 1 + m rows costs about one step


def weak_lane_pauses(cost: Cost, rounds: int = 40) -> bool:
    """A lane whose drafts are accepted 40 % of the time (one draft a round, 2 of 5 accepted;
    above ``min_accept_permille``, so only ``pays`` can pause it): does it pause at ``cost``?"""
    lane = LaneSpec(LookupConfig(), 1)
    for i in range(rounds):
        lane.note(1, int(i % 5 < 2), cost)
        if lane.pause:
            return True
    return False


def test_measured_costs_decide_whether_a_forty_percent_lane_drafts():
    """CPU-like timings fit the CPU line and pause the lane; GPU-like timings fit a nearly free
    verify round and keep it drafting."""
    cpu, gpu = VerifyCost(), VerifyCost()
    feed(cpu, CPU, plain_ms=20.0, rounds=24, seed=1)
    feed(gpu, GPU, plain_ms=4.0, rounds=24, seed=2)
    assert cpu.measured and gpu.measured
    assert cpu.current().base == pytest.approx(1.27, abs=0.08)
    assert cpu.current().per_draft == pytest.approx(0.375, abs=0.03)
    assert gpu.current().base == pytest.approx(1.0, abs=0.06)
    assert gpu.current().per_draft < 0.02
    assert not pays(0.4, 8, cpu.current()) and pays(0.4, 8, gpu.current())
    assert weak_lane_pauses(cpu.current())
    assert not weak_lane_pauses(gpu.current())
    s = gpu.stats()
    assert s["spec_verify_measured"] == 1 and s["spec_verify_samples"] == 24
    assert s["spec_verify_base_permille"] == round(gpu.current().base * 1000)


def test_outliers_do_not_flip_the_decision():
    """A shared box: a few plain steps and verify rounds preempted (8x their time) leave the GPU
    estimate where it was; the lane keeps drafting."""
    gpu = VerifyCost()
    feed(gpu, GPU, plain_ms=4.0, rounds=24, seed=3)
    clean = gpu.current()
    for _ in range(2):  # 2 of the plain window's 15
        gpu.note(1, 0, 32 * MS)
    for m in (2, 7, 5):  # 3 of the fit window's 27
        gpu.note(1, m, int(8 * 4 * MS * GPU.round(m)))
    hit = gpu.current()
    assert hit.base == pytest.approx(clean.base, abs=0.05) and hit.per_draft < 0.03
    assert pays(0.4, 8, hit) and not weak_lane_pauses(hit)


def test_too_few_samples_keep_the_default():
    """Before ``MIN_PLAIN`` plain calls of a batch size its verify calls are no samples, and before
    ``MIN_VERIFY`` samples the cost is the default: the GPU-like lane at 40 % still pauses."""
    c = VerifyCost()
    for _ in range(MIN_PLAIN - 1):
        c.note(1, 0, 4 * MS)
    for _ in range(MIN_VERIFY):
        c.note(1, 4, 4 * MS)  # no plain step of 1 lane to compare with yet
    assert c.stats()["spec_verify_samples"] == 0 and c.plain_ns(1) is None
    c.note(1, 0, 4 * MS)
    for m in range(1, MIN_VERIFY):
        c.note(1, m, 4 * MS)
    assert not c.measured and c.current() == DEFAULT_COST
    assert c.stats() == {
        "spec_verify_base_permille": 1270,
        "spec_verify_per_draft_permille": 375,
        "spec_verify_measured": 0,
        "spec_verify_samples": MIN_VERIFY - 1,
    }
    assert weak_lane_pauses(c.current())
    c.note(1, MIN_VERIFY, 4 * MS)
    assert c.measured and c.current() == Cost(1.0, 0.0)  # free drafts: the floor of the line
    assert not weak_lane_pauses(c.current())


def test_samples_compare_with_their_own_batch_size_and_the_windows_follow_load():
    """A verify call is measured against the plain step of as many lanes; a load change (every
    call 3x slower) moves the plain step within half a window and leaves the cost in plain steps
    as it was; samples older than the window weigh nothing."""
    c = VerifyCost()
    for _ in range(MIN_PLAIN):
        c.note(4, 0, 10 * MS)  # four lanes: 10 ms a plain step
        c.note(1, 0, 5 * MS)
    assert c.plain_ns(4) == 10 * MS and c.plain_ns(1) == 5 * MS and c.plain_ns(2) is None
    for m in range(1, MIN_VERIFY + 1):
        c.note(4, m, int(10 * MS * CPU.round(m)))
        c.note(2, m, 99 * MS)  # no plain step of 2 lanes: no sample
    assert c.stats()["spec_verify_samples"] == MIN_VERIFY
    assert c.current().base == pytest.approx(1.27) and c.current().per_draft == pytest.approx(0.375)
    for _ in range(PLAIN_WINDOW // 2 + 1):
        c.note(4, 0, 30 * MS)
    assert c.plain_ns(4) == 30 * MS
    for m in range(1, FIT_WINDOW + 1):
        c.note(4, m % 8 + 1, int(30 * MS * GPU.round(m % 8 + 1)))
    assert c.stats()["spec_verify_samples"] == FIT_WINDOW
    assert c.current() == Cost(pytest.approx(1.0), pytest.approx(0.004))


def test_the_line_is_fitted_at_the_first_full_window_then_every_few_samples():
    """The first fit comes with the ``MIN_VERIFY``-th sample; after it the line moves only every
    ``REFIT_EVERY`` samples (a fit is about 0.2 ms of numpy, a tenth of a GPU round)."""
    c = VerifyCost()
    feed(c, CPU, plain_ms=10.0, rounds=MIN_VERIFY - 1, seed=3)
    assert not c.measured
    feed(c, CPU, plain_ms=10.0, rounds=1, seed=4)
    first = c.current()
    assert c.measured and first == Cost(pytest.approx(1.27, rel=0.1), pytest.approx(0.375, rel=0.2))
    for i in range(1, REFIT_EVERY + 1):  # noisy samples: each cheaper one moves the medians
        c.note(1, 4, int(10 * MS * GPU.round(4)))  # much cheaper rounds
        assert (c.current() == first) == (i < REFIT_EVERY), i
    assert c.current().base < first.base


def test_one_draft_length_moves_the_level_and_keeps_the_slope():
    """Every sample with the same m: the slope cannot be fitted and stays; the intercept follows
    the data, and never below one plain step (then the line goes through (0, 1))."""
    c = VerifyCost()
    for _ in range(MIN_PLAIN):
        c.note(1, 0, 10 * MS)
    for _ in range(MIN_VERIFY):
        c.note(1, 4, int(10 * MS * CPU.round(4)))
    assert c.current() == Cost(pytest.approx(1.27), pytest.approx(0.375))
    for _ in range(FIT_WINDOW):
        c.note(1, 4, int(10 * MS * 1.2))  # 1.2 steps for 4 drafts: cheaper than the slope allows
    assert c.current() == Cost(1.0, pytest.approx(0.05))


# --------------------------------------------------------------------------- real rounds


def test_real_rounds_measure_decode_only_calls_and_report_the_estimate(lc):
    """On the tiny model: a plain lane's decode steps and a speculating lane's verify rounds are
    measured (only their decode-only ``llama_decode``: a round beside a short prefill in the same
    call is not, the decode part of a split round is), the estimate becomes the measured one, and
    the engine's stats report it."""
    eng, coord = lc
    cost = eng.rounds.speculator.cost
    noted: list[tuple[int, int]] = []
    note = cost.note

    def spy(lanes: int, drafts: int, ns: int) -> None:
        noted.append((lanes, drafts))
        note(lanes, drafts, ns)

    cost.note = spy
    slot = eng.strategy_register(lookup_registration(LookupConfig(min_accept_permille=0))).strategy_slot
    rng = np.random.default_rng(4)
    eng.rounds.speculator.override = lambda lane, k: rng.integers(0, eng.n_vocab, k, dtype=np.int32)

    def tick(**kw):
        ev = coord.tick(**kw)
        assert not ev.faults
        return ev

    p = make_prompt(31, 12)
    tick(
        admits=[admit(1, coord.prompt(p), params=ignore_eos())],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=len(p))],
    )
    assert noted == []  # a prefill alone
    for _ in range(MIN_PLAIN + 1):  # the first token is the prefill's held row: no llama_decode
        tick(decodes=[LaneDecode(lane_tag=1, max_new_tokens=1)])
    assert noted == [(1, 0)] * MIN_PLAIN
    # A round of lane 1 beside a 5-row prefill shares one llama_decode with it: not measured.
    short = make_prompt(32, SPLIT_MIN_PREFILL_ROWS - 3)
    tick(
        admits=[admit(2, coord.prompt(short))],
        prefills=[LanePrefill(lane_tag=2, token_offset=0, token_count=len(short))],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=1)],
    )
    assert len(noted) == MIN_PLAIN
    # Beside a prefill of SPLIT_MIN_PREFILL_ROWS rows the decode rows run first, alone: measured.
    long = make_prompt(33, SPLIT_MIN_PREFILL_ROWS + 4)
    tick(
        admits=[admit(3, coord.prompt(long))],
        prefills=[LanePrefill(lane_tag=3, token_offset=0, token_count=len(long))],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=1)],
    )
    assert noted[MIN_PLAIN:] == [(1, 0)]
    tick(retires=[LaneRetire(lane_tag=2), LaneRetire(lane_tag=3), LaneRetire(lane_tag=1)])
    noted.clear()
    q = make_prompt(34, 10)
    kw = dict(params=ignore_eos(), strategy_slot=slot)
    tick(
        admits=[admit(4, coord.prompt(q), **kw)],
        prefills=[LanePrefill(lane_tag=4, token_offset=0, token_count=len(q))],
    )
    for _ in range(MIN_VERIFY + 4):
        tick(decodes=[LaneDecode(lane_tag=4, max_new_tokens=4)])
    verify = [m for n, m in noted if m]
    rounds = eng.stats()["spec_rounds_total"]
    assert len(verify) == rounds >= MIN_VERIFY  # every verify round decode-only, one lane
    assert all(n == 1 and 0 <= m <= 3 for n, m in noted)  # a grant of 4: at most 3 drafts
    s = eng.stats()
    c = cost.current()
    assert cost.measured and s["spec_verify_measured"] == 1
    assert s["spec_verify_samples"] == min(rounds, FIT_WINDOW)
    assert (s["spec_verify_base_permille"], s["spec_verify_per_draft_permille"]) == (
        round(c.base * 1000),
        round(c.per_draft * 1000),
    )
    assert c != DEFAULT_COST
