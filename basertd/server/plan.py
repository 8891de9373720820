"""The tick plan builder: a pure function of scheduler state (DESIGN.md "Scheduling").

``build_plan(lanes, queue, limits, next_tag)`` decides one tick, in the order the engine runs it
(ABI rule 53):

1. **retires**: every lane marked to retire (finished, stopped, cancelled, disconnected, faulted);
2. **admits**: queued candidates in the order given (highest class first, FIFO within a class;
   the caller orders them), while a lane is free, the KV reservation (prompt + max_tokens tokens)
   fits, and the plan's admit count and prompt-ring tokens allow; the first that does not fit
   stops admission (strict order: a large request is never overtaken forever);
3. **prefills**: the prefill budget (tokens) shared among prefilling lanes, highest class first,
   then shortest remaining prompt first, each lane's chunk contiguous with what it has prefilled
   (ABI rule 45);
4. **decodes**: every decoding lane, plus every lane whose prefill completes in this very tick
   (admit + prefill + decode in one tick, ABI rule 54), with
   ``grant = min(decode_grant, tokens the request may still generate)``, so max_tokens is exact
   (at most ``max_decode_lanes`` lanes, ABI rule 30).

``TickRates`` turns measured tick timings into the budgets: ticks stay near ``tick_target_s``
while anything waits, and use the full configured budgets when nothing does.

Nothing here does I/O or reads a clock: the scheduler converts the ``PlanDraft`` into a
``TickPlan`` (writing admitted prompts into the prompt ring), and tests drive it directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LaneView:
    """What the plan builder needs of one live lane.

    ``prompt_len``: tokens the lane must prefill in total; ``prefilled``: tokens already prefilled
    (confirmed by tick events); ``remaining``: tokens the request may still generate (max_tokens
    minus delivered); ``reserved``: KV tokens the lane holds a reservation for; ``qos_rank``: 0
    interactive, 1 batch, 2 background; ``retire``/``publish``: retire it in this plan, and
    whether to publish its KV to the prefix cache."""

    tag: int
    prompt_len: int
    prefilled: int
    remaining: int
    reserved: int
    qos_rank: int = 0
    retire: bool = False
    publish: bool = False

    @property
    def decoding(self) -> bool:
        """True once the whole prompt is prefilled."""
        return self.prefilled >= self.prompt_len


@dataclass(frozen=True)
class Candidate:
    """A queued request the builder may admit: ``key`` (the request's key), prompt length and KV
    reservation in tokens, ``remaining`` (max_tokens for a fresh request), ``qos_rank``."""

    key: int
    prompt_len: int
    reserve: int
    remaining: int
    qos_rank: int = 0


@dataclass(frozen=True)
class PlanLimits:
    """Bounds of one plan. Lanes: ``max_lanes`` concurrent; ``max_decode_lanes`` decodes per tick
    (<= the engine's max_batch_size, ABI rule 31). Tokens: ``kv_tokens`` KV capacity the lanes'
    reservations must fit; ``prefill_budget`` prompt tokens this tick; ``decode_grant`` most new
    tokens per lane this tick; ``max_admit_tokens`` prompt tokens all admits of one plan may write
    into the prompt ring. ``max_admits`` admits in one plan (lowered after NEEDS_REPLAN)."""

    max_lanes: int
    max_decode_lanes: int
    kv_tokens: int
    prefill_budget: int
    decode_grant: int
    max_admit_tokens: int
    max_admits: int = 1 << 30


@dataclass
class PlanDraft:
    """One tick's decisions. ``retires``: (tag, publish); ``admits``: (new tag, candidate);
    ``prefills``: (tag, token_offset, token_count); ``decodes``: (tag, max_new_tokens)."""

    retires: list[tuple[int, bool]] = field(default_factory=list)
    admits: list[tuple[int, Candidate]] = field(default_factory=list)
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    decodes: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """True when the plan would do nothing (the scheduler then waits instead of ticking)."""
        return not (self.retires or self.admits or self.prefills or self.decodes)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens prefilled by this plan."""
        return sum(n for _, _, n in self.prefills)


def build_plan(
    lanes: Sequence[LaneView], queue: Iterable[Candidate], limits: PlanLimits, next_tag: int
) -> PlanDraft:
    """Decide one tick (see the module docstring). ``lanes``: every live lane of the worker;
    ``queue``: admission candidates in admission order (consumed lazily, only as far as admission
    goes); ``next_tag``: the first unused lane tag, new lanes get ``next_tag``, ``next_tag + 1``, ...
    Pure: the inputs are not modified."""
    draft = PlanDraft()
    live: list[LaneView] = []
    for lane in lanes:
        if lane.retire:
            draft.retires.append((lane.tag, lane.publish))
        else:
            live.append(lane)

    free_lanes = limits.max_lanes - len(live)
    kv_free = limits.kv_tokens - sum(lane.reserved for lane in live)
    admit_tokens = 0
    tag = next_tag
    for cand in queue:
        if (
            free_lanes <= 0
            or len(draft.admits) >= limits.max_admits
            or cand.reserve > kv_free
            or admit_tokens + cand.prompt_len > limits.max_admit_tokens
        ):
            break
        draft.admits.append((tag, cand))
        live.append(
            LaneView(
                tag=tag,
                prompt_len=cand.prompt_len,
                prefilled=0,
                remaining=cand.remaining,
                reserved=cand.reserve,
                qos_rank=cand.qos_rank,
            )
        )
        tag += 1
        free_lanes -= 1
        kv_free -= cand.reserve
        admit_tokens += cand.prompt_len

    budget = limits.prefill_budget
    completes: set[int] = set()
    prefilling = sorted(
        (lane for lane in live if not lane.decoding),
        key=lambda lane: (lane.qos_rank, lane.prompt_len - lane.prefilled, lane.tag),
    )
    for lane in prefilling:
        if budget <= 0:
            break
        count = min(lane.prompt_len - lane.prefilled, budget)
        draft.prefills.append((lane.tag, lane.prefilled, count))
        budget -= count
        if lane.prefilled + count >= lane.prompt_len:
            completes.add(lane.tag)

    decoders = [lane for lane in live if (lane.decoding or lane.tag in completes) and lane.remaining > 0]
    decoders.sort(key=lambda lane: (lane.qos_rank, lane.tag))
    for lane in decoders[: limits.max_decode_lanes]:
        draft.decodes.append((lane.tag, min(limits.decode_grant, lane.remaining, 0xFFFF)))
    return draft


@dataclass
class TickRates:
    """Measured engine speed, for budgets that keep ticks near ``tick_target_s`` (seconds) while
    anything waits (DESIGN.md "Scheduling": "Ticks stay short while anything waits").

    ``observe`` takes one tick's prefill tokens and decode steps (the largest grant) with its
    measured prefill and decode seconds and keeps exponentially weighted means of seconds per
    prefill token and per decode step. ``budgets`` returns ``(prefill_budget, decode_grant)``:
    the configured maxima when nothing waits; otherwise decode steps limited to half the target,
    and the prefill budget to what the rest of the target allows at the measured rate (at least
    ``min_prefill`` tokens, so prompts always progress)."""

    tick_target_s: float
    max_prefill: int
    max_grant: int
    min_prefill: int = 16
    alpha: float = 0.3
    prefill_s_per_token: float | None = None
    decode_s_per_step: float | None = None

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

    def budgets(self, waiting: bool) -> tuple[int, int]:
        """``(prefill_budget tokens, decode_grant tokens)`` for the next tick."""
        if not waiting:
            return self.max_prefill, self.max_grant
        grant = self.max_grant
        decode_s = 0.0
        if self.decode_s_per_step:
            grant = max(1, min(self.max_grant, int(0.5 * self.tick_target_s / self.decode_s_per_step)))
            decode_s = grant * self.decode_s_per_step
        prefill = self.max_prefill
        if self.prefill_s_per_token:
            room = max(self.tick_target_s - decode_s, 0.0)
            prefill = int(room / self.prefill_s_per_token)
        return max(min(self.min_prefill, self.max_prefill), min(self.max_prefill, prefill)), grant
