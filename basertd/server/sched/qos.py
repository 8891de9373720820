"""QoS classes: admission order with aging, per-class lane caps, and the preemption choice
(DESIGN.md "Scheduling").

Everything here is pure: functions of queue heads, lane views and seconds waited; the scheduler
(``basertd.server.sched.loop``) and the plan builder (``basertd.server.sched.plan_builder``) call them.

- **Classes**, highest first: ``interactive`` (rank 0), ``batch`` (1), ``background`` (2), one FIFO
  per class (``basertd.server.sched.lanes.RequestQueues``).
- **Aging**: a request that has waited ``w`` seconds competes at
  ``effective_rank = max(0, rank - floor(w / aging_s))``; among class heads the lowest effective
  rank goes first, then the oldest (receipt time), then the original class. ``aging_s`` 0 turns
  aging off (strict class order).
- **The rule aging keeps**: aging raises a request's rank against requests of its own and lower
  classes, so nothing starves, but it never holds back a fresh interactive request:

  1. an aged request that cannot be admitted (no lane free, its KV reservation does not fit)
     does not block the interactive requests queued behind it: they are still tried, and may
     preempt (``basertd.server.sched.plan_builder.build_plan``, ``urgent_after``);
  2. a lane admitted by aging stays preemptible by an interactive request once it has emitted a
     token in that admission (so each admission of an aged request makes progress, and it
     resumes exactly where it stopped: it cannot starve either);
  3. an interactive request itself is never preempted.

  So an interactive request is admitted in the plan after it arrives whatever the backlog of
  aged batch or background requests (first token within two ticks), and an aged request is
  admitted, at the latest, when a lane frees with no interactive request waiting for it.
- **Lane caps**: ``LaneCaps`` bounds the live lanes of a class (0 = no cap); a capped class is
  skipped, it never blocks the classes after it.
- **Preemption**: an *interactive* request that cannot be admitted (no lane free, or its KV
  reservation does not fit) may preempt lanes of a lower class. ``choose_victim`` takes the lowest
  class first and, within it, the youngest lane (highest tag, so the least work is paused). The
  victim retires with ``publish_to_cache`` and is requeued at the head of its class; it resumes
  with its generated tokens as ``decode_replay`` (ABI rules 71-73), so its client sees a pause,
  never a repeated or different token.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from basertd.schema.client import QosClass

QOS_RANKS: dict[str, int] = {q: rank for rank, q in enumerate(QosClass)}
"""Rank of each QoS class (0 is the highest): ``QosClass``'s definition order."""
INTERACTIVE = QOS_RANKS[QosClass.INTERACTIVE]
"""Rank of the interactive class: the only class whose waiting requests preempt lanes."""


def qos_rank(qos: str) -> int:
    """Rank of class ``qos`` (0 interactive, 1 batch, 2 background). Raises KeyError for an
    unknown class name (the client schema admits only these three)."""
    return QOS_RANKS[qos]


def effective_rank(rank: int, waited_s: float, aging_s: float) -> int:
    """The rank a request of class ``rank`` competes at after waiting ``waited_s`` seconds: one class
    higher per ``aging_s`` seconds, never above interactive (0). ``aging_s`` <= 0: no aging."""
    if aging_s <= 0 or waited_s <= 0:
        return rank
    steps = waited_s / aging_s
    return 0 if steps >= rank else rank - math.floor(steps)


class Queued(Protocol):
    """What admission order needs of a queued request: its class and its receipt time (monotonic
    seconds)."""

    qos: str
    t_received: float


Q = TypeVar("Q", bound=Queued)


def admission_order(
    classes: Mapping[str, Sequence[Q]], now: float, aging_s: float, *, skip: Callable[[Q], bool] | None = None
) -> Iterator[Q]:
    """Queued requests in admission order (module docstring): a merge of the per-class FIFOs by
    ``(effective rank of the class head, receipt time, class rank)``. ``classes`` maps class name to
    its FIFO (head first); each FIFO is read in order (a requeued request stays at its head).
    ``skip(req)`` drops a request from the order without disturbing its class. Lazy: consumers that
    stop early pay only for what they read. The FIFOs must not change while iterating."""
    cursors: list[tuple[int, float, int, int, str]] = []
    pos: dict[str, int] = {}

    def push(name: str) -> None:
        q = classes[name]
        i = pos[name]
        while i < len(q) and skip is not None and skip(q[i]):
            i += 1
        pos[name] = i
        if i < len(q):
            head = q[i]
            rank = QOS_RANKS[name]
            eff = effective_rank(rank, now - head.t_received, aging_s)
            heapq.heappush(cursors, (eff, head.t_received, rank, i, name))

    for name in classes:
        pos[name] = 0
        push(name)
    while cursors:
        _, _, _, i, name = heapq.heappop(cursors)
        yield classes[name][i]
        pos[name] = i + 1
        push(name)


@dataclass(frozen=True)
class LaneCaps:
    """Most live lanes per class (``caps[rank]``; 0 or absent = no cap). ``from_names`` takes the
    configuration's ``{"background": 2}`` form."""

    caps: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def from_names(cls, caps: Mapping[str, int]) -> LaneCaps:
        """Caps keyed by class name. Raises KeyError for an unknown class, ValueError for a
        negative cap."""
        out = [0, 0, 0]
        for name, n in caps.items():
            if n < 0:
                raise ValueError(f"lane cap of {name} must be >= 0, got {n}")
            out[QOS_RANKS[name]] = n
        return cls((out[0], out[1], out[2]))

    def allows(self, rank: int, live: Sequence[int]) -> bool:
        """True when one more lane of class ``rank`` fits, given ``live[r]`` lanes of each class."""
        cap = self.caps[rank]
        return cap == 0 or live[rank] < cap


class LaneLike(Protocol):
    """What the victim choice reads of a live lane (``basertd.server.sched.plan_builder.LaneView``)."""

    tag: int
    qos_rank: int
    preemptible: bool


L = TypeVar("L", bound=LaneLike)


@dataclass
class VictimPool:
    """The lanes a plan may still preempt, for requests of class ``rank``: ``take(rank)`` returns
    the next victim (lowest class, then youngest) among preemptible lanes of a lower class than
    ``rank``, or None, and removes it from the pool."""

    lanes: list[LaneLike] = field(default_factory=list)

    @classmethod
    def of(cls, lanes: Iterable[LaneLike]) -> VictimPool:
        """A pool of every preemptible lane in ``lanes``."""
        return cls([ln for ln in lanes if ln.preemptible])

    def take(self, rank: int) -> LaneLike | None:
        """The victim for a request of class ``rank`` (``choose_victim``), removed from the pool."""
        victim = choose_victim(self.lanes, rank)
        if victim is not None:
            self.lanes.remove(victim)
        return victim

    def put_back(self, lanes: Iterable[LaneLike]) -> None:
        """Return lanes taken for an admission that did not happen after all."""
        self.lanes.extend(lanes)


def choose_victim(lanes: Iterable[L], rank: int) -> L | None:
    """The lane a waiting request of class ``rank`` preempts: among preemptible lanes of a strictly
    lower class (higher rank number), the lowest class, then the youngest (highest tag). None when
    there is none."""
    best: L | None = None
    for ln in lanes:
        if not ln.preemptible or ln.qos_rank <= rank:
            continue
        if best is None or (ln.qos_rank, ln.tag) > (best.qos_rank, best.tag):
            best = ln
    return best
