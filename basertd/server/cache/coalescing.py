"""Prefix coalescing: which queued requests wait for a leader's prefix, and where the leaders
checkpoint (DESIGN.md "Prefix cache policy"; the rule is told in ``basertd.server.cache.policy``'s
module docstring, "Coalescing"). Pure: the scheduler hands it page hash paths and gets a decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from basertd.server.cache.prefix_index import lcp_pages

# --- coalescing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueuedPrompt:
    """A queued request as coalescing sees it: ``key``, its prompt's page hash path, the pages the
    index says are cached, its prefill end (tokens), whether it may lead (a request leads at most
    one checkpoint), and its QoS rank (it never waits for a leader of a lower class)."""

    key: int
    hashes: Sequence[int]
    cached_pages: int
    prefill_end: int
    can_lead: bool = True
    rank: int = 0


@dataclass(frozen=True)
class PrefillingLane:
    """A live lane that may lead (prefilling or decoding): ``tag``, its prompt's hash path, tokens
    prefilled so far, its prefill end, whether it may lead, its QoS rank, and whether it retires
    with publish in the plan being built (its prefix is cached one tick from now, with no pause
    for anyone: such a lane leads requests of every class)."""

    tag: int
    hashes: Sequence[int]
    prefilled: int
    prefill_end: int
    can_lead: bool = True
    rank: int = 0
    retiring: bool = False


@dataclass
class Coalescing:
    """The decision of one ``coalesce`` pass: ``blocked`` request keys (not offered for admission),
    checkpoints (tokens) for queued leaders (``leader_checkpoints``, by key) and live leader lanes
    (``lane_checkpoints``, by tag)."""

    blocked: set[int] = field(default_factory=set)
    leader_checkpoints: dict[int, int] = field(default_factory=dict)
    lane_checkpoints: dict[int, int] = field(default_factory=dict)


def coalesce(
    queued: Sequence[QueuedPrompt], lanes: Sequence[PrefillingLane], page: int, min_tokens: int
) -> Coalescing:
    """Which queued requests wait for a leader's prefix, and where the leaders checkpoint (module
    docstring). ``queued`` in admission order. A request waits when a live lane (a decoding one
    only of its own class), or a request queued ahead of it, of its class or a higher one, shares
    with it at least ``min_tokens`` tokens (whole pages, within the leader's prefill end) beyond
    what the index says is cached for it. Pure."""
    out = Coalescing()
    m = max(1, -(-min_tokens // page)) if min_tokens > 0 else 0
    if m == 0:
        return out
    by_group: dict[int, list[PrefillingLane]] = {}
    for ln in lanes:
        if ln.can_lead and len(ln.hashes) >= m:
            by_group.setdefault(ln.hashes[m - 1], []).append(ln)
    leaders: dict[int, QueuedPrompt] = {}
    for q in queued:
        if len(q.hashes) < m:
            continue
        group = q.hashes[m - 1]
        best: tuple[int, int] | None = None  # (shared pages, lane tag)
        for ln in by_group.get(group, ()):
            decoding = ln.prefilled >= ln.prefill_end
            if not ln.retiring and (ln.rank > q.rank or (decoding and ln.rank != q.rank)):
                continue  # never pause a decoding lane for a request of a lower class
            shared = min(lcp_pages(q.hashes, ln.hashes), ln.prefill_end // page)
            if shared - q.cached_pages >= m and (best is None or shared > best[0]):
                best = (shared, ln.tag)
        if best is not None:
            out.blocked.add(q.key)
            out.lane_checkpoints[best[1]] = max(out.lane_checkpoints.get(best[1], 0), best[0] * page)
            continue
        lead = leaders.get(group)
        if lead is not None and lead.rank <= q.rank:
            shared = min(lcp_pages(q.hashes, lead.hashes), lead.prefill_end // page)
            if shared - q.cached_pages >= m and shared > lead.cached_pages:
                out.blocked.add(q.key)
                cp = out.leader_checkpoints.get(lead.key, 0)
                out.leader_checkpoints[lead.key] = max(cp, shared * page)
                continue
        if q.can_lead and lead is None:
            leaders[group] = q
    return out
