"""Two processes on one small ring: a writer process rewrites 4 slots as fast as it can while this
process reads; every read is exactly the payload published under its generation, or StaleRef.
Never torn (ABI rule 129). Also: a writer killed by SIGKILL mid-stream leaves a ring that still
reads exact-or-stale and nothing in /dev/shm."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import numpy as np
import pytest
from proc_testutil import devshm_listing
from shm_ring_peer import (
    CTRL_WORDS,
    STRESS_CAP,
    STRESS_SLOT_BYTES,
    STRESS_SLOTS,
    stress_pattern,
    stress_segment_bytes,
    stress_span_of_slot,
)

from basertd.schema.abi import RingKind
from basertd.schema.tick import TokenRef
from basertd.shm import RingReader, RingWriter, Segment, StaleRef, ring_bytes, slot_bytes_for

RID = 9
READS = 200_000


class _Writer:
    """The hammering writer process over a fresh stress ring; ``ctrl`` = [stop, spans, ready, spare]."""

    def __init__(self, py_peer):
        length, ctrl_off = stress_segment_bytes()
        self.seg = Segment.create(length)
        RingWriter.create(self.seg, RID, RingKind.TOKENS, STRESS_SLOTS, STRESS_SLOT_BYTES).close()
        self.ctrl = np.frombuffer(self.seg.buffer, dtype=np.uint64, count=CTRL_WORDS, offset=ctrl_off)
        cmd = [*py_peer, "hammer", self.seg.fd, length, RID, STRESS_SLOTS, STRESS_SLOT_BYTES, ctrl_off]
        self.proc = subprocess.Popen(
            [str(a) for a in cmd], pass_fds=[self.seg.fd], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            self.reader = RingReader.attach(self.seg, RID, RingKind.TOKENS, STRESS_SLOTS, STRESS_SLOT_BYTES)
            deadline = time.monotonic() + 60
            while self.ctrl[2] == 0 or self.ctrl[1] < 30:  # started and writing
                assert self.proc.poll() is None, self.proc.stderr.read().decode()
                assert time.monotonic() < deadline, "writer did not start"
                time.sleep(0.01)
        except BaseException:
            self.close()
            raise

    def stop(self) -> dict:
        self.ctrl[0] = 1
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err.decode()
        return json.loads(out)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()
        del self.ctrl
        self.seg.close()


def _checked_read(reader: RingReader, index: int, older: bool) -> str:
    """One read of the span covering slot ``index`` (or of a span 5 slots older): 'ok', 'stale',
    'torn' (data that is not the payload of the reference's generation) or 'empty' (slot unwritten)."""
    gen = reader.slot_generation(index)
    if gen == 0:
        return "empty"
    first, count, _ = stress_span_of_slot(gen)
    if older and first > 5:
        first -= 5
    ref = TokenRef(ring_id=RID, index=(first - 1) % STRESS_SLOTS, count=count, generation=first)
    try:
        data = reader.read(ref)
    except StaleRef:
        return "stale"
    return "ok" if np.array_equal(data, stress_pattern(first, count)) else "torn"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_process_stress_never_reads_torn_data(no_leaks, py_peer):
    before = devshm_listing()
    w = _Writer(py_peer)
    try:
        rng = np.random.default_rng(12345)
        indices = rng.integers(0, STRESS_SLOTS, size=READS * 2).tolist()
        older = (rng.random(READS * 2) < 0.05).tolist()
        counts = {"ok": 0, "stale": 0, "torn": 0, "empty": 0}
        reads, i = 0, 0
        spans_at_start = int(w.ctrl[1])
        while reads < READS:
            outcome = _checked_read(w.reader, indices[i], older[i])
            i += 1
            counts[outcome] += 1
            reads += outcome != "empty"
        spans_during = int(w.ctrl[1]) - spans_at_start
        result = w.stop()
    finally:
        w.close()
    print(f"stress: {counts}, writer spans during reads {spans_during}, total {result['spans']}")
    assert counts["torn"] == 0, counts
    assert counts["ok"] + counts["stale"] == READS
    assert counts["ok"] > READS // 10, counts  # most reads of the newest spans succeed
    assert counts["stale"] > 0, counts  # recycled spans were hit and refused
    assert spans_during > 1000, "the writer did not run concurrently with the reads"
    assert devshm_listing() - before == set()


def _naive_read(seg: Segment, reader: RingReader, index: int) -> bool | None:
    """A deliberately broken reader: generation checked once, before a plain copy of the slot's
    payload, never after. Returns whether the copy matched, None if the slot was unwritten."""
    gen = reader.slot_generation(index)
    if gen == 0:
        return None
    first, count, pos = stress_span_of_slot(gen)
    n = min(STRESS_CAP, count - pos * STRESS_CAP)
    off = 64 + index * STRESS_SLOT_BYTES + 16
    data = np.frombuffer(seg.buffer, dtype=np.uint32, count=n, offset=off).copy()
    return np.array_equal(data, stress_pattern(first, count)[pos * STRESS_CAP : pos * STRESS_CAP + n])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_stress_check_catches_a_reader_without_the_second_check(no_leaks, py_peer):
    """Control for the test above: the same writer and payload check flag a reader that skips the
    after-copy validation, so zero torn reads there is a finding, not a blind spot."""
    w = _Writer(py_peer)
    try:
        bad = good = 0
        rng = np.random.default_rng(7)
        deadline = time.monotonic() + 20
        while bad < 5 and time.monotonic() < deadline:
            for index in rng.integers(0, STRESS_SLOTS, size=1000).tolist():
                ok = _naive_read(w.seg, w.reader, index)
                bad += ok is False
                good += ok is True
        w.stop()
    finally:
        w.close()
    print(f"naive reader: {bad} bad, {good} good")
    assert bad >= 5, f"the payload check never caught the naive reader ({good} reads matched)"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_writer_killed_mid_stream_leaves_exact_or_stale_and_no_dev_shm(no_leaks, py_peer):
    before = devshm_listing()
    w = _Writer(py_peer)
    try:
        w.proc.send_signal(signal.SIGKILL)
        assert w.proc.wait(timeout=30) == -signal.SIGKILL
        last = [w.reader.slot_generation(i) for i in range(STRESS_SLOTS)]
        outcomes = [_checked_read(w.reader, i, older=False) for i in range(STRESS_SLOTS)]
        assert "torn" not in outcomes, outcomes
        assert outcomes.count("ok") >= 1, (outcomes, last)  # the newest complete span survives
        # a new writer lifetime on the same ring starts over at generation 1 (ABI rule 130)
        w2 = RingWriter.attach(w.seg, RID, RingKind.TOKENS, STRESS_SLOTS, STRESS_SLOT_BYTES)
        assert w2.write([1, 2]) == TokenRef(ring_id=RID, index=0, count=2, generation=1)
        assert w.reader.read(TokenRef(ring_id=RID, index=0, count=2, generation=1)).tolist() == [1, 2]
    finally:
        w.close()
    assert devshm_listing() - before == set()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_c_writer_and_c_reader_processes_never_tear(no_leaks, c_peer):
    """The C ring code at C speed on both sides (the reference engine's writer against a C reader in
    another process): millions of contended reads, every one exact or stale (ABI rule 129)."""
    slots, slot_bytes = 5, slot_bytes_for(512)
    with Segment.create(ring_bytes(slots, slot_bytes)) as seg:
        RingWriter.create(seg, RID, RingKind.TOKENS, slots, slot_bytes).close()
        base = [str(c_peer), str(seg.fd), str(seg.length), str(RID), str(slots), str(slot_bytes)]
        writer = subprocess.Popen(
            [*base, "hammer-write", "1500"], pass_fds=[seg.fd], stdout=subprocess.PIPE, text=True
        )
        try:
            time.sleep(0.1)
            reader = subprocess.run(
                [*base, "hammer-read", "1000"], pass_fds=[seg.fd], capture_output=True, text=True, timeout=60
            )
            out, _ = writer.communicate(timeout=60)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
    assert reader.returncode == 0 and writer.returncode == 0, reader.stderr
    words = reader.stdout.split()
    counts = dict(zip(words[::2], map(int, words[1::2]), strict=True))
    print(f"C stress: {counts}, writer {out.strip()}")
    assert counts["torn"] == 0, counts
    assert counts["ok"] > 10_000 and counts["stale"] > 0, counts
    assert int(out.split()[1]) > 10_000
