"""What a validated plan asks of the llama.cpp engine: ``TickWork`` (and an ``AdmitWork`` per
admit), made by ``validate.validate_plan`` and carried out by ``tick`` and ``rounds``; the shed
reasons this engine reports (ShedEntry.reason, ABI rules 56-58)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from basertd.schema.abi import Exactness
from basertd.schema.tick import LaneAdmit, ShedEntry, TickPlan
from basertd.worker.engines.llamacpp.prefix_cache import CacheEntry, Lease

if TYPE_CHECKING:
    from basertd.worker.engines.llamacpp.strategies import LookupConfig

GRANTED_CLASS = Exactness.DISTRIBUTION_EXACT
"""What a plain lane of this engine is: it samples the model's distribution, but batch composition
changes llama.cpp's floating-point results, so it is not path-invariant."""

SHED_REASON_BUDGET = 1
"""ShedEntry.reason of a prefill chunk cut by prefill_token_budget."""
SHED_REASON_POOL = 2
"""ShedEntry.reason of a cache eviction that made room for the tick's KV."""
SHED_REASON_PUBLISH = 3
"""ShedEntry.reason of a cache eviction that made room for a published prefix."""


@dataclass
class AdmitWork:
    """A validated admit. ``cert_reject`` set means the admit is REJECTED in admit_results.

    Seed shape: ``share_len`` cells taken from the lease's source (0 cold), ``kv_len`` /
    ``prefilled`` / ``produced`` the lane's starting cursors, ``cold_fallback`` when the source's
    window was lost and the lane prefills from 0 internally."""

    rec: LaneAdmit
    prompt: np.ndarray
    prefill_end: int = 0
    lease: Lease | None = None
    share_len: int = 0
    kv_len: int = 0
    prefilled: int = 0
    produced: int = 0
    cold_fallback: bool = False
    cert_reject: bool = False
    granted: int = GRANTED_CLASS
    cert_id: int = 0
    lookup: LookupConfig | None = None  # set when the lane speculates (``strategies.AdmitGrant``)


@dataclass
class TickWork:
    """Everything a valid plan asks for, resolved against engine state."""

    plan: TickPlan
    retires: list[tuple[int, bool]] = field(default_factory=list)  # (tag, publish)
    commits: list[tuple[int, int]] = field(default_factory=list)  # (tag, token)
    admits: list[AdmitWork] = field(default_factory=list)
    prefills: list[tuple[int, int]] = field(default_factory=list)  # (tag, effective count)
    decodes: list[tuple[int, int]] = field(default_factory=list)  # (tag, max_new_tokens)
    overshoot: dict[int, int] = field(
        default_factory=dict
    )  # tag -> LaneDecode.overshoot of speculating lanes
    evict: list[CacheEntry] = field(default_factory=list)
    shed: list[ShedEntry] = field(default_factory=list)
    chunks_dropped: int = 0
    cells_needed: int = 0
