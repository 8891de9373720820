"""The journal on disk: ``FileJournal``, the ``Journal`` of modes "write" and "tick"
(``basertd.server.durability.wal``: the interface, the modes and what a commit promises in each,
the errors), and ``open_journal``, which opens the journal of a mode (``NullJournal``: "off").
The log is the one of DESIGN.md "Front ends, durability, ...": "Crash = preemption; acceptance is
durable". Records,
frames and segments: ``basertd.server.durability.wal_format``; the recovery plan carried out at
open: ``basertd.server.durability.wal_recover``; the lock and the epoch file:
``basertd.server.durability.wal_fence``; whole writes, directory fsyncs, the free-space check:
``basertd.server.durability.wal_files``.

Open: create ``state_dir`` (0700) and its ``wal/``, take the lock, check ``min_free_bytes`` are
free (``StateDirFull``), plan recovery (``WalCorrupt`` in refuse mode), write the epoch one past
every earlier one, cut a torn tail, then write a fresh checkpoint as a new segment, which deletes
the old segments (and renames the ones truncate mode quarantined ``*.corrupt``). Any ``OSError``
on the way releases the lock and the segment and is raised as ``StateDirUnwritable``.

Writes and syncs: a commit is one ``os.write`` of its frames to the current segment (opened
``O_APPEND``); mode "tick" fdatasyncs it before the commit returns. The journal counts the bytes
of commits written and those on stable storage (``unsynced_bytes`` is the difference); ``sync()``
fdatasyncs a duplicate of the segment's descriptor, so a rotation may close the segment meanwhile,
and never under the lock a commit takes. Every fdatasync of a segment is timed into
``JournalStats`` (seconds). A failed write, fdatasync or rotation closes the journal for good
(``JournalFailed``): an fsync is never retried.

Rotation and compaction: when a segment has grown ``segment_bytes`` past its own checkpoint (so a
checkpoint larger than ``segment_bytes`` does not rotate at every commit), or once it is older than
``result_ttl_s`` (at least ``MIN_AGE_ROTATION_S``) while it holds an expired result (so a
finished result leaves the disk within about twice its TTL, or a minute, even when little is
written; ``maintain()`` checks it between commits), ``commit`` writes a checkpoint of the
durable state into a new segment (finished requests older than ``result_ttl_s`` left out), makes
it durable (fdatasync of the new segment, fsync of the directory), then deletes the old segments;
``compact()`` does the same on demand. Frames, the checkpoint's included, are cut by bytes
(``wal_format.FRAME_BYTES``), far under what the reader accepts (``wal_format.MAX_FRAME_BYTES``,
256 MiB). Segments that ``--wal-recover=truncate`` quarantined (``*.corrupt``) are kept for
inspection, the newest ``KEEP_CORRUPT`` only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from basertd.schema.client import Timings, Usage
from basertd.server.durability.wal import (
    DEFAULT_MIN_FREE_BYTES,
    DEFAULT_SEGMENT_BYTES,
    MODES,
    CommitHook,
    Journal,
    JournalFailed,
    JournalUsageError,
    Mode,
    NullJournal,
    Recovered,
    SyncHook,
)
from basertd.server.durability.wal_fence import lock, read_epoch, write_epoch
from basertd.server.durability.wal_files import (
    StateDirUnwritable,
    check_free,
    fsync_dir,
    prune_corrupt,
    write_all,
)
from basertd.server.durability.wal_format import (
    WAL_DIR,
    Accept,
    Finish,
    FinishedResult,
    LogState,
    Record,
    RequestRecord,
    Toks,
    UnfinishedRequest,
    batches_of,
    encode_frame,
    encode_frames,
    segment_name,
)
from basertd.server.durability.wal_recover import RecoverMode, plan_recovery

__all__ = ["MIN_AGE_ROTATION_S", "FileJournal", "open_file_journal"]

log = logging.getLogger("basertd.wal")

MIN_AGE_ROTATION_S = 60.0
"""A segment rotates for its expired results only once it is this old (a ``result_ttl_s`` of 0
must not rotate the whole state at every commit)."""


def open_journal(
    state_dir: str | os.PathLike[str],
    mode: Mode = "write",
    result_ttl_s: float = 600.0,
    recover: RecoverMode = "refuse",
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    on_commit: CommitHook | None = None,
    on_sync: SyncHook | None = None,
    clock: Callable[[], float] = time.time,
) -> Journal:
    """The journal of ``mode``: a ``NullJournal`` for "off"; for "write" and "tick" (the
    ``wal`` module docstring) lock ``state_dir`` (created 0700 if missing), check it has
    ``min_free_bytes`` free, recover its log, bump the epoch and write a fresh checkpoint.
    ``recover``: "refuse" raises ``WalCorrupt`` on corruption, "truncate" keeps the log up to it
    and renames the dropped segments ``*.corrupt``. ``clock`` gives wall-clock seconds (result
    expiry). Raises ``JournalUsageError`` (a bad mode or recover), ``StateDirLocked``,
    ``StateDirFull``, ``StateDirUnwritable``, ``WalCorrupt``."""
    if mode == "off":
        return NullJournal()
    if mode not in MODES:
        raise JournalUsageError(f"durability mode must be one of {', '.join(MODES)}, got {mode!r}")
    if recover not in ("refuse", "truncate"):
        raise JournalUsageError(f"recover must be 'refuse' or 'truncate', got {recover!r}")
    j = open_file_journal(
        state_dir,
        mode,
        result_ttl_s,
        recover,
        segment_bytes=segment_bytes,
        min_free_bytes=min_free_bytes,
        clock=clock,
    )
    j.on_commit, j.on_sync = on_commit, on_sync
    return j


def open_file_journal(
    state_dir: str | os.PathLike[str],
    mode: str,
    result_ttl_s: float,
    recover: RecoverMode,
    *,
    segment_bytes: int,
    min_free_bytes: int,
    clock: Callable[[], float],
) -> FileJournal:
    """``open_journal`` for modes "write" and "tick" (its arguments, already checked): lock
    ``state_dir``, recover its log, bump the epoch, write a fresh checkpoint. Raises
    ``StateDirLocked``, ``StateDirFull``, ``StateDirUnwritable`` (any ``OSError``), ``WalCorrupt``;
    whatever it raises, the lock and the segment are released first."""
    j = FileJournal(Path(state_dir), mode, result_ttl_s, segment_bytes, clock)
    try:
        j._open(recover, min_free_bytes)
    except OSError as exc:
        j._release()
        raise StateDirUnwritable(
            f"state_dir {state_dir} cannot take a write ({exc}): give the daemon a writable "
            'state_dir with free space, or set [durability] mode = "off"'
        ) from exc
    except BaseException:
        j._release()
        raise
    return j


class FileJournal(Journal):
    """``mode = "write"`` or ``"tick"``: the log on disk.

    Locks: ``_buf_lock`` guards the buffer and the view (held by the buffering calls, never over
    I/O); ``_io_lock`` makes one writer (commit, rotation; held over a commit's write, and in mode
    "tick" its fdatasync, and over a rotation); ``_state_lock`` guards the durable mirror, held
    only while it changes (``result`` takes only it); ``_sync_lock`` makes one ``sync()`` at a
    time and is held over its fdatasync, which runs on a duplicate of the segment's descriptor,
    never under ``_io_lock``. Order: ``_sync_lock`` before ``_io_lock`` before ``_buf_lock`` /
    ``_state_lock``."""

    def __init__(
        self, state_dir: Path, mode: str, ttl_s: float, segment_bytes: int, clock: Callable[[], float]
    ):
        super().__init__()
        self.mode = mode
        self.state_dir = state_dir
        self.wal_dir = state_dir / WAL_DIR
        self.ttl_s = ttl_s
        self.segment_bytes = segment_bytes
        self.clock = clock
        self._lock_fd = -1
        self._fd = -1
        self._seq = 0  # current segment number
        self._seg_size = 0
        self._checkpoint_size = 0  # bytes of the current segment's own checkpoint
        self._seg_started = 0.0  # clock() when the current segment was written
        self._durable = LogState()  # the mirror of what is on disk; checkpoints copy it
        self._view: dict[str, int] = {}  # running request -> token count, buffered included
        self._buffer: list[Record] = []
        self._buf_lock = threading.Lock()
        self._io_lock = threading.Lock()  # one writer: commit, rotation
        self._state_lock = threading.Lock()  # the durable mirror, held only while it changes
        self._sync_lock = threading.Lock()  # one sync() at a time, held over its fdatasync
        self._written = 0  # bytes of commits written since open, in every segment
        self._synced = 0  # ... of which on stable storage (fdatasynced, or in a synced checkpoint)
        self._failed: str | None = None
        self._closed = False

    # --- open ------------------------------------------------------------------------------------

    def _open(self, recover: RecoverMode, min_free_bytes: int) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.wal_dir.mkdir(exist_ok=True, mode=0o700)
        self._lock_fd = lock(self.state_dir)
        check_free(self.state_dir, min_free_bytes)
        file_epoch = read_epoch(self.state_dir, recover)
        plan = plan_recovery(self.state_dir, recover)
        report = plan.report
        for warning in report.warnings:
            log.warning("write-ahead log: %s", warning)
        for problem in report.corrupt:
            log.error("write-ahead log: dropped (--wal-recover=truncate): %s", problem)
        self.epoch = max(file_epoch, report.last_epoch) + 1
        write_epoch(self.state_dir, self.epoch)
        if plan.truncate is not None and plan.truncate[0] not in plan.quarantine:
            path, length = plan.truncate
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, length)
                os.fsync(fd)
            finally:
                os.close(fd)
        state = plan.state
        state.expire(self.clock(), self.ttl_s)
        self._durable = state
        self._view = {rid: len(r.tokens) for rid, r in state.live.items()}
        self._seq = plan.next_seq - 1
        self._rotate(drop=plan.drop, quarantine=plan.quarantine)
        prune_corrupt(self.wal_dir)
        self.recovered = Recovered(
            unfinished=[
                UnfinishedRequest(record=r.record, tokens=list(r.tokens)) for r in state.live.values()
            ],
            results=list(state.results.values()),
            report=report,
        )
        st = self.stats
        st.records_recovered, st.bytes_truncated = report.records, report.truncated_bytes
        st.requests_recovered, st.results_recovered = len(state.live), len(state.results)

    def _release(self) -> None:
        for name in ("_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)  # closing the lock file's only descriptor releases the flock
                setattr(self, name, -1)

    # --- rotation --------------------------------------------------------------------------------

    def _rotate(self, drop: list[Path] = (), quarantine: list[Path] = ()) -> None:
        """Checkpoint the durable state into a new segment, make it durable, then remove ``drop``
        and every older segment (``quarantine`` ones are renamed ``*.corrupt``). Caller holds
        ``_io_lock`` (or is ``_open``)."""
        state = self._durable
        with self._state_lock:
            state.expire(self.clock(), self.ttl_s)
        seq = self._seq + 1
        path = self.wal_dir / segment_name(seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            records = state.checkpoint_records(seq, self.epoch, self.clock())
            size = 0
            for batch in batches_of(self.epoch, state.seq + 1, records):
                state.seq = batch.seq
                frame = encode_frame(batch, seq)
                write_all(fd, frame)
                size += len(frame)
            self._timed_fsync(fd)
            fsync_dir(self.wal_dir)
        except BaseException:
            os.close(fd)
            raise
        old_fd, old_seq = self._fd, self._seq
        self._synced = self._written  # the durable checkpoint holds every commit written so far
        self._fd, self._seq, self._seg_size = fd, seq, size
        self._checkpoint_size, self._seg_started = size, self.clock()
        self.stats.bytes_written += size
        if old_fd >= 0:
            os.close(old_fd)
            self.stats.rotations += 1
        for p in quarantine:
            os.replace(p, p.with_name(p.name + ".corrupt"))
        stale = {p for p in drop if p not in quarantine}
        stale |= {self.wal_dir / segment_name(old_seq)} if old_seq else set()
        for p in stale:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        fsync_dir(self.wal_dir)

    def _timed_fsync(self, fd: int) -> float:
        t0 = time.perf_counter()
        os.fdatasync(fd)
        dt = time.perf_counter() - t0
        st = self.stats
        st.fsyncs += 1
        st.fsync_seconds_total += dt
        st.last_fsync_s = dt
        return dt

    # --- the buffering surface -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._failed is not None:
            raise JournalFailed(f"the write-ahead log failed earlier: {self._failed}")
        if self._closed:
            raise JournalUsageError("the journal is closed")

    def accepted(self, record: RequestRecord) -> None:
        with self._buf_lock:
            self._check_open()
            if record.request_id in self._view:
                raise JournalUsageError(f"request {record.request_id!r} is already running")
            self._view[record.request_id] = 0
            self._buffer.append(Accept(record))

    def tokens(self, request_id: str, start: int, ids: list[int]) -> None:
        with self._buf_lock:
            self._check_open()
            have = self._view.get(request_id)
            if have is None:
                raise JournalUsageError(f"tokens for request {request_id!r}, which is not running")
            if not 0 <= start <= have:
                raise JournalUsageError(f"tokens of {request_id!r} at {start}: it has {have} so far")
            self._view[request_id] = start + len(ids)
            self._buffer.append(Toks(request_id, start, list(ids)))

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
        with self._buf_lock:
            self._check_open()
            if request_id not in self._view:
                raise JournalUsageError(f"finish of request {request_id!r}, which is not running")
            del self._view[request_id]
            self._buffer.append(
                Finish(
                    request_id,
                    reason,
                    usage or Usage(),
                    timings or Timings(),
                    str(error_code),
                    error_message,
                    self.clock(),
                )
            )

    def commit(self, *, rotate: bool = True) -> int:
        with self._io_lock:
            with self._buf_lock:
                self._check_open()
                records, self._buffer = self._buffer, []
            if not records:
                return 0
            state = self._durable
            fsync_s: float | None = None
            operation = "write"
            try:
                batches, data = encode_frames(self.epoch, state.seq + 1, records, self._seq)
                write_all(self._fd, data)
                if self.mode == "tick":
                    operation = "fdatasync"
                    fsync_s = self._timed_fsync(self._fd)
            except OSError as exc:
                self._fail(operation, exc)
                raise JournalFailed(f"write-ahead log {operation} failed: {exc}") from exc
            if self._failed is not None:  # a sync() failed meanwhile: this commit is not released
                raise JournalFailed(f"the write-ahead log failed earlier: {self._failed}")
            with self._state_lock:
                for batch in batches:  # cannot contradict: every call was checked against _view
                    state.apply_batch(batch)
            self._seg_size += len(data)
            self._written += len(data)
            if fsync_s is not None:
                self._synced = self._written
            st = self.stats
            st.bytes_written += len(data)
            st.commits += 1
            st.records_written += len(records)
            if self.on_commit is not None:
                self.on_commit(len(data), fsync_s)
            if rotate and self._rotation_due():
                self._rotate_or_fail()
            return len(data)

    def sync(self) -> float | None:
        with self._sync_lock:
            with self._io_lock:
                self._check_open()
                target = self._written
                if target == self._synced:
                    return None
                try:  # a descriptor of its own: a rotation may close the segment's meanwhile
                    fd = os.dup(self._fd)
                except OSError as exc:
                    self._fail("sync", exc)
                    raise JournalFailed(f"write-ahead log sync failed: {exc}") from exc
            t0 = time.perf_counter()
            try:
                os.fdatasync(fd)
            except OSError as exc:
                with self._io_lock:  # no commit after this one succeeds (``commit``)
                    self._fail("fdatasync", exc)
                raise JournalFailed(f"write-ahead log fdatasync failed: {exc}") from exc
            finally:
                os.close(fd)
            dt = time.perf_counter() - t0
            with self._io_lock:
                self._synced = max(self._synced, target)
                st = self.stats
                st.fsyncs += 1
                st.syncs += 1
                st.fsync_seconds_total += dt
                st.last_fsync_s = dt
        if self.on_sync is not None:
            self.on_sync(dt)
        return dt

    @property
    def unsynced_bytes(self) -> int:
        return self._written - self._synced

    def rotation_due(self) -> bool:
        return self._failed is None and not self._closed and self._rotation_due()

    def _rotation_due(self) -> bool:
        """The segment grew ``segment_bytes`` past its checkpoint, or is older than the TTL (and
        ``MIN_AGE_ROTATION_S``) while an expired result is still on disk (module docstring)."""
        grown = self._seg_size - self._checkpoint_size
        if grown >= self.segment_bytes:
            return True
        now = self.clock()
        if now - self._seg_started <= max(self.ttl_s, MIN_AGE_ROTATION_S):
            return False
        with self._state_lock:
            oldest = next(iter(self._durable.results.values()), None)  # in finishing order
        return oldest is not None and now - oldest.t_finished > self.ttl_s

    def _rotate_or_fail(self) -> None:
        try:
            self._rotate()
        except OSError as exc:
            self._fail("rotation", exc)
            raise JournalFailed(f"write-ahead log rotation failed: {exc}") from exc

    def _fail(self, operation: str, exc: OSError) -> None:
        """Mark the journal failed for good. ``_failed`` names the operation as well as the error,
        so a caller that meets the failure later (``_check_open``) reports what failed, not only
        the errno (another thread may reach the journal before the failing one reports)."""
        self._failed = f"{operation} failed: {exc}"
        log.error("write-ahead log %s failed, no further request is durable: %s", operation, exc)

    def compact(self) -> None:
        with self._io_lock:
            self._check_open()
            self._rotate_or_fail()

    def maintain(self) -> bool:
        with self._io_lock:
            self._check_open()
            if not self._rotation_due():
                return False
            self._rotate_or_fail()
            return True

    def result(self, request_id: str) -> FinishedResult | None:
        """Never waits for a write or an fsync in flight (only for the mirror's update), so the
        event loop may call it."""
        with self._state_lock:
            res = self._durable.results.get(request_id)
            if res is not None and self.clock() - res.t_finished > self.ttl_s:
                return None
            return res

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._failed is None:
                self.commit()
                self.sync()  # mode "write": what was written is on stable storage before the end
        finally:
            with self._io_lock:
                self._closed = True
                self._release()
