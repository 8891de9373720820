"""Test hooks of the ``basert`` engine: a test subclass, imported only when ``--ref-config`` names
``test_*`` keys (``basertd.worker.engines.basert.open_engine``); production configs never do.

``TEST_HOOK_KEYS`` (values are ``SamplingParams.top_k`` markers):

- ``test_reject_top_k`` = K: a plan with an admit whose ``top_k`` is K is rejected
  (REJECT_BOUNDS, naming the lane), as a value outside the ABI's u32 would be;
- ``test_stall_top_k`` = K: such a plan hangs the tick (sleeps ``test_stall_s`` seconds, default
  3600) before running;
- ``test_crash_top_k`` = K: a plan that decodes a lane admitted with that ``top_k`` kills the worker
  (SIGKILL), in every incarnation (a poison request);
- ``test_crash_emit_top_k`` = K: the same poison, killing the worker only *after* such a tick ran
  and its partial emits reached the coordinator, before the tick's result (a request that
  crashes its worker mid-tick after delivering tokens).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from basertd.schema.abi import Status
from basertd.schema.tick import TickEvents, TickPlan
from basertd.worker.engines import EngineOptionError
from basertd.worker.engines.base import PartialEmit, PlanRejected
from basertd.worker.engines.basert import BasertEngine

TEST_HOOK_KEYS = frozenset(
    {"test_reject_top_k", "test_stall_top_k", "test_stall_s", "test_crash_top_k", "test_crash_emit_top_k"}
)
"""``--ref-config`` keys that install ``HookedEngine`` (module docstring)."""
_EMIT_FLUSH_S = 0.05
"""Seconds ``test_crash_emit_top_k`` waits before its tick (past the worker's partial-emit window)
and before the kill (the frames leave the socket)."""


def check_hooks(hooks: dict[str, Any]) -> None:
    """Raise ``EngineOptionError`` (``--ref-config``) for a ``test_*`` key that is no hook, or a
    value that is not a number."""
    unknown = sorted(set(hooks) - TEST_HOOK_KEYS)
    if unknown:
        known = ", ".join(sorted(TEST_HOOK_KEYS))
        raise EngineOptionError("--ref-config", f"unknown test hook(s) {', '.join(unknown)}; known: {known}")
    for key, value in hooks.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EngineOptionError("--ref-config", f"{key} must be a number, got {value!r}")


class HookedEngine(BasertEngine):
    """A ``BasertEngine`` with the test hooks of ``--ref-config`` (module docstring): ``hooks``
    maps a ``TEST_HOOK_KEYS`` name to its value."""

    def __init__(self, *args: Any, hooks: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hooks = dict(hooks)
        self._poison: set[int] = set()  # lanes admitted with test_crash_top_k
        self._poison_emit: set[int] = set()  # lanes admitted with test_crash_emit_top_k

    def tick(self, plan: TickPlan, on_partial_emit: PartialEmit | None = None) -> TickEvents:
        """``BasertEngine.tick`` after the hooks: a marked admit rejects or stalls the plan; a plan
        that decodes (replay included) a lane admitted with ``params.top_k == test_crash_top_k``
        kills this worker process with SIGKILL before the engine runs it (a poison request); one with a
        lane admitted with ``test_crash_emit_top_k`` runs (its partial emits sent) and then kills it."""
        reject = self.hooks.get("test_reject_top_k")
        stall = self.hooks.get("test_stall_top_k")
        crash = self.hooks.get("test_crash_top_k")
        if crash is not None:
            self._poison.update(a.lane_tag for a in plan.admits if a.params.top_k == crash)
            if any(d.lane_tag in self._poison for d in plan.decodes):
                os.kill(os.getpid(), signal.SIGKILL)
            self._poison.difference_update(r.lane_tag for r in plan.retires)
        crash_emit = self.hooks.get("test_crash_emit_top_k")
        if crash_emit is not None:
            self._poison_emit.update(a.lane_tag for a in plan.admits if a.params.top_k == crash_emit)
            doomed = any(d.lane_tag in self._poison_emit for d in plan.decodes)
            self._poison_emit.difference_update(r.lane_tag for r in plan.retires)
            if doomed and on_partial_emit is not None:
                time.sleep(_EMIT_FLUSH_S)  # past the emit window: this tick's first emit goes out
                super().tick(plan, on_partial_emit)
                time.sleep(_EMIT_FLUSH_S)  # zmq's I/O thread sends the TICK_EMIT frames
                os.kill(os.getpid(), signal.SIGKILL)
        for i, admit in enumerate(plan.admits):
            if reject is not None and admit.params.top_k == reject:
                raise PlanRejected(
                    Status.REJECT_BOUNDS,
                    f"admits[{i}] (lane {admit.lane_tag}): params.top_k {admit.params.top_k} is out of range",
                )
            if stall is not None and admit.params.top_k == stall:
                time.sleep(float(self.hooks.get("test_stall_s", 3600.0)))
        return super().tick(plan, on_partial_emit)
