"""Test hooks of the llama.cpp engine, kept out of its production path: ``LaneTestHooks.install``
sets ``LlamaCppEngine.hooks``, which is None unless a test installs them; ``tick`` applies armed
hooks at one point, after the plan's retires (as the reference engine's ``baseRT_ref_*`` calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from basertd.schema.abi import FaultCode, Finish, Status
from basertd.worker.engines.base import EngineError

if TYPE_CHECKING:
    from basertd.worker.engines.llamacpp.engine import LlamaCppEngine
    from basertd.worker.engines.llamacpp.tick import Tick


class LaneTestHooks:
    """Faults and finishes armed for the next accepted tick of one engine."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine
        self._faults: dict[int, int] = {}  # lane tag -> FaultCode
        self._finishes: dict[int, int] = {}  # lane tag -> Finish

    @classmethod
    def install(cls, engine: LlamaCppEngine) -> LaneTestHooks:
        """Hooks on ``engine`` (reused when already installed)."""
        if engine.hooks is None:
            engine.hooks = cls(engine)
        return engine.hooks

    def inject_fault(self, lane_tag: int, code: int = FaultCode.INTERNAL) -> None:
        """``lane_tag`` faults with ``code`` in the next accepted tick (a fault record, its KV
        released; ABI rules 60-62). EngineError(REJECT_UNKNOWN_LANE) unless the lane is live,
        REJECT_BOUNDS for an unknown fault code."""
        if lane_tag not in self.engine.lanes:
            raise EngineError(Status.REJECT_UNKNOWN_LANE, f"lane {lane_tag} is not live")
        if code not in FaultCode.__members__.values():
            raise EngineError(Status.REJECT_BOUNDS, f"no fault code {code}")
        self._faults[lane_tag] = code

    def force_finish(self, lane_tag: int, finish: int) -> None:
        """The lane's next tick ends it with ``finish`` (EOS..ERROR), no more tokens.
        EngineError(REJECT_UNKNOWN_LANE) unless live and unfinished, REJECT_BOUNDS for a bad finish."""
        lane = self.engine.lanes.get(lane_tag)
        if lane is None or lane.finished:
            raise EngineError(Status.REJECT_UNKNOWN_LANE, f"lane {lane_tag} is not live and unfinished")
        if not Finish.EOS <= finish <= Finish.ERROR:
            raise EngineError(Status.REJECT_BOUNDS, f"finish {finish} is not EOS..ERROR")
        self._finishes[lane_tag] = finish

    def apply(self, tick: Tick) -> None:
        """Apply what was armed since the last tick to the tick in flight, then disarm."""
        eng = self.engine
        for tag, code in self._faults.items():
            lane = eng.lanes.get(tag)
            if lane is not None:
                tick.fault(lane, code, 0)
        self._faults.clear()
        for tag, finish in self._finishes.items():
            lane = eng.lanes.get(tag)
            if lane is not None and not lane.finished:
                lane.finish = Finish(finish)
                lane.held_row = None
                tick.note(tag)
                tick.finish[tag] = lane.finish
        self._finishes.clear()
