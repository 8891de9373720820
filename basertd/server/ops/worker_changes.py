"""Workers changed at run time: a reload's ``[[workers]]`` additions, removals and replacements,
and ``basertctl worker restart`` (DESIGN.md "Operators"; "Crash = preemption" for the resume).

**Ids are positions.** The N-th ``[[workers]]`` table is worker N, as it always was: in the
metrics' ``worker`` label, ``basertctl worker N``, the log lines, the KV-event publishers. A
reload compares the tables position by position (``worker_changes``): a table that differs
replaces worker N, tables past the old end are added, workers past the new end are removed (the
last first). Editing a table, appending one or dropping the last keeps every other worker's id
and process; removing a table in the middle shifts the ones after it, each of which the report
then names as replaced. An explicit ``id`` key would keep those too, but would make ids sparse
for every reader of them (and a key to get wrong in every existing file) for a case an operator
can avoid by editing in place.

**One worker at a time** (``apply_changes``): additions first (so lanes moved off a worker being
replaced or removed may go to them), then replacements in id order, then removals. Replacing worker
N (``replace``): it stops taking new requests while a peer serves its model (``Member.leaving``),
``HandOver.hand_over`` ends its tick in flight early and preempts every lane between two ticks,
with no crash charged, each request moving to the least loaded live peer serving the same model or
waiting at the head of its class here; when the new table serves another model (another served name
or vocabulary, the test peers pass for a crash resume too; the reference engine's ``ref_config``
keys are not told apart) what waits goes to a peer of the old model or fails WORKER_FAILED (its
tokens are the old model's); ``WorkerSlot.replace`` closes the old process in order and starts the
new one from the new table; the loop stays parked (new requests go to peers) until it serves or
gives up, then serves it, and the next change goes ahead. Resumed requests continue token-exact
(``decode_replay``, ABI rules 71-73). Removing the last worker hands its lanes and queue to peers
(failing WORKER_FAILED what no peer serving the model can take), then stops it. Other workers are
not touched. With ``[kv_events]`` on, an added worker gets its own publisher (worker N's
endpoints, as at start) and a removed worker's publisher is closed (``Fleet.add``,
``Fleet.remove_last``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

from basertd.server.config_sections import WorkerConfig
from basertd.server.fleet import Fleet, Member, Prepared
from basertd.server.states import SlotState

log = structlog.get_logger("basertd.reload")

READY_TIMEOUT_S = 300.0
"""Seconds a replaced or added worker may take to serve before the next change goes ahead."""


@dataclass(frozen=True)
class WorkerChange:
    """One worker a reload changes: ``kind`` "added", "replaced" or "removed", its id, and for a
    replacement the keys of its table that differ as ``key: old -> new`` lines (``keys``)."""

    kind: str
    worker_id: int
    keys: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the ``reloaded`` log line: "worker 1 replaced (lanes 2 -> 4)"."""
        detail = f" ({', '.join(self.keys)})" if self.keys else ""
        return f"worker {self.worker_id} {self.kind}{detail}"


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: data}


def worker_changes(old: list[WorkerConfig], new: list[WorkerConfig]) -> list[WorkerChange]:
    """The changes taking the tables ``old`` to ``new`` by position (module docstring), in the
    order they are applied: additions, replacements by id, removals from the last."""
    added = [WorkerChange("added", i) for i in range(len(old), len(new))]
    replaced = []
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        fa, fb = _flat(msgspec.to_builtins(a)), _flat(msgspec.to_builtins(b))
        keys = [
            f"{k} {fa.get(k)!r} -> {fb.get(k)!r}"
            for k in sorted(fa.keys() | fb.keys())
            if fa.get(k) != fb.get(k)
        ]
        if keys:
            replaced.append(WorkerChange("replaced", i, keys))
    removed = [WorkerChange("removed", i) for i in range(len(old) - 1, len(new) - 1, -1)]
    return added + replaced + removed


async def prepare_changes(
    fleet: Fleet, changes: list[WorkerChange], new: list[WorkerConfig]
) -> dict[int, Prepared]:
    """Each added or replaced worker's spec and tokenizer (``Fleet.prepare``), before anything
    changes. Raises ``basertd.models.ModelUnavailable`` or ``TokenizerError``: the reload then
    changes nothing."""
    out = {}
    for c in changes:
        if c.kind != "removed":
            out[c.worker_id] = await fleet.prepare(c.worker_id, new[c.worker_id])
    return out


async def _serving(m: Member) -> None:
    """Wait (bounded) until ``m``'s new incarnation serves or gives up; log which."""
    try:
        state = await asyncio.wait_for(m.slot.settled(), READY_TIMEOUT_S)
    except TimeoutError:
        log.warning("worker_change_slow", worker_id=m.worker_id, waited_s=READY_TIMEOUT_S)
        return
    if state is SlotState.GIVEN_UP:
        log.error("worker_change_failed", worker_id=m.worker_id, last_error=m.slot.last_error)


async def replace(fleet: Fleet, m: Member, prep: Prepared, reason: str) -> None:
    """Replace worker ``m`` by one serving ``prep`` (module docstring); returns once it serves
    (or gave up, or ``READY_TIMEOUT_S`` passed). The loop stays parked until then (new requests
    go to peers meanwhile); when the served name or the vocabulary changes (the test peers pass
    for a crash resume too), what waits here goes to a peer of the old model at once or fails
    WORKER_FAILED."""
    m.leaving = True
    try:
        await m.scheduler.handover.hand_over(reason)
        old_name, old_peers = m.model_name, m.scheduler.handover.peers()
        other_model = prep.name != m.model_name or prep.tok_key != m.tok_key
        m.slot.replace(prep.spec, reason)
        fleet.retarget(m, prep)
        if other_model:
            moved, failed = m.scheduler.handover.hand_off_queued(
                f"worker {m.worker_id} now serves another model and no worker serving {old_name!r} "
                "could take this request",
                old_peers,
            )
            if moved or failed:
                log.warning("worker_queue_handed_off", worker_id=m.worker_id, moved=moved, failed=failed)
        await _serving(m)
    finally:
        m.leaving = False
        m.scheduler.handover.release()


async def remove_last(fleet: Fleet, reason: str) -> None:
    """Hand the last worker's lanes and queue to peers, then stop it (module docstring)."""
    m = fleet.members[-1]
    m.leaving = True
    await m.scheduler.handover.hand_over(reason)
    moved, failed = m.scheduler.handover.hand_off_queued(
        f"worker {m.worker_id} was removed and no worker serving {m.model_name!r} could take this request"
    )
    if moved or failed:
        log.warning("worker_queue_handed_off", worker_id=m.worker_id, moved=moved, failed=failed)
    await fleet.remove_last()


async def apply_changes(fleet: Fleet, changes: list[WorkerChange], prepared: dict[int, Prepared]) -> None:
    """Apply ``changes`` (``worker_changes``) one worker at a time, with ``prepared`` from
    ``prepare_changes``. Hold ``fleet.changing`` around the call."""
    for c in changes:
        log.info("worker_change", change=c.describe())
        if c.kind == "added":
            await _serving(fleet.add(prepared[c.worker_id]))
        elif c.kind == "replaced":
            await replace(fleet, fleet[c.worker_id], prepared[c.worker_id], "reload")
        else:
            await remove_last(fleet, "reload")


async def restart(fleet: Fleet, worker_id: int) -> None:
    """``basertctl worker restart N``: replace worker ``worker_id`` by a new process of the same
    table, its running requests handed over as by a reload (module docstring)."""
    async with fleet.changing:
        m = fleet[worker_id]
        same = Prepared(m.config, m.slot.spec, m.tok_key, m.model_name, m.tokenizer)
        await replace(fleet, m, same, "operator request (basertctl worker restart)")
