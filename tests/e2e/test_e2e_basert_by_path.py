"""End to end on a basert worker loaded BY PATH (baseRT.h's ``baseRT_load_model_ex``, DESIGN.md
"Engines"): a real ``basertd serve`` whose ``[[workers]]`` name a reference bundle file as
``model``, so the very loading path of a real libbaseRT build runs, with the coordinator
tokenizing in its own tokenizer-only process (``baseRT_load_tokenizer_only``).

- served output is token-exact against a direct engine run of the same bundle;
- Tokenize answers while a long tick runs (the tokenizer is not behind the worker);
- a bundle without a prefix cache gets no cached tokens on a repeated prefix, a normal one does;
- a worker that cannot load (wrong struct size, a library lacking symbols, a bundle that does not
  load) exits 3 with one line, and the daemon gives up at once and shows that line in status,
  health and Workers instead of respawning.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon
from serving_harness import DirectRun, engine_stats

from basertd.native import header_path, ref_engine_path
from basertd.native.ref import write_ref_bundle
from basertd.schema import client as api
from basertd.server.request.tokenizer import BaseRTTokenizer
from basertd.server.workers.process import WorkerSpec

ROOT = Path(__file__).resolve().parents[2]
LANES = 4
CONTEXT = 512
BUNDLE = {"vocab_size": 259, "eos_token": 2, "eos_period": 0}
PAGE = 16  # the reference engine's default page_size_tokens


def worker_toml(model: Path, *, lib: str = "", extra: str = "") -> str:
    lib_line = f'lib = "{lib}"\n' if lib else ""
    return (
        f'[[workers]]\nengine = "basert"\nmodel = "{model}"\n{lib_line}lanes = {LANES}\n'
        f"context_length = {CONTEXT}\n{extra}\n"
    )


def scheduler_toml(grant: int = 4) -> str:
    return f"[scheduler]\ndecode_grant = {grant}\ndecode_tick_s = 0\n"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    d = tmp_path_factory.mktemp("bundles")
    return {
        "served": write_ref_bundle(d / "refmodel.ref", add_bos=True, tick_delay_us=1000, **BUNDLE),
        "direct": write_ref_bundle(d / "direct.ref", add_bos=True, tick_delay_us=0, **BUNDLE),
    }


def test_served_by_path_token_exact_against_a_direct_run(bundles):
    served, direct_model = bundles["served"], bundles["direct"]
    prompts = ["Hello, libbaseRT!", "ünïcode prompt, bytes all the way", "x" * 40]
    with Daemon(worker_toml(served) + scheduler_toml()) as d:
        with d.client() as c:
            models = c.models().models
            assert [(m.id, m.engine, m.vocab_size) for m in models] == [("refmodel", "basert", 259)]
            results = []
            for i, p in enumerate(prompts):
                ids = c.tokenize(p)
                kw = (
                    dict(max_tokens=30, temperature=0.0)
                    if i % 2 == 0
                    else dict(max_tokens=30, temperature=0.8, seed=7 + i)
                )
                out = c.generate(p, **kw)
                results.append((ids, kw, out))
        (w,) = d.workers()
        assert (w.engine, w.state, w.respawns) == ("basert", "ready", 0)
    tok = BaseRTTokenizer("", str(direct_model))
    try:
        for p, (ids, _, _) in zip(prompts, results, strict=True):
            assert ids == tok.encode(p, add_bos=True), "the daemon's Tokenize differs from the bundle's"
            assert ids[0] == tok.bos_id
    finally:
        tok.close()
    spec = WorkerSpec(engine="basert", model=str(direct_model), lanes=LANES, context_length=CONTEXT)
    with DirectRun(spec) as direct:
        for ids, kw, out in results:
            want = direct.run(ids, api.Generate(request_id="x", prompt="", **kw))
            assert len(want) == 30 and out.ids == want
            assert out.usage.prompt_tokens == len(ids)


def test_tokenize_answers_while_a_long_tick_runs(tmp_path):
    tick_s = 1.5
    model = write_ref_bundle(tmp_path / "slow.ref", tick_delay_us=int(tick_s * 1e6), **BUNDLE)
    with Daemon(worker_toml(model) + scheduler_toml(grant=1)) as d:
        done: dict = {}

        def generate() -> None:
            with d.client() as c:
                done["out"] = c.generate("keep the worker busy", max_tokens=3, temperature=0.0)

        t = threading.Thread(target=generate)
        t.start()
        try:
            # wait until a tick is in flight: the request occupies a lane
            deadline = time.monotonic() + 10
            while d.status().lanes_busy == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.02)
            times = []
            with d.client() as c:
                for i in range(5):
                    t0 = time.monotonic()
                    ids = c.tokenize(f"tokenize me {i} while the engine ticks")
                    times.append(time.monotonic() - t0)
                    assert len(ids) == len(f"tokenize me {i} while the engine ticks")
            assert d.status().lanes_busy == 1, "the tick ended before the Tokenize calls did"
        finally:
            t.join(30)
        assert max(times) < tick_s / 3, f"Tokenize waited for the tick: {times}"
        assert len(done["out"].ids) == 3


def test_a_bundle_without_prefix_cache_gets_no_seeds(tmp_path):
    cached = write_ref_bundle(tmp_path / "cached.ref", tick_delay_us=1000, **BUNDLE)
    plain = write_ref_bundle(tmp_path / "nocache.ref", prefix_cache=False, tick_delay_us=1000, **BUNDLE)
    shared = "A long shared system prompt that spans several pages of byte tokens, sure enough. " * 2
    assert len(shared) > 8 * PAGE
    config = worker_toml(cached) + worker_toml(plain) + scheduler_toml()
    with Daemon(config) as d:
        outs: dict[str, list] = {"cached": [], "nocache": []}
        with d.client() as c:
            for model in outs:
                for turn in range(2):
                    outs[model].append(
                        c.generate(shared + f"turn {turn}", model=model, max_tokens=4, temperature=0.0)
                    )
        d.wait_idle()
        stats = engine_stats(d)
        events = d.log_events()
    assert outs["cached"][0].usage.cached_tokens == 0
    assert outs["cached"][1].usage.cached_tokens >= 8 * PAGE
    assert [o.usage.cached_tokens for o in outs["nocache"]] == [0, 0]
    # the worker without a prefix cache prefilled both prompts whole; the other saved the shared pages
    assert stats[1]["prefill_tokens_total"] == sum(o.usage.prompt_tokens for o in outs["nocache"])
    assert stats[0]["prefill_tokens_total"] < sum(o.usage.prompt_tokens for o in outs["cached"])
    off = [e for e in events if e.get("event") == "prefix_cache_off"]
    assert len(off) == 1 and off[0]["worker_id"] == 1 and "prefix" in off[0]["reason"]


# --- workers that cannot load --------------------------------------------------------------------

WRONG_SIZE_SHIM = r"""
#include <stdio.h>
#include "basert_h.h"
static _Thread_local char err[256];
static _Thread_local BaseRTErrorCode code;
/* A library built against a baseRT.h whose BaseRTLoadOptions grew by 8 bytes; the rest of baseRT.h
   (the tokenizer-only handle included) comes from the reference engine it links. */
baseRT_model_t baseRT_load_model_ex(const char *m, const char *k, int c, const BaseRTLoadOptions *o) {
    (void)m; (void)k; (void)c;
    snprintf(err, sizeof err, "BaseRTLoadOptions.struct_size %zu, expected %zu",
             o ? o->struct_size : 0, sizeof(BaseRTLoadOptions) + 8);
    code = BASERT_ERR_INVALID_ARGUMENT;
    return NULL;
}
const char *baseRT_get_error(void) { return err; }
BaseRTErrorCode baseRT_get_error_code(void) { return code; }
"""


def wrong_size_lib(tmp_path: Path) -> Path:
    src = tmp_path / "shim.c"
    src.write_text(WRONG_SIZE_SHIM)
    lib = tmp_path / "libshim.so"
    ref_dir = str(Path(ref_engine_path()).parent)
    link = [f"-L{ref_dir}", "-Wl,--no-as-needed", "-l:libbasert_ref.so", f"-Wl,-rpath,{ref_dir}"]
    subprocess.run(
        ["cc", "-std=c11", "-shared", "-fPIC", f"-I{ref_dir}", str(src), *link, "-o", str(lib)], check=True
    )
    return lib


def tick_only_lib(tmp_path: Path) -> Path:
    lib = tmp_path / "libtickonly.so"
    src = ROOT / "tests" / "native" / "scripted_lib.c"
    inc = Path(header_path()).parent
    subprocess.run(["cc", "-std=c11", "-shared", "-fPIC", f"-I{inc}", str(src), "-o", str(lib)], check=True)
    return lib


def wait_given_up(d: Daemon, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        problems = d.status().problems
        if problems:
            return problems
        assert time.monotonic() < deadline, f"no problem reported:\n{d.log_text()}"
        time.sleep(0.05)


def assert_reported_not_respawned(d: Daemon, *needles: str) -> str:
    (line,) = wait_given_up(d)
    assert line.startswith("worker 0: ") and line.endswith("(exit status 3)"), line
    assert all(n in line for n in needles), line
    time.sleep(1.0)  # a supervisor that respawned would have spawned again by now
    events = d.log_events()
    assert sum(e.get("event") == "worker_spawned" for e in events) == 1
    assert sum(e.get("event") == "worker_given_up" for e in events) == 1
    with d.client() as c:
        h = c.health()
    assert h.status == "degraded" and line in h.reason, h
    (row,) = d.workers()
    assert row.last_error and row.last_error in line
    ctl = d.ctl("status")
    assert ctl.returncode == 0 and line in ctl.stdout, ctl.stdout + ctl.stderr
    rows = json.loads(d.ctl("workers", "--json").stdout)
    rows = rows["workers"] if isinstance(rows, dict) else rows
    assert rows[0]["last_error"] == row.last_error
    return line


def test_wrong_struct_size_is_reported_not_respawned(tmp_path):
    model = write_ref_bundle(tmp_path / "m.ref", **BUNDLE)
    lib = wrong_size_lib(tmp_path)
    with Daemon(worker_toml(model, lib=str(lib)), wait_workers=False) as d:
        line = assert_reported_not_respawned(d, "struct_size", "INVALID_ARGUMENT")
        # a request during the hold-off fails at once, typed; the reason (paths included) is the
        # operator's, in status and the log, not the client's
        with d.client() as c, pytest.raises(Exception, match=r"worker_failed.*could not be started") as err:
            c.generate("hi", max_tokens=2)
        assert "struct_size" not in str(err.value) and str(tmp_path) not in str(err.value)
        assert sum(e.get("event") == "worker_spawned" for e in d.log_events()) == 1
        assert "basertd-worker: cannot load the basert engine" in line


def test_a_library_lacking_symbols_is_reported_not_respawned(tmp_path):
    model = write_ref_bundle(tmp_path / "m.ref", **BUNDLE)
    lib = tick_only_lib(tmp_path)
    with Daemon(worker_toml(model, lib=str(lib)), wait_workers=False) as d:
        line = assert_reported_not_respawned(d, "baseRT_load_model_ex", "baseRT_load_tokenizer_only")
        assert "lacks" in line and str(lib) in line
        tok_events = [e for e in d.log_events() if e.get("event") == "tokenizer_unavailable"]
        assert len(tok_events) == 1 and "baseRT_load_tokenizer_only" in tok_events[0]["reason"]
        with d.client() as c, pytest.raises(Exception, match="tokenizer is unavailable"):
            c.tokenize("hi")


@pytest.mark.parametrize("content", [None, "garbage\n"], ids=["absent", "garbage"])
def test_a_bundle_that_does_not_load_is_reported_not_respawned(tmp_path, content):
    model = tmp_path / "m.ref"
    if content is not None:
        model.write_text(content)
    with Daemon(worker_toml(model), wait_workers=False) as d:
        line = assert_reported_not_respawned(d, "baseRT_load_model_ex", str(model))
        assert "cannot load the basert engine" in line
