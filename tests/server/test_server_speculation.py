"""Speculative decoding end to end (``[speculation]``, ``Generate.speculation``,
``basertd.server.sched.speculation``): a daemon whose llama.cpp worker registers prompt-lookup at
load; greedy requests with speculation on and off give the plain reference's tokens (up to the
near-ties a batch's shape may flip), usage counts the drafts, ``basertctl status`` and the metrics
show them, and a value the daemon cannot honour is INVALID_REQUEST before anything is queued."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from daemon_harness import Daemon
from serving_harness import assert_same_up_to_near_ties, bare_reference, tiny_toml

from basertd.client import ClientError
from basertd.schema.client import ErrorCode
from basertd.server.sched.speculation import OVERSHOOT_MAX, overshoot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llamacpp"))
from lc_harness import make_prompt

N = 48
SPEC = '[speculation]\nstrategies = ["prompt-lookup"]\nngram_min = 1\nmin_acceptance = 0.0\n'


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    with Daemon(tiny_toml(tiny_gguf, lanes=2, grant=8) + SPEC) as d:
        yield d


def test_greedy_tokens_are_the_reference_with_speculation_on_and_off(daemon, tiny_gguf):
    """A copy-heavy prompt (a block repeated three times): auto drafts and counts its drafts in
    usage, off drafts nothing, both give the plain reference's tokens."""
    prompts = [make_prompt(200 + i, 24)[:1] + make_prompt(200 + i, 24)[1:] * 3 for i in range(2)]
    refs = bare_reference(tiny_gguf, prompts, N)
    drafted = accepted = 0
    with daemon.client() as c:
        for i, p in enumerate(prompts):
            greedy = dict(prompt_tokens=p, max_tokens=N, temperature=0.0, ignore_eos=True)
            on = c.generate(**greedy)
            off = c.generate(**greedy, speculation="off")
            named = c.generate(**greedy, speculation="prompt-lookup")
            for got in (on, off, named):
                assert len(got.ids) == N
                assert_same_up_to_near_ties(got.ids, refs[i], f"prompt {i}")
            assert on.usage.draft_tokens > 0 and named.usage.draft_tokens > 0
            assert 0 <= on.usage.accepted_draft_tokens <= on.usage.draft_tokens
            assert off.usage.draft_tokens == off.usage.accepted_draft_tokens == 0
            drafted += on.usage.draft_tokens + named.usage.draft_tokens
            accepted += on.usage.accepted_draft_tokens + named.usage.accepted_draft_tokens
    # The worker counts every draft. A request that ends on a partial emit has the drafts up to
    # its end in its usage at once, while the worker's counters get them with that tick's
    # SpecStats, which may land after the Done: the counters catch up, then cover every usage.
    deadline = time.monotonic() + 30
    while True:
        (row,) = daemon.status().speculation
        if row.drafted_tokens >= drafted and row.accepted_tokens >= accepted:
            break
        assert time.monotonic() < deadline, (row, drafted, accepted)
        time.sleep(0.05)
    assert row.strategy == "prompt-lookup"
    assert row.acceptance_rate == pytest.approx(row.accepted_tokens / row.drafted_tokens)
    shown = daemon.ctl("status")
    assert shown.returncode == 0
    line = f"speculation prompt-lookup: drafted {row.drafted_tokens}  accepted {row.accepted_tokens}"
    assert line in shown.stdout
    metrics = daemon.ctl("metrics").stdout
    ours = f'basertd_spec_draft_tokens_total{{strategy="prompt-lookup",worker="0"}} {row.drafted_tokens}.0'
    model = Path(tiny_gguf).stem
    vllm = f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{model}"}} {row.accepted_tokens}.0'
    assert ours in metrics and vllm in metrics
    # The verify cost the engine measured from its own rounds (dozens of them above) reaches the
    # status and, from the scheduler's periodic read, the metrics.
    (worker,) = json.loads(daemon.ctl("status", "--json").stdout)["workers"]
    stats = worker["engine_stats"]
    assert stats["spec_verify_measured"] == 1
    base, per = stats["spec_verify_base_permille"] / 1000, stats["spec_verify_per_draft_permille"] / 1000
    again = daemon.ctl("status").stdout
    assert (
        f"speculation verify cost, worker 0: {base:.2f} + {per:.3f} x drafts plain steps (measured)" in again
    )
    for name in ("base", "per_draft", "measured"):
        assert f'basertd_spec_verify_{name}{{worker="0"}} ' in metrics


def test_the_overshoot_is_the_headroom_past_the_grant_of_a_speculating_lane():
    """``LaneDecode.overshoot``: what the request may still take past this tick's grant, capped at
    the largest draft_max; none for a plain lane, a replaying lane, or a grant that is the end."""
    assert overshoot("prompt-lookup", 8, 1000, False) == OVERSHOOT_MAX
    assert overshoot("prompt-lookup", 8, 20, False) == 12
    assert overshoot("draft-model", 1, 3, False) == 2
    assert overshoot("prompt-lookup", 8, 8, False) == 0
    assert overshoot("", 8, 1000, False) == 0
    assert overshoot("prompt-lookup", 8, 1000, True) == 0


def test_a_decode_grant_of_one_still_drafts_through_the_overshoot(tiny_gguf):
    """With ``decode_grant = 1`` a round has no room to draft within its grant (it commits its
    accepted drafts plus one token); the plan's overshoot (the request's headroom) lets the lane's
    one round draft and commit past it. The request still ends at exactly ``max_tokens`` with the
    plain reference's tokens, and its usage counts accepted drafts."""
    prompt = make_prompt(300, 24)[:1] + make_prompt(300, 24)[1:] * 3
    (ref,) = bare_reference(tiny_gguf, [prompt], N)
    with Daemon(tiny_toml(tiny_gguf, lanes=2, grant=1) + SPEC) as d, d.client() as c:
        got = c.generate(prompt_tokens=prompt, max_tokens=N, temperature=0.0, ignore_eos=True)
    assert len(got.ids) == N
    assert_same_up_to_near_ties(got.ids, ref, "decode_grant 1")
    assert got.usage.accepted_draft_tokens > 0


def test_a_sampled_request_speculates_and_a_bad_value_is_refused(daemon):
    """A sampled request (temperature > 0) drafts under auto and under its strategy's name (the
    sampled certificate, rejection-rule verification), is reproducible for its RNG seed, and "off"
    drafts nothing; an unknown strategy, or a named one with structured output, is
    INVALID_REQUEST. A logit bias makes the prompt's tokens likely, so the drafts are often
    accepted (tests/llamacpp/test_llamacpp_speculation.py compares the distributions)."""
    rng = np.random.default_rng(5)
    p = [1, *rng.choice([40, 41], 40, p=[0.6, 0.4]).tolist()]
    bias = {40: 8.0, 41: 12.0}  # makes the prompt's two tokens the tiny model's likely ones
    with daemon.client() as c:
        sampled = dict(prompt_tokens=p, max_tokens=24, temperature=1.0, top_k=6, seed=7, ignore_eos=True)
        sampled["logit_bias"] = bias
        on = c.generate(**sampled)
        again = c.generate(**sampled)
        named = c.generate(**sampled, speculation="prompt-lookup")
        off = c.generate(**sampled, speculation="off")
        assert on.ids == again.ids and len(on.ids) == len(off.ids) == 24
        assert on.usage.draft_tokens > 0 and named.usage.draft_tokens > 0
        assert 0 < on.usage.accepted_draft_tokens <= on.usage.draft_tokens
        assert off.usage.draft_tokens == off.usage.accepted_draft_tokens == 0
        json_out = {"type": "json_object"}
        for value, kw in (
            ("draft-model", {}),
            ("bogus", {}),
            ("prompt-lookup", {"response_format": json_out}),
        ):
            with pytest.raises(ClientError) as info:
                c.generate(prompt_tokens=p, max_tokens=4, speculation=value, temperature=0.8, **kw)
            assert info.value.code == ErrorCode.INVALID_REQUEST
            assert "speculation" in str(info.value)


def test_basertctl_generate_passes_speculation(daemon):
    """``basertctl generate --speculation``: a strategy name drafts on a prompt that repeats
    itself, "off" drafts nothing, an unknown value is refused naming the field."""
    prompt = "abc abd abc abd abc abd abc abd abc abd abc abd"
    on = daemon.ctl("generate", "--json", "--temperature", "0", "--max-tokens", "24",
                    "--speculation", "prompt-lookup", prompt)  # fmt: skip
    assert on.returncode == 0, on.stderr
    off = daemon.ctl("generate", "--json", "--temperature", "0", "--max-tokens", "24",
                     "--speculation", "off", prompt)  # fmt: skip
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["usage"]["draft_tokens"] == 0
    assert json.loads(on.stdout)["usage"]["draft_tokens"] > 0
    bad = daemon.ctl("generate", "--speculation", "bogus", prompt)
    assert bad.returncode != 0 and "speculation" in bad.stdout + bad.stderr
