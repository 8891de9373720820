"""What follows a plan the engine rejected (ABI rules 13, 17-52: a rejected plan changed nothing).

Pure: ``triage`` maps one rejection (its status, the plan's admit count, how many plans in a row
were rejected) to a ``Verdict``; the scheduler applies it.

- ``NEEDS_REPLAN`` and ``REJECT_STALE_SEED`` are handled by the scheduler itself (a smaller plan,
  one plan without seeds).
- Any other status is a rule the plan broke. When the plan admitted lanes, one admit may carry a
  value the engine cannot take (a sampling parameter outside its ABI type): the admits are
  **bisected** — the next plan admits only the first half of them; a plan of exactly one admit
  that is rejected names its culprit, whose request fails alone with ``INVALID_REQUEST`` naming
  the field (``suspect_field``), while every other lane goes on serving.
- A rejection no single admit explains (a plan without admits rejected twice in a row, or more
  rejections in a row than bisecting ``max_lanes`` admits needs) restarts the worker: the engine
  and the scheduler disagree about state.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from basertd.schema.tick import LaneAdmit

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1


class Action(enum.Enum):
    """The scheduler's answer to a rejected plan."""

    REPLAN_NO_ADMITS = "replan_no_admits"
    """Plan again without admits (one retry of a plan that admitted nothing)."""
    BISECT = "bisect"
    """Plan again admitting only the first ``Verdict.max_admits`` of the rejected plan's admits."""
    FAIL_ADMIT = "fail_admit"
    """The plan's single admit is the culprit: fail its request, then plan again."""
    RESTART = "restart"
    """No single lane explains it: restart the worker."""


@dataclass(frozen=True)
class Verdict:
    """``action``; ``max_admits``: the admit cap of the next plan (BISECT, REPLAN_NO_ADMITS)."""

    action: Action
    max_admits: int | None = None


def rejection_budget(max_lanes: int) -> int:
    """Rejected plans in a row after which the worker restarts: enough to bisect a plan of
    ``max_lanes`` admits down to one, fail it, and retry once."""
    return max(1, max_lanes).bit_length() + 3


def triage(n_admits: int, consecutive: int, max_lanes: int) -> Verdict:
    """The verdict on a rejected plan with ``n_admits`` admits, the ``consecutive``-th rejected
    plan in a row (1 for the first), on a worker of ``max_lanes`` lanes (module docstring)."""
    if consecutive > rejection_budget(max_lanes):
        return Verdict(Action.RESTART)
    if n_admits == 0:
        return Verdict(Action.REPLAN_NO_ADMITS, 0) if consecutive == 1 else Verdict(Action.RESTART)
    if n_admits == 1:
        return Verdict(Action.FAIL_ADMIT)
    return Verdict(Action.BISECT, n_admits // 2)


CLIENT_FIELD = {"freq_penalty": "frequency_penalty", "rng_counter_base": "seed"}
"""Client (``Generate``) names of ABI fields whose names differ."""

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "freq_penalty", "presence_penalty", "repeat_penalty")


def suspect_field(admit: LaneAdmit, message: str) -> str:
    """The field of ``admit`` that a rejection ``message`` names (``params.NAME``), else the first
    field whose value does not fit its ABI type (u32 ``top_k``/``flags``, finite f32 parameters,
    u64 ``rng_counter_base``), else ``""``."""
    m = re.search(r"params\.(\w+)", message)
    if m:
        return m.group(1)
    p = admit.params
    for name in ("top_k", "flags"):
        v = getattr(p, name)
        if not 0 <= v <= U32_MAX:
            return name
    for name in _FLOAT_FIELDS:
        v = getattr(p, name)
        if not math.isfinite(v) or abs(v) > 3.4028234663852886e38:
            return name
    if not 0 <= admit.rng_counter_base <= U64_MAX:
        return "seed"
    return ""
