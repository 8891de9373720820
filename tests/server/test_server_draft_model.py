"""Draft-model speculation end to end (``[speculation]`` "draft-model", ``draft_model`` global and
per ``[[workers]]`` table; ``basertd.worker.strategies``; ``basertd.server.sched.speculation``): the
config's flags for each worker, its typed errors, and a daemon whose llama.cpp worker registers a
draft model at load, serving greedy requests with the plain reference's tokens (up to the
near-ties a batch's shape may flip) and counting drafted and accepted tokens in usage,
``basertctl status`` and the metrics."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from daemon_harness import Daemon
from serving_harness import assert_same_up_to_near_ties, bare_reference, tiny_toml
from tinymodel import write_tiny_gguf

from basertd.client import ClientError
from basertd.schema.client import ErrorCode
from basertd.server.config import ConfigError, WorkerConfig, parse_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llamacpp"))
from lc_harness import make_prompt

N = 40


def test_worker_args_name_each_workers_draft_model():
    cfg = parse_config(
        {
            "workers": [
                {"model": "/m/a.gguf", "draft_model": "/m/own-draft.gguf"},
                {"model": "/m/b.gguf"},
                {"engine": "basert"},
            ],
            "speculation": {
                "strategies": ["draft-model", "prompt-lookup"],
                "draft_model": "/m/draft.gguf",
                "draft_max": 6,
                "min_acceptance": 0.2,
            },
        }
    )
    a, b, ref = (cfg.speculation.worker_args(w) for w in cfg.workers)
    knobs = "draft_min=1,draft_max=6,max_batch_lanes=4,min_accept_permille=200"
    assert a[:4] == (
        "--speculation",
        f"draft-model:{knobs}",
        "--speculation",
        f"prompt-lookup:{knobs},ngram_min=2,ngram_max=4",
    )
    assert a[4:] == ("--draft-model", "/m/own-draft.gguf")  # the worker's own path wins
    assert b[-2:] == ("--draft-model", "/m/draft.gguf")
    assert "draft-model" not in " ".join(ref) and "--draft-model" not in ref  # not a llamacpp worker
    only_lookup = parse_config({"speculation": {"strategies": ["prompt-lookup"]}})
    assert "--draft-model" not in only_lookup.speculation.worker_args(WorkerConfig())


@pytest.mark.parametrize(
    "data",
    [
        {"speculation": {"strategies": ["draft-model"]}},  # no path anywhere
        {"speculation": {"draft_model": "/m/d.gguf"}},  # a path, the strategy not named
        {"workers": [{"draft_model": "/m/d.gguf"}], "speculation": {"strategies": ["prompt-lookup"]}},
        {"speculation": {"strategies": ["draft-models"], "draft_model": "/m/d.gguf"}},
    ],
)
def test_draft_model_config_errors(data):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert "speculation" in str(info.value)


@pytest.fixture(scope="module")
def daemon(tiny_gguf, tmp_path_factory):
    """The worker's own ``draft_model`` is the target itself (its drafts are its own argmax chain,
    so nearly all are accepted); the global one, a one-layer model it overrides, would be accepted
    about one time in six."""
    weak = write_tiny_gguf(tmp_path_factory.mktemp("draft") / "weak.gguf", "llama", seed=0, n_layer=1)
    toml = tiny_toml(tiny_gguf, lanes=2, grant=8).replace(
        "threads = 1\n", f'threads = 1\ndraft_model = "{tiny_gguf}"\n', 1
    )
    spec = (
        '[speculation]\nstrategies = ["draft-model", "prompt-lookup"]\n'
        f'draft_model = "{weak}"\nmin_acceptance = 0.0\n'
    )
    with Daemon(toml + spec) as d:
        yield d


def test_draft_model_requests_are_exact_and_counted(daemon, tiny_gguf):
    """Free text (no repeats for prompt lookup to find): "draft-model" and "auto" (draft-model
    comes first in ``strategies``) draft and nearly every draft is accepted, "off" drafts nothing,
    all give the plain reference's tokens; the worker's counters show the strategy by name."""
    prompts = [make_prompt(500 + i, 20 + 7 * i) for i in range(2)]
    refs = bare_reference(tiny_gguf, prompts, N)
    drafted = accepted = 0
    with daemon.client() as c:
        for i, p in enumerate(prompts):
            greedy = dict(prompt_tokens=p, max_tokens=N, temperature=0.0, ignore_eos=True)
            named = c.generate(**greedy, speculation="draft-model")
            auto = c.generate(**greedy)
            off = c.generate(**greedy, speculation="off")
            for got in (named, auto, off):
                assert len(got.ids) == N
                assert_same_up_to_near_ties(got.ids, refs[i], f"prompt {i}")
            for got in (named, auto):
                u = got.usage
                print(f"prompt {i}: drafted {u.draft_tokens} accepted {u.accepted_draft_tokens}")
                assert u.draft_tokens > 0 and u.accepted_draft_tokens >= 0.9 * u.draft_tokens
                drafted += u.draft_tokens
                accepted += u.accepted_draft_tokens
            assert off.usage.draft_tokens == off.usage.accepted_draft_tokens == 0
    rows = {r.strategy: r for r in daemon.status().speculation}
    row = rows["draft-model"]
    assert row.drafted_tokens >= drafted and row.accepted_tokens >= accepted
    shown = daemon.ctl("status")
    assert shown.returncode == 0
    line = f"speculation draft-model: drafted {row.drafted_tokens}  accepted {row.accepted_tokens}"
    assert line in shown.stdout
    metrics = daemon.ctl("metrics").stdout
    assert (
        f'basertd_spec_draft_tokens_total{{strategy="draft-model",worker="0"}} {row.drafted_tokens}.0'
        in metrics
    )


def test_a_sampled_request_drafts_with_the_draft_model(daemon):
    """A sampled request (temperature > 0, top-k, a penalty) naming draft-model runs under its
    sampled certificate (the rejection rule): it drafts, and its tokens are a function of its RNG
    seed (the same seed, the same tokens)."""
    p = make_prompt(901, 24)
    sampled = dict(prompt_tokens=p, max_tokens=24, temperature=0.7, top_k=8, repeat_penalty=1.1)
    with daemon.client() as c:
        named = c.generate(**sampled, seed=3, ignore_eos=True, speculation="draft-model")
        again = c.generate(**sampled, seed=3, ignore_eos=True, speculation="draft-model")
        off = c.generate(**sampled, seed=3, ignore_eos=True, speculation="off")
    assert named.ids == again.ids and len(named.ids) == len(off.ids) == 24
    assert named.usage.draft_tokens > 0 and named.usage.accepted_draft_tokens <= named.usage.draft_tokens
    assert off.usage.draft_tokens == 0


def test_naming_draft_model_where_it_cannot_run_is_refused(daemon, tiny_gguf, tmp_path):
    """A request that names draft-model is refused (INVALID_REQUEST, nothing queued) where the
    strategy cannot run: a request with structured output (no certificate covers grammar lanes),
    and a worker whose draft model did not load at start (registration refused: the worker serves
    without it); "auto" serves the others, plainly or by a strategy."""
    p = make_prompt(900, 24)
    json_out = {"type": "json_object"}
    with daemon.client() as c:
        with pytest.raises(ClientError) as info:
            c.generate(prompt_tokens=p, max_tokens=4, speculation="draft-model", response_format=json_out)
        assert info.value.code == ErrorCode.INVALID_REQUEST
        assert "does not run with structured output" in str(info.value)
        assert len(c.generate(prompt_tokens=p, max_tokens=4, temperature=0.8, seed=1).ids) == 4
    missing = tmp_path / "no-such-draft.gguf"
    toml = tiny_toml(tiny_gguf, lanes=2, grant=8)
    spec = f'[speculation]\nstrategies = ["draft-model"]\ndraft_model = "{missing}"\n'
    with Daemon(toml + spec) as d, d.client() as c:
        assert '"strategy_refused"' in d.log_text()
        with pytest.raises(ClientError) as info:
            c.generate(prompt_tokens=p, max_tokens=4, speculation="draft-model", temperature=0.0)
        assert info.value.code == ErrorCode.INVALID_REQUEST
        assert "not registered by worker 0" in str(info.value)
        got = c.generate(prompt_tokens=p, max_tokens=4, temperature=0.0)
        assert len(got.ids) == 4 and got.usage.draft_tokens == 0
        assert (
            sum(1 for e in d.log_events() if e.get("event") == "access") == 1
        )  # the refused one queued nothing
