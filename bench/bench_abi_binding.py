"""Cost of the tick-ABI binding (basertd.native.abi) per tick, against raw baseRT_tick calls.

Both run the C reference engine in this process, on bundles built the same way: N lanes each
decoding one token per tick. The baseline calls ``baseRT_tick`` on a plan encoded once (only
plan_seq is bumped in the arena; events are not decoded): the engine's own cost plus one cffi
call. The binding path is ``Bundle.tick(TickPlan)``: marshal the schema plan into the arena, call,
decode the events fail-closed into schema records. Repetitions alternate which path goes first
so foreign load hits both alike; the ratio is the median over repetitions of baseline time /
binding time.

    .venv/bin/python bench/bench_abi_binding.py [--steps 200] [--reps 3]

Prints one row per lane count: ticks/s of each path, the binding's overhead per tick in
microseconds, and the ratio (1.0 = free).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from basertd.native.abi import RingSpec
from basertd.native.ref import create_ref_bundle
from basertd.schema.abi import RingKind, RingRole
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, TickPlan
from basertd.shm import RingWriter, Segment, ring_bytes, slot_bytes_for

PROMPT = 8


def _setup(lanes: int):
    b = create_ref_bundle(max_lanes=lanes, max_batch_size=lanes, pool_bytes=256 << 20, context_length=4096)
    tok = slot_bytes_for(64)
    segs = [Segment.create(ring_bytes(lanes + 8, tok), name="bench") for _ in range(2)]
    prompt = RingWriter.create(segs[0], 1, RingKind.TOKENS, lanes + 8, tok)
    RingWriter.create(segs[1], 2, RingKind.TOKENS, lanes + 8, tok).close()
    b.rings_attach(
        [
            RingSpec(
                1, RingKind.TOKENS, RingRole.ENGINE_READS, lanes + 8, tok, segs[0].address, segs[0].length
            ),
            RingSpec(
                2, RingKind.TOKENS, RingRole.ENGINE_WRITES, lanes + 8, tok, segs[1].address, segs[1].length
            ),
        ]
    )
    admits = [
        LaneAdmit(lane_tag=i + 1, prompt=prompt.write(np.arange(3, 3 + PROMPT, dtype=np.uint32)))
        for i in range(lanes)
    ]
    b.tick(
        TickPlan(
            plan_seq=1,
            prefill_token_budget=lanes * PROMPT,
            admits=admits,
            prefills=[LanePrefill(lane_tag=i + 1, token_offset=0, token_count=PROMPT) for i in range(lanes)],
        )
    )
    decodes = [LaneDecode(lane_tag=i + 1, max_new_tokens=1) for i in range(lanes)]
    return b, segs, decodes


def _raw(lanes: int, steps: int) -> float:
    b, segs, decodes = _setup(lanes)
    ptr = b.encode_plan(TickPlan(plan_seq=2, max_decode_lanes=lanes, decodes=decodes))
    t = time.perf_counter()
    for i in range(steps):
        ptr.plan_seq = 2 + i
        status, _ = b.tick_raw(ptr)
        assert status == 0, status
    dt = time.perf_counter() - t
    b.close()
    for s in segs:
        s.close()
    return dt


def _binding(lanes: int, steps: int) -> float:
    b, segs, decodes = _setup(lanes)
    t = time.perf_counter()
    for i in range(steps):
        ev = b.tick(TickPlan(plan_seq=2 + i, max_decode_lanes=lanes, decodes=decodes))
        assert len(ev.emits) == lanes
    dt = time.perf_counter() - t
    b.close()
    for s in segs:
        s.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(f"{'lanes':>5} {'raw ticks/s':>12} {'binding ticks/s':>16} {'overhead us':>12} {'ratio':>6}")
    for lanes in (1, 8, 64, 256):
        raws, binds, ratios = [], [], []
        for rep in range(args.reps):
            order = (_raw, _binding) if rep % 2 == 0 else (_binding, _raw)
            got = {fn: fn(lanes, args.steps) for fn in order}
            raws.append(got[_raw])
            binds.append(got[_binding])
            ratios.append(got[_raw] / got[_binding])
        n = args.steps * args.reps
        over = (sum(binds) - sum(raws)) / n * 1e6
        print(
            f"{lanes:>5} {n / sum(raws):>12.0f} {n / sum(binds):>16.0f} {over:>12.1f} "
            f"{statistics.median(ratios):>6.2f}"
        )


if __name__ == "__main__":
    main()
