"""What the journal keeps on disk stays bounded, and a start refuses a state directory it could
not keep writing (``basertd.server.durability.wal_disk``): frames cut by bytes, a large checkpoint that
does not rotate at every commit, results gone from disk within about twice ``result_ttl_s`` or a
minute (an idle journal too, through ``maintain``), quarantined ``*.corrupt`` segments bounded, a state
directory short of ``min_free_bytes`` or not writable refused, and a finished result read
without waiting for an fsync in flight (mode "tick": a commit's; mode "write": a ``sync()``'s,
which a commit does not wait for either)."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pytest

from basertd.server.durability import wal_format
from basertd.server.durability.wal_disk import MIN_AGE_ROTATION_S, open_journal
from basertd.server.durability.wal_files import StateDirFull, StateDirUnwritable
from basertd.server.durability.wal_format import WAL_DIR, RequestRecord, list_segments, read_segment


def _rec(rid: str, prompt_len: int = 3) -> RequestRecord:
    return RequestRecord(request_id=rid, prompt=list(range(prompt_len)), max_tokens=32, seed=1, qos="batch")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stall_fdatasync(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make ``os.fdatasync`` block: ``entered`` is set once a call is inside it, and it waits
    (at most 30 s) for ``release`` before syncing."""
    entered, release = threading.Event(), threading.Event()
    real = os.fdatasync

    def slow_fsync(fd: int) -> None:
        entered.set()
        release.wait(30)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fsync)
    return entered, release


def test_frames_are_cut_by_bytes_and_the_log_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wal_format, "FRAME_BYTES", 8192)
    with open_journal(tmp_path, segment_bytes=1 << 30) as j:
        for i in range(40):
            j.accepted(_rec(f"r{i}", prompt_len=1000))  # ~2-3 KiB of msgpack each
        j.commit()  # one group commit of ~100 KiB: several frames, one write
        j.compact()  # and a checkpoint of the same size
        (seq, seg) = list_segments(tmp_path / WAL_DIR)[-1]
        bounds = [0] + [end for _, end in read_segment(seg, seq).batches]
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert len(sizes) > 4 and max(sizes) <= 8192 + 4096, sizes  # none past the cut + one record
    with open_journal(tmp_path) as j:
        assert len(j.recovered.unfinished) == 40


def test_a_checkpoint_larger_than_segment_bytes_does_not_rotate_at_every_commit(tmp_path: Path) -> None:
    with open_journal(tmp_path, segment_bytes=16384) as j:
        for i in range(20):
            j.accepted(_rec(f"big{i}", prompt_len=2000))  # ~80 KiB live: every checkpoint > 16 KiB
        j.commit()
        j.compact()
        before = j.stats.rotations
        for n in range(50):
            j.tokens("big0", n, [n])
            j.commit()
        assert j.stats.rotations - before == 0  # 50 small commits grew the segment < 16 KiB


def test_results_leave_the_disk_within_twice_their_ttl(tmp_path: Path) -> None:
    clock = Clock()
    with open_journal(tmp_path, result_ttl_s=10, clock=clock) as j:
        j.accepted(_rec("secret-result"))
        j.tokens("secret-result", 0, [7, 8])
        j.finished("secret-result", "stop")
        j.commit()
        assert j.result("secret-result") is not None
        clock.now += 11
        assert not j.maintain()  # expired, but the segment is younger than MIN_AGE_ROTATION_S
        clock.now += MIN_AGE_ROTATION_S
        assert j.maintain()  # idle: no commit since, the segment is older than the TTL
        assert j.result("secret-result") is None
        assert not j.maintain()  # nothing new: no rotation
        on_disk = b"".join(p.read_bytes() for p in (tmp_path / WAL_DIR).iterdir())
        assert b"secret-result" not in on_disk
        j.accepted(_rec("another"))
        j.finished("another", "stop")
        j.commit()
        clock.now += MIN_AGE_ROTATION_S + 1
        j.accepted(_rec("later"))
        j.commit()  # a commit past the TTL rotates too
        on_disk = b"".join(p.read_bytes() for p in (tmp_path / WAL_DIR).iterdir())
        assert b"another" not in on_disk and b"later" in on_disk


def test_a_zero_ttl_does_not_rotate_at_every_commit(tmp_path: Path) -> None:
    clock = Clock()
    with open_journal(tmp_path, result_ttl_s=0, clock=clock) as j:
        for i in range(30):
            j.accepted(_rec(f"r{i}"))
            j.finished(f"r{i}", "stop")
            j.commit()
            clock.now += 1
        assert j.stats.rotations == 0  # 30 s: younger than MIN_AGE_ROTATION_S
        clock.now += MIN_AGE_ROTATION_S
        j.accepted(_rec("last"))
        j.commit()
        assert j.stats.rotations == 1


def test_quarantined_segments_are_bounded(tmp_path: Path) -> None:
    with open_journal(tmp_path):
        pass
    wal_dir = tmp_path / WAL_DIR
    for i in range(7):
        p = wal_dir / f"{i:020d}.wal.corrupt"
        p.write_bytes(b"x")
        os.utime(p, (1000 + i, 1000 + i))
    with open_journal(tmp_path):
        pass
    kept = sorted(p.name for p in wal_dir.glob("*.corrupt"))
    assert kept == [f"{i:020d}.wal.corrupt" for i in range(3, 7)]  # the newest KEEP_CORRUPT


def test_a_state_dir_short_of_min_free_bytes_is_refused(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(StateDirFull) as err:
        open_journal(tmp_path, min_free_bytes=free * 4 + (1 << 40))
    assert "min_free_bytes" in str(err.value)
    assert list_segments(tmp_path / WAL_DIR) == []  # nothing written
    with open_journal(tmp_path, min_free_bytes=0):  # and the lock was released
        pass


def test_a_state_dir_that_cannot_take_a_write_is_refused_typed(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StateDirUnwritable) as err:
        open_journal(tmp_path / "file" / "state")
    assert "cannot take a write" in str(err.value)


def test_a_result_is_read_without_waiting_for_the_fsync_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = open_journal(tmp_path, mode="tick")
    j.accepted(_rec("done"))
    j.finished("done", "stop")
    j.commit()
    entered, release = _stall_fdatasync(monkeypatch)
    j.accepted(_rec("next"))
    committer = threading.Thread(target=j.commit)
    committer.start()
    try:
        assert entered.wait(10)  # the committer is inside its fsync, holding the write lock
        got: list = []
        reader = threading.Thread(target=lambda: got.append(j.result("done")))
        reader.start()
        reader.join(5)
        assert not reader.is_alive() and got and got[0].finish_reason == "stop"
    finally:
        release.set()
        committer.join(30)
        monkeypatch.undo()
        j.close()


def test_write_mode_commits_and_results_never_wait_for_the_sync_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mode "write": while ``sync()`` sits in its fdatasync, commits (the event loop's) and result
    reads go through; the sync covers what was written before it began, the rest stays unsynced."""
    j = open_journal(tmp_path, mode="write")
    j.accepted(_rec("done"))
    j.finished("done", "stop")
    j.commit()
    entered, release = _stall_fdatasync(monkeypatch)
    syncer = threading.Thread(target=j.sync)
    syncer.start()
    try:
        assert entered.wait(10)  # the syncer is inside its fdatasync
        got: list = []

        def loop_side() -> None:
            j.accepted(_rec("next"))
            got.append(j.commit())
            got.append(j.result("done"))

        other = threading.Thread(target=loop_side)
        other.start()
        other.join(5)
        assert not other.is_alive() and got[0] > 0 and got[1].finish_reason == "stop"
        assert j.unsynced_bytes > 0  # in flight when written: not covered by this sync
    finally:
        release.set()
        syncer.join(30)
        monkeypatch.undo()
    assert j.unsynced_bytes == got[0] and j.stats.syncs == 1
    j.close()
    assert j.unsynced_bytes == 0
