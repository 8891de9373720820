"""Interop: the C ring code (the reference engine's) and the Python classes read each other's rings,
in one process through basertd.native._ringc and across processes over a descriptor passed with
pass_fds (a C process mapping the segment like an engine, and a second Python process)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from basertd.native._ringc import ffi, lib
from basertd.schema.abi import RingKind
from basertd.schema.tick import TokenRef
from basertd.shm import RingReader, RingWriter, Segment, StaleRef, ring_bytes, slot_bytes_for

RID = 2
SLOTS = 5
CAP = 6
SB = slot_bytes_for(CAP)
LEN = ring_bytes(SLOTS, SB)
TOK = RingKind.TOKENS


def c_pattern(n: int, seed: int) -> list[int]:
    """What shm_ring_peer.c writes for (n, seed)."""
    return [(seed + i * 2654435761) & 0xFFFFFFFF for i in range(n)]


def ref(index, count, gen):
    return TokenRef(ring_id=RID, index=index, count=count, generation=gen)


@pytest.fixture
def seg(no_leaks):
    with Segment.create(LEN) as s:
        RingWriter.create(s, RID, TOK, SLOTS, SB).close()  # formatted, no writer attached
        yield s


def test_in_process_c_writes_python_reads(seg):
    view = ffi.from_buffer(seg.buffer)
    try:
        ring = ffi.new("brt_ring *")
        assert lib.brt_ring_attach(ring, view, seg.length, RID, SB, SLOTS) == 0
        src = np.arange(1, 15, dtype=np.uint32)
        span = ffi.new("brt_span *")
        assert lib.brt_ring_write(ring, ffi.from_buffer(src), 14, 4, span) == 0
        assert (span.index, span.count, span.generation) == (0, 14, 1)
        assert (
            lib.brt_ring_write(ring, ffi.from_buffer(src), SLOTS * CAP + 1, 4, span)
            == lib.BRT_RING_ERR_BOUNDS
        )
        r = RingReader.attach(seg, RID, TOK, SLOTS, SB)
        assert r.read(ref(0, 14, 1)).tolist() == list(range(1, 15))
    finally:
        ffi.release(view)


def test_in_process_python_writes_c_reads(seg):
    w = RingWriter.attach(seg, RID, TOK, SLOTS, SB)
    a = w.write(np.arange(100, 113))
    view = ffi.from_buffer(seg.buffer)
    try:
        ring = ffi.new("brt_ring *")
        assert lib.brt_ring_attach(ring, view, seg.length, RID, SB, SLOTS) == 0
        dst = np.zeros(13, np.uint32)
        out = ffi.from_buffer(dst, require_writable=True)
        assert lib.brt_ring_read(ring, a.index, a.generation, a.count, 4, out) == 0
        assert dst.tolist() == list(range(100, 113))
        assert lib.brt_ring_read(ring, a.index, a.generation + 1, a.count, 4, out) == lib.BRT_RING_ERR_STALE
        assert lib.brt_ring_read(ring, a.index, 0, a.count, 4, out) == lib.BRT_RING_ERR_STALE
        assert lib.brt_ring_read(ring, SLOTS, a.generation, a.count, 4, out) == lib.BRT_RING_ERR_STALE
        assert lib.brt_ring_read(ring, a.index, a.generation, a.count - 2, 4, out) == lib.BRT_RING_ERR_STALE
        assert lib.brt_ring_read(ring, a.index, a.generation, a.count + 1, 4, out) == lib.BRT_RING_ERR_STALE
        assert [lib.brt_ring_slot_generation(ring, i) for i in range(SLOTS)] == [1, 2, 3, 0, 0]
    finally:
        ffi.release(view)


def _c_peer(c_peer, seg, *args, slots=SLOTS, ring_id=RID):
    cmd = [str(c_peer), str(seg.fd), str(seg.length), str(ring_id), str(slots), str(SB), *map(str, args)]
    out = subprocess.run(cmd, pass_fds=[seg.fd], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split("\n")[:-1]


def test_c_process_writes_python_reads(seg, c_peer):
    lines = _c_peer(c_peer, seg, "write", 4, 7, 13, 1000, 0, 5, 6, 99)
    refs = [tuple(int(x) for x in line.split()[1:]) for line in lines]
    # a fresh C writer starts at (index 0, generation 1); 13 tokens take 3 slots; 0 tokens take none
    assert refs == [(0, 4, 1), (1, 13, 2), (0, 0, 0), (4, 6, 5)]
    r = RingReader.attach(seg, RID, TOK, SLOTS, SB)
    assert r.read(ref(0, 4, 1)).tolist() == c_pattern(4, 7)
    assert r.read(ref(1, 13, 2)).tolist() == c_pattern(13, 1000)
    assert r.read(ref(4, 6, 5)).tolist() == c_pattern(6, 99)
    assert r.read(ref(0, 0, 0)).tolist() == []
    lines = _c_peer(c_peer, seg, "write", 6, 1)  # a second C writer lifetime restarts at generation 1
    assert lines == ["ref 0 6 1"]
    assert r.read(ref(0, 6, 1)).tolist() == c_pattern(6, 1)


def test_python_writes_c_process_reads(seg, c_peer):
    w = RingWriter.attach(seg, RID, TOK, SLOTS, SB)
    a = w.write([5, 6, 7])
    b = w.write(np.arange(40, 57))  # 17 tokens over slots 1, 2, 3
    c = w.write(np.arange(8, 16))  # 8 tokens over slots 4 and 0: wraps, recycles a
    lines = _c_peer(
        c_peer,
        seg,
        "read",
        *(b.index, b.count, b.generation),
        *(c.index, c.count, c.generation),
        *(a.index, a.count, a.generation),
        *(b.index, b.count - 1, b.generation),
        *(b.index, b.count, 0),
    )
    assert lines[0] == "ok " + " ".join(map(str, range(40, 57)))
    assert lines[1] == "ok " + " ".join(map(str, range(8, 16)))
    assert lines[2:] == ["stale -103"] * 3


def test_c_process_refuses_a_mismatched_layout(seg, c_peer):  # ABI rule 125
    assert _c_peer(c_peer, seg, "attach") == ["ok"]
    assert _c_peer(c_peer, seg, "attach", slots=SLOTS + 1) == ["layout -131"]
    assert _c_peer(c_peer, seg, "attach", ring_id=RID + 1) == ["layout -131"]


def _py_peer(py_peer, seg, mode, request, kind=TOK, slots=SLOTS):
    cmd = [*py_peer, mode, str(seg.fd), str(seg.length), str(RID), str(int(kind)), str(slots), str(SB)]
    out = subprocess.run(
        cmd, pass_fds=[seg.fd], input=json.dumps(request), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_python_process_reads_what_this_process_wrote(seg, py_peer):
    w = RingWriter.attach(seg, RID, TOK, SLOTS, SB)
    a = w.write(np.arange(9))
    b = w.write([2**32 - 1])
    got = _py_peer(
        py_peer, seg, "read", [[a.index, a.count, a.generation], [b.index, 1, b.generation], [0, 9, 7]]
    )
    assert got == [list(range(9)), [2**32 - 1], "stale"]


def test_python_process_writes_this_process_reads(seg, py_peer):
    spans = [[1, 2, 3], list(range(20)), [], [77]]
    refs = _py_peer(py_peer, seg, "write", spans)
    assert refs == [[0, 3, 1], [1, 20, 2], [0, 0, 0], [0, 1, 6]]
    r = RingReader.attach(seg, RID, TOK, SLOTS, SB)
    assert r.read(ref(0, 1, 6)).tolist() == [77]
    assert r.read(ref(1, 20, 2)).tolist() == list(range(20))
    with pytest.raises(StaleRef):
        r.read(ref(0, 3, 1))  # recycled by the wrapped write of [77]
