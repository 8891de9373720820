"""Recorded write-ahead logs for the recovery tests: a real ``Journal`` runs a script of calls
and notes, after each commit, the segment's length and the state a recovery must find there."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from basertd.schema.client import Usage
from basertd.server.durability.wal_disk import open_journal
from basertd.server.durability.wal_format import WAL_DIR, LogState, RequestRecord, list_segments

CLOCK = 1_000_000.0
"""Fixed wall clock of recorded logs (results never expire in them)."""


def snapshot(state: LogState) -> tuple:
    """A comparable picture of a state: running requests with their tokens, results."""
    live = {rid: (r.record, tuple(r.tokens)) for rid, r in state.live.items()}
    results = {rid: (tuple(r.tokens), r.finish_reason, r.usage) for rid, r in state.results.items()}
    return live, results


@dataclass
class RecordedLog:
    """One segment's bytes and ``boundaries``: (end offset, snapshot) after the checkpoint and
    after each commit, in order."""

    name: str
    data: bytes
    boundaries: list[tuple[int, tuple]]

    def expected_at(self, cut: int) -> tuple[int, tuple]:
        """The boundary (offset, snapshot) a log cut at byte ``cut`` must recover to."""
        best = (0, (dict(), dict()))
        for end, snap in self.boundaries:
            if end <= cut:
                best = (end, snap)
        return best

    def expected_for(self, damaged: bytes) -> tuple[int, tuple]:
        """The boundary a damaged copy must recover to: the last one within the bytes it still
        shares with the original (a zeroed tail may rebuild a frame that ended in zeros)."""
        n = 0
        limit = min(len(damaged), len(self.data))
        while n < limit and damaged[n] == self.data[n]:
            n += 1
        return self.expected_at(n)

    def write(self, state_dir: Path, data: bytes) -> None:
        """Make ``state_dir`` hold only this segment, with contents ``data``."""
        shutil.rmtree(state_dir / WAL_DIR, ignore_errors=True)
        (state_dir / WAL_DIR).mkdir(parents=True)
        (state_dir / WAL_DIR / self.name).write_bytes(data)


def record_log(state_dir: Path, seed: int, commits: int = 8) -> RecordedLog:
    """Run a random script of accepted / tokens / finished calls over ``commits`` commits."""
    rng = random.Random(seed)
    journal = open_journal(state_dir, clock=lambda: CLOCK)
    boundaries = []
    seg = list_segments(state_dir / WAL_DIR)[-1][1]
    mirror = journal._durable  # the durable state after each commit
    boundaries.append((seg.stat().st_size, snapshot(mirror)))
    running: dict[str, int] = {}
    next_id = 0
    for _ in range(commits):
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.3 or not running:
                rid = f"r{next_id}"
                next_id += 1
                journal.accepted(
                    RequestRecord(
                        request_id=rid,
                        prompt=[rng.randrange(1, 300) for _ in range(rng.randint(1, 6))],
                        max_tokens=rng.randint(1, 64),
                        seed=rng.randrange(1 << 32),
                        temperature=rng.choice([0.0, 0.7]),
                        qos=rng.choice(["interactive", "batch"]),
                        stop=["\n"] if rng.random() < 0.3 else [],
                        t_accepted=CLOCK,
                    )
                )
                running[rid] = 0
            elif op < 0.85:
                rid = rng.choice(sorted(running))
                ids = [rng.randrange(0, 70000) for _ in range(rng.randint(1, 5))]
                journal.tokens(rid, running[rid], ids)
                running[rid] += len(ids)
            else:
                rid = rng.choice(sorted(running))
                del running[rid]
                journal.finished(rid, rng.choice(["stop", "length", "eos"]), usage=Usage(completion_tokens=3))
        journal.commit()
        boundaries.append((seg.stat().st_size, snapshot(mirror)))
    journal.close()
    return RecordedLog(seg.name, seg.read_bytes(), boundaries)
