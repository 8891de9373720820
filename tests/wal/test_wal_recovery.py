"""Recovery of a write-ahead log cut, zeroed, flipped or followed by garbage: it is right (the
state of the last commit wholly on disk) or it fails closed (``WalCorrupt``), never wrong
(``basertd.server.durability.wal_format``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wal_testutil import CLOCK, RecordedLog, record_log, snapshot

from basertd.server.durability.wal_disk import open_journal
from basertd.server.durability.wal_format import (
    WAL_DIR,
    Batch,
    Toks,
    WalCorrupt,
    encode_frame,
)
from basertd.server.durability.wal_recover import plan_recovery


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> RecordedLog:
    return record_log(tmp_path_factory.mktemp("rec"), seed=1, commits=8)


def _recover(log: RecordedLog, state_dir: Path, data: bytes):
    log.write(state_dir, data)
    return plan_recovery(state_dir)


def test_recorded_log_has_frames_and_state(recorded: RecordedLog) -> None:
    assert len(recorded.boundaries) == 9
    assert recorded.boundaries[-1][0] == len(recorded.data)
    live, results = recorded.boundaries[-1][1]
    assert live or results  # the script did something


def test_every_cut_offset_recovers_the_last_whole_commit(recorded: RecordedLog, tmp_path: Path) -> None:
    for cut in range(len(recorded.data) + 1):
        plan = _recover(recorded, tmp_path, recorded.data[:cut])
        end, expected = recorded.expected_at(cut)
        assert snapshot(plan.state) == expected, f"cut at {cut}"
        torn = cut - end
        assert plan.report.truncated_bytes == torn, f"cut at {cut}"
        assert bool(plan.report.warnings) == (torn > 0 or cut == 0), f"cut at {cut}"  # 0: empty segment
        assert plan.report.ok


def test_zeroed_tails_are_truncated(recorded: RecordedLog, tmp_path: Path) -> None:
    rng = random.Random(7)
    for cut in range(0, len(recorded.data) + 1):
        data = recorded.data[:cut] + bytes(rng.randint(1, 600))
        plan = _recover(recorded, tmp_path, data)
        assert snapshot(plan.state) == recorded.expected_for(data)[1], f"cut at {cut}"
        assert plan.report.warnings


def test_garbage_tails_are_truncated_or_refused(recorded: RecordedLog, tmp_path: Path) -> None:
    rng = random.Random(8)
    boundaries = {end for end, _ in recorded.boundaries}
    for cut in range(0, len(recorded.data) + 1, 2):
        data = recorded.data[:cut] + rng.randbytes(rng.randint(1, 600))
        try:
            plan = _recover(recorded, tmp_path, data)
        except WalCorrupt:
            # garbage past a frame whose header survived: a later write, so not a torn tail
            assert cut not in boundaries, f"cut at {cut}"
            continue
        assert snapshot(plan.state) == recorded.expected_for(data)[1], f"cut at {cut}"


def test_zeroed_range_before_a_valid_frame_fails_closed(recorded: RecordedLog, tmp_path: Path) -> None:
    last_start = recorded.boundaries[-2][0]
    for pos in range(0, last_start, 5):
        data = bytearray(recorded.data)
        data[pos : pos + 8] = bytes(8)
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(data, recorded.data, strict=True)) if a != b), None
        )
        if first_diff is None or first_diff >= last_start:  # only the last frame damaged: torn
            continue
        with pytest.raises(WalCorrupt, match="wal check"):
            _recover(recorded, tmp_path, bytes(data))


def test_every_flipped_byte_fails_closed_or_drops_only_the_last_frame(
    recorded: RecordedLog, tmp_path: Path
) -> None:
    last_start = recorded.boundaries[-2][0]
    rng = random.Random(3)
    for pos in range(len(recorded.data)):
        data = bytearray(recorded.data)
        data[pos] ^= 1 << rng.randrange(8)
        if pos < last_start:
            with pytest.raises(WalCorrupt) as err:
                _recover(recorded, tmp_path, bytes(data))
            assert "--wal-recover=truncate" in str(err.value)
        else:
            plan = _recover(recorded, tmp_path, bytes(data))
            assert snapshot(plan.state) == recorded.boundaries[-2][1], f"flip at {pos}"


def test_truncate_mode_keeps_the_log_up_to_the_corruption(recorded: RecordedLog, tmp_path: Path) -> None:
    for k in range(1, len(recorded.boundaries) - 2):
        pos = recorded.boundaries[k][0] + 10  # inside frame k+1, valid frames follow
        data = bytearray(recorded.data)
        data[pos] ^= 0xFF
        recorded.write(tmp_path, bytes(data))
        plan = plan_recovery(tmp_path, "truncate")
        assert snapshot(plan.state) == recorded.boundaries[k][1]
        assert not plan.report.ok and plan.report.corrupt
        assert plan.quarantine == [tmp_path / WAL_DIR / recorded.name]


def test_valid_checksum_but_contradictory_records_fail_closed(recorded: RecordedLog, tmp_path: Path) -> None:
    seg = int(recorded.name.split(".")[0])
    last_seq = len(recorded.boundaries)  # one checkpoint frame + one frame per commit
    unknown = encode_frame(Batch(1, last_seq + 1, [Toks("nobody", 0, [1])]), seg)
    gap = encode_frame(Batch(1, last_seq + 5, []), seg)
    for extra in (unknown, gap):
        with pytest.raises(WalCorrupt, match=r"not running|follows"):
            _recover(recorded, tmp_path, recorded.data + extra)
        recorded.write(tmp_path, recorded.data + extra)
        plan = plan_recovery(tmp_path, "truncate")
        assert snapshot(plan.state) == recorded.boundaries[-1][1]
    # a frame of another segment never validates here (the checksum is seeded with the segment)
    foreign = encode_frame(Batch(1, last_seq + 1, []), seg + 1)
    plan = _recover(recorded, tmp_path, recorded.data + foreign)
    assert plan.report.truncated_bytes == len(foreign)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    commits=st.integers(1, 10),
    kind=st.sampled_from(["cut", "zeros", "garbage", "flip"]),
    where=st.floats(0.0, 1.0),
    tail=st.binary(min_size=1, max_size=300),
)
def test_any_damaged_log_is_right_or_refused(
    tmp_path_factory: pytest.TempPathFactory, seed: int, commits: int, kind: str, where: float, tail: bytes
) -> None:
    state_dir = tmp_path_factory.mktemp("hyp")
    log = record_log(state_dir, seed=seed, commits=commits)
    pos = int(where * len(log.data))
    if kind == "flip":
        data = bytearray(log.data)
        data[min(pos, len(data) - 1)] ^= tail[0] or 1
        try:
            plan = _recover(log, state_dir, bytes(data))
        except WalCorrupt:
            assert pos < log.boundaries[-2][0] or commits == 0
            return
        assert snapshot(plan.state) == log.boundaries[-2][1]
        return
    data = log.data[:pos] + {"cut": b"", "zeros": bytes(len(tail)), "garbage": tail}[kind]
    try:
        plan = _recover(log, state_dir, data)
    except WalCorrupt:
        assert kind == "garbage" and pos not in {end for end, _ in log.boundaries}
        return
    expected = log.expected_for(data)[1]
    assert snapshot(plan.state) == expected
    # and a real open on the damaged log recovers the same, then starts a clean segment
    journal = open_journal(state_dir, clock=lambda: CLOCK)
    try:
        got = {r.record.request_id: tuple(r.tokens) for r in journal.recovered.unfinished}
        assert got == {rid: toks for rid, (_, toks) in expected[0].items()}
    finally:
        journal.close()
    assert plan_recovery(state_dir).report.warnings == []
