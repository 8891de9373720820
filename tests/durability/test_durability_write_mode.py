"""``[durability] mode = "write"`` (the default; ``basertd.server.durability.durable``): a group
commit is one ``os.write`` on the event loop and the held replies go out right after it; one
fdatasync in a thread, at most every ``sync_interval_ms``, covers every commit before it; a stop
fdatasyncs what is left; a failed fdatasync stops acknowledging for good.

In process, on a real state directory: the commits run on the loop's own thread without an
fdatasync, the background fdatasyncs are at least the interval apart and the last one comes about
an interval after the last commit, ``close`` leaves nothing unsynced, and a failing fdatasync
(``os.fdatasync`` raising EIO, as in tests/wal) ends acknowledging, never retried. Then a real
``basertd serve`` whose fdatasync starts failing (the same fault, injected into the daemon's process
by a ``sitecustomize`` module on its ``PYTHONPATH``) exits with status 74."""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import threading
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon
from serving_harness import ref_toml
from sink_testutil import Sink, journaled_request

from basertd.client import ClientError
from basertd.schema import client as api
from basertd.server.durability.durable import EXIT_JOURNAL_FAILED, Durability
from basertd.server.durability.wal_disk import open_journal
from basertd.server.observe.metrics import Metrics

INTERVAL_S = 0.2


async def _until(cond, timeout: float) -> None:
    """Wait until ``cond()`` holds (polled on the loop), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_commits_run_on_the_loop_and_fsyncs_are_coalesced_per_interval(tmp_path: Path) -> None:
    commits: list[tuple[int, float | None]] = []  # (thread, fsync seconds) of each commit
    syncs: list[tuple[float, float]] = []  # (start, end) of each background fdatasync, monotonic

    def on_sync(seconds: float) -> None:
        now = time.monotonic()
        syncs.append((now - seconds, now))

    async def scenario() -> tuple[int, float, float, list[int]]:
        loop_thread = threading.get_ident()
        journal = open_journal(
            tmp_path,
            mode="write",
            on_commit=lambda n, fsync_s: commits.append((threading.get_ident(), fsync_s)),
            on_sync=on_sync,
        )
        dur = Durability(journal, Metrics(), sync_interval_s=INTERVAL_S)
        dur.start()
        sink = Sink()
        req = journaled_request(dur, sink)
        t0 = time.monotonic()
        for i in range(120):  # a token every ~5 ms for about a second: many commits
            req.sink.send(api.Tokens(request_id="a", ids=[i]))
            await asyncio.sleep(0.005)
        await dur.flush()
        last_commit = time.monotonic()
        assert sink.ids() == list(range(120))  # every reply released (before its fdatasync)
        await _until(lambda: journal.unsynced_bytes == 0, INTERVAL_S * 10 + 5)
        synced = time.monotonic()
        assert all(t == loop_thread for t, _ in commits), "a commit hopped to a thread"
        assert all(f is None for _, f in commits), "a commit fsynced"
        await dur.close()
        return dur.commits, last_commit - t0, synced - last_commit, sink.ids()

    n_commits, streamed_s, tail_s, delivered = asyncio.run(scenario())
    assert n_commits >= 60 and len(syncs) >= 2  # the syncs ran while it streamed, not only at the end
    assert len(syncs) <= streamed_s / INTERVAL_S + 3 < n_commits / 4  # one covers many commits
    starts = [s for s, _ in syncs]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= INTERVAL_S * 0.9, gaps  # at most one per interval
    assert tail_s <= INTERVAL_S + 1.0, tail_s  # the last commit synced within about an interval
    with open_journal(tmp_path) as j:
        (u,) = j.recovered.unfinished
        assert u.tokens == delivered == list(range(120))


def test_a_close_fdatasyncs_what_no_sync_covered_yet(tmp_path: Path) -> None:
    async def scenario() -> list[int]:
        journal = open_journal(tmp_path, mode="write")
        dur = Durability(journal, Metrics(), sync_interval_s=3600.0)
        dur.start()
        sink = Sink()
        req = journaled_request(dur, sink)
        await dur.flush()
        await _until(lambda: journal.unsynced_bytes == 0, 10)  # the first sync comes at once
        req.sink.send(api.Tokens(request_id="a", ids=[7, 8]))
        await dur.flush()
        assert sink.ids() == [7, 8] and journal.unsynced_bytes > 0  # the next one: an hour later
        await dur.close()
        assert journal.unsynced_bytes == 0 and journal.stats.syncs == 2
        return sink.ids()

    delivered = asyncio.run(scenario())
    with open_journal(tmp_path) as j:
        (u,) = j.recovered.unfinished
        assert u.tokens == delivered


def test_a_failed_fdatasync_stops_acknowledging_and_is_never_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[int] = []

    def eio(fd: int) -> None:
        tries.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    async def scenario() -> tuple[int, int, str | None]:
        journal = open_journal(tmp_path, mode="write")
        failed = asyncio.Event()
        sink = Sink()
        at_failure: list[int] = []

        def on_failed() -> None:
            at_failure.append(len(sink.sent))
            failed.set()

        dur = Durability(journal, Metrics(), on_failed=on_failed, sync_interval_s=0.02)
        dur.start()
        req = journaled_request(dur, sink)
        req.sink.send(api.Tokens(request_id="a", ids=[1]))
        await dur.flush()
        await _until(lambda: journal.unsynced_bytes == 0, 10)
        monkeypatch.setattr(os, "fdatasync", eio)
        req.sink.send(api.Tokens(request_id="a", ids=[2]))  # written, released: its sync fails
        await asyncio.wait_for(failed.wait(), 10)
        for i in range(3, 10):  # nothing is released any more, nor synced again
            req.sink.send(api.Tokens(request_id="a", ids=[i]))
            await dur.flush()
        req.sink.send(api.Done(request_id="a", finish_reason="length"))
        await dur.flush()
        await dur.close()  # no last commit, no fdatasync: the journal failed
        return at_failure[0], len(sink.sent), dur.failure

    released_at_failure, released, failure = asyncio.run(scenario())
    monkeypatch.undo()
    assert len(tries) == 1  # fsyncgate: one try
    assert released == released_at_failure
    assert failure is not None and "fdatasync failed" in failure and "Input/output error" in failure
    assert EXIT_JOURNAL_FAILED == 74


SITECUSTOMIZE = """
import errno, os
_trigger = os.environ.get("BRT_TEST_FAIL_FDATASYNC")
if _trigger:
    _real = os.fdatasync

    def _fdatasync(fd):
        if os.path.exists(_trigger):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return _real(fd)

    os.fdatasync = _fdatasync
"""


def test_a_daemon_whose_fdatasync_fails_exits_74(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    trigger = tmp_path / "fail-now"
    env = {
        "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "BRT_TEST_FAIL_FDATASYNC": str(trigger),
    }
    cfg = ref_toml(lanes=2, context=256) + '[durability]\nmode = "write"\nsync_interval_ms = 20\n'
    d = Daemon(cfg, env=env)
    try:
        with d.client() as c:
            assert len(c.generate("before", max_tokens=4, temperature=0).ids) == 4
            trigger.touch()
            with pytest.raises(ClientError):  # the connection ends once the fdatasync failed
                for i in range(1000):
                    c.generate(f"after {i}", max_tokens=4, temperature=0, resume=False)
        rc = d.proc.wait(60)
    except BaseException:
        d.kill()
        raise
    log = d.log_text()
    assert rc == EXIT_JOURNAL_FAILED, log
    failed = [e for e in d.log_events() if e.get("event") == "durability_failed"]
    assert failed and "fdatasync failed" in failed[0]["error"], log
    assert "Input/output error" in failed[0]["error"], log
    d.track_children()
    d.assert_released()
    d.cleanup()
