"""RULES.md section H, exports and op handles: rules 92-100.

A refusal is checked for its code and, where the rule says so, for what it must not do: issue an
op handle, write a byte into the caller's buffer (test-owned buffers filled with a sentinel), or
leave a claim behind (the same submission is accepted right after). Each rule also runs its legal
neighbour, so an engine refusing everything fails.
"""

from __future__ import annotations

import pytest
from gkit import PAGED, blob, wait_op
from hkit import (
    RawBuffer,
    bare,
    checksum,
    demote,
    envelope,
    in_flight,
    lane,
    raw_snapshot,
    rng,
    served,
    sized,
    snapshot,
    status_of,
)
from lanekit import D

from basertd.native.abi import ENVELOPE_BYTES, ArgumentError
from basertd.native.ref import RefSpace, create_ref_bundle
from basertd.schema.abi import STATE_ENVELOPE_MAGIC, Encoding, OpState, SpaceFlag, SpaceKind, Status

LOSSLESS, Q8, Q4 = Encoding.LOSSLESS, Encoding.Q8, Encoding.Q4
UNSUPPORTED = Status.ERR_OP_UNSUPPORTED


# ABI rule 92
def test_rule_092_export_size_ops_unavailable_or_unknown_space(make_rig):
    rig = make_rig(spaces=[PAGED, blob(flags=SpaceFlag.OPS_UNAVAILABLE)])
    seq, _ = lane(rig)
    assert status_of(rig.bundle.export_size, seq, 1, rng(0, 16), LOSSLESS) == UNSUPPORTED
    for unknown in (2, 99, 0xFFFFFFFF):
        assert (
            status_of(rig.bundle.export_size, seq, unknown, rng(0, 16), LOSSLESS) == Status.ERR_UNKNOWN_HANDLE
        )
    # The served space of the same sequence sizes normally: 136-byte envelope + 16 tokens x 64 B.
    assert sized(rig, seq, 0, 16)[0] == ENVELOPE_BYTES + 16 * 64


# ABI rule 92
def test_rule_092_export_size_unknown_space_on_a_default_bundle(rig):
    seq, _ = lane(rig)
    assert status_of(rig.bundle.export_size, seq, 5, rng(0, 16), LOSSLESS) == Status.ERR_UNKNOWN_HANDLE
    size, _ = sized(rig, seq, 0, 16)
    assert size > ENVELOPE_BYTES


# ABI rule 93
def test_rule_093_lossy_blob_and_encoder_cache_exports_unsupported(make_rig):
    enc_cache = RefSpace(2, SpaceKind.ENCODER_CACHE, name="vision")
    rig = make_rig(spaces=[PAGED, blob(), enc_cache])
    seq, _ = lane(rig)  # 32 tokens: blob boundaries 16 and 32
    for enc in (Q8, Q4):
        assert status_of(rig.bundle.export_size, seq, 1, rng(0, 32), enc) == UNSUPPORTED
        # a demote quoting a valid LOSSLESS sizing is refused for the encoding all the same
        size, gen = sized(rig, seq, 1, 32)
        assert status_of(rig.bundle.demote, seq, 1, rng(0, 32), enc, gen, size) == UNSUPPORTED
    for enc in (LOSSLESS, Q8):
        assert status_of(rig.bundle.export_size, seq, 2, rng(0, 0), enc) == UNSUPPORTED
    # LOSSLESS blob exports and lossy paged exports are served.
    assert sized(rig, seq, 1, 32)[0] == ENVELOPE_BYTES + 512
    assert sized(rig, seq, 0, 32, enc=Q8)[0] == ENVELOPE_BYTES + 32 * 32
    assert sized(rig, seq, 0, 32, enc=Q4)[0] == ENVELOPE_BYTES + 32 * 16


@pytest.mark.parametrize("space", [0, 1], ids=["paged", "blob"])
# ABI rule 94
def test_rule_094_export_range_out_of_bounds(make_rig, space):
    rig = make_rig(spaces=[PAGED, blob()])
    seq, _ = lane(rig)  # 32 tokens valid in both spaces
    for bad in (rng(20, 10), rng(0, 33), rng(33, 40)):
        assert status_of(rig.bundle.export_size, seq, space, bad, LOSSLESS) == Status.REJECT_BOUNDS
        size, gen = sized(rig, seq, space, 32)
        assert status_of(rig.bundle.demote, seq, space, bad, LOSSLESS, gen, size) == Status.REJECT_BOUNDS
    assert status_of(rig.bundle.snapshot, seq, space, 33, sized(rig, seq, space, 32)[1], 1 << 16) == (
        Status.REJECT_BOUNDS
    )
    sized(rig, seq, space, 32)  # the whole valid length is fine
    sized(rig, seq, space, 32, start=32)


def _check_sealed(data: bytes, required: int, start: int, end: int, kind: int) -> None:
    env = envelope(data)
    assert len(data) == required == ENVELOPE_BYTES + env.payload_len
    assert env.magic == STATE_ENVELOPE_MAGIC and data[:8] == b"BRTSTATE"
    assert env.space_kind == kind
    assert (env.range.start, env.range.end) == (start, end)
    assert env.content_checksum == checksum(env.checksum_kind, data[ENVELOPE_BYTES:])


# ABI rule 95
def test_rule_095_sealed_export_is_exactly_required_bytes(rig):
    seq, _ = lane(rig, decode=3)  # 35 tokens
    for pos in (16, 32):
        size, gen = sized(rig, seq, 0, pos)
        op = rig.bundle.snapshot(seq, 0, pos, gen, size + 100)  # a larger buffer than needed
        assert wait_op(rig, op) == OpState.DONE
        data = rig.bundle.op_output(op)
        _check_sealed(data, size, 0, pos, SpaceKind.PAGED_TOKEN_KV)
        assert rig.bundle.op_poll(op).bytes_moved == size


# ABI rule 95
def test_rule_095_nothing_written_past_required(rig):
    seq, _ = lane(rig)
    size, gen = sized(rig, seq, 0, 32)
    buf = RawBuffer(rig.bundle, size + 64)
    status, op = raw_snapshot(rig, seq, 0, 32, gen, buf)
    assert status == Status.OK and op
    assert wait_op(rig, op) == OpState.DONE
    data = buf.bytes()
    _check_sealed(data[:size], size, 0, 32, SpaceKind.PAGED_TOKEN_KV)
    assert data[size:] == bytes([0xA5]) * 64


# ABI rule 95
def test_rule_095_blob_and_lossy_exports_are_exactly_required_bytes(make_rig):
    rig = make_rig(spaces=[PAGED, blob()])
    seq, _ = lane(rig)
    size, gen = sized(rig, seq, 1, 32)
    op = rig.bundle.snapshot(seq, 1, 32, gen, size + 7)
    assert wait_op(rig, op) == OpState.DONE
    _check_sealed(rig.bundle.op_output(op), size, 32, 32, SpaceKind.RECURRENT_BLOB)  # blob range {q, q}
    size, gen = sized(rig, seq, 0, 16, enc=Q4)
    op = served(rig.bundle.demote, seq, 0, rng(0, 16), Q4, gen, size + 9)
    assert wait_op(rig, op) == OpState.DONE
    data = rig.bundle.op_output(op)
    _check_sealed(data, size, 0, 16, SpaceKind.PAGED_TOKEN_KV)
    assert envelope(data).encoding == Q4


# ABI rule 96
def test_rule_096_stale_sizing_after_a_tick(rig):
    seq, _ = lane(rig, decode=1)
    size, gen = sized(rig, seq, 0, 16)
    rig.tick(decodes=[D(1, 1)])  # the lane's sequence advances
    assert status_of(rig.bundle.snapshot, seq, 0, 16, gen, size) == Status.ERR_STALE_SIZING
    assert rig.tick().op_completions == []  # no op was issued
    size, fresh = sized(rig, seq, 0, 16)
    assert fresh != gen
    assert wait_op(rig, rig.bundle.snapshot(seq, 0, 16, fresh, size)) == OpState.DONE
    stale = status_of(rig.bundle.demote, seq, 0, rng(0, 16), LOSSLESS, gen, size)
    assert stale in (Status.ERR_STALE_SIZING, UNSUPPORTED)  # an engine may serve no demote


# ABI rule 96
def test_rule_096_stale_sizing_after_a_trim(rig):
    seq, _ = bare(rig)
    size, gen = sized(rig, seq, 0, 16)
    rig.bundle.trim(seq, 0, 20)  # a synchronous op changes the space
    assert status_of(rig.bundle.snapshot, seq, 0, 16, gen, size) == Status.ERR_STALE_SIZING
    size, gen = sized(rig, seq, 0, 16)
    assert wait_op(rig, rig.bundle.snapshot(seq, 0, 16, gen, size)) == OpState.DONE


# ABI rule 96
def test_rule_096_stale_sizing_after_a_completed_op(rig):
    seq, _ = bare(rig)
    size, gen = sized(rig, seq, 0, 16)
    assert wait_op(rig, demote(rig, seq, 0, 16, 20)) == OpState.DONE
    # the completed demote advanced the space
    assert status_of(rig.bundle.snapshot, seq, 0, 16, gen, size) == Status.ERR_STALE_SIZING
    size, fresh = sized(rig, seq, 0, 16)
    assert wait_op(rig, rig.bundle.snapshot(seq, 0, 16, fresh, size)) == OpState.DONE


# ABI rule 96
def test_rule_096_no_op_handle_on_stale_sizing(rig):
    seq, _ = lane(rig, decode=1)
    size, gen = sized(rig, seq, 0, 16)
    rig.tick(decodes=[D(1, 1)])
    buf = RawBuffer(rig.bundle, size)
    status, op = raw_snapshot(rig, seq, 0, 16, gen, buf)
    assert (status, op) == (Status.ERR_STALE_SIZING, 0)
    assert buf.untouched()


# ABI rule 97
def test_rule_097_buffer_too_small_writes_nothing(rig):
    seq, _ = lane(rig)
    size, gen = sized(rig, seq, 0, 32)
    for short in (0, ENVELOPE_BYTES, size - 1):
        buf = RawBuffer(rig.bundle, short)
        status, op = raw_snapshot(rig, seq, 0, 32, gen, buf)
        assert (status, op) == (Status.ERR_BUFFER_TOO_SMALL, 0)
        assert buf.untouched()
    assert status_of(rig.bundle.snapshot, seq, 0, 16, gen, size // 2 - 1) == Status.ERR_BUFFER_TOO_SMALL
    # Nothing is claimed by the refusals: the right size goes through at once.
    buf = RawBuffer(rig.bundle, size)
    status, op = raw_snapshot(rig, seq, 0, 32, gen, buf)
    assert status == Status.OK and op
    assert wait_op(rig, op) == OpState.DONE and not buf.untouched()


# ABI rule 98
def test_rule_098_second_op_on_the_pair_is_ebusy(rig):
    seq, _ = bare(rig)
    op = snapshot(rig, seq, 0, 32)
    in_flight(rig, op)
    size, gen = sized(rig, seq, 0, 16)
    assert status_of(rig.bundle.snapshot, seq, 0, 16, gen, size) == Status.EBUSY
    assert status_of(rig.bundle.demote, seq, 0, rng(0, 16), LOSSLESS, gen, size) == Status.EBUSY
    assert status_of(rig.bundle.seq_fork, seq) == Status.EBUSY
    assert status_of(rig.bundle.trim, seq, 0, 16) == Status.EBUSY
    assert wait_op(rig, op) == OpState.DONE
    # The claim ends with the op.
    rig.bundle.seq_fork(seq)
    rig.bundle.trim(seq, 0, 16)
    assert wait_op(rig, snapshot(rig, seq, 0, 16)) == OpState.DONE


# ABI rule 98
def test_rule_098_claims_are_per_space(make_rig):
    rig = make_rig(spaces=[PAGED, blob()])
    seq, _ = bare(rig)
    op = snapshot(rig, seq, 0, 32)
    in_flight(rig, op)
    other = snapshot(rig, seq, 1, 32)  # another space of the same sequence is free
    assert status_of(rig.bundle.trim, seq, 0, 16) == Status.EBUSY
    assert status_of(rig.bundle.trim, seq, 1, 16) == Status.EBUSY
    assert wait_op(rig, op) == OpState.DONE and wait_op(rig, other) == OpState.DONE
    rig.bundle.trim(seq, 1, 16)


# ABI rule 99
def test_rule_099_unknown_op_handle(rig):
    for op in (0, 1, 12345, 2**64 - 1):
        assert status_of(rig.bundle.op_poll, op) == Status.ERR_UNKNOWN_HANDLE
        assert status_of(rig.bundle.op_cancel, op) == Status.ERR_UNKNOWN_HANDLE


# ABI rule 99
def test_rule_099_op_handles_never_reused(rig):
    seq, _ = bare(rig)
    seen = []
    for i in range(6):
        op = snapshot(rig, seq, 0, 16 + i)
        seen.append(op)
        if i % 2:
            rig.bundle.op_cancel(op)
        assert wait_op(rig, op) in (OpState.DONE, OpState.CANCELLED)
    assert len(set(seen)) == len(seen)
    for op in seen:  # terminal ops keep their handle and answer polls
        assert rig.bundle.op_poll(op).state in (OpState.DONE, OpState.CANCELLED)


# ABI rule 99
def test_rule_099_op_handles_are_per_bundle(rig):
    assert rig.ref  # two bundles of one engine: the reference engine's factory (skips elsewhere)
    seq, _ = bare(rig)
    op = snapshot(rig, seq, 0, 16)
    other = create_ref_bundle()
    try:
        assert status_of(other.op_poll, op) == Status.ERR_UNKNOWN_HANDLE
        assert status_of(other.op_cancel, op) == Status.ERR_UNKNOWN_HANDLE
    finally:
        other.close()
    assert wait_op(rig, op) == OpState.DONE


# ABI rule 100
def test_rule_100_cancel_running_op(rig):
    seq, _ = lane(rig)
    size, gen = sized(rig, seq, 0, 32)
    buf = RawBuffer(rig.bundle, size)
    status, op = raw_snapshot(rig, seq, 0, 32, gen, buf)
    assert status == Status.OK
    in_flight(rig, op)
    rig.bundle.op_cancel(op)
    assert rig.bundle.op_poll(op).state == OpState.CANCELLED
    # The claim is released at once: the lane ticks and the pair takes a new op.
    rig.tick(decodes=[D(1, 1)])
    assert buf.untouched()  # no output, now or later
    op2 = snapshot(rig, seq, 0, 33)
    ticks = [rig.tick().op_completions for _ in range(2)]
    done = {c.op: c.state for t in ticks for c in t}
    assert done.get(op2) == OpState.DONE
    assert buf.untouched()


# ABI rule 100
def test_rule_100_cancelled_op_is_reported_and_has_no_output(rig):
    seq, _ = bare(rig)
    op = snapshot(rig, seq, 0, 32)
    in_flight(rig, op)
    rig.bundle.op_cancel(op)
    (c,) = [c for c in rig.tick().op_completions if c.op == op]
    assert c.state == OpState.CANCELLED and c.bytes_moved == 0
    with pytest.raises(ArgumentError):
        rig.bundle.op_output(op)


# ABI rule 100
def test_rule_100_cancel_done_op_leaves_it_done(rig):
    seq, _ = bare(rig)
    op = snapshot(rig, seq, 0, 32)
    assert wait_op(rig, op) == OpState.DONE
    rig.bundle.op_cancel(op)
    assert rig.bundle.op_poll(op).state == OpState.DONE
    assert len(rig.bundle.op_output(op)) == sized(rig, seq, 0, 32)[0]
