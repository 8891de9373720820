"""The journal: the coordinator's write-ahead log in ``state_dir`` (DESIGN.md "Front ends,
durability, ...": "Crash = preemption; acceptance is durable"), as the daemon sees it: ``Journal``
(opened with ``wal_disk.open_journal``), ``NullJournal``, ``JournalStats``, ``Recovered``, the modes, the
hooks and the errors. The log on disk (open and recovery carried out, segments, rotation, the
fsyncs): ``basertd.server.durability.wal_disk``; format and recovery rules:
``basertd.server.durability.wal_format``; recovery planning: ``basertd.server.durability.wal_recover``.

How the daemon uses it (one ``Journal`` per daemon, opened before the socket accepts)::

    journal = open_journal(state_dir, mode="write", result_ttl_s=600, recover="refuse")
    for req in journal.recovered.unfinished:   # requeue: prompt + req.tokens, decode_replay
        ...
    for res in journal.recovered.results:      # answer Resume for these until they expire
        ...
    # per accepted request (before Accepted is sent):   journal.accepted(RequestRecord(...))
    # per tick, per lane with new tokens:               journal.tokens(request_id, start, ids)
    # per finished / failed / cancelled request:        journal.finished(request_id, reason, ...)
    # once per tick, BEFORE that tick's tokens are delivered:  journal.commit()
    # mode "write", in a thread, at most every sync_interval_ms while commits were written:
    #                                                   journal.sync()
    journal.close()

``commit()`` is group commit: everything buffered since the last commit goes out as ONE frame in
ONE ``os.write`` (the file only grows, so one fdatasync covers every write before it). What then
depends on the mode (DESIGN.md "Front ends, durability, ...": "Crash = preemption"):

- ``"write"`` (the daemon's default): the commit returns once the write did, microseconds (an
  append to the page cache), so the event loop may call it. The records are then in the kernel:
  a SIGKILL or a crash of the process loses none of them. ``sync()`` makes them durable on stable
  storage, ONE ``os.fdatasync`` for every commit written before it (call it from a thread, at most
  every ``sync_interval_ms``); it never holds the lock a commit takes while it waits, so a commit
  never waits for an fsync. A power loss or kernel crash may lose the commits written since the
  last ``sync()``. The journal's durable mirror (what ``result`` and a checkpoint read) advances
  at the write.
- ``"tick"``: the commit writes, then fdatasyncs before it returns (milliseconds on an SSD): call
  it from a thread (``await asyncio.to_thread(journal.commit)``) when the event loop must not
  stall. What a client saw then survives a power loss too. ``sync()`` has nothing to do.

Either way the journal is thread-safe for one committing thread, one syncing thread and callers
buffering the next tick meanwhile. Only committed records survive a crash; a request or token
never committed may be lost, so nothing may be sent to a client before the commit that holds it
has returned. Before anything relies on the log being on stable storage (a rotation's checkpoint
replacing a segment, ``close``) everything written is fdatasynced, in both modes.

``mode="off"`` gives a ``NullJournal``: no file, no lock, no fsync, nothing recovered, every call
a no-op (epoch 0); a log left in ``state_dir`` by an earlier run stays untouched and is recovered by
the next start with the log on (``"write"`` and ``"tick"`` write the same log).

Epoch: every open bumps ``epoch`` past every earlier one (the ``epoch`` file and the log) and
makes it durable before returning; every frame carries it. The daemon fences with it: anything
stamped with an older epoch (lane tags, shm names, worker generations) belongs to a dead daemon.
The lock and the epoch file are ``basertd.server.durability.wal_fence``'s.

Rotation: ``commit`` rotates the log when it is due (``wal_disk`` says when), writing a checkpoint
of the durable state into a new segment and deleting the old ones; ``compact()`` does the same on
demand, ``maintain()`` when due between commits. ``commit(rotate=False)`` leaves a due rotation to
the caller (``rotation_due()``, then ``maintain()`` or a ``commit()`` off the event loop: a
rotation blocks for its fsyncs).

Space: ``open`` refuses a state directory with fewer than ``min_free_bytes`` free
(``StateDirFull``) and wraps any failure to write there into ``StateDirUnwritable``, so a daemon
never reports ready on a log it cannot write.

Errors: ``wal_fence.StateDirLocked`` (another daemon holds ``state_dir``), ``StateDirFull``,
``StateDirUnwritable``, ``WalCorrupt`` (recovery refuses;
the message says what to do), ``JournalUsageError`` (a call that contradicts the journal; nothing
changes), ``JournalFailed`` (a write or fsync failed: the journal is closed for good, as after a
failed fsync the kernel may have dropped the pages and marked them clean, so an fsync is never
retried; the daemon must stop acknowledging).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from basertd.schema.client import Timings, Usage
from basertd.server.durability.wal_format import FinishedResult, RequestRecord, UnfinishedRequest, WalError
from basertd.server.durability.wal_recover import RecoveryReport

__all__ = ["Journal", "JournalFailed", "JournalStats", "JournalUsageError", "NullJournal", "Recovered"]

DEFAULT_SEGMENT_BYTES = 64 << 20
"""A segment is rotated (checkpoint + compaction) once it passes this many bytes."""
DEFAULT_MIN_FREE_BYTES = 64 << 20
"""Free bytes ``state_dir`` must have at open (one segment's worth: a rotation writes a checkpoint)."""


class JournalUsageError(WalError, ValueError):
    """A call that contradicts the journal (an unknown or already running request, a token
    position past the end); raised before anything is buffered."""


class JournalFailed(WalError):
    """A write or fsync of the log failed; the journal accepts nothing more."""


class Recovered(msgspec.Struct, kw_only=True):
    """What ``open_journal`` found: ``unfinished`` requests to run again (in acceptance order),
    ``results`` of finished requests within ``result_ttl_s`` (in finishing order), and the
    ``report`` (torn tails dropped, corruption dropped in truncate mode)."""

    unfinished: list[UnfinishedRequest] = msgspec.field(default_factory=list)
    results: list[FinishedResult] = msgspec.field(default_factory=list)
    report: RecoveryReport | None = None


@dataclass
class JournalStats:
    """Counters for the metrics: bytes written (frames, checkpoints included), commits (one write
    each), records written, fsyncs (every fdatasync of a segment: a commit's in mode "tick", a
    ``sync()``'s in mode "write", a rotation's checkpoint) and their total and last latency
    (seconds), ``syncs`` (the fdatasyncs of ``sync()``), segments rotated, and what recovery found
    at open (records replayed, unfinished requests, results, torn bytes dropped)."""

    bytes_written: int = 0
    commits: int = 0
    records_written: int = 0
    fsyncs: int = 0
    syncs: int = 0
    fsync_seconds_total: float = 0.0
    last_fsync_s: float = 0.0
    rotations: int = 0
    records_recovered: int = 0
    requests_recovered: int = 0
    results_recovered: int = 0
    bytes_truncated: int = 0


CommitHook = Callable[[int, float | None], None]
"""Called after each group commit with (bytes written, seconds of its fdatasync; None in mode
"write", whose commits do not fsync): feed a counter and a histogram."""
SyncHook = Callable[[float], None]
"""Called after each ``sync()`` fdatasync (mode "write") with its seconds: feed a histogram."""

Mode = Literal["write", "tick", "off"]
"""``[durability] mode``: "write" (one write per commit, an fdatasync at most every
``sync_interval_ms`` off the delivery path), "tick" (one write + one fdatasync per commit, before
delivery), "off" (no log)."""
MODES: tuple[str, ...] = ("write", "tick", "off")


class Journal:
    """The write-ahead log of one daemon; open it with ``wal_disk.open_journal``."""

    mode: str = "write"

    def __init__(self) -> None:
        self.epoch = 0
        self.recovered = Recovered()
        self.stats = JournalStats()
        self.on_commit: CommitHook | None = None
        self.on_sync: SyncHook | None = None

    # The buffering and commit surface (``wal_disk.FileJournal`` and ``NullJournal`` implement it).
    def accepted(self, record: RequestRecord) -> None:
        """Buffer the acceptance of ``record`` (durable at the next ``commit``). Raises
        ``JournalUsageError`` when the id is already running."""
        raise NotImplementedError

    def tokens(self, request_id: str, start: int, ids: list[int]) -> None:
        """Buffer generated tokens ``ids`` of a running request at positions ``start``...
        (``start`` counts generated tokens; a ``start`` below the count so far replaces the tokens
        from there on). Raises ``JournalUsageError`` for an unknown request or a gap."""
        raise NotImplementedError

    def finished(
        self,
        request_id: str,
        reason: str,
        *,
        usage: Usage | None = None,
        timings: Timings | None = None,
        error_code: str = "",
        error_message: str = "",
    ) -> None:
        """Buffer the end of a running request: ``reason`` stop/length/eos/cancelled/error, and for
        an Error the client ``ErrorCode`` value and message. Raises ``JournalUsageError`` for an
        unknown request."""
        raise NotImplementedError

    def commit(self, *, rotate: bool = True) -> int:
        """Group commit: everything buffered goes out in one write; mode "tick" then fdatasyncs
        it, mode "write" leaves that to ``sync()`` (module docstring). Rotates when due unless
        ``rotate`` is False. Returns bytes written (0 when nothing was buffered: no write, no
        fsync). Raises ``JournalFailed`` (a write, fsync or rotation failed, now or earlier)."""
        raise NotImplementedError

    def sync(self) -> float | None:
        """Mode "write": one fdatasync covering every commit written so far. Returns its seconds,
        or None when nothing was written since the last one (no system call). Blocks for the
        fsync: call it from a thread; a commit never waits for it. Raises ``JournalFailed`` (the
        fsync failed: never retried, the journal accepts nothing more)."""
        raise NotImplementedError

    def rotation_due(self) -> bool:
        """Whether the next ``commit()`` or ``maintain()`` would rotate (no I/O, no wait on a
        write or an fsync)."""
        raise NotImplementedError

    @property
    def unsynced_bytes(self) -> int:
        """Bytes of commits written but not yet on stable storage (mode "write" until its next
        ``sync()``; always 0 in modes "tick" and "off")."""
        return 0

    def compact(self) -> None:
        """Rotate now: checkpoint the durable state into a new segment, drop the old ones."""
        raise NotImplementedError

    def maintain(self) -> bool:
        """Rotate when the segment is older than ``result_ttl_s`` and holds an expired result
        (they leave the disk even when nothing is committed); returns whether it rotated. Blocks
        for the fsyncs: call it from a thread. Raises ``JournalFailed``."""
        raise NotImplementedError

    def result(self, request_id: str) -> FinishedResult | None:
        """The durable result of a finished request still within ``result_ttl_s``, else None."""
        raise NotImplementedError

    def close(self) -> None:
        """Commit what is buffered, close the segment, release the lock. Idempotent."""
        raise NotImplementedError

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullJournal(Journal):
    """``mode = "off"``: no file, no lock, no fsync, nothing recovered; every call is a no-op."""

    mode = "off"

    def accepted(self, record: RequestRecord) -> None:
        pass

    def tokens(self, request_id: str, start: int, ids: list[int]) -> None:
        pass

    def finished(self, request_id: str, reason: str, **kw: object) -> None:  # type: ignore[override]
        pass

    def commit(self, *, rotate: bool = True) -> int:
        return 0

    def sync(self) -> float | None:
        return None

    def rotation_due(self) -> bool:
        return False

    def compact(self) -> None:
        pass

    def maintain(self) -> bool:
        return False

    def result(self, request_id: str) -> FinishedResult | None:
        return None

    def close(self) -> None:
        pass
