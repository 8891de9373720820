"""References for what a daemon serves, and helpers of the serving tests (e2e, and the
serving-under-contention and prefix-cache tests; importable from every test folder):
``DirectRun``, an engine worker driven alone, one uninterrupted lane at a time, for token-exact
comparisons; ``bare_reference``, a plain llama.cpp loop, with its near-tie tolerance;
reference-engine and tiny-GGUF daemon configurations; the daemon's access-log lines and the
engines' own counters (PONG stats through Workers). The daemon itself is ``daemon_harness.Daemon``."""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from daemon_harness import Daemon

from basertd.schema import client as api
from basertd.schema.abi import AdmitStatus, Finish
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, TickPlan
from basertd.server.request.record import sampler_for
from basertd.server.workers.process import WorkerSpec
from basertd.server.workers.sync_worker import SyncWorker

__all__ = [
    "MARGIN_TOL",
    "REF",
    "DirectRun",
    "access_lines",
    "assert_same_up_to_near_ties",
    "bare_reference",
    "common_prefix",
    "direct_ref",
    "engine_stats",
    "ref_toml",
    "tiny_toml",
    "wait_leases",
]


class DirectRun:
    """An engine worker driven without the coordinator, for token-exact comparisons: one lane at a
    time, the whole prompt prefilled in the admit tick, then decode grants of up to 7 tokens until
    the engine finishes the lane or ``max_tokens`` is reached. Sampling comes from the same
    ``sampler_for`` the daemon uses (temperature 0 greedy, else Gumbel with rng base seed << 32).
    A context manager: ``close()`` at the end of the block."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.rundir = tempfile.mkdtemp(prefix="brt-direct-", dir="/tmp")
        self.worker = SyncWorker(dataclasses.replace(spec, runtime_dir=self.rundir))
        self.seq = 0
        self.tag = 0

    def run(self, prompt: list[int], gen: api.Generate) -> list[int]:
        """Token ids the engine generates for ``prompt`` under ``gen``'s sampling and max_tokens."""
        proc = self.worker.proc
        sampler = sampler_for(gen)
        self.tag += 1
        ref = proc.prompt_ring.write(np.asarray(prompt, dtype=np.uint32))
        admit = LaneAdmit(
            lane_tag=self.tag,
            prompt=ref,
            sampling=int(sampler.mode),
            params=sampler.params,
            rng_counter_base=sampler.rng_counter_base(),
        )
        out: list[int] = []
        first = True
        while len(out) < gen.max_tokens:
            self.seq += 1
            plan = TickPlan(
                plan_seq=self.seq,
                prefill_token_budget=len(prompt) if first else 0,
                max_decode_lanes=1,
                admits=[admit] if first else [],
                prefills=[LanePrefill(lane_tag=self.tag, token_offset=0, token_count=len(prompt))]
                if first
                else [],
                decodes=[LaneDecode(lane_tag=self.tag, max_new_tokens=min(7, gen.max_tokens - len(out)))],
            )
            ev = self.worker.tick(plan)
            if first:
                assert ev.admit_results[0].status == AdmitStatus.ADMITTED, ev.admit_results
            first = False
            (emit,) = ev.emits
            if emit.n_tokens:
                out += proc.emit_ring.read(emit.token_ref).tolist()
            if emit.finish != Finish.NONE:
                break
        self.seq += 1
        self.worker.tick(TickPlan(plan_seq=self.seq, retires=[LaneRetire(lane_tag=self.tag)]))
        return out[: gen.max_tokens]

    def close(self) -> None:
        """Stop the worker and remove its directory."""
        self.worker.close()
        shutil.rmtree(self.rundir, ignore_errors=True)

    def __enter__(self) -> DirectRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


REF = {"vocab_size": 259, "eos_token": 2, "eos_period": 0, "tick_delay_us": 20000}
"""Reference engine: the bytes vocabulary, no EOS (generations run to max_tokens), 20 ms ticks so
that the order of events is set by ticks, not by the machine's load."""


def ref_toml(
    *,
    lanes: int = 2,
    context: int = 512,
    grant: int = 2,
    queue_limit: int = 1000,
    ref: dict | None = None,
    scheduler: str = "",
    cache: str = "",
    workers: int = 1,
    worker: str = "",
) -> str:
    """A daemon config: ``workers`` reference-engine workers with ``lanes`` lanes of ``context``
    tokens, ``ref`` overriding ``REF``, a decode grant of exactly ``grant`` tokens (``decode_tick_s``
    0: the tests pace their streams by the grant) and a queue of ``queue_limit`` requests; extra
    ``[[workers]]`` / ``[scheduler]`` / ``[cache]`` lines verbatim."""
    table = "\n".join(f"{k} = {v}" for k, v in {**REF, **(ref or {})}.items())
    worker = (
        f'[[workers]]\nengine = "basert"\nlanes = {lanes}\ncontext_length = {context}\n{worker}\n'
        f"[workers.ref_config]\n{table}\n"
    )
    sched = (
        f"[scheduler]\ndecode_grant = {grant}\ndecode_tick_s = 0\nqueue_limit = {queue_limit}\n{scheduler}\n"
    )
    return worker * workers + sched + f"[cache]\n{cache}\n"


def direct_ref(*, lanes: int = 2, context: int = 512, ref: dict | None = None) -> DirectRun:
    """The reference engine of ``ref_toml`` driven alone, one uninterrupted lane at a time."""
    spec = WorkerSpec(
        engine="basert",
        ref_config={**REF, **(ref or {}), "tick_delay_us": 0},
        lanes=lanes,
        context_length=context,
    )
    return DirectRun(spec)


def common_prefix(seqs: list[list[int]]) -> list[int]:
    """The longest prefix every one of ``seqs`` (token ids) starts with."""
    n = 0
    while all(len(s) > n and s[n] == seqs[0][n] for s in seqs):
        n += 1
    return seqs[0][:n]


def access_lines(d: Daemon) -> dict[str, dict]:
    """The daemon's ``access`` log lines so far, by request id."""
    return {e["request_id"]: e for e in d.log_events() if e.get("event") == "access"}


def engine_stats(d: Daemon) -> list[dict[str, int]]:
    """Each worker's engine counters (PONG stats), by worker id."""
    return [dict(r.engine_stats) for r in sorted(d.workers(), key=lambda r: r.worker_id)]


def wait_leases(d: Daemon, expected: int = 0, timeout: float = 10.0) -> list[dict[str, int]]:
    """Until every engine reports ``expected`` live seed leases in all (leases expire by ticks, so
    an idle engine keeps what it holds: the policy must release them); returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(d)
        if sum(s.get("live_seed_leases", 0) for s in stats) == expected:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"seed leases {[s.get('live_seed_leases') for s in stats]} != {expected}")
        time.sleep(0.05)


def tiny_toml(
    model,
    *,
    lanes: int = 2,
    context: int = 256,
    grant: int = 2,
    scheduler: str = "",
    cache: str = "",
    worker: str = "",
) -> str:
    """A daemon config: one llamacpp worker on the tiny GGUF ``model``, one thread, a decode grant
    of exactly ``grant`` tokens (``decode_tick_s`` 0, as ``ref_toml``); ``worker``: more keys of its
    ``[[workers]]`` table."""
    return (
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{model}"\nlanes = {lanes}\ncontext_length = {context}\n'
        f"threads = 1\n{worker}\n[scheduler]\ndecode_grant = {grant}\ndecode_tick_s = 0\nqueue_limit = 1000\n"
        f"{scheduler}\n"
        f"[cache]\n{cache}\n"
    )


def bare_reference(model, prompts: list[list[int]], n_new: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and top-2 logit margins of each prompt from a plain llama.cpp loop, one prompt at
    a time (``tests/llamacpp/lc_harness.BareLlama``): the uninterrupted reference of the llamacpp
    tests, whose tolerance is the llamacpp issue's: outputs may differ only where this reference's
    top-2 margin is below ``MARGIN_TOL`` (batch composition may flip a near-tie, never a clear
    choice)."""
    here = str(Path(__file__).resolve().parent / "llamacpp")
    if here not in sys.path:
        sys.path.insert(0, here)
    from lc_harness import BareLlama
    from llama_cpp import llama_get_memory, llama_memory_clear

    n_ctx = max(512, -(-(max(map(len, prompts), default=0) + n_new) // 256) * 256)
    params = dict(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=512, n_seq_max=1, n_threads=1, n_threads_batch=1)
    bare = BareLlama(model, params)
    try:
        out = []
        for p in prompts:
            toks, margins = bare.greedy([p], n_new)
            out.append((toks[0], margins[0]))
            llama_memory_clear(llama_get_memory(bare.ctx), True)
        return out
    finally:
        bare.close()


MARGIN_TOL = 1e-3


def assert_same_up_to_near_ties(got: list[int], ref: tuple[list[int], list[float]], what: str = "") -> None:
    """``got`` equals the reference tokens, except from a position where the reference's top-2
    margin is below ``MARGIN_TOL`` on (the prefixes up to there are equal)."""
    tokens, margins = ref
    for i, (a, b) in enumerate(zip(got, tokens, strict=False)):
        if a != b:
            assert margins[i] < MARGIN_TOL, (
                f"{what}: diverged at {i} where the reference margin is {margins[i]:.4f}"
            )
            return
    assert len(got) <= len(tokens)


def end_cancelled(stream, it, max_tokens: int) -> None:
    """Cancel ``stream`` (a sync ``GenerationStream`` being read through ``it``) and read it to its
    end: it must end CANCELLED, or — when the cancel came after its last token — done on its own
    (``finish_reason`` eos, or length with all ``max_tokens`` tokens). Anything else fails the
    test."""
    from basertd.client import ClientError
    from basertd.schema.client import ErrorCode

    stream.cancel()
    try:
        for _ in it:
            pass
    except ClientError as exc:
        assert exc.code == ErrorCode.CANCELLED, exc
        return
    assert stream.done is not None and stream.done.finish_reason in ("length", "eos"), stream.done
    if stream.done.finish_reason == "length":
        assert stream.received == max_tokens, (stream.received, max_tokens)
