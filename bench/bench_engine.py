"""Aggregate greedy decode throughput of the llama.cpp engine adapter against a bare llama.cpp loop.

Both run the same model with the same threads and context parameters in this process. The baseline
is the tightest loop the low-level API allows: one reused ``llama_batch`` with one token per lane,
one ``llama_decode`` per step, an in-place ``argmax`` of each lane's logits row. The adapter runs
one tick per step (a plan built, validated, every lane decoding one token, tokens written to the
emit ring, events built), the way the coordinator drives it.

The two run in lockstep: each decode step of the baseline is immediately followed (or preceded,
alternating) by the same step of the adapter, so load from other processes on this shared machine
falls on both alike. Per lane count it reports tokens/s from the summed times and, as the ratio,
the median over all steps of (baseline step time / adapter step time), which bursts of foreign load
cannot move much; both lanes sets are reset every ``--steps`` steps so contexts stay short.

    .venv/bin/python bench/bench_engine.py [--model PATH] [--threads 2] [--steps 32] [--reps 5]

Prints one row per lane count: tokens/s of each and the ratio (target >= 0.95).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import llama_cpp as L
import numpy as np

from basertd.schema.abi import RingKind, RingRole, SamplingFlag
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, SamplingParams, TickPlan
from basertd.shm import RingReader, RingWriter, Segment, ring_bytes, slot_bytes_for
from basertd.worker.engines.base import RingMapping
from basertd.worker.engines.llamacpp import LlamaCppEngine

PROMPT_LEN = 16


def prompts_for(n_lanes: int, vocab: int) -> list[np.ndarray]:
    """Distinct deterministic prompts of PROMPT_LEN tokens (BOS 2 for Gemma, then ordinary ids)."""
    rng = np.random.default_rng(1234)
    top = min(vocab, 200_000)
    return [np.concatenate([[2], rng.integers(1000, top, PROMPT_LEN - 1)]) for _ in range(n_lanes)]


class Baseline:
    """The bare loop: one context, one reused batch, argmax per lane per step."""

    def __init__(self, model_path: Path, params: dict) -> None:
        self.model = L.llama_model_load_from_file(str(model_path).encode(), L.llama_model_default_params())
        cp = L.llama_context_default_params()
        for k, v in params.items():
            setattr(cp, k, v)
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(params["n_batch"], 0, 1)
        self.toks: list[int] = []
        self.pos = 0

    def start(self, prompts: list[np.ndarray]) -> None:
        """Clear the cache, prefill every prompt in one batch, take each lane's first token."""
        L.llama_memory_clear(self.mem, True)
        b, n, last = self.batch, 0, []
        for s, p in enumerate(prompts):
            for i, t in enumerate(p):
                b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = int(t), i, 1, int(i == len(p) - 1)
                b.seq_id[n][0] = s
                n += 1
            last.append(n - 1)
        b.n_tokens = n
        assert L.llama_decode(self.ctx, b) == 0
        nv = self.n_vocab
        self.toks = [
            int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), (nv,)))) for i in last
        ]
        self.pos = PROMPT_LEN

    def step(self) -> None:
        """One decode step of every lane."""
        b, nv = self.batch, self.n_vocab
        for s, tok in enumerate(self.toks):
            b.token[s], b.pos[s], b.n_seq_id[s], b.logits[s] = tok, self.pos, 1, 1
            b.seq_id[s][0] = s
        b.n_tokens = len(self.toks)
        assert L.llama_decode(self.ctx, b) == 0
        self.toks = [
            int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, s), (nv,))))
            for s in range(len(self.toks))
        ]
        self.pos += 1

    def close(self) -> None:
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


class Adapter:
    """The engine adapter with its rings, driven one decode tick per step."""

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
        self.tags = list(range(1, len(prompts) + 1))
        pairs = list(zip(self.tags, prompts, strict=True))
        admits = [
            LaneAdmit(lane_tag=t, prompt=self.prompts.write(p.astype(np.uint32)), params=params)
            for t, p in pairs
        ]
        prefills = [LanePrefill(lane_tag=t, token_offset=0, token_count=len(p)) for t, p in pairs]
        self._tick(admits=admits, prefills=prefills, decodes=[LaneDecode(lane_tag=t) for t in self.tags])

    def step(self) -> None:
        """One decode tick of every lane (one token each)."""
        ev = self._tick(decodes=[LaneDecode(lane_tag=t) for t in self.tags])
        assert len(ev.emits) == len(self.tags) and all(e.n_tokens == 1 for e in ev.emits)

    def close(self) -> None:
        self.engine.close()
        self.prompts.close()
        self.emits.close()
        for s in self.segments:
            s.close()


def measure(
    base: Baseline, adapter: Adapter, prompts, steps: int, reps: int
) -> tuple[list[float], list[float]]:
    """Per-step times (seconds) of both, in lockstep, alternating which goes first."""
    tb: list[float] = []
    ta: list[float] = []
    clock = time.perf_counter
    for _ in range(reps):
        base.start(prompts)
        adapter.start(prompts)
        for s in range(steps):
            if s % 2 == 0:
                t0 = clock()
                base.step()
                t1 = clock()
                adapter.step()
                t2 = clock()
                tb.append(t1 - t0)
                ta.append(t2 - t1)
            else:
                t0 = clock()
                adapter.step()
                t1 = clock()
                base.step()
                t2 = clock()
                ta.append(t1 - t0)
                tb.append(t2 - t1)
    return tb, ta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 4, 8, 16])
    args = ap.parse_args(argv)
    logging.getLogger("basertd.llamacpp").setLevel(logging.ERROR)  # model-load warnings
    if args.model is None:
        from basertd.models import default_model_path

        args.model = default_model_path()
    ctx_len = PROMPT_LEN + args.steps + 16
    print(f"model {args.model.name}, threads {args.threads}, {args.steps} steps x {args.reps} reps, lockstep")
    print(f"{'lanes':>5} {'baseline tok/s':>15} {'adapter tok/s':>14} {'ratio':>7}")
    worst = float("inf")
    for n in args.lanes:
        adapter = Adapter(args.model, n, args.threads, ctx_len)
        base = Baseline(args.model, adapter.engine.context_params())
        prompts = prompts_for(n, adapter.engine.n_vocab)
        measure(base, adapter, prompts, 4, 1)  # warm both
        tb, ta = measure(base, adapter, prompts, args.steps, args.reps)
        ratio = float(np.median(np.array(tb) / np.array(ta)))
        worst = min(worst, ratio)
        tokens = n * len(tb)
        print(f"{n:>5} {tokens / sum(tb):>15.1f} {tokens / sum(ta):>14.1f} {ratio:>7.3f}", flush=True)
        base.close()
        adapter.close()
    print(f"worst ratio {worst:.3f} (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
