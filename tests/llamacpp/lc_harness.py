"""Test harness for the llama.cpp engine: plays the coordinator's side of the rings and plans.

``Coordinator`` holds the three rings (``ring_rig.RingRig``: memfd segments, formatted), hands
their ``RingMapping``s to the engine, writes prompts into the prompt ring and reads emitted tokens
and logits rows back. It also numbers plans. ``bare_greedy`` is a plain llama.cpp batched loop
written against the low-level API, the reference the engine's greedy output must equal token for
token.
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp as L
import numpy as np
from ring_rig import RingRig, geometry

from basertd.schema.abi import Sampling, SamplingFlag
from basertd.schema.tick import (
    LaneAdmit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    RingRef,
    SamplingParams,
    TickEvents,
    TickPlan,
    TokenRef,
)


class Coordinator:
    """The coordinator's half of one engine's rings, plus a plan_seq counter."""

    def __init__(
        self,
        engine,
        *,
        prompt_slots: int = 512,
        prompt_slot_tokens: int = 64,
        emit_slots: int = 4096,
        emit_slot_tokens: int = 16,
        logits_slots: int = 4,
        with_logits: bool = True,
    ) -> None:
        self.engine = engine
        self.rig = RingRig(
            geometry(
                prompt_slots=prompt_slots,
                prompt_slot_tokens=prompt_slot_tokens,
                emit_slots=emit_slots,
                emit_slot_tokens=emit_slot_tokens,
                logits_slots=logits_slots,
                vocab=engine.info().vocab_size if with_logits else None,
            )
        )
        self.prompts, self.emits, self.rows = self.rig.prompt, self.rig.emit, self.rig.logits
        self.mappings = self.rig.mappings()
        try:
            engine.attach_rings(self.mappings)
        except BaseException:
            self.rig.close()
            raise
        self.plan_seq = 0

    def prompt(self, tokens: Sequence[int] | np.ndarray) -> TokenRef:
        """Write a prompt into the prompt ring."""
        return self.prompts.write(np.asarray(tokens, dtype=np.uint32))

    def read(self, ref: TokenRef) -> list[int]:
        """Tokens an emit names."""
        return self.emits.read(ref).tolist()

    def row(self, ref: RingRef) -> np.ndarray:
        """A HOST lane's logits row."""
        return self.rows.read_row(ref)

    def plan(self, **kw) -> TickPlan:
        """A plan with the next plan_seq, an ample prefill budget and every lane allowed to decode."""
        self.plan_seq += 1
        kw.setdefault("prefill_token_budget", 1 << 20)
        kw.setdefault("max_decode_lanes", self.engine.info().max_lanes)
        return TickPlan(plan_seq=self.plan_seq, **kw)

    def tick(self, on_partial_emit=None, **kw) -> TickEvents:
        """Build a plan from ``kw`` and run it."""
        return self.engine.tick(self.plan(**kw), on_partial_emit)

    def emitted(self, ev: TickEvents, tag: int) -> list[int]:
        """The tokens lane ``tag`` emitted in one tick."""
        return [t for e in ev.emits if e.lane_tag == tag and e.n_tokens for t in self.read(e.token_ref)]

    def tokens_of(self, ev: TickEvents) -> dict[int, list[int]]:
        """Emitted tokens per lane of one tick."""
        return {e.lane_tag: self.read(e.token_ref) for e in ev.emits if e.n_tokens}

    def close(self) -> None:
        """Close rings and segments."""
        self.rig.close()


def make_prompt(i: int, n: int, vocab: int = 293) -> list[int]:
    """A deterministic prompt of ``n`` tokens: BOS 1 then ordinary ids (3..vocab-1) from ``i``."""
    rng = np.random.default_rng(1000 + i)
    return [1, *rng.integers(3, vocab, n - 1).tolist()]


def admit(tag, ref, **kw) -> LaneAdmit:
    """A LaneAdmit with keyword overrides."""
    return LaneAdmit(lane_tag=tag, prompt=ref, **kw)


def host_row(coord, tag, prompt, skip=0, seed=0) -> np.ndarray:
    """The logits row after ``prompt`` from a HOST lane (tag ``tag``) seeded with ``seed`` covering
    its first ``skip`` tokens, prefilled from there; the lane is retired afterwards."""
    coord.tick(admits=[admit(tag, coord.prompt(prompt), sampling=Sampling.HOST, seed_handle=seed)])
    ev = coord.tick(
        prefills=[LanePrefill(lane_tag=tag, token_offset=skip, token_count=len(prompt) - skip)],
        decodes=[LaneDecode(lane_tag=tag)],
    )
    row = coord.row(ev.emits[0].logits_row).copy()
    coord.tick(retires=[LaneRetire(lane_tag=tag)])
    return row


def ignore_eos(**kw) -> SamplingParams:
    """Sampling params with IGNORE_EOS set (keyword overrides for the rest)."""
    return SamplingParams(flags=SamplingFlag.IGNORE_EOS, **kw)


def generate(
    coord: Coordinator,
    prompts: dict[int, list[int]],
    n_new: int,
    *,
    per_tick: int = 1,
    retire: bool = True,
    admit_kw: dict | None = None,
    publish: bool = False,
) -> dict[int, list[int]]:
    """Admit every prompt with a full prefill in one tick, then decode ``per_tick`` tokens per tick
    until each lane has ``n_new`` tokens or finished; returns the emitted tokens per lane."""
    admit_kw = admit_kw or {}
    out: dict[int, list[int]] = {t: [] for t in prompts}
    admits = [admit(t, coord.prompt(p), **admit_kw.get(t, {})) for t, p in prompts.items()]
    prefills = [LanePrefill(lane_tag=t, token_offset=0, token_count=len(p)) for t, p in prompts.items()]
    live = set(prompts)
    first = True
    while live:
        decodes = [
            LaneDecode(lane_tag=t, max_new_tokens=min(per_tick, n_new - len(out[t])))
            for t in prompts
            if t in live
        ]
        ev = coord.tick(admits=admits if first else [], prefills=prefills if first else [], decodes=decodes)
        first = False
        for e in ev.emits:
            if e.n_tokens:
                out[e.lane_tag] += coord.read(e.token_ref)
            if e.finish or len(out[e.lane_tag]) >= n_new:
                live.discard(e.lane_tag)
    if retire:
        coord.tick(retires=[LaneRetire(lane_tag=t, publish_to_cache=int(publish)) for t in prompts])
    return out


class BareLlama:
    """A plain llama.cpp context driven with the low-level API: the reference loop."""

    def __init__(self, model_path, params: dict) -> None:
        self.model = L.llama_model_load_from_file(str(model_path).encode(), L.llama_model_default_params())
        cp = L.llama_context_default_params()
        for k, v in params.items():
            setattr(cp, k, v)
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.batch = L.llama_batch_init(max(params["n_batch"], 64), 0, 1)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Decode rows of (token, pos, seq, want_logits) in one llama_decode; returns the logits
        rows (copies) of the rows that asked for them, in order."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if want else 0
        b.n_tokens = len(rows)
        rc = L.llama_decode(self.ctx, b)
        assert rc == 0, rc
        out = []
        for i, (_, _, _, want) in enumerate(rows):
            if want:
                out.append(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), (self.n_vocab,)).copy())
        return out

    def greedy(self, prompts: list[list[int]], n_new: int) -> tuple[list[list[int]], list[list[float]]]:
        """Prefill every prompt in one batch (lane i = sequence i, prompts in order), then decode
        one token per lane per batch, lanes in order: the batch composition of the engine's
        admit-prefill-decode tick followed by one-token decode ticks. Returns each lane's tokens
        and the top-2 logit margin at every position."""
        rows = []
        for s, p in enumerate(prompts):
            rows += [(t, i, s, i == len(p) - 1) for i, t in enumerate(p)]
        logits = self.decode(rows)
        toks = [[] for _ in prompts]
        margins = [[] for _ in prompts]
        for step in range(n_new):
            for s, lg in enumerate(logits):
                top2 = np.partition(lg, -2)[-2:]
                margins[s].append(float(top2[1] - top2[0]))
                toks[s].append(int(np.argmax(lg)))
            if step == n_new - 1:
                break
            logits = self.decode([(toks[s][-1], len(p) + step, s, True) for s, p in enumerate(prompts)])
        return toks, margins

    def close(self) -> None:
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def first_divergence(tokens: list[int], ref: list[int], ref_margins: list[float], tol: float) -> int | None:
    """Where ``tokens`` first differs from ``ref`` (None when equal over the common length),
    asserting the reference's top-2 logit margin there is below ``tol``: a different batch
    composition or chunking may flip a near-tie, never a clear choice."""
    for i, (a, b) in enumerate(zip(tokens, ref, strict=False)):
        if a != b:
            assert ref_margins[i] < tol, f"diverged at {i} where the reference margin is {ref_margins[i]:.4f}"
            return i
    return None
