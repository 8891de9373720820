"""Cost of the write-ahead log's group commit (DESIGN.md "Crash = preemption; acceptance is
durable"): ticks of ``--lanes`` lanes that each append ``--grant`` tokens, one ``commit()`` (one
write + one fdatasync) per tick, as with ``[durability] mode = "tick"``; beside it the same ticks
on ``mode = "off"`` (no log) in the same process and minute. Prints ticks/s, records/s and tokens/s
of each, bytes per commit and the fsync latency (p50, p99, max). A request is accepted every few
ticks and finished when it reaches its length, so Accept and Finish records are in the mix; a small
``--segment-mib`` makes rotation (checkpoint + compaction) part of the figure.

    .venv/bin/python bench/bench_durability_wal.py [--seconds 2] [--lanes 8] [--grant 8] [--dir DIR]

The directory (default: a temporary one under the current directory, i.e. on the disk the state
directory would use, not tmpfs) is removed afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from basertd.server.durability.wal import Journal
from basertd.server.durability.wal_disk import open_journal
from basertd.server.durability.wal_format import RequestRecord


def run(journal: Journal, seconds: float, lanes: int, grant: int, fsyncs: list[float]) -> dict:
    """Run ticks for ``seconds``; returns counts. ``fsyncs`` collects fsync latencies."""
    journal.on_commit = lambda nbytes, fsync_s: fsyncs.append(fsync_s)
    running: dict[str, int] = {}
    next_id = ticks = records = tokens = nbytes = 0
    t_end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < t_end:
        while len(running) < lanes:
            rid = f"r{next_id}"
            next_id += 1
            journal.accepted(
                RequestRecord(request_id=rid, prompt=list(range(200)), max_tokens=256, seed=next_id)
            )
            running[rid] = 0
            records += 1
        for rid in list(running):
            start = running[rid]
            journal.tokens(rid, start, list(range(start, start + grant)))
            running[rid] = start + grant
            records += 1
            tokens += grant
            if running[rid] >= 256:
                journal.finished(rid, "length")
                del running[rid]
                records += 1
        nbytes += journal.commit()
        ticks += 1
    wall = time.perf_counter() - t0
    return {"ticks": ticks, "records": records, "tokens": tokens, "bytes": nbytes, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--grant", type=int, default=8, help="tokens per lane per tick")
    ap.add_argument("--segment-mib", type=float, default=4.0)
    ap.add_argument("--dir", type=Path, default=Path.cwd())
    args = ap.parse_args()

    results = {}
    fsyncs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-wal-", dir=args.dir) as tmp:
        for mode in ("off", "tick"):
            journal = open_journal(tmp, mode=mode, segment_bytes=int(args.segment_mib * (1 << 20)))
            try:
                results[mode] = run(journal, args.seconds, args.lanes, args.grant, fsyncs)
            finally:
                journal.close()
            if mode == "tick":
                results[mode]["rotations"] = journal.stats.rotations
    print(f"{args.lanes} lanes x {args.grant} tokens per tick, {args.seconds:.1f} s per mode, dir {args.dir}")
    for mode, r in results.items():
        w = r["wall"]
        print(
            f"  mode={mode:4s}  ticks/s {r['ticks'] / w:10.0f}  records/s {r['records'] / w:10.0f}"
            f"  tokens/s {r['tokens'] / w:11.0f}  bytes/commit {r['bytes'] / max(r['ticks'], 1):7.0f}"
        )
    if fsyncs:
        q = statistics.quantiles(fsyncs, n=100) if len(fsyncs) > 1 else fsyncs * 99
        print(
            f"  fsync latency ms: p50 {q[49] * 1e3:.3f}  p99 {q[98] * 1e3:.3f}  max {max(fsyncs) * 1e3:.3f}"
            f"  ({len(fsyncs)} commits, {results['tick'].get('rotations', 0)} rotations)"
        )
    per_tick = {m: r["wall"] / max(r["ticks"], 1) for m, r in results.items()}
    print(f"  commit cost per tick: {(per_tick['tick'] - per_tick['off']) * 1e3:.3f} ms")
    print(f"  tick ticks/s as a ratio of off: {per_tick['off'] / per_tick['tick']:.4f}")


if __name__ == "__main__":
    main()
