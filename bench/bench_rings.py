"""BRTRING1 throughput: publish + read of one span through a ring, as a ratio to a plain numpy copy
of the same bytes measured in the same process a moment before (DESIGN.md "Rings").

Cases: 1024-token spans (4 KiB) in 4 KiB slots and in 1 KiB slots (4 slots per span), and
262,144-float logits rows (1 MiB, the default model's vocabulary) in one slot each. A ring round
trip copies the bytes twice (into the ring, out of it) plus one foreign call each way, so 0.5 is
the ceiling for large rows. Each figure is the best of several timed repeats.

    .venv/bin/python bench/bench_rings.py [--quick]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

from basertd.schema.abi import RingKind
from basertd.shm import RingReader, RingWriter, Segment, ring_bytes, slot_bytes_for


def best_seconds(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Best-of-``repeats`` wall time of one call, each repeat timing ``iters`` calls."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def bench_case(name: str, kind: RingKind, elems: int, slot_elems: int, iters: int, repeats: int) -> float:
    """Prints and returns the throughput ratio ring / numpy copy for spans of ``elems`` elements."""
    slots = max(4, 2 * -(-elems // slot_elems))
    slot_bytes = slot_bytes_for(slot_elems)
    rng = np.random.default_rng(0)
    if kind == RingKind.TOKENS:
        src = rng.integers(0, 262_144, size=elems, dtype=np.uint32)
    else:
        src = rng.standard_normal(elems).astype(np.float32)
    nbytes = src.nbytes
    with Segment.create(ring_bytes(slots, slot_bytes)) as seg:
        writer = RingWriter.create(seg, 1, kind, slots, slot_bytes)
        reader = RingReader.attach(seg, 1, kind, slots, slot_bytes)
        one_row = kind == RingKind.LOGITS and elems <= slot_elems

        def ring_round_trip() -> np.ndarray:
            if one_row:
                return reader.read_row(writer.write_row(src))
            return reader.read(writer.write(src))

        out = np.empty_like(src)

        def ring_round_trip_out() -> np.ndarray:
            if one_row:
                return reader.read_row(writer.write_row(src), out=out)
            return reader.read(writer.write(src), out=out)

        got = ring_round_trip()
        assert np.array_equal(got, src), "ring round trip changed the data"
        baseline = best_seconds(src.copy, iters, repeats)
        ring = best_seconds(ring_round_trip, iters, repeats)
        ring_out = best_seconds(ring_round_trip_out, iters, repeats)
        baseline_after = best_seconds(src.copy, iters, repeats)
    baseline = min(baseline, baseline_after)
    ratio = baseline / ring
    print(
        f"{name:<44} {nbytes / 1024:>7.0f} KiB  numpy copy {baseline * 1e6:8.2f} us "
        f"({nbytes / baseline / 1e9:5.2f} GB/s)  ring publish+read {ring * 1e6:8.2f} us "
        f"({nbytes / ring / 1e9:5.2f} GB/s)  ratio {ratio:5.3f}  "
        f"(read into out: {ring_out * 1e6:7.2f} us, ratio {baseline / ring_out:5.3f})"
    )
    return ratio


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    scale = 10 if quick else 1
    ratios = {
        "tokens 1024 (one 4 KiB slot)": bench_case(
            "tokens: 1024-token span, 4 KiB slots", RingKind.TOKENS, 1024, 1024, 20_000 // scale, 5
        ),
        "tokens 1024 (4 x 1 KiB slots)": bench_case(
            "tokens: 1024-token span, 1 KiB slots", RingKind.TOKENS, 1024, 256, 20_000 // scale, 5
        ),
        "logits 262144 (one 1 MiB slot)": bench_case(
            "logits: 262,144-float row, one slot", RingKind.LOGITS, 262_144, 262_144, 300 // scale, 5
        ),
    }
    print("ratios (ring publish+read throughput / numpy copy throughput, same bytes, same run):")
    for key, value in ratios.items():
        print(f"  {key}: {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
