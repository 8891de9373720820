"""Recovery of the write-ahead log: which segment to replay, what to drop, what is corrupt
(the rules are in ``basertd.server.durability.wal_format``'s docstring).

``plan_recovery`` only reads: ``basertctl wal check`` runs it on a live or dead log, and
``open_journal`` carries its plan out (truncate a torn tail, write a fresh checkpoint, delete or
quarantine the old segments).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from basertd.server.durability.wal_format import (
    WAL_DIR,
    LogState,
    SegmentScan,
    Start,
    WalCorrupt,
    _Inconsistent,
    list_segments,
    read_segment,
)

RecoverMode = Literal["refuse", "truncate"]
"""What recovery does with corruption: refuse to start (``WalCorrupt``), or keep the log up to
the corrupt record and quarantine the rest (``basertd serve --wal-recover=truncate``)."""

_ANY_SEGMENT = re.compile(r"(\d{20})\.wal")


class RecoveryReport(msgspec.Struct, kw_only=True):
    """What recovery found: segments present, the replayed ``base`` segment, frames and records
    replayed, unfinished requests and results recovered, the last epoch in the log, bytes of torn
    tail dropped, ``warnings`` (torn tails), ``corrupt`` (what truncate mode dropped; refuse mode
    raises instead) and ``ok`` (False when anything corrupt was found)."""

    state_dir: str
    segments: int = 0
    base: str = ""
    frames: int = 0
    records: int = 0
    unfinished: int = 0
    results: int = 0
    last_epoch: int = 0
    truncated_bytes: int = 0
    warnings: list[str] = msgspec.field(default_factory=list)
    corrupt: list[str] = msgspec.field(default_factory=list)
    ok: bool = True


@dataclass
class RecoveryPlan:
    """The outcome of ``plan_recovery``: the replayed ``state``; ``truncate``: (segment, length)
    of a torn tail to cut before anything new is written; ``drop``: segments to delete once a new
    checkpoint is durable (obsolete or torn); ``quarantine``: segments holding data truncate mode
    dropped (renamed ``*.corrupt`` instead); ``next_seq``: the next segment number."""

    state: LogState
    report: RecoveryReport
    truncate: tuple[Path, int] | None = None
    drop: list[Path] = field(default_factory=list)
    quarantine: list[Path] = field(default_factory=list)
    next_seq: int = 1


def plan_recovery(state_dir: Path, recover: RecoverMode = "refuse") -> RecoveryPlan:
    """Read the log under ``state_dir`` and decide what survives; changes nothing on disk.
    Raises ``WalCorrupt`` (refuse mode) and OSError (unreadable segment)."""
    wal_dir = state_dir / WAL_DIR
    segments = list_segments(wal_dir)
    report = RecoveryReport(state_dir=str(state_dir), segments=len(segments))
    plan = RecoveryPlan(state=LogState(), report=report, next_seq=_next_seq(wal_dir))

    def corrupt(scan: SegmentScan | None, offset: int, reason: str) -> None:
        if recover != "truncate":
            raise WalCorrupt(state_dir, scan.path if scan else None, offset, reason)
        where = f"{scan.path.name} at byte {offset}: " if scan else ""
        report.corrupt.append(where + reason)
        report.ok = False
        if scan is not None and scan.path not in plan.quarantine:
            plan.quarantine.append(scan.path)

    # The base: the newest segment whose checkpoint is complete; newer ones lack one.
    base: SegmentScan | None = None
    newer: list[SegmentScan] = []
    for seq, path in reversed(segments):
        scan = read_segment(path, seq)
        if scan.checkpoint_frames() is not None:
            base = scan
            break
        newer.append(scan)
    older = [p for s, p in segments if base is not None and s < base.seq]
    plan.drop.extend(older)

    for i, scan in enumerate(newer):
        torn = i == 0 and not scan.valid_after_bad and not scan.undecodable
        if torn and (base is not None or (len(segments) == 1 and scan.seq == 1)):
            report.warnings.append(
                f"{scan.path.name}: checkpoint torn by a crash ({scan.size} bytes); dropped"
            )
            report.truncated_bytes += scan.size
            plan.drop.append(scan.path)
        else:
            corrupt(scan, scan.bad_offset or 0, "segment without a complete checkpoint")
    if base is None:
        return plan

    report.base = base.path.name
    state = _replay(base, len(base.batches), corrupt)
    if base.bad_offset is not None:
        bad = base.bad_offset
        if base.undecodable:
            corrupt(base, bad, "a frame with a valid checksum does not decode")
        elif base.valid_after_bad:
            corrupt(base, bad, "bad frame followed by valid frames")
        elif newer:
            corrupt(base, bad, "bad frame in a segment followed by another segment")
        else:
            torn_bytes = base.size - base.good_end
            report.warnings.append(
                f"{base.path.name}: torn tail of {torn_bytes} bytes at byte {bad} (a crash during "
                "a write); truncated"
            )
            report.truncated_bytes += torn_bytes
            plan.truncate = (base.path, base.good_end)
    if base.path not in plan.quarantine:
        plan.drop.append(base.path)
    plan.state = state
    report.frames = state.frames
    report.records = state.records
    report.unfinished = len(state.live)
    report.results = len(state.results)
    report.last_epoch = max([state.epoch] + [b.epoch for s in newer for b, _ in s.batches])
    return plan


def _replay(base: SegmentScan, limit: int, corrupt) -> LogState:
    """Replay the first ``limit`` frames of ``base``; on a contradiction report it and replay
    only the frames before it (truncate mode)."""
    state = LogState()
    start = 0
    for i, (batch, end) in enumerate(base.batches[:limit]):
        try:
            if i == 0 and not (batch.records and isinstance(batch.records[0], Start)):
                raise _Inconsistent("the segment does not start with a checkpoint")
            state.apply_batch(batch, first=i == 0)
            if i == 0 and state.segment != base.seq:
                raise _Inconsistent(f"the checkpoint names segment {state.segment}")
        except _Inconsistent as exc:
            corrupt(base, start, str(exc))
            if i < (base.checkpoint_frames() or 0):
                return LogState()  # no complete checkpoint before the contradiction
            return _replay(base, i, corrupt)
        state.frames += 1
        state.records += len(batch.records)
        start = end
    return state


def _next_seq(wal_dir: Path) -> int:
    """One more than the highest segment number ever used here (quarantined ones included)."""
    if not wal_dir.is_dir():
        return 1
    seqs = [int(m.group(1)) for p in wal_dir.iterdir() if (m := _ANY_SEGMENT.match(p.name))]
    return max(seqs, default=0) + 1


def check_log(state_dir: Path) -> dict:
    """What ``basertctl wal check`` prints: ``status`` "empty" (no log), "clean", "torn" (a torn
    tail the next start drops with a warning) or "corrupt" (the next start refuses; ``errors``
    says where, and what ``--wal-recover=truncate`` would drop), the counts of
    ``RecoveryReport``, the ``epoch`` file's value, and ``warnings``. Reads only; safe while the
    daemon runs (its last frame may then look torn). Raises OSError for an unreadable segment."""
    errors: list[str] = []
    try:
        report = plan_recovery(state_dir, "refuse").report
    except WalCorrupt as exc:
        errors.append(str(exc))
        report = plan_recovery(state_dir, "truncate").report
        errors += [f"--wal-recover=truncate would drop: {c}" for c in report.corrupt]
    epoch_text = ""
    try:
        epoch_text = (state_dir / "epoch").read_text().strip()
    except FileNotFoundError:
        pass
    if epoch_text and not epoch_text.isdigit():
        errors.append(f"{state_dir / 'epoch'}: not a number")
    if errors:
        status = "corrupt"
    elif report.segments == 0:
        status = "empty"
    else:
        status = "torn" if report.warnings else "clean"
    data = msgspec.structs.asdict(report)
    del data["corrupt"]
    data.update(status=status, ok=not errors, errors=errors, epoch=int(epoch_text or 0) if not errors else 0)
    return data
