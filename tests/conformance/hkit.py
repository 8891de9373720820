"""Helpers of the section H tests (state ops and the envelope): lanes and bare sequences to work on,
sealed exports, envelope surgery, checksums, and raw submissions into test-owned buffers (to see
that a refused or cancelled op writes no byte)."""

from __future__ import annotations

import msgspec
import pytest
import xxhash
from gkit import wait_op
from lanekit import R

from basertd.native.abi import ENVELOPE_BYTES, AbiError
from basertd.native.ref import RefBundle
from basertd.schema.abi import ChecksumKind, Encoding, OpState, Status
from basertd.schema.tick import StateEnvelope, TokenRange

PROMPT = list(range(40, 72))  # 32 tokens: two whole 16-token blocks
TERMINAL = (OpState.DONE, OpState.FAILED, OpState.CANCELLED)
SENTINEL = 0xA5


def is_ref(rig) -> bool:
    """True on the reference engine (whose test surface shows engine state directly)."""
    return isinstance(rig.bundle, RefBundle)


def status_of(call, *args) -> Status:
    """The status ``call(*args)`` is refused with (fails the test when it succeeds)."""
    with pytest.raises(AbiError) as info:
        call(*args)
    return info.value.status


def served(call, *args):
    """``call(*args)``, skipping the test when the engine answers OP_UNSUPPORTED: the ABI lets an
    engine not serve an op (e.g. demote), and a rule that only uses it as a vehicle cannot run."""
    try:
        return call(*args)
    except AbiError as e:
        if e.status == Status.ERR_OP_UNSUPPORTED:
            pytest.skip(f"{getattr(call, '__name__', call)}: this engine does not serve it (OP_UNSUPPORTED)")
        raise


def rng(start: int, end: int) -> TokenRange:
    return TokenRange(start=start, end=end)


def lane(rig, tag: int = 1, tokens=PROMPT, decode: int = 0) -> tuple[int, list[int]]:
    """A live lane holding ``tokens`` (+ ``decode`` generated); returns (its sequence, history)."""
    events = rig.start(tag, list(tokens), decode=decode)
    return rig.bundle.lane_sequence(tag), list(tokens) + rig.emitted(events, tag)


def bare(rig, tokens=PROMPT, decode: int = 0, tag: int = 9) -> tuple[int, list[int]]:
    """A caller-owned sequence holding ``tokens`` (+ ``decode`` generated): a fork of a lane that
    is then retired; returns (sequence, history)."""
    seq, history = lane(rig, tag, tokens, decode)
    child = rig.bundle.seq_fork(seq)
    rig.tick(retires=[R(tag)])
    return child, history


def sized(
    rig, seq: int, space: int, end: int, start: int = 0, enc: int = Encoding.LOSSLESS
) -> tuple[int, int]:
    """(required_bytes, sizing_gen) of an export of [start, end)."""
    return rig.bundle.export_size(seq, space, rng(start, end), enc)


def snapshot(rig, seq: int, space: int, pos: int, extra: int = 0) -> int:
    """Submit a snapshot of [0, pos) into a buffer ``extra`` bytes larger than required."""
    size, gen = sized(rig, seq, space, pos)
    return rig.bundle.snapshot(seq, space, pos, gen, size + extra)


def sealed(rig, seq: int, space: int, pos: int) -> bytes:
    """The sealed bytes of a completed snapshot of [0, pos)."""
    op = snapshot(rig, seq, space, pos)
    assert wait_op(rig, op) == OpState.DONE
    return rig.bundle.op_output(op)


def demote(rig, seq: int, space: int, start: int, end: int, enc: int = Encoding.LOSSLESS) -> int:
    """Submit a demote of [start, end) (skips on an engine that serves no demote)."""
    size, gen = served(sized, rig, seq, space, end, start, enc)
    return served(rig.bundle.demote, seq, space, rng(start, end), enc, gen, size)


def demoted_bytes(rig, seq: int, space: int, start: int, end: int, enc: int = Encoding.LOSSLESS) -> bytes:
    op = demote(rig, seq, space, start, end, enc)
    assert wait_op(rig, op) == OpState.DONE
    return rig.bundle.op_output(op)


def restored(rig, seq: int, space: int, data: bytes) -> int:
    """Restore ``data`` into ``seq`` and wait; returns the terminal state."""
    return wait_op(rig, rig.bundle.restore(seq, space, data))


def envelope(data: bytes) -> StateEnvelope:
    return StateEnvelope.unpack(data[:ENVELOPE_BYTES])


def reseal(data: bytes, **changes) -> bytes:
    """``data`` with envelope fields changed (the payload and its checksum untouched)."""
    env = msgspec.structs.replace(envelope(data), **changes)
    return env.pack() + data[ENVELOPE_BYTES:]


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def checksum(kind: int, payload: bytes) -> int:
    """The payload checksum of ``kind``, computed independently of the engine."""
    if kind == ChecksumKind.FNV1A64:
        return fnv1a64(payload)
    assert kind == ChecksumKind.XXH3_64, f"unexpected checksum kind {kind}"
    return xxhash.xxh3_64_intdigest(payload)


def valid_len(rig, seq: int, space: int = 0) -> int:
    """The space's valid length, read through export_size (any engine): the largest end an export
    range may have."""
    lo, hi = 0, 1 << 16
    while lo < hi:  # [0, end) is BOUNDS exactly when end is above the valid length (rule 94)
        mid = (lo + hi + 1) // 2
        try:
            sized(rig, seq, space, mid)
            lo = mid
        except AbiError as e:
            assert e.status == Status.REJECT_BOUNDS, e
            hi = mid - 1
    return lo


def in_flight(rig, op: int) -> None:
    """Skip when the engine finished ``op`` at submission: nothing is in flight to test."""
    if rig.bundle.op_poll(op).state in TERMINAL:
        pytest.skip("this engine completes state ops at submission; no op is in flight to observe")


def need_cffi(bundle):
    """The bundle's cffi FFI, or skip (raw submissions with test-owned buffers need the C ABI)."""
    ffi = getattr(bundle, "ffi", None)
    if ffi is None:
        pytest.skip("raw C submissions need a cffi-bound library")
    return ffi


class RawBuffer:
    """A test-owned 8-byte-aligned buffer of ``n`` bytes filled with SENTINEL, lent to raw calls."""

    def __init__(self, bundle, n: int) -> None:
        self.ffi = ffi = need_cffi(bundle)
        self.n = n
        words = max(1, (n + 7) // 8)
        self.mem = ffi.new("uint64_t[]", words)
        ffi.memmove(self.mem, bytes([SENTINEL]) * 8 * words, 8 * words)
        self.buf = ffi.new("BaseRTBuf *", {"ptr": self.mem, "len": n})[0]

    def bytes(self) -> bytes:
        return bytes(self.ffi.buffer(self.mem, self.n))

    def untouched(self) -> bool:
        return self.bytes() == bytes([SENTINEL]) * self.n


def raw_snapshot(rig, seq: int, space: int, pos: int, gen: int, buf: RawBuffer) -> tuple[int, int]:
    """baseRT_space_snapshot into ``buf``; returns (status, op value written, 0 if none)."""
    b = rig.bundle
    op = buf.ffi.new("baseRT_op_t *")
    status = b.lib.baseRT_space_snapshot(b.sequence_pointer(seq), space, pos, buf.buf, gen, op)
    return status, int(op[0])


def raw_demote(
    rig, seq: int, space: int, r: TokenRange, enc: int, gen: int, buf: RawBuffer
) -> tuple[int, int]:
    b = rig.bundle
    op = buf.ffi.new("baseRT_op_t *")
    c_rng = buf.ffi.new("BaseRTTokenRange *", {"start": r.start, "end": r.end})[0]
    status = b.lib.baseRT_space_demote(b.sequence_pointer(seq), space, c_rng, enc, buf.buf, gen, op)
    return status, int(op[0])
