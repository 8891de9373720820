"""Plan validation for the llama.cpp engine: a TickPlan in, a TickWork (or a reject code) out.

``validate_plan`` reads engine state and the prompt ring but changes nothing, so a rejected plan
leaves lanes, KV, cache, leases and the plan_seq watermark exactly as they were (RULES.md preamble).
It also rules out everything llama.cpp would abort or fail on: token ids outside the vocabulary,
prompts longer than a lane's context, KV demand beyond the pool (NEEDS_REPLAN); sequence ids and
batch sizes are the engine's own and always in range.

Checks, in order (first failure wins; the ABI rule is in brackets):

1. plan_seq not above the last accepted one: ILLEGAL_COMBINATION [32].
2. max_decode_lanes above max_batch_size, or more decodes than max_decode_lanes: BUDGET [30, 31].
3. A tag twice in one array: DUPLICATE_LANE [27].
4. DRAIN with admits, a tag in admits and retires/commits, or in retires and commits/prefills/
   decodes: ILLEGAL_COMBINATION [28, 29, 33].
5. Retires: unknown tag UNKNOWN_LANE [38, 61]; a sequence with an op in flight TRANSFER_LOCKED [49].
6. Admits: a live (or faulted, not yet retired) tag, sampling > 2, an unregistered strategy
   slot, an unknown grammar handle, grammar_replay without a grammar or above the prompt length,
   an unknown logit-bias handle: ILLEGAL_COMBINATION [34, 36, 74]; HOST without a logits ring, or
   on a strategy without HOST_COMPATIBLE, HOST_RULES [37]; a stale prompt ref BAD_REF_GENERATION
   [35]; an empty prompt, a token outside the vocabulary, a prompt longer than the lane context,
   decode_replay >= prompt length, want_logprobs > 1 + 20: BOUNDS [71]; an expired, unknown or
   doubly used seed, or one whose determinism class or prefix does not match: STALE_SEED [80-83];
   more lanes than max_lanes: BUDGET.
7. Commits: unknown UNKNOWN_LANE; not HOST or finished ILLEGAL_COMBINATION [39, 42]; no row
   pending HOST_RULES [40]; wrong nonce STALE_NONCE [41]; token outside the vocabulary BOUNDS [42];
   locked TRANSFER_LOCKED.
8. Prefills: unknown UNKNOWN_LANE; locked; finished or not contiguous ILLEGAL_COMBINATION [45];
   past prompt_len - decode_replay BOUNDS [46]. Then the prefill budget truncates, in plan order,
   with a shed entry per shortened chunk [56, 57].
9. Decodes: unknown UNKNOWN_LANE [38, 61]; locked; finished, a grant of 0 tokens, or prefill not
   complete after this tick's (truncated) prefills ILLEGAL_COMBINATION [47, 48]; HOST with
   max_new_tokens != 1, or with a row pending and no commit HOST_RULES [43, 44]; grants (plus a
   speculating lane's overshoot) that could emit more slots than the emit ring has BOUNDS.
10. KV: the cells the tick may need against free cells plus what its retires free, then cache
   entries the shed envelope lets it evict (LRU); if that is not enough NEEDS_REPLAN [50-52]
   (``feasibility.check_kv``); per-lane, the same for the admits' lane streams
   (``feasibility.check_lane_streams``).

Admits that no certificate serves (on a strategy slot: ``strategies.Strategies.admit_grant``;
without one: a required_cert_id, or minimum_exactness above what this engine grants) are not a
plan rejection: they are REJECTED with REJECT_CERT_UNMATCHED in admit_results
unless allow_approximate (ABI rules 14, 119, 122); records naming such a lane are then ignored.

Semantics this engine fixes where the ABI leaves a choice:

- ``prefill_token_budget`` and ``max_decode_lanes`` are literal: 0 means none.
- Internal work the coordinator did not plan (the cold prefill after a lost sliding window, the
  re-decode of a fully cached prompt's last token) is not charged to the prefill budget.
- KV feasibility (``feasibility``) is checked against a cell ledger that mirrors llama.cpp's cells
  exactly. Lanes are never shed; a decode grant of 0 is ILLEGAL_COMBINATION and grants that could
  overflow the emit ring are BOUNDS, as in the reference engine.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from basertd.schema.abi import Exactness, Sampling, ShedKind, Status, TickFlag
from basertd.schema.tick import LaneAdmit, ShedEntry, TickPlan
from basertd.worker.engines.base import EngineError, PlanRejected
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.feasibility import check_kv, check_lane_streams
from basertd.worker.engines.llamacpp.grammar import GrammarSet
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.pool import CellLedger
from basertd.worker.engines.llamacpp.prefix_cache import PrefixCache, common_prefix
from basertd.worker.engines.llamacpp.rings import EngineRings
from basertd.worker.engines.llamacpp.seeds import Seeds
from basertd.worker.engines.llamacpp.strategies import Strategies
from basertd.worker.engines.llamacpp.work import GRANTED_CLASS, SHED_REASON_BUDGET, AdmitWork, TickWork

MAX_LOGPROBS_BYTE = 21  # 1 + MAX_TOP_LOGPROBS


class EngineState(Protocol):
    """What validation reads from the engine (all read-only here)."""

    last_plan_seq: int | None
    tick_index: int
    max_lanes: int
    context_length: int
    n_vocab: int
    bytes_per_token: int
    lanes: dict[int, Lane]
    faulted: set[int]
    locked: set[int]
    logit_biases: dict[int, tuple[np.ndarray, np.ndarray]]
    grammars: GrammarSet
    rings: EngineRings
    cache: PrefixCache
    ledger: CellLedger
    cells: Cells
    seeds: Seeds  # a lease's source sequence and its sliding window (``source``, ``window_ok``)
    strategies: Strategies  # registered speculation slots and their certificates
    speculates: bool  # whether lanes may draft at all (``speculation``: not on a pruned window cache)


def _reject(status: Status, msg: str) -> PlanRejected:
    return PlanRejected(status, msg)


def _dupes(tags: list[int]) -> int | None:
    if len(tags) < 2 or len(set(tags)) == len(tags):
        return None
    seen: set[int] = set()
    for t in tags:
        if t in seen:
            return t
        seen.add(t)
    return None


def validate_plan(st: EngineState, plan: TickPlan) -> TickWork:
    """Resolve ``plan`` against ``st`` or raise PlanRejected (module docstring lists the checks).
    Reads admit prompts out of the prompt ring (copies). Changes no state."""
    work = TickWork(plan)
    if st.last_plan_seq is not None and plan.plan_seq <= st.last_plan_seq:
        raise _reject(
            Status.REJECT_ILLEGAL_COMBINATION, f"plan_seq {plan.plan_seq} not above {st.last_plan_seq}"
        )
    if plan.max_decode_lanes > st.max_lanes:
        raise _reject(Status.REJECT_BUDGET, f"max_decode_lanes {plan.max_decode_lanes} > {st.max_lanes}")
    if len(plan.decodes) > plan.max_decode_lanes:
        raise _reject(Status.REJECT_BUDGET, f"{len(plan.decodes)} decodes > max_decode_lanes")

    admit_tags = [a.lane_tag for a in plan.admits]
    commit_tags = [c.lane_tag for c in plan.commits]
    prefill_tags = [p.lane_tag for p in plan.prefills]
    decode_tags = [d.lane_tag for d in plan.decodes]
    retire_tags = [r.lane_tag for r in plan.retires]
    for tags in (admit_tags, commit_tags, prefill_tags, decode_tags, retire_tags):
        t = _dupes(tags)
        if t is not None:
            raise _reject(Status.REJECT_DUPLICATE_LANE, f"lane {t} twice in one array")
    if plan.flags & TickFlag.DRAIN and plan.admits:
        raise _reject(Status.REJECT_ILLEGAL_COMBINATION, "DRAIN plan with admits")
    a_set, c_set, r_set = set(admit_tags), set(commit_tags), set(retire_tags)
    for x, y, what in (
        (a_set, r_set, "admitted and retired"),
        (a_set, c_set, "admitted and committed"),
        (c_set, r_set, "committed and retired"),
        (set(decode_tags), r_set, "decoded and retired"),
        (set(prefill_tags), r_set, "prefilled and retired"),
    ):
        both = x & y
        if both:
            raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"lane {min(both)} {what} in one plan")

    def live(tag: int) -> Lane:
        lane = st.lanes.get(tag)
        if lane is None:
            raise _reject(Status.REJECT_UNKNOWN_LANE, f"lane {tag} is not live")
        if lane.handle in st.locked:
            raise _reject(Status.REJECT_TRANSFER_LOCKED, f"lane {tag} has a state op in flight")
        return lane

    # -- retires
    for r in plan.retires:
        if r.lane_tag in st.faulted:
            work.retires.append((r.lane_tag, False))
            continue
        live(r.lane_tag)
        work.retires.append((r.lane_tag, bool(r.publish_to_cache)))

    # -- admits
    used_leases: set[int] = set()
    admitted: dict[int, AdmitWork] = {}
    for a in plan.admits:
        admitted[a.lane_tag] = _validate_admit(st, a, used_leases)
    work.admits = list(admitted.values())
    n_new = sum(1 for w in work.admits if not w.cert_reject)
    n_live = len(st.lanes) - sum(1 for t, _ in work.retires if t in st.lanes)
    if n_live + n_new > st.max_lanes:
        raise _reject(Status.REJECT_BUDGET, f"{n_live + n_new} lanes > max_lanes {st.max_lanes}")

    # -- commits
    for c in plan.commits:
        lane = live(c.lane_tag)
        if not lane.is_host:
            raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"commit on non-HOST lane {c.lane_tag}")
        if lane.finished:
            raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"commit on finished lane {c.lane_tag}")
        if lane.pending_nonce == 0:
            raise _reject(Status.REJECT_HOST_RULES, f"lane {c.lane_tag} has no logits row pending")
        if c.logits_nonce != lane.pending_nonce:
            raise _reject(Status.REJECT_STALE_NONCE, f"nonce {c.logits_nonce} != {lane.pending_nonce}")
        if not 0 <= c.token_id < st.n_vocab:
            raise _reject(Status.REJECT_BOUNDS, f"token {c.token_id} outside the vocabulary")
        work.commits.append((c.lane_tag, c.token_id))

    # -- prefills: cursors after this tick, per lane tag
    cursor: dict[int, int] = {}  # prefilled after this tick
    budget = plan.prefill_token_budget
    for p in plan.prefills:
        tag = p.lane_tag
        w = admitted.get(tag)
        if w is not None:
            if w.cert_reject:
                continue
            prefilled, end, finished = w.prefilled, w.prefill_end, False
        else:
            lane = live(tag)
            prefilled, end, finished = lane.prefilled, lane.prefill_end, lane.finished
        if finished:
            raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"prefill on finished lane {tag}")
        if p.token_offset != prefilled:
            raise _reject(
                Status.REJECT_ILLEGAL_COMBINATION,
                f"lane {tag}: prefill at {p.token_offset}, expected {prefilled}",
            )
        if p.token_offset + p.token_count > end:
            raise _reject(Status.REJECT_BOUNDS, f"lane {tag}: prefill past {end}")
        eff = min(p.token_count, budget)
        budget -= eff
        if eff < p.token_count:
            work.shed.append(
                ShedEntry(
                    lane_tag=tag,
                    kind=ShedKind.PREFILL_CHUNK,
                    reason=SHED_REASON_BUDGET,
                    tokens=p.token_count - eff,
                )
            )
            work.chunks_dropped += 1
        cursor[tag] = prefilled + eff
        work.prefills.append((tag, eff))

    # -- decodes
    commit_set = c_set
    for d in plan.decodes:
        tag = d.lane_tag
        w = admitted.get(tag)
        if w is not None:
            if w.cert_reject:
                continue
            end, finished, host = w.prefill_end, False, w.rec.sampling == Sampling.HOST
            after = cursor.get(tag, w.prefilled)
            pending = False
            speculating = w.lookup is not None
        else:
            lane = live(tag)
            end, finished, host = lane.prefill_end, lane.finished, lane.is_host
            after = cursor.get(tag, lane.prefilled)
            pending = lane.pending_nonce != 0
            speculating = lane.spec is not None
        if finished:
            raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"decode on finished lane {tag}")
        if d.max_new_tokens == 0:
            raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"lane {tag}: a decode grant of 0 tokens")
        if after != end:
            raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"lane {tag}: decode before its prefill ends")
        if host and d.max_new_tokens != 1:
            raise _reject(Status.REJECT_HOST_RULES, f"HOST lane {tag}: max_new_tokens must be 1")
        if host and pending and tag not in commit_set:
            raise _reject(Status.REJECT_HOST_RULES, f"HOST lane {tag}: decode with a row pending")
        work.decodes.append((tag, d.max_new_tokens))
        if speculating and d.overshoot:
            work.overshoot[tag] = d.overshoot
    if work.decodes:
        emits = st.rings.emits
        if emits is None:
            raise _reject(Status.REJECT_BOUNDS, "decodes but no emit ring attached")
        cap = emits.capacity_elems
        slots = sum(-(-(n + work.overshoot.get(t, 0)) // cap) for t, n in work.decodes)
        if slots > emits.slots:
            raise _reject(
                Status.REJECT_BOUNDS, f"decodes could emit {slots} slots, the emit ring has {emits.slots}"
            )

    check_kv(st, work, admitted, cursor)
    check_lane_streams(st, work)
    return work


def _validate_admit(st: EngineState, a: LaneAdmit, used_leases: set[int]) -> AdmitWork:
    tag = a.lane_tag
    if tag in st.lanes or tag in st.faulted:
        raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"lane {tag} is already live")
    if a.sampling > Sampling.HOST:
        raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"lane {tag}: sampling {a.sampling}")
    if not st.strategies.known(a.strategy_slot):
        raise _reject(
            Status.REJECT_ILLEGAL_COMBINATION,
            f"lane {tag}: strategy slot {a.strategy_slot} is not registered",
        )
    if a.sampling == Sampling.HOST and not st.strategies.host_compatible(a.strategy_slot):
        raise _reject(
            Status.REJECT_HOST_RULES, f"lane {tag}: HOST lane on a strategy without HOST_COMPATIBLE"
        )
    if a.grammar_handle != 0 and not st.grammars.known(a.grammar_handle):
        raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"lane {tag}: no such grammar")
    if a.grammar_replay != 0 and a.grammar_handle == 0:
        raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"lane {tag}: grammar_replay without a grammar")
    if a.logit_bias_handle != 0 and a.logit_bias_handle not in st.logit_biases:
        raise _reject(Status.REJECT_ILLEGAL_COMBINATION, f"lane {tag}: unknown logit bias")
    if a.sampling == Sampling.HOST and (
        st.rings.logits is None or st.rings.logits.capacity_elems < st.n_vocab
    ):
        raise _reject(Status.REJECT_HOST_RULES, f"lane {tag}: HOST sampling needs a logits ring slot per row")
    if a.want_logprobs > MAX_LOGPROBS_BYTE:
        raise _reject(Status.REJECT_BOUNDS, f"lane {tag}: want_logprobs {a.want_logprobs} > 21")
    try:
        prompt = st.rings.read_prompt(a.prompt)
    except EngineError as exc:
        raise _reject(exc.status, f"lane {tag}: {exc}") from exc
    n = prompt.shape[0]
    if n == 0:
        raise _reject(Status.REJECT_BOUNDS, f"lane {tag}: empty prompt")
    if n > st.context_length:
        raise _reject(Status.REJECT_BOUNDS, f"lane {tag}: prompt of {n} > context {st.context_length}")
    if int(prompt.max()) >= st.n_vocab:
        raise _reject(Status.REJECT_BOUNDS, f"lane {tag}: token outside the vocabulary")
    if a.decode_replay >= n:
        raise _reject(Status.REJECT_BOUNDS, f"lane {tag}: decode_replay {a.decode_replay} >= prompt {n}")
    if a.grammar_replay > n:
        msg = f"lane {tag}: grammar_replay {a.grammar_replay} > prompt {n}"
        raise _reject(Status.REJECT_ILLEGAL_COMBINATION, msg)
    n_p = n - a.decode_replay
    w = AdmitWork(a, prompt.astype(np.int32), prefill_end=n_p)
    w.produced = n_p
    if a.seed_handle:
        lease = st.cache.leases.get(a.seed_handle)
        if lease is None or lease.expires_after_tick < st.tick_index:
            raise _reject(Status.REJECT_STALE_SEED, f"lane {tag}: seed {a.seed_handle} is unknown or expired")
        if a.seed_handle in used_leases:
            raise _reject(Status.REJECT_STALE_SEED, f"lane {tag}: seed {a.seed_handle} used twice")
        if lease.determinism_class != a.determinism_class:
            raise _reject(Status.REJECT_STALE_SEED, f"lane {tag}: determinism class differs from the seed's")
        p = lease.prefix.shape[0]
        if p > n or common_prefix(lease.prefix, w.prompt) < p:
            raise _reject(Status.REJECT_STALE_SEED, f"lane {tag}: prompt does not start with the seed prefix")
        used_leases.add(a.seed_handle)
        w.lease = lease
        _, _, pos_min, _ = st.seeds.source(lease)
        kv_avail = p - lease.pending  # an adopted fork of a lane may lack its last token's KV
        if p == n:  # the whole prompt is cached: (re-)decode position p - 1 for its logits
            share = p - 1
            w.produced = p
        elif p >= n_p:  # the seed covers replayed tokens: units feed the rest, one each [72]
            share = kv_avail
            w.produced = p
        else:
            share = kv_avail
        if st.seeds.window_ok(pos_min, share):
            w.share_len = w.kv_len = share
            w.prefilled = min(p, n_p)
        else:  # the window is gone: prefill from 0 inside the engine, replay like a cold lane
            w.cold_fallback = True
            w.prefilled = min(p, n_p)
            w.produced = n_p
    if a.strategy_slot:
        grant = st.strategies.admit_grant(a)
        if grant is None:
            w.cert_reject = True
        else:
            w.granted, w.cert_id = grant.granted, grant.cert_id
            w.lookup = grant.lookup if st.speculates else None
    elif a.required_cert_id != 0 or a.minimum_exactness > GRANTED_CLASS:
        if a.allow_approximate:
            w.granted = Exactness.APPROXIMATE
        else:
            w.cert_reject = True
    return w
