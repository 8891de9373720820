"""The tick plan builder: a pure function of scheduler state (DESIGN.md "Scheduling").

``build_plan(lanes, queue, limits, next_tag)`` decides one tick, in the order the engine runs it
(ABI rule 53):

1. **retires**: every lane marked to retire (finished, stopped, cancelled, disconnected, faulted,
   or checkpointed for the prefix cache);
2. **admits**: queued candidates in the order given (the caller orders them: QoS classes with
   aging, ``basertd.server.sched.qos``), while a lane is free, the KV reservation (prompt + max_tokens
   tokens) fits, and the plan's admit count and prompt-ring tokens allow; the first that does not
   fit stops admission (strict order: a large request is never overtaken forever). A candidate of
   a class at its lane cap is skipped. An *urgent* (interactive) candidate that does not fit
   preempts lower-class lanes (``qos.choose_victim``): they retire in this very plan with
   ``publish_to_cache`` and are listed in ``PlanDraft.preempted`` for the scheduler to requeue.
   When a non-urgent candidate (an aged request) stops admission, the ``urgent_after``
   candidates (the interactive requests behind it) are still tried, in their order, so aging
   never holds back a fresh interactive request (the QoS rule of ``basertd.server.sched.qos``);
3. **prefills**: first every interactive lane whose remaining prompt fits what is left of
   ``urgent_prefill_budget`` prefills it whole (so a short interactive request gets its first token
   in the tick that admits it, whatever else waits); then the prefill budget (tokens) is shared
   among the prefilling lanes, highest class first, then shortest remaining prompt first. Each
   chunk is contiguous with what the lane has prefilled (ABI rule 45; a seeded lane starts at its
   seed length) and ends at the lane's prefill end (its prompt less the replayed tokens, ABI rule
   46) or at its checkpoint;
4. **decodes**: every decoding lane, plus every lane whose prefill completes in this very tick
   (admit + prefill + decode in one tick, ABI rule 54), with
   ``grant = min(decode_grant * tokens_per_round, replay tokens left + tokens the request may
   still generate)``, so max_tokens is exact (replay units emit nothing, ABI rule 72; at most
   ``max_decode_lanes`` lanes, rule 30). ``decode_grant`` counts decode rounds: a speculating
   lane's rounds commit several tokens each (``LaneView.tokens_per_round``, measured), and a grant
   of ``decode_grant`` tokens would end its tick after one or two rounds, putting the coordinator's
   turn between ticks (planning, the tick's last tokens' delivery) on nearly every round. A lane
   holding for a checkpoint gets no decode.

``TickRates`` turns measured tick timings and the engine's measured rate curve into the budgets:
long ticks of whole prefill chunks near the engine's best rate when nothing urgent waits, ticks
near ``tick_target_s`` while an interactive request waits, and prefill bounded by ``max_itl_s``
beside streaming lanes on an engine that cannot yield.

Nothing here does I/O or reads a clock: the scheduler converts the ``PlanDraft`` into a
``TickPlan`` (writing admitted prompts into the prompt ring), and tests drive it directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from basertd.server.sched.qos import INTERACTIVE, LaneCaps, VictimPool


@dataclass(frozen=True)
class LaneView:
    """What the plan builder needs of one live lane.

    ``prompt_len``: tokens the lane must prefill in total (its prefill end: the admitted prompt
    less ``decode_replay``); ``prefilled``: tokens already prefilled or seeded (confirmed by tick
    events); ``remaining``: tokens the request may still generate (max_tokens minus delivered);
    ``replay``: replayed tokens the lane's decode units must still feed (ABI rule 72);
    ``reserved``: KV tokens the lane holds a reservation for; ``qos_rank``: 0 interactive, 1 batch,
    2 background; ``retire``/``publish``: retire it in this plan, and whether to publish its KV to
    the prefix cache; ``checkpoint``: 0, or the token count at which the lane's prefill stops so it
    can retire with publish (prefix coalescing, ``basertd.server.cache.policy``), with no decode;
    ``preemptible``: an urgent request may preempt it (``basertd.server.sched.qos``);
    ``tokens_per_round``: tokens one decode round of the lane commits (1 for a plain lane; more for
    a speculating one, whose rounds commit accepted drafts: the grant's scale)."""

    tag: int
    prompt_len: int
    prefilled: int
    remaining: int
    reserved: int
    qos_rank: int = 0
    retire: bool = False
    publish: bool = False
    replay: int = 0
    checkpoint: int = 0
    preemptible: bool = False
    tokens_per_round: float = 1.0

    @property
    def decoding(self) -> bool:
        """True once the whole prompt is prefilled."""
        return self.prefilled >= self.prompt_len


@dataclass(frozen=True)
class Candidate:
    """A queued request the builder may admit: ``key`` (the request's key), ``prompt_len`` its
    prefill end and ``reserve`` its KV reservation in tokens, ``remaining`` (max_tokens for a fresh
    request), ``qos_rank``. A resumed request (preempted earlier) carries its generated tokens at
    the end of its admitted prompt: ``replay`` of them (ABI rules 71-73). ``prefilled``: tokens its
    seed covers (ABI rule 45; may exceed ``prompt_len`` into the replayed tokens); ``urgent``: it
    may preempt lower-class lanes; ``checkpoint``: as ``LaneView.checkpoint``; ``ring_tokens``:
    prompt tokens its admit writes into the prompt ring (0: ``prompt_len + replay``)."""

    key: int
    prompt_len: int
    reserve: int
    remaining: int
    qos_rank: int = 0
    prefilled: int = 0
    replay: int = 0
    urgent: bool = False
    checkpoint: int = 0
    ring_tokens: int = 0

    @property
    def admit_tokens(self) -> int:
        """Prompt-ring tokens of this admit."""
        return self.ring_tokens or self.prompt_len + self.replay


@dataclass(frozen=True)
class PlanLimits:
    """Bounds of one plan. Lanes: ``max_lanes`` concurrent; ``max_decode_lanes`` decodes per tick
    (<= the engine's max_batch_size, ABI rule 31). Tokens: ``kv_tokens`` KV capacity the lanes'
    reservations must fit; ``prefill_budget`` prompt tokens this tick; ``decode_grant`` most new
    tokens per lane this tick; ``max_admit_tokens`` prompt tokens all admits of one plan may write
    into the prompt ring. ``max_admits`` admits in one plan (lowered after NEEDS_REPLAN).
    ``urgent_prefill_budget``: prompt tokens that interactive lanes whose whole remaining prompt
    fits may prefill on top of ``prefill_budget`` (their prefill goes first, DESIGN.md
    "Scheduling"); ``lane_caps``: most lanes per class; ``preempt``: urgent candidates may preempt
    lower-class lanes, which retire with ``publish_to_cache`` = ``preempt_publish``.
    ``lengthened``: ``decode_grant`` is past the configured grant because the decode step is short
    (``TickRates.long_grant``), carried into the draft."""

    max_lanes: int
    max_decode_lanes: int
    kv_tokens: int
    prefill_budget: int
    decode_grant: int
    max_admit_tokens: int
    max_admits: int = 1 << 30
    urgent_prefill_budget: int = 0
    lane_caps: LaneCaps = field(default_factory=LaneCaps)
    preempt: bool = False
    preempt_publish: bool = True
    lengthened: bool = False


@dataclass
class PlanDraft:
    """One tick's decisions. ``retires``: (tag, publish); ``admitted``: (new lane tag, ``Candidate``)
    of each request the plan admits (the ``LaneAdmit`` records are made from them at launch);
    ``prefills``: (tag, token_offset, token_count); ``decodes``: (tag, max_new_tokens);
    ``preempted``: tags among ``retires`` that were preempted for an urgent admit (the scheduler
    requeues their requests once the plan is accepted); ``lengthened``: the decode grants run past
    the configured ``decode_grant`` for a short decode step (``PlanLimits.lengthened``)."""

    retires: list[tuple[int, bool]] = field(default_factory=list)
    admitted: list[tuple[int, Candidate]] = field(default_factory=list)
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    decodes: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    lengthened: bool = False

    @property
    def empty(self) -> bool:
        """True when the plan would do nothing (the scheduler then waits instead of ticking)."""
        return not (self.retires or self.admitted or self.prefills or self.decodes)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens prefilled by this plan."""
        return sum(n for _, _, n in self.prefills)


def build_plan(
    lanes: Sequence[LaneView],
    queue: Iterable[Candidate],
    limits: PlanLimits,
    next_tag: int,
    urgent_after: Iterable[Candidate] = (),
) -> PlanDraft:
    """Decide one tick (see the module docstring). ``lanes``: every live lane of the worker;
    ``queue``: admission candidates in admission order (consumed lazily, only as far as admission
    goes); ``next_tag``: the first unused lane tag, new lanes get ``next_tag``, ``next_tag + 1``, ...;
    ``urgent_after``: urgent candidates not yet read from ``queue``, in their order, tried once a
    non-urgent candidate stopped admission (consumed lazily; only after ``queue`` stopped).
    Pure: the inputs are not modified."""
    draft = PlanDraft(lengthened=limits.lengthened)
    live: list[LaneView] = []
    for lane in lanes:
        if lane.retire:
            draft.retires.append((lane.tag, lane.publish))
        else:
            live.append(lane)

    free_lanes = limits.max_lanes - len(live)
    kv_free = limits.kv_tokens - sum(lane.reserved for lane in live)
    per_class = [0, 0, 0]
    for lane in live:
        per_class[lane.qos_rank] += 1
    victims = VictimPool.of(live) if limits.preempt else VictimPool()
    admit_tokens = 0
    tag = next_tag

    def admit(cand: Candidate) -> bool | None:
        """Admit ``cand`` if it fits: True; None when it is skipped (lane cap); False when it
        stops admission."""
        nonlocal free_lanes, kv_free, admit_tokens, tag
        if not limits.lane_caps.allows(cand.qos_rank, per_class):
            return None  # its class is at its cap: the classes after it go on
        if (
            len(draft.admitted) >= limits.max_admits
            or admit_tokens + cand.admit_tokens > limits.max_admit_tokens
        ):
            return False
        taken: list[LaneView] = []
        while cand.urgent and (free_lanes <= 0 or cand.reserve > kv_free):
            victim = victims.take(cand.qos_rank)
            if victim is None:
                break
            assert isinstance(victim, LaneView)
            taken.append(victim)
            free_lanes += 1
            kv_free += victim.reserved
        if free_lanes <= 0 or cand.reserve > kv_free:
            for victim in taken:  # preempting them would not make room: keep them running
                free_lanes -= 1
                kv_free -= victim.reserved
            victims.put_back(taken)
            return False
        for victim in taken:
            live.remove(victim)
            per_class[victim.qos_rank] -= 1
            draft.retires.append((victim.tag, limits.preempt_publish))
            draft.preempted.append(victim.tag)
        draft.admitted.append((tag, cand))
        live.append(
            LaneView(
                tag=tag,
                prompt_len=cand.prompt_len,
                prefilled=cand.prefilled,
                remaining=cand.remaining,
                reserved=cand.reserve,
                qos_rank=cand.qos_rank,
                replay=max(0, cand.prompt_len + cand.replay - max(cand.prefilled, cand.prompt_len)),
                checkpoint=cand.checkpoint,
            )
        )
        per_class[cand.qos_rank] += 1
        tag += 1
        free_lanes -= 1
        kv_free -= cand.reserve
        admit_tokens += cand.admit_tokens
        return True

    stopped_by: Candidate | None = None
    for cand in queue:
        if admit(cand) is False:
            stopped_by = cand
            break
    if stopped_by is not None and not stopped_by.urgent and limits.preempt:
        for cand in urgent_after:
            if admit(cand) is False:
                break

    budget = limits.prefill_budget
    urgent = limits.urgent_prefill_budget
    completes: set[int] = set()
    prefilling = sorted(
        (lane for lane in live if not lane.decoding),
        key=lambda lane: (lane.qos_rank, lane.prompt_len - lane.prefilled, lane.tag),
    )
    for lane in prefilling:
        target = min(lane.checkpoint, lane.prompt_len) if lane.checkpoint else lane.prompt_len
        need = target - lane.prefilled
        if need <= 0:
            continue
        if lane.qos_rank == INTERACTIVE and need <= urgent:
            count = need  # a short interactive prompt prefills whole, ahead of everything else
            urgent -= need
        elif budget > 0:
            count = min(need, budget)
            budget -= count
        else:
            continue
        draft.prefills.append((lane.tag, lane.prefilled, count))
        if lane.prefilled + count >= lane.prompt_len and not lane.checkpoint:
            completes.add(lane.tag)

    decoders = [
        lane
        for lane in live
        if (lane.decoding or lane.tag in completes) and lane.remaining > 0 and not lane.checkpoint
    ]
    decoders.sort(key=lambda lane: (lane.qos_rank, lane.tag))
    for lane in decoders[: limits.max_decode_lanes]:
        grant = max(1, round(limits.decode_grant * max(1.0, lane.tokens_per_round)))
        draft.decodes.append((lane.tag, min(grant, lane.remaining + lane.replay, 0xFFFF)))
    return draft


GRANT_CEILING = 256
"""The most decode rounds ``TickRates.long_grant`` grants a lane in one tick."""
CHUNK_WITHIN = 0.9
"""A prefill chunk runs "near the best rate" when its bucket reaches this fraction of the best."""
ITL_MARGIN = 0.8
"""Fraction of ``max_itl_s`` a tick's prefill may fill when an engine cannot yield (the rest is
slack for the decode step, planning and the link)."""


def rate_curve(stats: dict[str, int] | None) -> list[tuple[int, float]]:
    """The engine's measured prefill-rate curve from its PONG ``stats``: ``[(rows, tokens/s)]``
    from every ``rate_tok_s_b<rows>`` entry, smallest bucket first (empty when none)."""
    out = []
    for key, value in (stats or {}).items():
        if key.startswith("rate_tok_s_b") and key[12:].isdigit() and value > 0:
            out.append((int(key[12:]), float(value)))
    return sorted(out)


def best_chunk(curve: list[tuple[int, float]], floor: int, ceiling: int) -> int:
    """The smallest bucket of ``curve`` whose rate is within ``CHUNK_WITHIN`` of the best one,
    clamped to ``[floor, ceiling]`` tokens (``ceiling`` when nothing is measured)."""
    if not curve:
        return ceiling
    best = max(r for _, r in curve)
    rows = min(b for b, r in curve if r >= CHUNK_WITHIN * best)
    return max(min(floor, ceiling), min(rows, ceiling))


@dataclass
class TickRates:
    """Measured engine speed, and the budgets of the next tick (DESIGN.md "Scheduling").

    ``observe`` takes one tick's prefill tokens and decode steps (the most tokens a lane decoded)
    with its measured prefill and decode seconds and keeps exponentially weighted means of seconds
    per prefill token and per decode step; ``set_curve`` takes the engine's measured rate curve
    (``rate_curve`` of its PONG stats), from which ``chunk`` is the prefill size at which the
    engine runs near its best rate.

    ``budgets`` returns ``(prefill_budget, decode_grant)`` in one of three regimes:

    - *urgent* (an interactive request waits): decode steps limited to half of ``tick_target_s``
      and the prefill budget to what the rest of the target allows at the measured rate (at least
      ``min_prefill`` tokens, so prompts always progress; with no lane decoding the whole target
      goes to prefill);
    - *streaming* (a streaming lane decodes) on an engine that cannot yield: the prefill budget is
      what ``ITL_MARGIN`` of ``max_itl_s`` less one decode step allows, so no streaming lane waits
      longer than ``max_itl_s`` between tokens (an engine that yields is instead asked to end the
      tick in time, and keeps the long budget);
    - *throughput* (nothing urgent): ``long_prefill`` (0: ``max_prefill``) rounded down to a whole
      number of chunks (at least one), the ``long_grant``; decode lanes are granted every tick.
      While a streaming lane decodes on an engine that spreads a tick's prefill over its decode
      rounds, the scheduler raises the grant to ``round_grant`` of the tick's prefill, so each
      round stays within the inter-token bound.

    Outside the urgent regime the grant is ``long_grant()``: ``max_grant`` rounds, or as many as
    fill ``decode_tick_s`` at the measured decode step when that is more (at most
    ``GRANT_CEILING``): on an engine whose step takes a millisecond or two (a GPU), ``max_grant``
    rounds would make every tick that short, and the worker waits out the coordinator's turn
    between two ticks (the tick's last tokens applied, the next plan drafted and sent) once per
    tick. The scheduler keeps ``max_grant`` while requests are queued (``draft.plan_limits``).
    """

    tick_target_s: float
    max_prefill: int
    max_grant: int
    min_prefill: int = 16
    alpha: float = 0.3
    prefill_s_per_token: float | None = None
    decode_s_per_step: float | None = None
    long_prefill: int = 0
    max_itl_s: float = 0.5
    min_chunk: int = 64
    curve: list[tuple[int, float]] = field(default_factory=list)
    decode_tick_s: float = 0.0

    def observe(self, prefill_tokens: int, prefill_s: float, decode_steps: int, decode_s: float) -> None:
        """Fold one tick's measurements in (counts in tokens / steps, times in seconds)."""
        if prefill_tokens > 0 and prefill_s > 0:
            x = prefill_s / prefill_tokens
            p = self.prefill_s_per_token
            self.prefill_s_per_token = x if p is None else p + self.alpha * (x - p)
        if decode_steps > 0 and decode_s > 0:
            x = decode_s / decode_steps
            d = self.decode_s_per_step
            self.decode_s_per_step = x if d is None else d + self.alpha * (x - d)

    def set_curve(self, curve: list[tuple[int, float]]) -> None:
        """Take the engine's measured rate curve (``[(rows, tokens/s)]``); an empty one is ignored."""
        if curve:
            self.curve = list(curve)

    def long_grant(self) -> int:
        """Decode rounds of a tick outside the urgent regime (class docstring): ``max_grant``, or
        the rounds that fill ``decode_tick_s`` at the measured step when more, at most
        ``GRANT_CEILING``."""
        step = self.decode_s_per_step
        if not self.decode_tick_s or not step:
            return self.max_grant
        return max(self.max_grant, min(GRANT_CEILING, int(self.decode_tick_s / step)))

    @property
    def long_budget(self) -> int:
        """The throughput regime's ceiling (tokens): ``long_prefill``, or ``max_prefill`` if 0."""
        return max(self.long_prefill, self.max_prefill) if self.long_prefill else self.max_prefill

    def chunk(self) -> int:
        """The prefill chunk (tokens) near the engine's best rate (``best_chunk``)."""
        return best_chunk(self.curve, self.min_chunk, self.long_budget)

    def budgets(
        self, waiting: bool, decoding: bool = True, *, streaming: bool = False, can_yield: bool = False
    ) -> tuple[int, int]:
        """``(prefill_budget tokens, decode_grant tokens)`` for the next tick. ``waiting``: an
        urgent (interactive) request waits; ``decoding``: some lane will decode in it;
        ``streaming``: a streaming lane decodes (its inter-token gap is bounded by ``max_itl_s``);
        ``can_yield``: the engine ends a tick early when asked (class docstring)."""
        if waiting:
            return self._urgent(decoding)
        if streaming and not can_yield and self.prefill_s_per_token:
            step = self.decode_s_per_step or 0.0
            room = max(ITL_MARGIN * self.max_itl_s - step, 0.0)
            prefill = int(room / self.prefill_s_per_token)
            floor = min(self.min_prefill, self.long_budget)
            return max(floor, min(self.long_budget, prefill)), self.long_grant()
        chunk = self.chunk()
        return max(chunk, (self.long_budget // chunk) * chunk), self.long_grant()

    def round_grant(self, prefill: int) -> int:
        """The decode grant of a long tick that prefills ``prefill`` tokens beside streaming lanes
        on an engine that spreads its prefill over the decode rounds (the llama.cpp engine): enough
        rounds that each carries at most what ``ITL_MARGIN`` of ``max_itl_s`` less one decode step
        allows at the measured prefill rate, so a streaming lane gets a token at least that often
        through the whole tick; never below ``max_grant``, never above 0xFFFF (a u16)."""
        rows = self.round_rows()
        if rows is None:
            return self.max_grant
        return max(self.max_grant, min(0xFFFF, -(-prefill // rows)))

    def round_rows(self) -> int | None:
        """Prefill tokens one decode round may carry so that it ends within ``ITL_MARGIN`` of
        ``max_itl_s`` (less one decode step) at the measured prefill rate; None before any
        prefill was measured."""
        if not self.prefill_s_per_token:
            return None
        room = max(ITL_MARGIN * self.max_itl_s - (self.decode_s_per_step or 0.0), 0.1 * self.max_itl_s)
        return max(1, int(room / self.prefill_s_per_token))

    def _urgent(self, decoding: bool) -> tuple[int, int]:
        grant = self.max_grant
        decode_s = 0.0
        if self.decode_s_per_step and decoding:
            grant = max(1, min(self.max_grant, int(0.5 * self.tick_target_s / self.decode_s_per_step)))
            decode_s = grant * self.decode_s_per_step
        # Nothing measured yet (a fresh worker whose first tick was cut): the floor, not the
        # ceiling, so the tick serving the interactive request stays short.
        prefill = self.min_prefill
        if self.prefill_s_per_token:
            room = max(self.tick_target_s - decode_s, 0.0)
            prefill = int(room / self.prefill_s_per_token)
        return max(min(self.min_prefill, self.max_prefill), min(self.max_prefill, prefill)), grant

    def itl_yield_after(self, step_tokens: int) -> float:
        """Seconds after a streaming lane's last token at which a yielding engine must be asked to
        end its tick so the lane's next token still comes within ``max_itl_s``: the bound less one
        prefill step of ``step_tokens`` tokens (the step in flight finishes), one decode step and
        a tenth of the bound for planning and the link; never below a tenth of the bound."""
        step = (self.prefill_s_per_token or 0.0) * max(1, step_tokens)
        decode = self.decode_s_per_step or 0.0
        return max(0.1 * self.max_itl_s, 0.9 * self.max_itl_s - step - decode)
