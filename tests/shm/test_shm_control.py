"""The per-worker control segment (basertd.shm.control): layout, both sides' views of the yield
word, refusal of a segment that is not a control segment."""

from __future__ import annotations

import os

import pytest

from basertd.schema.abi import Status
from basertd.shm import CONTROL_BYTES, ControlBlock, Segment, SegmentError, YieldReason
from basertd.shm.control import CONTROL_MAGIC, YIELD_WORD_OFFSET


def test_both_sides_see_one_word():
    with ControlBlock.create() as coord:
        assert coord.segment.length == CONTROL_BYTES
        assert bytes(coord.segment.buffer[:8]) == CONTROL_MAGIC
        worker = ControlBlock.attach(os.dup(coord.fd))
        try:
            assert worker.yield_reason() == 0
            coord.request_yield(YieldReason.CANCEL)
            assert worker.yield_reason() == YieldReason.CANCEL
            assert (
                int.from_bytes(worker.segment.buffer[YIELD_WORD_OFFSET : YIELD_WORD_OFFSET + 8], "little")
                == 2
            )
            worker.note_yield_taken()
            worker.note_yield_taken()
            assert coord.yields_taken == 2
            coord.clear_yield()
            assert worker.yield_reason() == 0
            assert worker.yield_word_address % 8 == 0
        finally:
            worker.close()
            worker.close()  # idempotent


def test_reason_zero_is_refused_and_nothing_changes():
    with ControlBlock.create() as c:
        with pytest.raises(ValueError):
            c.request_yield(0)
        assert c.yield_reason() == 0


def test_a_segment_without_the_magic_is_refused_and_its_fd_left_open():
    seg = Segment.create(CONTROL_BYTES)
    fd = os.dup(seg.fd)
    try:
        with pytest.raises(SegmentError) as err:
            ControlBlock.attach(fd)
        assert err.value.status == Status.ERR_RING_LAYOUT
        os.fstat(fd)  # still open: the caller owns it
    finally:
        os.close(fd)
        seg.close()
