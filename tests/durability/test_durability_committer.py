"""The committer never dies silently (``basertd.server.durability.durable.Durability``): any
exception of a group commit, not only ``JournalFailed``, stops acknowledging (the held reply is
never released), records why and calls ``on_failed`` (the daemon then exits 74,
``EXIT_JOURNAL_FAILED``). The fault is real: the journal's own ``on_commit`` hook (the metrics
histogram in the daemon) raises inside a real commit on a real state directory, in mode "tick"
(the commit in a thread) and "write" (the commit on the event loop)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sink_testutil import Sink, journaled_request

from basertd.server.durability.durable import EXIT_JOURNAL_FAILED, Durability
from basertd.server.durability.wal_disk import open_journal
from basertd.server.observe.metrics import Metrics


@pytest.mark.parametrize("mode", ["write", "tick"])
def test_a_committer_that_dies_of_any_exception_fails_closed_and_says_so(tmp_path: Path, mode: str) -> None:
    def broken_hook(nbytes: int, fsync_s: float | None) -> None:
        raise RuntimeError("histogram exploded")

    async def scenario():
        journal = open_journal(tmp_path, mode=mode, on_commit=broken_hook)
        failed = asyncio.Event()
        dur = Durability(journal, Metrics(), on_failed=failed.set)
        dur.start()
        sink = Sink()
        journaled_request(dur, sink, max_tokens=4)  # held until its commit returns: that commit raises
        await asyncio.wait_for(failed.wait(), 10)
        failure = dur.failure
        await dur.close()
        return sink.sent, failure

    sent, failure = asyncio.run(scenario())
    assert sent == []  # nothing acknowledged
    assert failure == "RuntimeError: histogram exploded"
    assert EXIT_JOURNAL_FAILED == 74


def test_an_idle_journal_is_maintained_and_a_busy_one_is_not(tmp_path: Path, monkeypatch) -> None:
    """``Journal.maintain`` (expired results leave the disk) runs once no commit happened for
    ``MAINTAIN_EVERY_S``, checked by a timer every ``MAINTAIN_EVERY_S``; a commit within that time
    puts it off."""
    from basertd.server.durability import durable

    monkeypatch.setattr(durable, "MAINTAIN_EVERY_S", 0.2)

    async def scenario():
        journal = open_journal(tmp_path, mode="write")
        calls: list[float] = []
        real = journal.maintain

        def counted() -> bool:
            calls.append(1.0)
            return real()

        journal.maintain = counted  # type: ignore[method-assign]
        dur = Durability(journal, Metrics())
        dur.start()
        busy_until = asyncio.get_running_loop().time() + 0.9
        n = 0
        while asyncio.get_running_loop().time() < busy_until:  # a commit every 50 ms
            sink = Sink()
            journaled_request(dur, sink, f"r{n}", max_tokens=4)
            await dur.flush()
            assert sink.sent, "the acceptance was released by its commit"
            n += 1
            await asyncio.sleep(0.05)
        busy = len(calls)
        for _ in range(100):  # idle: at most 2 x MAINTAIN_EVERY_S after the last commit
            if len(calls) > busy:
                break
            await asyncio.sleep(0.05)
        idle = len(calls)
        await dur.close()
        return busy, idle, dur.commits

    busy, idle, commits = asyncio.run(scenario())
    assert commits >= 10
    assert busy == 0  # every check found a commit within MAINTAIN_EVERY_S
    assert idle >= 1
