"""Speculation on the llama.cpp engine: prompt-lookup drafts (or a draft model's, below), their
place in a round, their verification, greedy or sampled (tick ABI §2; ``LaneDecode.overshoot``;
``SpecStats`` in a lane's emit).

A lane admitted on a certified prompt-lookup slot (``strategies``) carries a ``LaneSpec``. In a
round where it forwards its pending token at position ``k``, ``Speculator.plan`` may give it ``m``
draft tokens: the continuation of the most recent earlier occurrence of its last n-gram in its own
tokens (prompt and output, ``lookup``). The round's batch then holds ``k+1`` positions for that
sequence, ``tokens[k], d_1 .. d_m`` at ``k .. k+m``, each with logits (``rounds``). ``verify``
takes the rows in order: row ``i`` gives the token ``t_i`` exactly as a plain decode unit would
(logit bias and penalties over the history including ``t_0 .. t_{i-1}``, then ``sampling.select``
with the lane's own uniform ``u = draw(rng_counter_base + p)`` for stream position ``p``, ABI rules
67, 73), commits it, and goes on only while ``t_i == d_{i+1}``; so a round commits the accepted
drafts plus one bonus token. The KV of rejected drafts is removed at once (``Cells.truncate``:
``llama_memory_seq_rm`` and the ledger together), leaving the lane's usual shape: KV of every
committed token but the last.

Greedy lanes: the chain is the argmax chain a non-speculative greedy run takes (up to near-ties that
the batch shape may flip, the margin rule of the engine's tests). Sampled lanes (temperature > 0):
this is the standard speculative rejection rule for a deterministic drafter. A prompt-lookup draft
``d`` has the one-hot proposal ``q = [d]``, so the rule accepts ``d`` with probability
``min(1, p(d) / q(d)) = p(d)``, ``p`` the lane's sampling distribution at that row (after bias,
penalties, top-k, top-p, min-p and temperature, exactly as ``sampling.select`` builds it); on a
rejection it draws from ``p`` with ``d`` removed and renormalised and stops; after ``m`` accepted
drafts the bonus token is drawn from the last row's ``p``. Acceptance and the draw on rejection use
one uniform: the inverse-CDF token of ``u`` is ``d`` on an interval of ``u`` of length ``p(d)``
(accept), and off it ``u`` is uniform on the rest, whose inverse-CDF token has law ``p`` without
``d``, renormalised. So each committed token has, given its history, the law a plain decode unit
gives it (``DISTRIBUTION_EXACT``), and a lane's tokens are a function of its seed and rows alone, as
a plain lane's are: with the same rows, speculation on and off commit the same tokens for the same
RNG seed (the rows themselves differ in the last bits across batch shapes, the exactness note of
the README).

Bounds on ``m`` per round: the lane's adaptive draft length (``LaneSpec``); the grant left minus
one plus the decode's unused ``overshoot`` (ABI: tokens a round may commit past max_new_tokens; a
round that would pass the grant only drafts into cells nobody else was promised this tick); the
lane's context; and the batch: every decode row of a round sits in the round's first
``llama_decode`` part, so a yield or abort takes a speculative run whole or not at all. A round
with more than ``max_batch_lanes`` decoding lanes drafts nothing.

Whether a lane's drafts pay (``LaneSpec.note``, ``pays``): at the lane's estimated conditional
acceptance some draft length must commit more tokens per plain decode step than no draft, where a
round verifying ``m`` drafts costs ``base + per_draft * m`` plain steps as this engine measures
them (``verify_cost.VerifyCost``: its own decode-only ``llama_decode`` calls timed; the CPU
defaults ``VERIFY_BASE`` / ``VERIFY_PER_DRAFT`` until enough are). A lane whose drafts do not pay
pauses for ``PAUSE_ROUNDS`` rounds, then drafts again: the same drafts may pay on a GPU, where
a draft row costs a fraction of what it costs on a CPU (``verify_cost``), and not on a CPU.

Speculation is off (the lane decodes plainly) on lanes the certificates do not cover or this
engine does not verify: HOST lanes, grammar lanes, lanes in their replay tail (ABI rule 72: replay
units keep their one-token shape), and on a sliding-window model whose window cache is pruned
(``swa_full`` False: a draft written past the window could prune keys the next position needs).

Lanes on a draft-model certificate (``Speculator.sources``, greedy or sampled) take their ``m``
drafts, within the same bounds, from a smaller model's greedy decodes instead of lookup
(``draft_model``); the verification is the same. Those drafts are deterministic too (the draft
model's argmax chain given the lane's committed tokens, computed before the round's uniforms are
drawn and never from them), so the rejection rule above holds for sampled draft-model lanes as it
does for prompt lookup.

Strategy faults: a draft this engine cannot verify (a token id outside ``0 .. n_vocab - 1``, a
proposal that is not one row of integers) is a ``StrategyFault`` (``FaultCode.STRATEGY``). The
round discards that draft, the lane's speculation is turned off for the rest of its life (its
``LaneSpec`` dropped, so its emits carry ``cert_id_in_effect`` 0 from that tick on) and the engine
counts it (``spec_faults_total``); the lane itself goes on decoding plainly, its tokens those of a
lane that never drafted. The fault is not a ``LaneFault`` record of the tick's events: that record
stops the lane (ABI rules 60-62) and the coordinator ends its request, while a drafter's mistake
costs the lane nothing but its drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from basertd.schema.abi import FaultCode
from basertd.worker.engines.llamacpp import sampling
from basertd.worker.engines.llamacpp.verify_cost import DEFAULT_COST, Cost, VerifyCost
from basertd.worker.engines.lookup import LookupConfig

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from basertd.worker.engines.draft import DraftConfig
    from basertd.worker.engines.llamacpp.cells import Cells
    from basertd.worker.engines.llamacpp.draft_model import DraftModel
    from basertd.worker.engines.llamacpp.lane import Lane
    from basertd.worker.engines.llamacpp.tick import Tick

_EMPTY = np.zeros(0, np.int32)
_U64 = (1 << 64) - 1
_DECAY = 0.8  # weight of the acceptance window's past per drafting round
_WINDOW_MIN = 8.0  # drafted tokens in the window before a pause is considered
PAUSE_ROUNDS = 32
"""Rounds a lane drafts nothing after its drafts stopped paying (``LaneSpec.note``)."""
_PRIOR_ACCEPT = 0.75  # conditional acceptance assumed before a lane has verified anything
_PRIOR_WEIGHT = 2.0  # ... worth this many drafts
_RISK_DECAY = 0.9  # weight of the conditional-acceptance estimate's past per drafting round


def pays(accept: float, hi: int, cost: Cost = DEFAULT_COST) -> bool:
    """Whether some draft length ``m`` in ``1 .. hi`` gives more expected tokens per decode step
    than no draft, when each draft is accepted with probability ``accept`` given the ones before
    it: a round commits ``1 + accept + .. + accept**m`` tokens on average and costs
    ``cost.round(m)`` plain steps (``verify_cost``: the engine's measured cost, or the default
    ``VERIFY_BASE + VERIFY_PER_DRAFT * m``), a plain round 1 token for 1 step."""
    tokens, p = 1.0, 1.0
    for m in range(1, hi + 1):
        p *= accept
        tokens += p
        if tokens > cost.round(m):
            return True
    return False


def lookup(tokens: np.ndarray, n: int, k: int, ngram_min: int, ngram_max: int) -> np.ndarray:
    """Up to ``k`` tokens (int32) that followed the most recent earlier occurrence of the longest
    suffix of ``tokens[:n]`` of ``ngram_max`` .. ``ngram_min`` tokens; empty when none occurs.
    The continuation is taken from ``tokens[:n]`` only (it may run up to position ``n - 1``)."""
    if k <= 0 or n < 2:
        return _EMPTY
    hist = tokens[:n]
    for g in range(min(ngram_max, n - 1), ngram_min - 1, -1):
        key = hist[n - g :]
        cand = np.flatnonzero(hist[: n - g] == key[0])  # starts i with i + g <= n - 1
        for j in range(1, g):
            if not cand.size:
                break
            cand = cand[hist[cand + j] == key[j]]
        if cand.size:
            start = int(cand[-1]) + g
            return hist[start : min(n, start + k)].astype(np.int32)
    return _EMPTY


class StrategyFault(Exception):
    """A draft the engine refuses to verify (module docstring): ``code`` is ``FaultCode.STRATEGY``,
    ``detail`` the first offending token id as u64 (0 when the proposal is not a row of ids)."""

    code = FaultCode.STRATEGY

    def __init__(self, detail: int, why: str) -> None:
        super().__init__(why)
        self.detail = detail & _U64


def checked_drafts(drafts: object, n_vocab: int) -> np.ndarray:
    """``drafts`` as int32 token ids, each in ``0 .. n_vocab - 1``; StrategyFault for anything
    else (a non-integer or multi-dimensional proposal, an id out of the vocabulary). The bounds are
    checked before the cast, so an int64 id past int32 cannot wrap into the vocabulary."""
    a = np.asarray(drafts)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise StrategyFault(0, f"a draft must be one row of token ids, got {a.dtype} of shape {a.shape}")
    if not a.size:
        return _EMPTY
    bad = np.flatnonzero((a < 0) | (a >= n_vocab))
    if bad.size:
        tok = int(a[bad[0]])
        raise StrategyFault(tok, f"draft token {tok} at {int(bad[0])} is outside the vocabulary of {n_vocab}")
    return a.astype(np.int32)


@dataclass(eq=False)
class LaneSpec:
    """One lane's speculation state: its config and certificate, the draft length ``k`` it asks
    for now (``draft_min`` .. ``draft_max``), a pause (rounds left without drafting), a decaying
    window of drafted / accepted tokens (the ``min_accept_permille`` rule) and a decaying estimate
    of the conditional acceptance (accepted drafts over the drafts at risk: the accepted ones and
    each round's first rejected one; ``pays``); ``proposed`` / ``accepted`` count the lane's whole
    life."""

    cfg: LookupConfig | DraftConfig
    cert_id: int
    k: int = 0
    pause: int = 0
    win_drafted: float = 0.0
    win_accepted: float = 0.0
    risk_accepted: float = 0.0
    risk_seen: float = 0.0
    proposed: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        if not self.k:
            self.k = self.cfg.draft_max

    def acceptance(self) -> float:
        """The conditional acceptance estimate, with a prior of ``_PRIOR_ACCEPT``."""
        return (self.risk_accepted + _PRIOR_ACCEPT * _PRIOR_WEIGHT) / (self.risk_seen + _PRIOR_WEIGHT)

    def note(self, drafted: int, accepted: int, cost: Cost = DEFAULT_COST) -> None:
        """After a verified round: adapt ``k`` (full acceptance doubles it, else it becomes the
        accepted run plus one) and pause the lane for ``PAUSE_ROUNDS`` when its drafts do not pay:
        its recent share of accepted drafts is below ``min_accept_permille``, or at its estimated
        conditional acceptance no draft length beats a plain step at ``cost`` (``pays``; the
        engine passes its measured ``VerifyCost.current()``). A ``min_accept_permille`` of 0
        never pauses. A pause forgets the estimates."""
        c = self.cfg
        self.proposed += drafted
        self.accepted += accepted
        self.k = min(c.draft_max, 2 * self.k) if accepted == drafted else max(c.draft_min, accepted + 1)
        self.win_drafted = self.win_drafted * _DECAY + drafted
        self.win_accepted = self.win_accepted * _DECAY + accepted
        self.risk_seen = self.risk_seen * _RISK_DECAY + accepted + (accepted < drafted)
        self.risk_accepted = self.risk_accepted * _RISK_DECAY + accepted
        if not c.min_accept_permille:
            return
        low = (
            self.win_drafted >= _WINDOW_MIN
            and self.win_accepted * 1000 < c.min_accept_permille * self.win_drafted
        )
        if low or not pays(self.acceptance(), c.draft_max, cost):
            self.pause = PAUSE_ROUNDS
            self.k = c.draft_min
            self.win_drafted = self.win_accepted = self.risk_seen = self.risk_accepted = 0.0


class Speculator:
    """Draft planning and verification for one engine (module docstring); ``n_vocab`` is the
    model's vocabulary size, the bound of a draft's ids. ``override``, None in production, lets a
    test supply the drafts: ``override(lane, k) -> array of token ids`` (checked like any draft).
    ``sources`` maps a certificate id to the draft model drafting for its lanes (``draft_model``;
    a slot's greedy and sampled certificates map to the same one, whose lanes are drafted in one
    batch; the lanes of other certificates draft by prompt lookup): the same bounds on ``m``, drafts
    batched over the round's lanes after the bounds are set. ``cost`` measures what verification
    costs on this engine (``verify_cost``; ``rounds`` notes each decode-only ``llama_decode``): the
    cost ``verify`` judges each lane's drafts by, plus, for a draft-model lane, what each drafted
    token cost the draft model (``DraftModel.step_ratio``)."""

    def __init__(
        self,
        cells: Cells,
        context_length: int,
        n_vocab: int,
        sources: Mapping[int, DraftModel] | None = None,
    ) -> None:
        self.cells = cells
        self.context_length = context_length
        self.n_vocab = n_vocab
        self.override: Callable[[Lane, int], np.ndarray] | None = None
        self.sources: Mapping[int, DraftModel] = {} if sources is None else sources
        self.cost = VerifyCost()

    def forget_gone(self, lanes: Mapping[int, Lane]) -> None:
        """Release the draft-model state of lanes no longer in ``lanes`` (the engine's live lanes)."""
        for src in set(self.sources.values()):
            src.forget_gone(lanes)

    def plan(self, forward: list[Lane], n_active: int, tick: Tick, rows_free: int) -> dict[int, np.ndarray]:
        """Drafts for this round's forwarding lanes, by tag (lanes absent draft nothing);
        ``n_active`` decoding lanes in the round, ``rows_free`` decode rows the round's first
        ``llama_decode`` part has left."""
        out: dict[int, np.ndarray] = {}
        slack: int | None = None
        batched: dict[DraftModel, list[tuple[Lane, int]]] = {}
        for lane in forward:
            s = lane.spec
            if s is None or n_active > s.cfg.max_batch_lanes or rows_free <= 0:
                continue
            if lane.produced != lane.n_tokens or lane.grammar is not None:
                continue
            if s.pause:
                s.pause -= 1
                continue
            grant = tick.grant.get(lane.tag, 0)
            over = tick.overshoot.get(lane.tag, 0)
            if over and slack is None:
                slack = self._slack(tick)
            extra = min(over, slack or 0)
            m = min(s.k, grant - 1 + extra, self.context_length - lane.n_tokens - 1, rows_free)
            if m <= 0:
                continue
            d = self.override(lane, m) if self.override is not None else None
            if d is None and s.cert_id in self.sources:  # rows reserved; drafted after the loop
                batched.setdefault(self.sources[s.cert_id], []).append((lane, m))
                d = np.zeros(m, np.int32)
            elif d is None:
                c = s.cfg
                d = lookup(lane.tokens, lane.n_tokens, m, c.ngram_min, c.ngram_max)
            try:
                d = checked_drafts(d, self.n_vocab)[:m]
            except StrategyFault:
                lane.spec = None  # this lane decodes plainly from now on (module docstring)
                tick.stats["spec_faults_total"] += 1
                continue
            if not d.size:
                continue
            out[lane.tag] = d
            rows_free -= int(d.size)
            if d.size > grant - 1 and slack is not None:
                slack -= int(d.size) - (grant - 1)
        for src, want in batched.items():
            got = src.draft(want, tick.lanes)
            for lane, _ in want:
                if lane.tag in got:
                    out[lane.tag] = got[lane.tag]
                else:
                    del out[lane.tag]
        return out

    def _slack(self, tick: Tick) -> int:
        """KV cells no lane was promised this tick: free cells minus every lane's pending tokens,
        the grants left and the prefill still to run (what overshoot drafts may use)."""
        promised = sum(ln.pending_tokens for ln in tick.lanes.values())
        promised += sum(max(0, g) for g in tick.grant.values())
        promised += sum(max(0, ln.prefilled - ln.kv_len) for ln in tick.lanes.values())
        return max(0, self.cells.free - promised)

    def verify(self, tick: Tick, lane: Lane, rows: np.ndarray, drafts: np.ndarray) -> None:
        """Commit the chain of ``rows`` (float32, (m + 1, vocab): the logits at positions
        ``k .. k + m``) against ``drafts`` (m tokens): each row's token chosen as a plain decode
        unit chooses it (argmax, or a sampled lane's inverse-CDF draw with its uniform for that
        stream position: the rejection rule, module docstring), going on while it equals the next
        draft; then drop the KV past the last committed token's predecessor and count the round in
        the lane's emit. Each token goes through the tick's ordinary decode unit (logprobs, EOS,
        LENGTH, partial emits)."""
        k0 = lane.kv_len - rows.shape[0]  # the position of tokens[k0], the pending token
        tag = lane.tag
        committed = accepted = 0
        for i in range(rows.shape[0]):
            if tag not in tick.lanes or lane.finished:
                break
            head = tick.unit_head(lane, rows[i])
            if head is None:
                break
            r = sampling.adjusted_row(head, lane.cfg, lane.tokens[: lane.n_tokens], lane.prefill_end)
            u = sampling.draw(lane.rng_base + lane.generated) if lane.cfg.sampled else 0.0
            tok = sampling.select(r, lane.cfg, u)
            tick.unit_tail(lane, r, tok)
            committed += 1
            if i == drafts.shape[0] or tok != int(drafts[i]):
                break
            accepted += 1
        over = -tick.grant.get(tag, 0)
        if over > 0:  # tokens past max_new_tokens come out of the decode's overshoot
            tick.grant[tag] = 0
            tick.overshoot[tag] = max(0, tick.overshoot.get(tag, 0) - over)
        if tag in tick.lanes:
            keep = k0 + committed
            if lane.kv_len > keep:
                self.cells.truncate(lane.seq, keep)
                lane.kv_len = keep
        drafted = int(drafts.shape[0])
        if lane.spec is not None:
            cost = self.cost.current()
            src = self.sources.get(lane.spec.cert_id)
            if src is not None:  # its drafts cost the draft model's steps too (``draft_model``)
                cost = Cost(cost.base, cost.per_draft + src.step_ratio(self.cost.plain_ns))
            lane.spec.note(drafted, accepted, cost)
        tick.note_spec(tag, drafted, accepted)
