"""KV feasibility of a validated plan for the llama.cpp engine (ABI rules 50-52).

Checked against a cell ledger (``pool.CellLedger``) that mirrors llama.cpp's cells and sharing
exactly: every committed token is charged a cell when committed (its KV follows at the next decode
unit). What the tick may need is compared with the free cells, then with what its retires free,
then with the cache entries the plan's shed envelope lets it evict (least recently used first);
NEEDS_REPLAN when that is not enough. With per-lane streams the plan's admits also need lane
streams (``check_lane_streams``). Changes nothing but the ``TickWork`` it fills.
"""

from __future__ import annotations

from typing import Protocol

from basertd.schema.abi import Sampling, Status
from basertd.worker.engines.base import PlanRejected
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.pool import CellLedger
from basertd.worker.engines.llamacpp.prefix_cache import CacheEntry, PrefixCache
from basertd.worker.engines.llamacpp.work import AdmitWork, TickWork


class PoolState(Protocol):
    """What the KV check reads from the engine (read-only)."""

    context_length: int
    bytes_per_token: int
    lanes: dict[int, Lane]
    cache: PrefixCache
    ledger: CellLedger
    cells: Cells


def check_kv(st: PoolState, work: TickWork, admitted: dict[int, AdmitWork], cursor: dict[int, int]) -> None:
    """KV cells the tick of ``work`` may need vs. what is free (ABI rules 50-52): returns, with
    ``work.cells_needed`` and ``work.evict`` (the cache entries to evict first) filled, or raises
    PlanRejected(NEEDS_REPLAN). ``admitted``: the plan's admits by lane tag; ``cursor``: each
    prefilled lane's prefill position after this tick.

    A lane is charged a cell for every token it has committed, including the one or two whose KV
    the next decode unit computes (a sampled or committed token, a replayed token, the re-decoded
    end of a cached prompt): those cells are reserved, so a pending forward always finds one, and
    commits, seed back-offs and HOST replay tokens count when they are committed (rule 52). A tick
    adds its prefill chunks (and the internal cold prefill after a lost window), one cell per
    decode unit that produces a token (HOST units that only hand out a row produce none), and one
    per commit."""
    need = 0
    for w in admitted.values():
        if w.cert_reject:
            continue
        after = cursor.get(w.rec.lane_tag, w.prefilled)
        fed = max(w.kv_len, after)
        need += fed - w.kv_len
        if after >= w.prefill_end:
            need += max(0, w.produced - fed)
    for tag, after in cursor.items():
        lane = st.lanes.get(tag)
        if lane is not None:
            need += max(0, after - lane.kv_len)
    committed = {tag for tag, _ in work.commits}
    need += len(committed)
    for tag, max_new in work.decodes:
        lane = st.lanes.get(tag)
        if lane is not None:
            produced, n_known, host = lane.produced + (tag in committed), lane.n_tokens, lane.is_host
        else:
            w = admitted[tag]
            produced, n_known, host = w.produced, w.prompt.shape[0], w.rec.sampling == Sampling.HOST
        if host:
            need += 1 if produced < n_known else 0  # a HOST unit replays a token or hands out a row
        else:
            need += min(max_new, max(0, st.context_length - produced))
    reserved = sum(ln.pending_tokens for ln in st.lanes.values())
    work.cells_needed = need
    if need <= st.ledger.free - reserved:
        return
    drops = []
    for tag, publish in work.retires:
        lane = st.lanes.get(tag)
        if lane is not None:
            keep = (lane.kv_len // st.cache.page) * st.cache.page if publish else 0
            drops.append((lane.seq, keep))
            reserved -= lane.pending_tokens
    have = st.ledger.free - reserved + st.ledger.freed_by(drops)
    if need <= have:
        return
    pol = work.plan.shed_policy
    bpt = st.bytes_per_token
    all_entries = [(e.seq, 0) for e in st.cache.entries.values()]
    total = st.ledger.freed_by(all_entries) * bpt
    cap = min(pol.max_evict_bytes, max(0, total - pol.protected_quota_bytes))
    freed_bytes = 0
    chosen: list[CacheEntry] = []
    for e in st.cache.eviction_order(pol.evictable_cache_classes):
        trial = drops + [(x.seq, 0) for x in chosen] + [(e.seq, 0)]
        now = st.ledger.free - reserved + st.ledger.freed_by(trial)
        gain = (now - have) * bpt
        if freed_bytes + gain > cap:
            continue
        chosen.append(e)
        freed_bytes += gain
        have = now
        if need <= have:
            break
    if need > have:
        raise PlanRejected(Status.NEEDS_REPLAN, f"tick needs {need} KV cells, at most {have} can be freed")
    work.evict = chosen


def check_lane_streams(st: PoolState, work: TickWork) -> None:
    """Per-lane streams (``cells``): the lane streams the plan's admits take against those free
    once its retires and ``work.evict`` ran, then those that cache entries holding lane streams
    leave when moved to free ids above the lanes' (``seeds.Seeds.vacate_lane_streams``), then more
    entries the shed envelope lets it evict, least recently used first (appended to
    ``work.evict``, within what ``check_kv`` already spent of it); raises PlanRejected(NEEDS_REPLAN)
    when that is not enough (ABI rules 50, 51). A publishing retire is counted as leaving an entry
    in its lane's stream, which it does unless it publishes nothing; as a last resort such a
    retire publishes nothing (``work.retires`` rewritten) and gives its stream to an admit."""
    cells = st.cells
    need = sum(1 for w in work.admits if not w.cert_reject)
    if not cells.streams or need == 0:
        return
    free_lanes, free_ids, held = cells.free_lane_streams, len(cells.free_seqs), 0
    for tag, publish in work.retires:
        if tag in st.lanes:
            if publish:
                held += 1
            else:
                free_lanes += 1
    evicting = set(map(id, work.evict))
    for e in st.cache.entries.values():
        in_lane = cells.lane_stream(e.seq)
        if id(e) not in evicting:
            held += in_lane
        elif in_lane:
            free_lanes += 1
        else:
            free_ids += 1
    short = need - free_lanes - min(held, free_ids)
    if short <= 0:
        return
    held, free_ids = held - min(held, free_ids), 0
    pol = work.plan.shed_policy
    bpt = st.bytes_per_token
    total = st.ledger.freed_by([(e.seq, 0) for e in st.cache.entries.values()]) * bpt
    cap = min(pol.max_evict_bytes, max(0, total - pol.protected_quota_bytes))
    spent = st.ledger.freed_by([(e.seq, 0) for e in work.evict]) * bpt
    for e in st.cache.eviction_order(pol.evictable_cache_classes):
        if short <= 0:
            break
        cost = st.ledger.exclusive(e.seq) * bpt
        if id(e) in evicting or spent + cost > cap or held == 0:
            continue
        # a lane stream's entry frees its stream; any other frees an id one held entry moves to
        held -= 1
        short -= 1
        spent += cost
        work.evict.append(e)
    for i, (tag, publish) in enumerate(work.retires):
        if short <= 0 or held == 0:
            break
        if publish and tag in st.lanes:
            work.retires[i] = (tag, False)
            held -= 1
            short -= 1
    if short > 0:
        raise PlanRejected(Status.NEEDS_REPLAN, f"{need} admits, {need - short} lane streams can be freed")
