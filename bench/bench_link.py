"""Link W cost: ticks per second through a real ``basertd-worker`` against the same plans run on a
reference bundle in this process, in the same run.

For each lane count (1, 8, 64, 256) a mixed plan stream (``tests/worker/worker_plans.py``, the
stream of the 1,000-tick equivalence test: admits with prompts in the prompt ring, chunked
prefills, decodes, HOST commits, retires with publishing, EOS finishes) is recorded once, then
replayed twice with the reference engine at zero tick delay:

- in-process: write the tick's prompts to the prompt ring, ``Bundle.tick``, read every emitted
  span from the emit ring;
- worker: the same through ``SyncWorker`` (coordinator asyncio link, zmq ipc, msgpack both ways,
  the worker's adapter) with the engine in another process.

Both sides do the same ring work, so the ratio in-process time / worker time is what the link and
its marshalling cost (1.0 = free); ``+us/tick`` is the same cost in microseconds per tick. Partial
emits are off for those columns; ``stream ratio`` repeats the comparison with PARTIAL_EMITS on
every plan (the worker sends one TICK_EMIT per token; in-process, a callback collects them). The
worker side runs every tick from one coroutine, as the coordinator's scheduler does. Each figure
is the best of ``--rounds`` interleaved rounds (the machine is shared: expect noise).

    .venv/bin/python bench/bench_link.py [--ticks N] [--lanes 1,8,64,256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "worker"))

from worker_plans import (
    EMIT_RING,
    LOGITS_RING,
    PROMPT_RING,
    InProcess,
    Step,
    StreamConfig,
    record,
    ring_geometry,
)

from basertd.native.ref import RefConfig
from basertd.schema.abi import TickFlag
from basertd.server.workers.process import RingGeometry, WorkerSpec
from basertd.server.workers.sync_worker import SyncWorker


def ref_config(lanes: int) -> RefConfig:
    """Reference engine sized for ``lanes``: every lane fits the pool with room for the cache."""
    return RefConfig(
        max_lanes=lanes,
        max_batch_size=lanes,
        pool_bytes=max(1 << 20, lanes * 16 * 1024),
        eos_period=24,
        tick_delay_us=0,
    )


def with_partial_emits(steps: list[Step]) -> list[Step]:
    """The same steps with PARTIAL_EMITS set on every plan (the events do not change)."""
    flag = int(TickFlag.PARTIAL_EMITS)
    return [
        dataclasses.replace(s, plan=msgspec.structs.replace(s.plan, flags=s.plan.flags | flag)) for s in steps
    ]


def run_in_process(steps: list[Step], ref: RefConfig, geo: dict, streaming: bool) -> float:
    """Seconds to replay ``steps`` on a fresh in-process bundle (with ``streaming``, a partial-emit
    callback collects the tokens, as the worker's does)."""
    runner = InProcess(ref, geo)
    sink: list = []
    on_emit = (lambda tag, toks: sink.append(toks)) if streaming else None
    try:
        t0 = time.perf_counter()
        for step in steps:
            for prompt in step.prompts:
                runner.write_prompt(prompt)
            events = runner.tick(step.plan, on_emit)
            for e in events.emits:
                runner.read_tokens(e.token_ref)
            sink.clear()
        return time.perf_counter() - t0
    finally:
        runner.close()


def run_worker(steps: list[Step], ref: RefConfig, geo: dict, rundir: str, streaming: bool) -> float:
    """Seconds to replay ``steps`` through a fresh worker (start-up not counted), from one
    coroutine on the link's event loop, as the coordinator's scheduler drives it."""
    overrides = {
        "max_lanes": ref.max_lanes,
        "max_batch_size": ref.max_batch_size,
        "pool_bytes": ref.pool_bytes,
        "eos_period": ref.eos_period,
        "tick_delay_us": 0,
    }
    spec = WorkerSpec(
        ref_config=overrides,
        prompt_ring=RingGeometry(*geo[PROMPT_RING]),
        emit_ring=RingGeometry(*geo[EMIT_RING]),
        logits_ring=RingGeometry(*geo[LOGITS_RING]),
        runtime_dir=rundir,
        log_level="warning",
    )
    with SyncWorker(spec) as w:
        prompt_ring, emit_ring, link = w.proc.prompt_ring, w.proc.emit_ring, w.link
        sink: list = []
        on_emit = sink.append if streaming else None

        async def replay() -> float:
            t0 = time.perf_counter()
            for step in steps:
                for prompt in step.prompts:
                    prompt_ring.write(prompt)
                events = await link.tick(step.plan, on_emit=on_emit)
                for e in events.emits:
                    emit_ring.read(e.token_ref)
                sink.clear()
            return time.perf_counter() - t0

        return w.call(replay())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticks", type=int, default=0, help="ticks per lane count (default: by lane count)")
    ap.add_argument("--lanes", default="1,8,64,256")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per figure (best is kept)")
    args = ap.parse_args()
    lane_counts = [int(x) for x in args.lanes.split(",")]
    header = ("lanes", "ticks", "tok/tick", "in-proc t/s", "worker t/s", "ratio", "+us/tick", "stream ratio")
    widths = (5, 6, 8, 12, 11, 6, 9, 12)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)), flush=True)
    with tempfile.TemporaryDirectory(prefix="brtb-", dir="/tmp") as rundir:
        for lanes in lane_counts:
            ticks = args.ticks or (2000 if lanes <= 8 else 1000 if lanes <= 64 else 300)
            cfg = StreamConfig(
                lanes=lanes,
                prefill_budget=max(96, 16 * lanes),
                max_gen=64,
                partial_every=0,
                admit_prob=0.8,
                seed=lanes,
            )
            ref = ref_config(lanes)
            geo = ring_geometry(cfg, ref)
            steps = record(cfg, ref, ticks)
            streamed = with_partial_emits(steps)
            tokens = sum(len(t) for s in steps for t in s.tokens)
            best = {k: float("inf") for k in ("in", "w", "in_s", "w_s")}
            for _ in range(args.rounds):
                best["in"] = min(best["in"], run_in_process(steps, ref, geo, False))
                best["w"] = min(best["w"], run_worker(steps, ref, geo, rundir, False))
                best["in_s"] = min(best["in_s"], run_in_process(streamed, ref, geo, True))
                best["w_s"] = min(best["w_s"], run_worker(streamed, ref, geo, rundir, True))
            t_in, t_w = best["in"], best["w"]
            row = (
                f"{lanes:>5} {ticks:>6} {tokens / ticks:>8.1f} {ticks / t_in:>12.0f} {ticks / t_w:>11.0f} "
                f"{t_in / t_w:>6.3f} {(t_w - t_in) / ticks * 1e6:>9.1f} {best['in_s'] / best['w_s']:>12.3f}"
            )
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
