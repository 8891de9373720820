"""A deterministic mixed plan stream for the reference engine, and a recorder that replays it.

``MixedPlanStream`` plays a small scheduler: each tick it retires finished or done lanes (some with
publish_to_cache), admits new lanes (prompts written to the prompt ring; greedy, Gumbel and HOST
sampling), gives prefill chunks under a budget (occasionally over it, so the engine sheds), and
decode grants to lanes whose prefill completes; HOST lanes get a commit of the argmax of their
pending logits row. It follows the engine's events (finishes, rejected admits, faults, shed
prefill tokens, logits rows), so every plan it makes is valid for an engine that behaves like the
reference engine.

``record(stream, ticks, engine)`` drives an in-process reference bundle with the stream and
returns every step (prompts written before the plan, the plan, the events, the emitted tokens, the
logits rows). ``replay`` sends recorded steps to any other runner (e.g. a worker through Link W)
and checks, tick by tick, that it answers exactly the same. Shared by ``tests/worker`` and
``bench/bench_link.py`` (same plans in both).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
from ring_rig import EMIT_RING as EMIT_RING
from ring_rig import LOGITS_RING as LOGITS_RING
from ring_rig import PROMPT_RING as PROMPT_RING
from ring_rig import RingRig

from basertd.native.ref import RefConfig, create_ref_bundle
from basertd.schema.abi import AdmitStatus, Sampling, ShedKind, TickFlag
from basertd.schema.tick import (
    LaneAdmit,
    LaneCommit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    RingRef,
    SamplingParams,
    ShedPolicy,
    TickEvents,
    TickPlan,
    TickTimings,
    TokenRef,
)
from basertd.shm import slot_bytes_for


@dataclass
class _Lane:
    tag: int
    prompt_len: int
    host: bool
    target: int  # generated tokens after which the stream retires the lane
    prefilled: int = 0
    generated: int = 0
    finished: bool = False
    faulted: bool = False
    pending_row: RingRef | None = None


@dataclass
class StreamConfig:
    """Knobs of the stream. ``lanes``: most live lanes; ``vocab``: token ids drawn below it (>= 3);
    ``prefill_budget``: tokens per tick; ``max_prompt``: prompt length 1..max_prompt tokens;
    ``decode_max``: grant 1..decode_max tokens; ``max_gen``: lanes are retired after 1..max_gen
    generated tokens; ``host_share`` / ``gumbel_share``: fraction of admits sampled on the host /
    with Gumbel; ``publish_share``: fraction of retires publishing to the cache;
    ``partial_every``: PARTIAL_EMITS on every n-th plan (0: never); ``admit_prob``: chance per
    free lane slot per tick of an admit."""

    lanes: int = 8
    vocab: int = 512
    prefill_budget: int = 96
    max_prompt: int = 48
    decode_max: int = 4
    max_gen: int = 40
    host_share: float = 0.15
    gumbel_share: float = 0.25
    publish_share: float = 0.3
    partial_every: int = 3
    admit_prob: float = 0.5
    seed: int = 1234


class MixedPlanStream:
    """Makes plan after plan (see the module docstring). Call ``next_plan`` then ``observe`` with
    that plan's events, alternately."""

    def __init__(self, cfg: StreamConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.lanes: dict[int, _Lane] = {}
        self.plan_seq = 0
        self.next_tag = 1

    def next_plan(
        self, write_prompt: Callable[[np.ndarray], TokenRef], read_row: Callable[[RingRef], np.ndarray]
    ) -> tuple[list[np.ndarray], TickPlan]:
        """The prompts this plan admits (already written through ``write_prompt``) and the plan.
        ``read_row`` reads a pending HOST logits row (for the commit's argmax)."""
        cfg, rng = self.cfg, self.rng
        self.plan_seq += 1
        retires: list[LaneRetire] = []
        for lane in list(self.lanes.values()):
            decoding = lane.prefilled >= lane.prompt_len
            done = lane.finished or lane.faulted or lane.generated >= lane.target
            if done or (decoding and rng.random() < 0.02):
                publish = int(not lane.faulted and rng.random() < cfg.publish_share)
                retires.append(LaneRetire(lane_tag=lane.tag, publish_to_cache=publish))
                del self.lanes[lane.tag]
        prompts: list[np.ndarray] = []
        admits: list[LaneAdmit] = []
        new: list[_Lane] = []
        for _ in range(cfg.lanes - len(self.lanes)):
            if rng.random() >= cfg.admit_prob:
                continue
            n = rng.randint(1, cfg.max_prompt)
            prompt = np.array([rng.randrange(3, cfg.vocab) for _ in range(n)], dtype=np.uint32)
            ref = write_prompt(prompt)
            prompts.append(prompt)
            tag = self.next_tag
            self.next_tag += 1
            roll = rng.random()
            if roll < cfg.host_share:
                sampling, params = Sampling.HOST, SamplingParams()
            elif roll < cfg.host_share + cfg.gumbel_share:
                sampling, params = Sampling.GPU_GUMBEL, SamplingParams(temperature=0.8)
            else:
                sampling, params = Sampling.GPU_GREEDY, SamplingParams()
            admits.append(
                LaneAdmit(
                    lane_tag=tag,
                    prompt=ref,
                    sampling=int(sampling),
                    params=params,
                    rng_counter_base=rng.randrange(1 << 32),
                )
            )
            lane = _Lane(tag, n, sampling == Sampling.HOST, rng.randint(1, cfg.max_gen))
            new.append(lane)
            self.lanes[tag] = lane
        prefills: list[LanePrefill] = []
        budget_left = cfg.prefill_budget
        complete: set[int] = set()
        for lane in self.lanes.values():
            left = lane.prompt_len - lane.prefilled
            if left <= 0:
                continue
            chunk = min(left, rng.randint(1, 40))
            prefills.append(LanePrefill(lane_tag=lane.tag, token_offset=lane.prefilled, token_count=chunk))
            if chunk <= budget_left and chunk == left:
                complete.add(lane.tag)
            lane.prefilled += chunk  # corrected by observe() for shed tokens
            budget_left -= min(chunk, max(budget_left, 0))
        commits: list[LaneCommit] = []
        decodes: list[LaneDecode] = []
        for lane in self.lanes.values():
            if lane.finished or lane.faulted:
                continue
            ready = lane.tag in complete or (
                lane.prefilled >= lane.prompt_len and not any(p.lane_tag == lane.tag for p in prefills)
            )
            if not ready:
                continue
            if lane.host:
                if lane.pending_row is not None:
                    row = read_row(lane.pending_row)
                    commits.append(
                        LaneCommit(
                            lane_tag=lane.tag,
                            token_id=int(np.argmax(row)),
                            logits_nonce=lane.pending_row.generation,
                        )
                    )
                    lane.pending_row = None
                    lane.generated += 1
                decodes.append(LaneDecode(lane_tag=lane.tag, max_new_tokens=1))
            else:
                decodes.append(LaneDecode(lane_tag=lane.tag, max_new_tokens=rng.randint(1, cfg.decode_max)))
        flags = 0
        if cfg.partial_every and self.plan_seq % cfg.partial_every == 0:
            flags |= TickFlag.PARTIAL_EMITS
        plan = TickPlan(
            plan_seq=self.plan_seq,
            flags=int(flags),
            prefill_token_budget=cfg.prefill_budget,
            max_decode_lanes=len(decodes),
            admits=admits,
            commits=commits,
            prefills=prefills,
            decodes=decodes,
            retires=retires,
            shed_policy=ShedPolicy(
                evictable_cache_classes=1, protected_quota_bytes=0, max_evict_bytes=1 << 40
            ),
        )
        return prompts, plan

    def observe(self, events: TickEvents) -> None:
        """Follow the engine: rejected admits, emits (tokens, finishes, HOST rows), faults and
        shed prefill tokens."""
        for r in events.admit_results:
            if r.status != AdmitStatus.ADMITTED:
                self.lanes.pop(r.lane_tag, None)
        for e in events.emits:
            lane = self.lanes.get(e.lane_tag)
            if lane is None:
                continue
            lane.generated += e.n_tokens
            if e.finish:
                lane.finished = True
            if e.logits_row.generation:
                lane.pending_row = e.logits_row
        for f in events.faults:
            if f.lane_tag in self.lanes:
                self.lanes[f.lane_tag].faulted = True
        for s in events.shed.entries:
            if s.kind == ShedKind.PREFILL_CHUNK and s.lane_tag in self.lanes:
                self.lanes[s.lane_tag].prefilled -= s.tokens


# --- in-process runner and recording -----------------------------------------------------------


def ring_geometry(cfg: StreamConfig, ref: RefConfig) -> dict[int, tuple[int, int]]:
    """(slots, slot_bytes) of the prompt, emit and logits rings for a stream and engine config:
    the prompt ring holds many ticks of admits, the emit ring every emit of a tick many times over,
    the logits ring one vocab-sized row per slot."""
    return {
        PROMPT_RING: (4096, slot_bytes_for(64)),
        EMIT_RING: (max(1024, 8 * cfg.lanes), slot_bytes_for(16)),
        LOGITS_RING: (max(16, 2 * cfg.lanes), slot_bytes_for(ref.vocab_size)),
    }


class InProcess:
    """A reference bundle in this process with its own three rings (``ring_rig.RingRig``), driven
    like a worker: ``write_prompt``, ``tick``, ``read_tokens``, ``read_row``. ``close()`` frees all."""

    def __init__(self, ref: RefConfig, geometry: dict[int, tuple[int, int]]) -> None:
        self.bundle = create_ref_bundle(ref)
        try:
            self.rings = RingRig(geometry)
        except BaseException:
            self.bundle.close()
            raise
        self.bundle.rings_attach(self.rings.specs)

    def write_prompt(self, tokens: np.ndarray) -> TokenRef:
        return self.rings.prompt.write(tokens)

    def tick(self, plan: TickPlan, on_emit: Callable | None = None) -> TickEvents:
        return self.bundle.tick(plan, on_emit)

    def read_tokens(self, ref: TokenRef) -> np.ndarray:
        return self.rings.emit.read(ref)

    def read_row(self, ref: RingRef) -> np.ndarray:
        return self.rings.row(ref)

    def close(self) -> None:
        self.bundle.close()
        self.rings.close()


@dataclass
class Step:
    """One recorded tick: ``prompts`` written (in order) just before ``plan``; ``refs`` they got;
    the ``events`` (timings zeroed); per emit index, the emitted ``tokens``; per emit index with a
    logits row, the ``rows``; per lane, the tokens its partial emits carried."""

    prompts: list[np.ndarray]
    refs: list[TokenRef]
    plan: TickPlan
    events: TickEvents
    tokens: list[np.ndarray] = field(default_factory=list)
    rows: dict[int, np.ndarray] = field(default_factory=dict)
    partial: dict[int, list[int]] = field(default_factory=dict)


def comparable(events: TickEvents) -> TickEvents:
    """``events`` with the timings zeroed (wall-clock, the only field that may differ)."""
    return msgspec.structs.replace(events, timings=TickTimings())


def record(cfg: StreamConfig, ref: RefConfig, ticks: int) -> list[Step]:
    """Run ``ticks`` plans of a fresh stream on a fresh in-process bundle and record every step."""
    runner = InProcess(ref, ring_geometry(cfg, ref))
    try:
        stream = MixedPlanStream(cfg)
        steps: list[Step] = []
        for _ in range(ticks):
            refs: list[TokenRef] = []

            def write(tokens: np.ndarray, refs: list[TokenRef] = refs) -> TokenRef:
                r = runner.write_prompt(tokens)
                refs.append(r)
                return r

            prompts, plan = stream.next_plan(write, runner.read_row)
            partial: dict[int, list[int]] = {}

            def on_emit(tag: int, toks: np.ndarray, partial: dict[int, list[int]] = partial) -> None:
                partial.setdefault(tag, []).extend(int(t) for t in toks)

            events = runner.tick(plan, on_emit if plan.flags & TickFlag.PARTIAL_EMITS else None)
            stream.observe(events)
            step = Step(prompts, refs, plan, comparable(events), partial=partial)
            for i, e in enumerate(events.emits):
                step.tokens.append(runner.read_tokens(e.token_ref))
                if e.logits_row.generation:
                    step.rows[i] = runner.read_row(e.logits_row)
            steps.append(step)
        return steps
    finally:
        runner.close()
