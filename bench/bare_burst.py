"""The bare engine's baselines for bench_serving.py: the llama.cpp engine driven directly over Link
W on its own worker (no coordinator), running a burst of prompts the plain way a serving loop
would: prefill in ``batch``-token ticks (prompts in order, each lane admitted in the tick its
prefill starts), every lane whose prefill is done decoding in the same ticks (grants of ``grant``
tokens), then decode-only ticks until every lane has ``max_tokens`` tokens. Greedy, EOS ignored.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np

from basertd.schema.abi import Sampling, SamplingFlag
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, SamplingParams, TickPlan
from basertd.server.workers.process import WorkerSpec
from basertd.server.workers.sync_worker import SyncWorker


class BareBurst:
    """One llama.cpp worker with ``lanes`` lanes of ``context`` tokens; ``close()`` stops it."""

    def __init__(self, model: str, threads: int, lanes: int = 8, context: int = 2048) -> None:
        self.rundir = tempfile.mkdtemp(prefix="brt-bare-", dir="/tmp")
        self.worker = SyncWorker(
            WorkerSpec(
                engine="llamacpp",
                model=model,
                lanes=lanes,
                context_length=context,
                threads=threads,
                runtime_dir=self.rundir,
            )
        )
        self.seq = 0
        self.tag = 0

    def _tick(self, **kw) -> object:
        self.seq += 1
        return self.worker.tick(TickPlan(plan_seq=self.seq, **kw))

    def burst(self, prompts: list[list[int]], max_tokens: int, batch: int = 2048, grant: int = 8) -> dict:
        """Run ``prompts`` (token ids) as one burst. Returns seconds from the first tick: ``wall``
        (every lane done), ``prefill_done`` (the last prompt prefilled), ``ttft`` (per prompt), and
        ``decode_tps``: tokens per second of the decode-only ticks (every lane decoding)."""
        proc = self.worker.proc
        greedy = SamplingParams(flags=int(SamplingFlag.IGNORE_EOS))
        tags = []
        for _ in prompts:
            self.tag += 1
            tags.append(self.tag)
        fed = [0] * len(prompts)
        admitted = [False] * len(prompts)
        got = [0] * len(prompts)
        ttft: list[float | None] = [None] * len(prompts)
        prefill_done = 0.0
        dec_tokens, dec_s = 0, 0.0
        t0 = time.perf_counter()
        while any(g < max_tokens for g in got):
            budget = batch
            admits, prefills = [], []
            for i, p in enumerate(prompts):
                need = len(p) - fed[i]
                if need <= 0 or budget <= 0:
                    continue
                if not admitted[i]:
                    ref = proc.prompt_ring.write(np.asarray(p, dtype=np.uint32))
                    admits.append(
                        LaneAdmit(
                            lane_tag=tags[i], prompt=ref, sampling=int(Sampling.GPU_GREEDY), params=greedy
                        )
                    )
                    admitted[i] = True
                n = min(need, budget)
                prefills.append(LanePrefill(lane_tag=tags[i], token_offset=fed[i], token_count=n))
                fed[i] += n
                budget -= n
            decodes = [
                LaneDecode(lane_tag=tags[i], max_new_tokens=min(grant, max_tokens - got[i]))
                for i, p in enumerate(prompts)
                if fed[i] >= len(p) and got[i] < max_tokens
            ]
            t = time.perf_counter()
            ev = self._tick(
                prefill_token_budget=sum(x.token_count for x in prefills),
                max_decode_lanes=max(1, len(decodes)),
                admits=admits,
                prefills=prefills,
                decodes=decodes,
            )
            now = time.perf_counter()
            n_tok = 0
            for e in ev.emits:
                i = tags.index(e.lane_tag)
                got[i] += e.n_tokens
                n_tok += e.n_tokens
                if e.n_tokens and ttft[i] is None:
                    ttft[i] = now - t0
            if prefills:
                prefill_done = now - t0
            elif len(decodes) == len(prompts):
                dec_tokens += n_tok
                dec_s += now - t
        wall = time.perf_counter() - t0
        self._tick(retires=[LaneRetire(lane_tag=t) for t in tags])
        return {
            "wall": wall,
            "prefill_done": prefill_done,
            "ttft": ttft,
            "decode_tps": dec_tokens / dec_s if dec_s else float("nan"),
        }

    def lone_ttft(self, prompt: list[int]) -> float:
        """Seconds for one tick that admits ``prompt``, prefills it whole and draws its first token."""
        return self.burst([prompt], max_tokens=1, batch=max(2048, len(prompt)))["ttft"][0] or float("nan")

    def close(self) -> None:
        self.worker.close()
        shutil.rmtree(self.rundir, ignore_errors=True)
