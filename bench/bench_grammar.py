"""Decode throughput of JSON-schema-constrained lanes against unconstrained lanes, and schema
compile time, on the llama.cpp engine.

Two engines on the same model run in this process, in lockstep: one decodes N free lanes, the
other N lanes all constrained by one JSON schema (an unbounded array of small objects, so lanes do
not finish), both greedy with IGNORE_EOS, one decode tick per step. Each step of one is
immediately followed (alternating which goes first) by the same step of the other, so load from
other processes falls on both alike. The ratio is the median over steps of (free step time /
constrained step time); 1.0 means grammars cost nothing. Lane sets restart every ``--steps``
steps (and a repetition ends early should a constrained lane complete its grammar).

Compile time: ``grammar_create`` of a fresh schema on a warm engine (llguidance compile plus the
matcher build against the cached tokenizer), the first call's extra cost (the per-model tokenizer
build), and the coordinator's validation (``basertd.server.request.grammar``, no tokenizer).

    .venv/bin/python bench/bench_grammar.py [--model PATH] [--threads 2] [--steps 32] [--reps 3]

Prints one row per lane count: tokens/s of each and the ratio (target >= 0.90), then compile times.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from basertd.schema.abi import Finish, RingKind, RingRole, SamplingFlag
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, SamplingParams, TickPlan
from basertd.server.request.grammar import schema_spec
from basertd.shm import RingReader, RingWriter, Segment, ring_bytes, slot_bytes_for
from basertd.worker.engines.base import RingMapping
from basertd.worker.engines.llamacpp import LlamaCppEngine

PROMPT_LEN = 16
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "score": {"type": "integer", "minimum": 0, "maximum": 1000},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        },
        "required": ["name", "score", "tags"],
        "additionalProperties": False,
    },
}


def prompts_for(n_lanes: int, vocab: int) -> list[np.ndarray]:
    """Distinct deterministic prompts of PROMPT_LEN tokens (BOS-like id 1 or 2, then ordinary ids)."""
    rng = np.random.default_rng(1234)
    lo = 3 if vocab < 2000 else 1000
    top = min(vocab, 200_000)
    return [
        np.concatenate([[2 if vocab >= 2000 else 1], rng.integers(lo, top, PROMPT_LEN - 1)])
        for _ in range(n_lanes)
    ]


class Driver:
    """One engine with its rings, driven one decode tick per step; lanes optionally constrained."""

    def __init__(self, model_path: Path, lanes: int, threads: int, ctx_len: int) -> None:
        self.engine = LlamaCppEngine(
            model_path, lanes=lanes, context_length=ctx_len, n_threads=threads, n_threads_batch=threads
        )
        self.segments = []
        maps = []
        for ring_id, role, slots, elems in (
            (1, RingRole.ENGINE_READS, 256, 64),
            (2, RingRole.ENGINE_WRITES, 4096, 16),
        ):
            sb = slot_bytes_for(elems)
            seg = Segment.create(ring_bytes(slots, sb))
            self.segments.append(seg)
            w = RingWriter.create(seg, ring_id, RingKind.TOKENS, slots, sb)
            if ring_id == 1:
                self.prompts = w
            else:
                w.close()
                self.emits = RingReader.attach(seg, ring_id, RingKind.TOKENS, slots, sb)
            maps.append(
                RingMapping(ring_id, RingKind.TOKENS, role, slots, sb, seg.buffer, seg.address, seg.length)
            )
        self.engine.attach_rings(maps)
        self.seq = 0
        self.tags: list[int] = []
        self.next_tag = 1
        self.grammar = 0

    def _tick(self, **kw):
        self.seq += 1
        plan = TickPlan(
            plan_seq=self.seq, prefill_token_budget=1 << 20, max_decode_lanes=self.engine.max_lanes, **kw
        )
        return self.engine.tick(plan)

    def start(self, prompts: list[np.ndarray]) -> None:
        """Retire the previous lanes; admit + prefill + first token of every prompt in one tick."""
        if self.tags:
            self._tick(retires=[LaneRetire(lane_tag=t) for t in self.tags])
        params = SamplingParams(flags=SamplingFlag.IGNORE_EOS)
        self.tags = list(range(self.next_tag, self.next_tag + len(prompts)))
        self.next_tag += len(prompts)
        pairs = list(zip(self.tags, prompts, strict=True))
        admits = [
            LaneAdmit(
                lane_tag=t,
                prompt=self.prompts.write(p.astype(np.uint32)),
                params=params,
                grammar_handle=self.grammar,
            )
            for t, p in pairs
        ]
        prefills = [LanePrefill(lane_tag=t, token_offset=0, token_count=len(p)) for t, p in pairs]
        self._tick(admits=admits, prefills=prefills, decodes=[LaneDecode(lane_tag=t) for t in self.tags])

    def step(self) -> bool:
        """One decode tick of every lane; False when a lane finished (its grammar completed)."""
        ev = self._tick(decodes=[LaneDecode(lane_tag=t) for t in self.tags])
        assert not ev.faults, ev.faults
        return all(e.n_tokens == 1 and e.finish == Finish.NONE for e in ev.emits)

    def close(self) -> None:
        self.engine.close()
        self.prompts.close()
        self.emits.close()
        for s in self.segments:
            s.close()


def measure(free: Driver, cons: Driver, prompts, steps: int, reps: int) -> tuple[list[float], list[float]]:
    """Per-step times (seconds) of both, in lockstep, alternating which goes first."""
    tf: list[float] = []
    tc: list[float] = []
    clock = time.perf_counter
    for _ in range(reps):
        free.start(prompts)
        cons.start(prompts)
        for s in range(steps):
            first, second = (free, cons) if s % 2 == 0 else (cons, free)
            t0 = clock()
            ok1 = first.step()
            t1 = clock()
            ok2 = second.step()
            t2 = clock()
            (tf if first is free else tc).append(t1 - t0)
            (tc if first is free else tf).append(t2 - t1)
            if not (ok1 and ok2):
                break
    return tf, tc


def compile_times(engine: LlamaCppEngine, n: int = 10) -> tuple[float, float, float]:
    """(first grammar_create on a fresh engine, median later grammar_create, median coordinator
    validation), seconds, over schemas that differ in one bound so nothing is cached."""

    def schema(i: int) -> dict:
        s = json.loads(json.dumps(SCHEMA))
        s["items"]["properties"]["score"]["maximum"] = 1000 + i
        return s

    t0 = time.perf_counter()
    first = engine.grammar_create(json.dumps(schema(0)))
    t_first = time.perf_counter() - t0
    assert first
    later, validate = [], []
    for i in range(1, n + 1):
        t0 = time.perf_counter()
        h = engine.grammar_create(json.dumps(schema(i)))
        later.append(time.perf_counter() - t0)
        assert h
        engine.grammar_free(h)
        t0 = time.perf_counter()
        schema_spec(schema(i))
        validate.append(time.perf_counter() - t0)
    engine.grammar_free(first)
    return t_first, statistics.median(later), statistics.median(validate)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.model is None:
        from basertd.models import default_model_path

        args.model = default_model_path()
    print(f"model {args.model.name}, threads {args.threads}, {args.steps} steps x {args.reps} reps")
    print(f"{'lanes':>5} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6}")
    worst = 1.0
    for n in args.lanes:
        ctx = PROMPT_LEN + args.steps + 8
        free = Driver(args.model, n, args.threads, ctx)
        cons = Driver(args.model, n, args.threads, ctx)
        try:
            if n == args.lanes[0]:
                tfirst, tlater, tval = compile_times(cons.engine)
            cons.grammar = cons.engine.grammar_create(json.dumps(SCHEMA))
            prompts = prompts_for(n, free.engine.n_vocab)
            measure(free, cons, prompts, 2, 1)  # warm-up
            tf, tc = measure(free, cons, prompts, args.steps, args.reps)
        finally:
            free.close()
            cons.close()
        ratio = statistics.median(f / c for f, c in zip(tf, tc, strict=True))
        worst = min(worst, ratio)
        print(f"{n:>5} {n * len(tf) / sum(tf):>11.1f} {n * len(tc) / sum(tc):>11.1f} {ratio:>6.3f}")
    print(
        f"schema compile: first {tfirst * 1e3:.1f} ms (tokenizer build included), "
        f"then {tlater * 1e3:.2f} ms; coordinator validation {tval * 1e3:.2f} ms"
    )
    print(f"worst ratio {worst:.3f} (target >= 0.90)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
