"""The journal on a real state directory: reopen, result expiry, group commit, rotation and
compaction, the lock and the epoch across real processes, SIGKILL, refuse / truncate, off mode
(``basertd.server.durability.wal``). Mode "tick" (a write and an fdatasync per commit) and mode
"write" (a write per commit, one ``sync()`` fdatasync for every commit before it) each: what
their commits do, a failed fdatasync, close and rotation making the log durable, SIGKILL."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from basertd.schema.client import Usage
from basertd.server.durability.wal import JournalFailed, JournalUsageError, NullJournal
from basertd.server.durability.wal_disk import open_journal
from basertd.server.durability.wal_fence import StateDirLocked
from basertd.server.durability.wal_format import (
    WAL_DIR,
    RequestRecord,
    WalCorrupt,
    list_segments,
    read_segment,
)
from basertd.server.durability.wal_recover import plan_recovery


def _rec(rid: str, prompt: list[int] | None = None) -> RequestRecord:
    return RequestRecord(
        request_id=rid, prompt=prompt or [1, 2, 3], max_tokens=32, seed=1234, temperature=0.8, qos="batch"
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reopen_recovers_unfinished_requests_and_results(tmp_path: Path) -> None:
    with open_journal(tmp_path) as j:
        j.accepted(_rec("a", [5, 6]))
        j.accepted(_rec("b"))
        j.commit()
        j.tokens("a", 0, [10, 11])
        j.tokens("b", 0, [20])
        j.commit()
        j.tokens("a", 2, [12])
        j.finished("b", "eos", usage=Usage(prompt_tokens=3, completion_tokens=1))
        j.commit()
        j.accepted(_rec("never-committed"))  # close() commits it
    with open_journal(tmp_path) as j:
        unfinished = {u.record.request_id: u for u in j.recovered.unfinished}
        assert set(unfinished) == {"a", "never-committed"}
        assert unfinished["a"].tokens == [10, 11, 12]
        assert unfinished["a"].record == _rec("a", [5, 6])
        (res,) = j.recovered.results
        assert (res.request_id, res.tokens, res.finish_reason) == ("b", [20], "eos")
        assert res.usage.completion_tokens == 1
        assert j.result("b") == res
        assert j.stats.requests_recovered == 2 and j.stats.results_recovered == 1
        # generation continues where the log stopped
        j.tokens("a", 3, [13])
        j.finished("a", "length")
    with open_journal(tmp_path) as j:
        assert j.result("a").tokens == [10, 11, 12, 13]


def test_results_expire_after_result_ttl(tmp_path: Path) -> None:
    clock = Clock()
    with open_journal(tmp_path, result_ttl_s=60, clock=clock) as j:
        j.accepted(_rec("a"))
        j.finished("a", "stop")
        j.commit()
        clock.now += 59
        assert j.result("a") is not None
        clock.now += 2
        assert j.result("a") is None
    with open_journal(tmp_path, result_ttl_s=60, clock=clock) as j:
        assert j.recovered.results == []
    assert plan_recovery(tmp_path).report.results == 0  # dropped from the checkpoint on disk too


def _count_io(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """Note every ``os.write`` and ``os.fdatasync`` (still done) in ``calls``."""
    real_write, real_fdatasync = os.write, os.fdatasync
    monkeypatch.setattr(os, "write", lambda fd, b: calls.append("write") or real_write(fd, b))
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append("fsync") or real_fdatasync(fd))


def test_commit_is_one_write_and_one_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_write, real_fdatasync = os.write, os.fdatasync
    with open_journal(tmp_path, mode="tick") as j:
        monkeypatch.setattr(os, "write", lambda fd, b: calls.append("write") or real_write(fd, b))
        monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append("fsync") or real_fdatasync(fd))
        for i in range(16):
            j.accepted(_rec(f"r{i}"))
            j.tokens(f"r{i}", 0, list(range(8)))
        n = j.commit()
        assert calls == ["write", "fsync"] and n > 0
        assert j.commit() == 0 and calls == ["write", "fsync"]  # nothing buffered: no I/O
        assert j.stats.commits == 1 and j.stats.records_written == 32
        assert j.sync() is None and calls == ["write", "fsync"]  # mode "tick": nothing left to sync
        monkeypatch.undo()


def test_write_mode_commits_write_once_and_one_sync_covers_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    synced: list[float] = []
    with open_journal(tmp_path, mode="write", on_sync=synced.append) as j:
        assert j.mode == "write"
        _count_io(monkeypatch, calls)
        for i in range(16):
            j.accepted(_rec(f"r{i}"))
            j.tokens(f"r{i}", 0, list(range(8)))
        n = j.commit()
        assert calls == ["write"] and n > 0 and j.unsynced_bytes == n  # no fsync on the commit
        assert j.stats.fsyncs == 1  # the checkpoint's, at open
        for i in range(3):
            j.tokens("r0", 8 + i, [i])
            j.commit()
        assert calls == ["write"] * 4
        dt = j.sync()  # one fdatasync for the four commits
        assert dt is not None and dt >= 0 and synced == [dt]
        assert calls == ["write"] * 4 + ["fsync"] and j.unsynced_bytes == 0
        assert j.sync() is None and calls == ["write"] * 4 + ["fsync"]  # nothing new: no system call
        assert j.stats.commits == 4 and j.stats.syncs == 1 and j.stats.fsyncs == 2
        j.finished("r1", "stop")
        j.commit()
        assert j.result("r1") is not None  # the mirror advances at the write (process-death durable)
        assert calls[-1] == "write" and j.unsynced_bytes > 0
        j.accepted(_rec("at-close"))
        j.close()  # the last commit, then its fdatasync
        assert calls[-2:] == ["write", "fsync"] and j.unsynced_bytes == 0
        monkeypatch.undo()
    with open_journal(tmp_path) as j:
        assert {u.record.request_id for u in j.recovered.unfinished} >= {"r0", "at-close"}
        assert j.result("r1") is not None


def test_bad_calls_are_refused_and_buffer_nothing(tmp_path: Path) -> None:
    with open_journal(tmp_path) as j:
        j.accepted(_rec("a"))
        with pytest.raises(JournalUsageError):
            j.accepted(_rec("a"))
        with pytest.raises(JournalUsageError):
            j.tokens("zzz", 0, [1])
        with pytest.raises(JournalUsageError):
            j.tokens("a", 1, [1])  # gap: "a" has 0 tokens
        with pytest.raises(JournalUsageError):
            j.finished("zzz", "stop")
        j.commit()
    with open_journal(tmp_path) as j:
        assert [u.tokens for u in j.recovered.unfinished] == [[]]


def test_failed_fsync_closes_the_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = open_journal(tmp_path, mode="tick")
    j.accepted(_rec("a"))

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(JournalFailed):
        j.commit()
    monkeypatch.undo()
    with pytest.raises(JournalFailed):
        j.accepted(_rec("b"))
    j.close()


def test_write_mode_failed_fsync_is_never_retried_and_closes_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = open_journal(tmp_path, mode="write")
    j.accepted(_rec("a"))
    j.commit()  # written, not synced
    tries: list[int] = []

    def eio(fd: int) -> None:
        tries.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(JournalFailed, match="fdatasync failed"):
        j.sync()
    assert len(tries) == 1
    with pytest.raises(JournalFailed):
        j.sync()  # fsyncgate: the kernel may have marked the lost pages clean, never ask again
    assert len(tries) == 1
    monkeypatch.undo()
    # a caller that meets the failure later (another thread, the next tick) learns what failed
    with pytest.raises(JournalFailed, match=r"failed earlier: fdatasync failed: .*Input/output"):
        j.tokens("a", 0, [1])
    assert not j.rotation_due()
    with pytest.raises(JournalFailed):
        j.compact()
    j.close()  # no commit, no fsync, the lock released
    open_journal(tmp_path).close()


def test_write_mode_a_commit_after_a_failed_sync_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit buffered before the fdatasync failed is not released: ``commit`` raises."""
    j = open_journal(tmp_path, mode="write")
    j.accepted(_rec("a"))
    j.commit()
    j.tokens("a", 0, [1, 2])  # buffered before the failure
    monkeypatch.setattr(os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(JournalFailed):
        j.sync()
    monkeypatch.undo()
    with pytest.raises(JournalFailed):
        j.commit()
    j.close()


def test_write_mode_rotation_and_compaction_make_everything_durable_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    with open_journal(tmp_path, mode="write", segment_bytes=4096) as j:
        _count_io(monkeypatch, calls)
        j.accepted(_rec("a"))
        n = 0
        while not j.rotation_due():
            j.tokens("a", n, list(range(n, n + 50)))
            n += 50
            j.commit(rotate=False)  # the caller rotates: off the event loop
        assert set(calls) == {"write"} and j.unsynced_bytes > 0
        old = list_segments(tmp_path / WAL_DIR)
        assert j.maintain() and j.stats.rotations == 1
        assert "fsync" in calls and j.unsynced_bytes == 0 and not j.rotation_due()
        assert list_segments(tmp_path / WAL_DIR)[0][0] > old[-1][0]  # the old segment is gone
        calls.clear()
        assert j.sync() is None and calls == []  # the checkpoint covered every commit
        j.tokens("a", n, [1])
        j.commit()
        assert j.unsynced_bytes > 0
        j.compact()
        assert j.unsynced_bytes == 0 and "fsync" in calls
        monkeypatch.undo()
    with open_journal(tmp_path) as j:
        assert j.recovered.unfinished[0].tokens == [i for i in range(n)] + [1]


def test_rotation_compacts_into_one_segment(tmp_path: Path) -> None:
    clock = Clock()
    with open_journal(tmp_path, segment_bytes=4096, result_ttl_s=10, clock=clock) as j:
        for i in range(200):
            j.accepted(_rec(f"r{i}"))
            j.tokens(f"r{i}", 0, list(range(20)))
            if i % 2:
                j.finished(f"r{i}", "stop")
            j.commit()
            clock.now += 1
        assert j.stats.rotations >= 10
        assert len(list_segments(tmp_path / WAL_DIR)) == 1
    report = plan_recovery(tmp_path).report
    assert report.unfinished == 100
    assert report.results <= 12  # finished more than result_ttl_s ago: compacted away
    with open_journal(tmp_path, result_ttl_s=10, clock=clock) as j:
        assert len(j.recovered.unfinished) == 100
        assert all(u.tokens == list(range(20)) for u in j.recovered.unfinished)


def test_epoch_grows_with_every_open(tmp_path: Path) -> None:
    epochs = []
    for _ in range(3):
        with open_journal(tmp_path) as j:
            epochs.append(j.epoch)
    assert epochs == [1, 2, 3]
    assert (tmp_path / "epoch").read_text().strip() == "3"
    (tmp_path / "epoch").unlink()  # the log alone still fences: its frames carry epoch 3
    with open_journal(tmp_path) as j:
        assert j.epoch == 4


_CHILD = """
import sys
from basertd.server.durability.wal import Journal
from basertd.server.durability.wal_disk import open_journal
from basertd.server.durability.wal_format import RequestRecord
j = open_journal(sys.argv[1], mode=sys.argv[2])
j.accepted(RequestRecord(request_id="x", prompt=[1], max_tokens=10**6, seed=1))
j.commit()
print("ready", flush=True)
i = 0
while True:
    j.tokens("x", i, [i])
    j.commit()
    print(i, flush=True)
    i += 1
"""


def _child(state_dir: Path, mode: str = "write") -> subprocess.Popen:
    """A process committing one token at a time, printing each count after its commit returned
    (in mode "write" it never syncs: only the page cache holds its tokens)."""
    argv = [sys.executable, "-c", _CHILD, str(state_dir), mode]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_one_daemon_per_state_dir_across_processes(tmp_path: Path) -> None:
    proc = _child(tmp_path)
    try:
        with pytest.raises(StateDirLocked, match=f"pid {proc.pid}"):
            open_journal(tmp_path)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    with open_journal(tmp_path) as j:  # the lock died with its holder
        assert j.recovered.unfinished[0].record.request_id == "x"


@pytest.mark.parametrize("mode", ["write", "tick"])
def test_sigkill_loses_no_acknowledged_token(tmp_path: Path, mode: str) -> None:
    rng = random.Random(5)
    for trial in range(4):
        state_dir = tmp_path / f"t{trial}"
        proc = _child(state_dir, mode)
        acked = -1
        for _ in range(rng.randint(1, 60)):
            acked = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        with open_journal(state_dir) as j:
            (u,) = j.recovered.unfinished
            n = len(u.tokens)
            assert u.tokens == list(range(n))
            assert n >= acked + 1, f"acknowledged {acked + 1} tokens, recovered {n}"


def test_corruption_refuses_then_truncate_quarantines(tmp_path: Path) -> None:
    with open_journal(tmp_path, segment_bytes=1 << 30) as j:
        j.accepted(_rec("a"))
        for i in range(5):
            j.tokens("a", i, [i])
            j.commit()
    (seq, seg) = list_segments(tmp_path / WAL_DIR)[-1]
    data = bytearray(seg.read_bytes())
    ends = [end for _, end in read_segment(seg, seq).batches]  # checkpoint, then one per commit
    data[ends[3] - 2] ^= 0x40  # inside the frame of the third commit

    seg.write_bytes(bytes(data))
    with pytest.raises(WalCorrupt) as err:
        open_journal(tmp_path)
    assert "basertctl wal check" in str(err.value) and "--wal-recover=truncate" in str(err.value)
    assert seg.read_bytes() == bytes(data)  # refusing changed nothing
    with open_journal(tmp_path, recover="truncate") as j:
        assert not j.recovered.report.ok
        (u,) = j.recovered.unfinished
        assert u.tokens == [0, 1]
    assert (seg.parent / (seg.name + ".corrupt")).exists()
    with open_journal(tmp_path) as j:  # clean from now on
        assert j.recovered.report.ok and j.recovered.report.warnings == []


def test_off_mode_touches_nothing(tmp_path: Path) -> None:
    j = open_journal(tmp_path / "state", mode="off")
    assert isinstance(j, NullJournal) and j.epoch == 0
    j.accepted(_rec("a"))
    j.tokens("a", 0, [1])
    j.finished("a", "stop")
    assert j.commit() == 0
    j.close()
    assert not (tmp_path / "state").exists()
