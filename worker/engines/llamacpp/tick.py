"""``Tick``: one llama.cpp tick's working state and its lane work (ABI section E, rule 53).

A ``Tick`` is made per accepted plan over the engine's long-lived ``TickParts``. It holds what the
tick accumulates (grants left, tokens and logits rows per lane, finishes, faults, timings, the
yield bookkeeping ``rounds`` reads) and does the lane work around the decode rounds: retires and
commits before them (the admits, between the two, are ``admit``'s), each decode unit (``units``:
rules 67, 72) inside them, the emit records after them. Faults stop one lane and the tick goes on
(rules 60-62).

Semantics this engine fixes where the ABI leaves a choice:

- A lane stops with EOS on any end-of-generation token unless IGNORE_EOS (rule 68), with LENGTH when
  it holds ``context_length`` tokens; retiring a lane that has not stopped emits CANCELLED; a lane
  fault emits ERROR with a fault record (rules 60-62).
- HOST commits are not echoed in emits: a HOST lane's emits carry n_tokens 0 and the logits row
  (rule 65); a committed end-of-generation token finishes the lane with an EOS emit.
- A lane's sequence holds the KV of every committed token but the last sampled one (computed by the
  next decode); forks of a lane carry that token as pending, so lengths agree with the reference
  engine's committed count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from basertd.schema.abi import FaultCode, Finish, TickStatus
from basertd.schema.tick import (
    LaneEmit,
    LaneFault,
    LaneLogprob,
    RingRef,
    SpecStats,
    TickEvents,
    TokenRef,
)
from basertd.shm import RingError
from basertd.worker.engines.base import PartialEmit
from basertd.worker.engines.llamacpp import sampling
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.grammar import GrammarSet
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.rings import EngineRings
from basertd.worker.engines.llamacpp.seeds import Seeds
from basertd.worker.engines.llamacpp.work import TickWork


@dataclass(eq=False)
class TickParts:
    """The engine's long-lived parts a tick works on: the live lanes by tag, tags faulted and not
    yet retired, KV cells, seeds, rings, grammars, logit biases by handle, the counters, the
    model's end-of-generation mask (bool per token id), ``context_length`` tokens per lane and
    ``new_handle`` (sequence handles)."""

    lanes: dict[int, Lane]
    faulted: set[int]
    cells: Cells
    seeds: Seeds
    rings: EngineRings
    grammars: GrammarSet
    logit_biases: dict[int, tuple[np.ndarray, np.ndarray]]
    stats: dict[str, int]
    eog_mask: np.ndarray
    context_length: int
    new_handle: Callable[[], int]


class Tick:
    """One tick in flight: its events ``ev`` and the per-lane state the rounds fill."""

    def __init__(self, parts: TickParts, ev: TickEvents, on_partial_emit: PartialEmit | None) -> None:
        self.parts = parts
        self.lanes = parts.lanes
        self.stats = parts.stats
        self.grammars = parts.grammars
        self.rings = parts.rings
        self.eog_mask = parts.eog_mask
        self.context_length = parts.context_length
        self.ev = ev
        self.on_partial = on_partial_emit
        self.on_partial_spec = getattr(on_partial_emit, "spec", None)  # ``base.PartialEmit``
        self.grant: dict[int, int] = {}
        self.start_tokens: dict[int, int] = {}
        self.rows: dict[int, RingRef] = {}
        self.finish: dict[int, int] = {}
        self.emit_order: list[int] = []
        self.fresh: dict[int, list[int]] = {}
        self.fault_lanes: dict[int, Lane] = {}
        self.prefill_ns = 0
        self.decode_ns = 0
        self.floor: dict[int, int] = {}  # lane tag -> prefilled before this tick's chunk
        self.min_rows = 0  # rows of the batch in flight that a yield may not cut
        self.steps = 0  # llama_decode calls so far
        self.yielded = False
        self.replaying = False  # a decoding lane of the round in flight is in its replay tail
        self.clear_at_start = True  # the yield word was clear when the tick began
        self.overshoot: dict[int, int] = {}  # lane tag -> tokens a round may still commit past its grant
        self.spec: dict[int, tuple[int, int]] = {}  # lane tag -> (drafted, accepted) this tick
        self._noted: set[int] = set()

    def note(self, tag: int) -> None:
        """Give ``tag`` an emit record this tick (once, in first-noted order)."""
        if tag not in self._noted:
            self._noted.add(tag)
            self.emit_order.append(tag)

    def note_spec(self, tag: int, drafted: int, accepted: int) -> None:
        """Count one verified speculative round of ``tag`` in its emit's SpecStats."""
        d, a = self.spec.get(tag, (0, 0))
        self.spec[tag] = (d + drafted, a + accepted)
        self.stats["spec_rounds_total"] += 1
        self.stats["spec_drafted_total"] += drafted
        self.stats["spec_accepted_total"] += accepted

    def fault(self, lane: Lane, code: int, detail: int) -> None:
        """Stop one lane with a typed fault, its KV released; the tick goes on (ABI rules 60-62)."""
        self.lanes.pop(lane.tag, None)
        self.parts.faulted.add(lane.tag)
        self.parts.cells.free_seq(lane.seq)
        self.grant[lane.tag] = 0
        self.note(lane.tag)
        self.finish[lane.tag] = Finish.ERROR
        self.ev.faults.append(LaneFault(lane_tag=lane.tag, code=code, detail=detail))
        self.stats["faults_total"] += 1
        self.start_tokens.setdefault(lane.tag, lane.n_tokens)
        self.fault_lanes[lane.tag] = lane

    # ------------------------------------------------------------------ before the rounds

    def retire(self, work: TickWork) -> None:
        """The plan's retires: CANCELLED for a lane that had not stopped; its sequence published
        (rules 90, 91) or freed."""
        p = self.parts
        for tag, publish in work.retires:
            if tag in p.faulted:
                p.faulted.discard(tag)
                continue
            lane = self.lanes.pop(tag)
            if not lane.finished:
                self.note(tag)
                self.finish[tag] = Finish.CANCELLED
            lane.held_row = None
            if publish:
                p.seeds.publish(
                    lane.seq,
                    lane.tokens,
                    lane.kv_len,
                    lane.taint,
                    work.plan.shed_policy,
                    self.ev.shed,
                    prompt_end=lane.prefill_end,
                )
            else:
                p.cells.free_seq(lane.seq)

    def commit(self, work: TickWork) -> None:
        """HOST lanes' committed tokens (rules 39-42), finishing a lane on EOS, grammar or LENGTH."""
        for tag, token in work.commits:
            lane = self.lanes.get(tag)
            if lane is None:
                continue  # faulted by a test hook this tick
            lane.pending_nonce = 0
            lane.append(token)
            self.stats["decode_tokens_total"] += 1
            g_finish = self.grammar_consume(lane, token)
            if g_finish < 0:
                continue
            if self.eog_mask[token] and not lane.cfg.ignore_eos:
                lane.finish = Finish.EOS
            elif g_finish == Finish.GRAMMAR:
                lane.finish = Finish.GRAMMAR
            elif lane.n_tokens >= self.context_length:
                lane.finish = Finish.LENGTH
            if lane.finished:
                self.note(tag)
                self.finish[tag] = lane.finish

    # ------------------------------------------------------------------ decode units

    def units(self, lanes: list[Lane], rows: np.ndarray | None) -> None:
        """One decode unit for each of ``lanes`` (ABI rules 67, 72), lane i taking logits row
        ``rows[i]`` of the 2-D float32 array ``rows`` (n_lanes, vocab), or no row (None: replayed
        tokens). Token selection is one ``sampling.select_batch`` call over every sampling lane."""
        pend: list[int] = []
        heads: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # lane index -> (its row, masked row)
        for i, lane in enumerate(lanes):
            own = None if rows is None else rows[i]
            head = self.unit_head(lane, own)
            if head is not None:
                pend.append(i)
                heads[i] = (own, head)
        if not pend:
            return
        assert rows is not None
        adjusted: dict[int, np.ndarray] = {}
        for j, i in enumerate(pend):
            lane = lanes[i]
            own, row = heads[i]  # the logits row, and the same masked by the lane's grammar
            r = sampling.adjusted_row(row, lane.cfg, lane.tokens[: lane.n_tokens], lane.prefill_end)
            if r is not own:
                adjusted[j] = r
        if not adjusted and pend == list(range(rows.shape[0])):
            mat = rows  # every row as llama.cpp wrote it: no copy
        else:
            mat = rows[pend]
            for j, r in adjusted.items():
                mat[j] = r
        cfgs = [lanes[i].cfg for i in pend]
        samplers = [lanes[i] for i in pend]
        us = [sampling.draw(ln.rng_base + ln.generated) if ln.cfg.sampled else 0.0 for ln in samplers]
        toks = sampling.select_batch(mat, cfgs, us)
        for j, i in enumerate(pend):
            self.unit_tail(lanes[i], mat[j], int(toks[j]))

    def unit_head(self, lane: Lane, row: np.ndarray | None) -> np.ndarray | None:
        """The part of a decode unit before sampling: a replayed token, a full context, the
        lane's grammar mask, or a HOST lane's row to the logits ring. Returns the row the lane
        samples its token from (masked by its grammar), or None when it samples nothing."""
        tag = lane.tag
        self.grant[tag] -= 1
        if lane.produced < lane.n_tokens:  # a replayed token: its forward is done, no emit
            lane.produced += 1
            self.stats["replay_tokens_total"] += 1
            return None
        if lane.n_tokens >= self.context_length:  # a prompt of the full context: nothing fits
            lane.finish = Finish.LENGTH
            self.grant[tag] = 0
            self.finish[tag] = lane.finish
            return None
        cfg = lane.cfg
        if lane.grammar is not None:
            row = self.grammars.mask_row(lane.grammar, row)
            if row is None:  # the grammar allows no token
                self.fault(lane, FaultCode.GRAMMAR_OVERFLOW, 0)
                return None
        if lane.is_host:
            try:
                ref = self.rings.write_row(sampling.adjusted_row(row, cfg, lane.tokens[:0], 0))
            except RingError:
                self.fault(lane, FaultCode.REF_SPAN_OOB, 0)
                return None
            lane.pending_nonce = ref.generation
            self.rows[tag] = ref
            return None
        return row

    def unit_tail(self, lane: Lane, r: np.ndarray, tok: int) -> None:
        """The part of a decode unit after sampling ``tok`` from the adjusted row ``r``: logprobs,
        commit, partial-emit bookkeeping, finish."""
        tag = lane.tag
        cfg = lane.cfg
        if cfg.n_logprobs >= 0:
            lp, ids, lps = sampling.logprobs(r, tok, cfg.n_logprobs)
            self.ev.logprobs.append(
                LaneLogprob(
                    lane_tag=tag, logprob=lp, n_top=len(ids), top_ids=ids.tolist(), top_logprobs=lps.tolist()
                )
            )
        lane.append(tok)
        self.stats["decode_tokens_total"] += 1
        fresh = self.fresh.get(tag)
        if fresh is None:
            self.fresh[tag] = [tok]
        else:
            fresh.append(tok)
        g_finish = self.grammar_consume(lane, tok)
        if g_finish < 0:
            return
        if self.eog_mask[tok] and not cfg.ignore_eos:
            lane.finish = Finish.EOS
        elif g_finish == Finish.GRAMMAR:
            lane.finish = Finish.GRAMMAR
        elif lane.n_tokens >= self.context_length:
            lane.finish = Finish.LENGTH
        if lane.finished:
            self.grant[tag] = 0
            self.finish[tag] = lane.finish

    def grammar_consume(self, lane: Lane, token: int) -> int:
        """Feed a committed token to the lane's matcher: Finish.NONE, Finish.GRAMMAR (complete),
        or -1 after faulting the lane with GRAMMAR_OVERFLOW (the grammar refused the token)."""
        if lane.grammar is None:
            return Finish.NONE
        res = self.grammars.consume(lane.grammar, token)
        if res < 0:
            self.fault(lane, FaultCode.GRAMMAR_OVERFLOW, token)
        return res

    # ------------------------------------------------------------------ after the rounds

    def _spec_stats(self, tag: int, lane: Lane | None) -> SpecStats:
        """The emit's SpecStats: tokens drafted and accepted this tick, the lane's certificate."""
        drafted, accepted = self.spec.get(tag, (0, 0))
        cert = lane.spec.cert_id if lane is not None and lane.spec is not None else 0
        return SpecStats(proposed=drafted, accepted=accepted, cert_id_in_effect=cert)

    def finish_events(self, work: TickWork) -> None:
        """One emit per noted lane (its new tokens in the emit ring, its logits row), the plan's
        shed entries first among the shed report's, and the tick status."""
        ev = self.ev
        for tag in self.emit_order:
            lane = self.lanes.get(tag) or self.fault_lanes.get(tag)
            start = self.start_tokens.get(tag)
            ref = TokenRef()
            n = 0
            if lane is not None and start is not None and lane.n_tokens > start:
                toks = lane.tokens[start : lane.n_tokens].astype(np.uint32)
                try:
                    ref = self.rings.write_tokens(toks)
                    n = int(toks.shape[0])
                except RingError:
                    if tag in self.lanes:
                        self.fault(lane, FaultCode.REF_SPAN_OOB, int(toks.shape[0]))
                    else:
                        ev.faults.append(LaneFault(lane_tag=tag, code=FaultCode.REF_SPAN_OOB))
                    self.finish[tag] = Finish.ERROR
            ev.emits.append(
                LaneEmit(
                    lane_tag=tag,
                    token_ref=ref,
                    n_tokens=n,
                    finish=self.finish.get(tag, Finish.NONE),
                    logits_row=self.rows.get(tag, RingRef()),
                    spec=self._spec_stats(tag, lane),
                )
            )
        ev.shed.prefill_chunks_dropped += work.chunks_dropped
        ev.shed.entries[:0] = work.shed
        if ev.faults:
            ev.tick_status = TickStatus.LANE_ERRORS
        elif ev.shed.entries:
            ev.tick_status = TickStatus.SHED
