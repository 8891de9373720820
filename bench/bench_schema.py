"""Link W schema cost: encode + decode of a 256-lane TickPlan and its TickEvents through
``LinkCodec`` (typed msgspec Structs, array-like bodies, envelope frame), against the same data as
plain dicts through msgpack (msgspec's untyped encoder/decoder) in the same process.

Prints the median microseconds per round trip of each path and the ratio schema / dicts
(below 1.0: the schema path is cheaper). Runs in a few seconds; ``--rounds`` changes the count.

    .venv/bin/python bench/bench_schema.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import msgspec

from basertd.schema.abi import AdmitStatus, Finish, ShedKind, TickStatus
from basertd.schema.codec import LinkCodec
from basertd.schema.tick import (
    AdmitResult,
    LaneAdmit,
    LaneCommit,
    LaneDecode,
    LaneEmit,
    LaneFault,
    LaneLogprob,
    LanePrefill,
    LaneRetire,
    MemCounters,
    OpComplete,
    SamplingParams,
    ShedEntry,
    ShedPolicy,
    ShedReport,
    TickEvents,
    TickPlan,
    TickTimings,
    TokenRef,
)

LANES = 256


def make_plan(lanes: int = LANES) -> TickPlan:
    """A busy tick: every lane decodes, 16 are admitted and prefilled, 8 retire, 4 commit."""
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, repeat_penalty=1.1)
    return TickPlan(
        plan_seq=123_456,
        prefill_token_budget=2048,
        max_decode_lanes=lanes,
        admits=[
            LaneAdmit(
                lane_tag=10_000 + i,
                prompt=TokenRef(ring_id=1, index=i * 64, count=512, generation=9_000 + i),
                sampling=1,
                params=params,
                rng_counter_base=0xDEADBEEF + i,
                want_logprobs=3,
            )
            for i in range(16)
        ],
        commits=[LaneCommit(lane_tag=i, token_id=1234 + i, logits_nonce=77 + i) for i in range(4)],
        prefills=[LanePrefill(lane_tag=10_000 + i, token_offset=0, token_count=128) for i in range(16)],
        decodes=[LaneDecode(lane_tag=i, max_new_tokens=1) for i in range(lanes)],
        retires=[LaneRetire(lane_tag=300 + i, publish_to_cache=1) for i in range(8)],
        shed_policy=ShedPolicy(
            victim_lanes=list(range(200, 216)),
            evictable_cache_classes=3,
            protected_quota_bytes=1 << 30,
            max_evict_bytes=64 << 20,
        ),
    )


def make_events(lanes: int = LANES) -> TickEvents:
    """What that tick reports: an emit per lane, 16 admit results, 32 lanes with logprobs."""
    return TickEvents(
        plan_seq=123_456,
        tick_status=TickStatus.SHED,
        admit_results=[AdmitResult(lane_tag=10_000 + i, status=AdmitStatus.ADMITTED) for i in range(16)],
        emits=[
            LaneEmit(
                lane_tag=i,
                token_ref=TokenRef(ring_id=2, index=i, count=1, generation=50_000 + i),
                n_tokens=1,
                finish=Finish.EOS if i % 97 == 0 else Finish.NONE,
            )
            for i in range(lanes)
        ],
        faults=[LaneFault(lane_tag=255, code=5, detail=42)],
        shed=ShedReport(
            prefill_chunks_dropped=1,
            evictions_performed=1,
            bytes_evicted=1 << 20,
            entries=[
                ShedEntry(lane_tag=10_015, kind=ShedKind.PREFILL_CHUNK, tokens=64),
                ShedEntry(kind=ShedKind.CACHE_EVICTION, bytes=1 << 20),
            ],
        ),
        op_completions=[OpComplete(op=9, state=2, bytes_moved=4096)],
        timings=TickTimings(wall_ns=8_000_000, prefill_ns=5_000_000, decode_ns=3_000_000, graph_hits=1),
        mem=MemCounters(allocated_bytes=1 << 33, pool_blocks_total=4096, pool_blocks_used=3000),
        logprobs=[
            LaneLogprob(
                lane_tag=i,
                logprob=-0.25,
                n_top=5,
                top_ids=[1, 2, 3, 4, 5],
                top_logprobs=[-0.25, -1.5, -2.0, -3.0, -4.5],
            )
            for i in range(32)
        ],
    )


def as_dicts(obj: Any) -> Any:
    """The same data as nested plain dicts and lists (what an untyped codec would carry)."""
    if isinstance(obj, msgspec.Struct):
        return {f: as_dicts(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list):
        return [as_dicts(x) for x in obj]
    return obj


def median_us(fn, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000, help="round trips per path and record (default 2000)")
    args = ap.parse_args()

    codec = LinkCodec(version=1)
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode
    plan, events = make_plan(), make_events()
    plan_d, events_d = as_dicts(plan), as_dicts(events)

    # Correctness first: both paths carry the same data.
    assert codec.decode(codec.encode(plan, seq=1))[1] == plan
    assert codec.decode(codec.encode(events, seq=2))[1] == events
    assert decode(encode(plan_d)) == plan_d and decode(encode(events_d)) == events_d

    def schema_rt(msg):
        return lambda: codec.decode(codec.encode(msg, seq=1))

    def dict_rt(d):
        return lambda: decode(encode(d))

    cases = {
        "TickPlan": (schema_rt(plan), dict_rt(plan_d), plan),
        "TickEvents": (schema_rt(events), dict_rt(events_d), events),
    }
    for fn_s, fn_d, _ in cases.values():  # warm up
        median_us(fn_s, 50)
        median_us(fn_d, 50)

    rows = []
    for name, (fn_s, fn_d, msg) in cases.items():
        # Interleave the two paths in blocks so both see the same machine state.
        s_meds, d_meds = [], []
        for _ in range(10):
            s_meds.append(median_us(fn_s, args.rounds // 10))
            d_meds.append(median_us(fn_d, args.rounds // 10))
        s, d = statistics.median(s_meds), statistics.median(d_meds)
        size_s = sum(len(memoryview(f)) for f in codec.encode(msg, seq=1))
        size_d = len(encode(as_dicts(msg)))
        rows.append((name, s, d, size_s, size_d))

    print(f"Link W schema round trip (encode + decode), {LANES} lanes, median of {args.rounds} per path")
    print(f"{'record':<12}{'schema us':>11}{'dicts us':>10}{'ratio':>8}{'schema B':>10}{'dicts B':>9}")
    for name, s, d, size_s, size_d in rows:
        print(f"{name:<12}{s:>11.1f}{d:>10.1f}{s / d:>8.2f}{size_s:>10}{size_d:>9}")
    total_s, total_d = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{'plan+events':<12}{total_s:>11.1f}{total_d:>10.1f}{total_s / total_d:>8.2f}")


if __name__ == "__main__":
    main()
