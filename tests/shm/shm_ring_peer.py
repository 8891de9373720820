"""A second process for the ring tests: it attaches a segment handed over with ``pass_fds`` and reads,
writes or hammers a ring in it. Also holds the stress test's span schedule and payload pattern, which
the test imports so writer and reader agree on what each generation must contain.

Usage (one JSON document on stdin and one on stdout where noted):
  shm_ring_peer.py read   FD LEN RING_ID KIND SLOTS SLOT_BYTES   stdin [[index, count, gen], ...]
                                                                 stdout [[values] | "stale", ...]
  shm_ring_peer.py write  FD LEN RING_ID KIND SLOTS SLOT_BYTES   stdin [[values], ...]
                                                                 stdout [[index, count, gen], ...]
  shm_ring_peer.py hammer FD LEN RING_ID SLOTS SLOT_BYTES CTRL_OFF
  shm_ring_peer.py own-and-hang
  shm_ring_peer.py fd-open FD                                    exit 0 if FD is open, 3 if not
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from basertd.schema.abi import RingKind
from basertd.schema.tick import TokenRef
from basertd.shm import RingReader, RingWriter, Segment, StaleRef, ring_bytes, slot_bytes_for

# --- stress schedule: 4 slots of 256 tokens; spans of 1, 2 and 2 slots repeat every 5 slots, so the
# spans start at every index in turn and some wrap around the end of the ring.
STRESS_SLOTS = 4
STRESS_CAP = 256
STRESS_SLOT_BYTES = slot_bytes_for(STRESS_CAP)
STRESS_SPANS = (256, 300, 512)
STRESS_PERIOD = 5  # slots per repetition of STRESS_SPANS
# control words after the ring: [stop flag, spans written, ready flag, spare]
CTRL_WORDS = 4
_SPAN_AT = {0: (0, 256), 1: (0, 300), 2: (1, 300), 3: (0, 512), 4: (1, 512)}  # offset -> (back, count)


def stress_span_of_slot(generation: int) -> tuple[int, int, int]:
    """For a slot holding ``generation``: (first generation of its span, span count, the slot's
    position inside the span)."""
    back, count = _SPAN_AT[(generation - 1) % STRESS_PERIOD]
    return generation - back, count, back


def stress_pattern(first_generation: int, count: int) -> np.ndarray:
    """The u32 payload of the span whose first slot has ``first_generation``: every element depends on
    the generation, so a mix of two spans is detectable."""
    base = np.uint32((first_generation * 0x9E3779B1) & 0xFFFFFFFF)
    return np.arange(count, dtype=np.uint32) * np.uint32(0x85EBCA77) + base


def stress_segment_bytes() -> tuple[int, int]:
    """(segment length, offset of the control words) for the stress ring."""
    off = ring_bytes(STRESS_SLOTS, STRESS_SLOT_BYTES)
    return off + 8 * CTRL_WORDS, off


def _hammer(fd: int, length: int, ring_id: int, slots: int, slot_bytes: int, ctrl_off: int) -> None:
    seg = Segment.attach(fd, length)
    writer = RingWriter.attach(seg, ring_id, RingKind.TOKENS, slots, slot_bytes)
    ctrl = np.frombuffer(seg.buffer, dtype=np.uint64, count=CTRL_WORDS, offset=ctrl_off)
    deadline = time.monotonic() + 90.0
    spans = 0
    ctrl[2] = 1
    while ctrl[0] == 0:
        for count in STRESS_SPANS:
            first = writer.next_generation
            ref = writer.write(stress_pattern(first, count))
            if ref.generation != first or ref.index != (first - 1) % slots:
                sys.exit(f"writer cursor broke: {ref}")
        spans += len(STRESS_SPANS)
        ctrl[1] = spans
        if spans % 3000 == 0 and time.monotonic() > deadline:
            break
    del ctrl
    seg.close()
    print(json.dumps({"spans": spans}))


def _own_and_hang() -> None:
    seg = Segment.create(ring_bytes(4, 64), name="brt-peer")
    writer = RingWriter.create(seg, 9, RingKind.TOKENS, 4, 64)
    writer.write(np.arange(10))
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the descriptor listdir itself used
    print(json.dumps({"memfds": [t for t in links if t.startswith("/memfd:")]}), flush=True)
    time.sleep(120)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "hammer":
        _hammer(*(int(a) for a in argv[1:7]))
        return
    if mode == "own-and-hang":
        _own_and_hang()
        return
    if mode == "fd-open":
        try:
            os.fstat(int(argv[1]))
        except OSError:
            sys.exit(3)
        return
    fd, length, ring_id, kind, slots, slot_bytes = (int(a) for a in argv[1:7])
    seg = Segment.attach(fd, length)
    request = json.load(sys.stdin)
    if mode == "read":
        reader = RingReader.attach(seg, ring_id, RingKind(kind), slots, slot_bytes)
        answer: list = []
        for index, count, gen in request:
            try:
                answer.append(
                    reader.read(TokenRef(ring_id=ring_id, index=index, count=count, generation=gen)).tolist()
                )
            except StaleRef:
                answer.append("stale")
    elif mode == "write":
        writer = RingWriter.attach(seg, ring_id, RingKind(kind), slots, slot_bytes)
        dtype = np.uint32 if RingKind(kind) == RingKind.TOKENS else np.float32
        answer = []
        for values in request:
            ref = writer.write(np.asarray(values, dtype=dtype))
            answer.append([ref.index, ref.count, ref.generation])
    else:
        sys.exit(f"unknown mode {mode}")
    seg.close()
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
