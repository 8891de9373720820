"""RULES.md section H, restore, promote and what they leave behind: rules 101-108, and the resume
path they exist for (export a lane, restore into a fresh sequence, adopt it, continue exactly).

Every refused restore is followed by the same target taking the good bytes, so a check that
refused everything would fail; "unchanged" is read through the ABI (the valid length export_size
allows, the bytes a snapshot of the target gives) and, on the reference engine, through
``space_info``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from gkit import PAGED, blob, wait_op
from hkit import (
    bare,
    demote,
    demoted_bytes,
    envelope,
    is_ref,
    lane,
    reseal,
    restored,
    rng,
    sealed,
    served,
    sized,
    status_of,
    valid_len,
)
from lanekit import D, R

from basertd.native.abi import ENVELOPE_BYTES, PlanRejected
from basertd.native.ref import RefSpace
from basertd.schema.abi import (
    STATE_ENVELOPE_MAGIC,
    AdmitStatus,
    ChecksumKind,
    Encoding,
    OpState,
    SpaceKind,
    Status,
    Taint,
)

MISMATCH = Status.ERR_ENVELOPE_MISMATCH
DONE = OpState.DONE
Q8, Q4, LOSSLESS = Encoding.Q8, Encoding.Q4, Encoding.LOSSLESS


def _export(rig, n_decode: int = 0):
    """A lane's sealed export, its history and the exported length."""
    seq, history = lane(rig, decode=n_decode)
    n = valid_len(rig, seq)
    return sealed(rig, seq, 0, n), history[:n], n


def _refused_then_restored(rig, bad: bytes, good: bytes, status: Status, n: int) -> None:
    target = rig.bundle.sequence_create()
    assert status_of(rig.bundle.restore, target, 0, bad) == status
    assert valid_len(rig, target) == 0  # rule 104: the target is untouched
    assert restored(rig, target, 0, good) == DONE
    assert valid_len(rig, target) == n


@pytest.mark.parametrize("case", ["short", "magic", "version", "kind", "truncated", "extended"])
# ABI rule 101
def test_rule_101_envelope_mismatch(rig, case):
    data, _, n = _export(rig)
    bad = {
        "short": lambda: data[: ENVELOPE_BYTES - 1],
        "magic": lambda: reseal(data, magic=STATE_ENVELOPE_MAGIC ^ 0xFF),
        "version": lambda: reseal(data, envelope_version=envelope(data).envelope_version + 1),
        "kind": lambda: reseal(data, space_kind=SpaceKind.RECURRENT_BLOB),
        "truncated": lambda: data[:-1],  # payload_len says one byte more than supplied
        "extended": lambda: data + b"\0",
    }[case]()
    _refused_then_restored(rig, bad, data, MISMATCH, n)


# ABI rule 101
def test_rule_101_space_kind_of_the_target(make_rig):
    rig = make_rig(spaces=[PAGED, blob()])
    seq, _ = lane(rig)
    paged, blob_state = sealed(rig, seq, 0, 32), sealed(rig, seq, 1, 32)
    target = rig.bundle.sequence_create()
    assert status_of(rig.bundle.restore, target, 1, paged) == MISMATCH
    assert status_of(rig.bundle.restore, target, 0, blob_state) == MISMATCH
    assert restored(rig, target, 0, paged) == DONE and restored(rig, target, 1, blob_state) == DONE


@pytest.mark.parametrize("field", ["compat_identity", "version_tag"])
# ABI rule 102
def test_rule_102_identity_fields_must_match_the_target(rig, field):
    data, _, n = _export(rig)
    env = envelope(data)
    changed = {
        "compat_identity": bytes([env.compat_identity[0] ^ 1]) + env.compat_identity[1:],
        "version_tag": env.version_tag + 1,
    }[field]
    _refused_then_restored(rig, reseal(data, **{field: changed}), data, Status.ERR_IDENTITY_MISMATCH, n)


# ABI rule 102
def test_rule_102_restore_into_another_model_or_space_version(make_rig):
    one, other, same = (make_rig(identity=bytes([i]) * 32) for i in (1, 2, 1))
    bumped = make_rig(identity=bytes([1]) * 32, spaces=[RefSpace(0, SpaceKind.PAGED_TOKEN_KV, version_tag=2)])
    data, _, n = _export(one)
    for rig in (other, bumped):
        target = rig.bundle.sequence_create()
        assert status_of(rig.bundle.restore, target, 0, data) == Status.ERR_IDENTITY_MISMATCH
        assert valid_len(rig, target) == 0
    target = same.bundle.sequence_create()
    assert restored(same, target, 0, data) == DONE and valid_len(same, target) == n


# ABI rule 103
def test_rule_103_flipped_payload_byte(rig):
    data, _, n = _export(rig)
    for at in (ENVELOPE_BYTES, ENVELOPE_BYTES + 77, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x40
        _refused_then_restored(rig, bytes(bad), data, Status.ERR_CHECKSUM, n)


@pytest.mark.parametrize("kind", [0, 3, 0xFFFFFFFF])
# ABI rule 103
def test_rule_103_checksum_kind_zero_or_unknown_is_refused(rig, kind):
    data, _, n = _export(rig)
    _refused_then_restored(rig, reseal(data, checksum_kind=kind), data, Status.ERR_CHECKSUM, n)


# ABI rule 103
def test_rule_103_both_checksum_kinds_are_verified(rig):
    ref = rig.ref
    seq, _ = lane(rig)
    exports = {}
    for kind in (ChecksumKind.FNV1A64, ChecksumKind.XXH3_64):
        ref.set_export_checksum(kind)
        exports[kind] = data = sealed(rig, seq, 0, 32)
        assert envelope(data).checksum_kind == kind  # content_checksum is checked in hkit.checksum
    fnv, xxh = exports[ChecksumKind.FNV1A64], exports[ChecksumKind.XXH3_64]
    assert fnv[ENVELOPE_BYTES:] == xxh[ENVELOPE_BYTES:]
    # Each checksum is verified by its own kind: relabelling either one is caught.
    _refused_then_restored(rig, reseal(fnv, checksum_kind=ChecksumKind.XXH3_64), fnv, Status.ERR_CHECKSUM, 32)
    _refused_then_restored(rig, reseal(xxh, checksum_kind=ChecksumKind.FNV1A64), xxh, Status.ERR_CHECKSUM, 32)
    bad = bytearray(xxh)
    bad[-1] ^= 1
    _refused_then_restored(rig, bytes(bad), xxh, Status.ERR_CHECKSUM, 32)


_NO_XXHASH = textwrap.dedent(
    """
    import sys
    from basertd.native.abi import AbiError
    from basertd.native.ref import create_ref_bundle
    from basertd.schema.abi import ChecksumKind

    b = create_ref_bundle()
    codes = []
    for call in (lambda: b.set_export_checksum(ChecksumKind.XXH3_64),
                 lambda: b.restore(b.sequence_create(), 0, open(sys.argv[1], "rb").read())):
        try:
            call()
            codes.append(0)
        except AbiError as e:
            codes.append(int(e.status))
    b.set_export_checksum(ChecksumKind.FNV1A64)
    b.close()
    print(*codes)
    """
)


# ABI rule 103
def test_rule_103_xxh3_without_libxxhash_is_a_typed_refusal(rig, tmp_path):
    rig.ref.set_export_checksum(ChecksumKind.XXH3_64)
    seq, _ = lane(rig)
    path = tmp_path / "xxh3.state"
    path.write_bytes(sealed(rig, seq, 0, 32))
    env = {**os.environ, "BASERT_REF_XXHASH_LIB": str(tmp_path / "no-such-libxxhash.so")}
    out = subprocess.run(
        [sys.executable, "-c", _NO_XXHASH, str(path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(int(Status.ERR_OP_UNSUPPORTED))] * 2


def _bad_variants(good: bytes) -> list[tuple[bytes, Status]]:
    """Refusable variants of ``good`` with their codes (rules 101-103)."""
    flipped = bytearray(good)
    flipped[-1] ^= 1
    env = envelope(good)
    return [
        (good[:-1], MISMATCH),
        (reseal(good, space_kind=SpaceKind.RING_KV), MISMATCH),
        (reseal(good, version_tag=env.version_tag ^ 1), Status.ERR_IDENTITY_MISMATCH),
        (bytes(flipped), Status.ERR_CHECKSUM),
        (reseal(good, checksum_kind=0), Status.ERR_CHECKSUM),
    ]


# ABI rule 104
def test_rule_104_failed_restore_leaves_an_empty_target_empty(rig):
    good, _, n = _export(rig)
    target = rig.bundle.sequence_create()
    info = rig.ref.space_info(target, 0) if is_ref(rig) else None
    for bad, status in _bad_variants(good):
        assert status_of(rig.bundle.restore, target, 0, bad) == status
        assert valid_len(rig, target) == 0
        if info is not None:
            assert rig.ref.space_info(target, 0) == info
    assert restored(rig, target, 0, good) == DONE and valid_len(rig, target) == n


# ABI rule 104
def test_rule_104_failed_restore_leaves_a_restored_target_as_it_was(rig):
    ref = rig.ref  # restoring over a held state is a reference-engine choice (others may say EBUSY)
    first, _, n = _export(rig)
    target = rig.bundle.sequence_create()
    assert restored(rig, target, 0, first) == DONE
    before, info = sealed(rig, target, 0, n), ref.space_info(target, 0)
    other, _ = lane(rig, tag=2, tokens=list(range(200, 216)))
    good = sealed(rig, other, 0, 16)
    for bad, status in _bad_variants(good):
        assert status_of(rig.bundle.restore, target, 0, bad) == status
        assert sealed(rig, target, 0, n) == before and ref.space_info(target, 0) == info
    assert restored(rig, target, 0, good) == DONE  # a good one replaces the state
    assert valid_len(rig, target) == 16 and sealed(rig, target, 0, 16) == good


# ABI rule 105
def test_rule_105_promote_only_a_demoted_range(rig):
    seq, _ = bare(rig)
    data = demoted_bytes(rig, seq, 0, 0, 16)
    for wrong in (rng(16, 32), rng(0, 8), rng(0, 32)):
        assert status_of(rig.bundle.promote, seq, 0, wrong, data) == Status.REJECT_BOUNDS
    assert valid_len(rig, seq) == 32
    assert wait_op(rig, rig.bundle.promote(seq, 0, rng(0, 16), data)) == DONE
    assert valid_len(rig, seq) == 32  # promote never changes the valid length
    # Promoted: the range is resident again, so a second promote is refused too.
    assert status_of(rig.bundle.promote, seq, 0, rng(0, 16), data) == Status.REJECT_BOUNDS


# ABI rule 105
def test_rule_105_promote_checks_the_envelope(rig):
    seq, _ = bare(rig)
    data = demoted_bytes(rig, seq, 0, 0, 16)
    twin, _ = bare(rig, tokens=list(range(300, 332)), tag=8)
    foreign = demoted_bytes(rig, twin, 0, 0, 16)  # same range, another sequence's state
    assert status_of(rig.bundle.promote, seq, 0, rng(0, 16), foreign) == Status.ERR_IDENTITY_MISMATCH
    flipped = bytearray(data)
    flipped[ENVELOPE_BYTES] ^= 1
    assert status_of(rig.bundle.promote, seq, 0, rng(0, 16), bytes(flipped)) == Status.ERR_CHECKSUM
    assert status_of(rig.bundle.promote, seq, 0, rng(0, 16), data[:-1]) == MISMATCH
    assert wait_op(rig, rig.bundle.promote(seq, 0, rng(0, 16), data)) == DONE


# ABI rule 106
def test_rule_106_overlapping_demote_is_refused(rig):
    seq, _ = bare(rig, tokens=list(range(40, 88)))  # 48 tokens
    assert wait_op(rig, demote(rig, seq, 0, 16, 32)) == DONE
    for start, end in ((8, 24), (16, 32), (31, 40), (0, 48), (20, 21)):
        size, gen = sized(rig, seq, 0, end, start)
        assert (
            status_of(rig.bundle.demote, seq, 0, rng(start, end), LOSSLESS, gen, size) == Status.REJECT_BOUNDS
        )
    # Neighbours that do not overlap are accepted.
    assert wait_op(rig, demote(rig, seq, 0, 0, 16)) == DONE
    assert wait_op(rig, demote(rig, seq, 0, 32, 48)) == DONE


def _taint_of_export(rig, seq, n: int) -> int:
    return envelope(sealed(rig, seq, 0, n)).taint_bits


@pytest.mark.parametrize("enc", [Q8, Q4, LOSSLESS])
# ABI rule 107
def test_rule_107_lossy_demote_taints_on_promote_and_stays(rig, enc):
    seq, _ = bare(rig)
    data = demoted_bytes(rig, seq, 0, 0, 16, enc)
    assert envelope(data).taint_bits == 0 and envelope(data).encoding == enc
    if is_ref(rig):  # the reference engine shows the space's taint directly
        assert rig.ref.space_info(seq, 0).taint_bits == 0  # demote itself adds none
    assert wait_op(rig, rig.bundle.promote(seq, 0, rng(0, 16), data)) == DONE
    want = 0 if enc == LOSSLESS else Taint.QUANTIZED_DEMOTION
    assert _taint_of_export(rig, seq, 32) == want
    # A lossless export of that state restores still tainted.
    target = rig.bundle.sequence_create()
    assert restored(rig, target, 0, sealed(rig, seq, 0, 32)) == DONE
    assert _taint_of_export(rig, target, 32) == want
    if is_ref(rig):
        assert rig.ref.space_info(target, 0).taint_bits == want


# ABI rule 107
def test_rule_107_tainted_lane_keeps_its_taint(rig):
    seq, _ = lane(rig)
    data = demoted_bytes(rig, seq, 0, 0, 16, Q8)
    assert rig.ref.lane_info(1).taint_bits == 0
    assert wait_op(rig, rig.bundle.promote(seq, 0, rng(0, 16), data)) == DONE
    assert rig.ref.lane_info(1).taint_bits == Taint.QUANTIZED_DEMOTION
    rig.tick(decodes=[D(1, 3)])  # decoding on goes on tainted
    assert rig.ref.lane_info(1).taint_bits == Taint.QUANTIZED_DEMOTION


# ABI rule 108
def test_rule_108_demote_releases_pool_bytes_at_completion(rig):
    ref = rig.ref
    seq, _ = lane(rig, tokens=list(range(40, 88)))  # 48 tokens: three 1 KiB blocks
    lane(rig, tag=2, tokens=list(range(40, 88)))  # an untouched twin
    before = ref.stats()["pool_bytes_used"]
    op = demote(rig, seq, 0, 0, 32)
    assert ref.stats()["pool_bytes_used"] == before  # submitted: nothing released yet
    events = rig.tick()
    assert [(c.op, c.state) for c in events.op_completions] == [(op, DONE)]
    assert ref.stats()["pool_bytes_used"] == before - 2048  # the two whole blocks of [0, 32)
    assert events.mem.pool_blocks_used * 1024 == before - 2048
    data = rig.bundle.op_output(op)
    # While demoted the lane is locked (rule 49); promote gives the blocks back.
    with pytest.raises(PlanRejected) as info:
        rig.tick(decodes=[D(1, 1)])
    assert info.value.status == Status.REJECT_TRANSFER_LOCKED
    assert wait_op(rig, rig.bundle.promote(seq, 0, rng(0, 32), data)) == DONE
    assert ref.stats()["pool_bytes_used"] == before
    both = rig.tick(decodes=[D(1, 4), D(2, 4)])
    assert rig.emitted(both, 1) == rig.emitted(both, 2)  # the lane continues as if never moved


# ABI rule 108
def test_rule_108_cancelled_demote_releases_nothing(rig):
    ref = rig.ref
    seq, _ = lane(rig)
    before = ref.stats()["pool_bytes_used"]
    op = demote(rig, seq, 0, 0, 32)
    rig.bundle.op_cancel(op)
    rig.tick()
    assert ref.stats()["pool_bytes_used"] == before
    assert rig.bundle.op_poll(op).state == OpState.CANCELLED
    rig.tick(decodes=[D(1, 1)])  # nothing is demoted, the lane is free


# -- the resume path these ops serve (RULES.md 95, 104 and 86 together) --------------------------


def _continue(rig, tag: int, n: int) -> list[int]:
    return rig.emitted(rig.tick(decodes=[D(tag, n)]), tag)


def test_restore_adopt_admit_continues_exactly(rig):
    seq, history = lane(rig, decode=5)
    n = valid_len(rig, seq)
    data = sealed(rig, seq, 0, n)
    want = _continue(rig, 1, 6)  # what the original goes on to generate
    target = rig.bundle.sequence_create()
    assert restored(rig, target, 0, data) == DONE
    if is_ref(rig):  # the reference payload is a function of the tokens: byte-identical re-export
        assert sealed(rig, target, 0, n) == data
    seed = served(rig.bundle.seed_adopt, target, rig.put(history[:n]))
    events = rig.tick([rig.admit(2, rig.put(history[:n]), seed_handle=seed)])
    assert [r.status for r in events.admit_results] == [AdmitStatus.ADMITTED]
    # The adopted lane goes on from position n of the original's stream (an engine may hold the
    # last drawn token outside its state, so n can be one short of the history).
    assert _continue(rig, 2, 6) == (history + want)[n : n + 6]


def test_restore_adopt_continues_exactly_with_a_blob_space(make_rig):
    rig = make_rig(spaces=[PAGED, blob()])
    seq, history = lane(rig, decode=0)  # 32 tokens: blob boundaries 16 and 32
    paged, state = sealed(rig, seq, 0, 32), sealed(rig, seq, 1, 32)
    want = _continue(rig, 1, 5)
    target = rig.bundle.sequence_create()
    assert restored(rig, target, 1, state) == DONE  # any order of spaces
    assert status_of(rig.bundle.seed_adopt, target, rig.put(history)) == Status.ERR_SEED_UNSERVABLE
    assert restored(rig, target, 0, paged) == DONE
    seed = rig.bundle.seed_adopt(target, rig.put(history))
    rig.tick([rig.admit(2, rig.put(history), seed_handle=seed)])
    assert _continue(rig, 2, 5) == want


def test_restore_adopt_continues_exactly_on_a_blob_only_model(make_rig):
    rig = make_rig(spaces=[blob()])
    seq, history = lane(rig, decode=0)
    state = sealed(rig, seq, 1, 32)
    want = _continue(rig, 1, 5)
    target = rig.bundle.sequence_create()
    assert restored(rig, target, 1, state) == DONE
    info = rig.ref.space_info(target, 1)
    assert (info.valid_len, info.tokens_known) == (32, 0)  # the tokens come with the adopt
    assert sealed(rig, target, 1, 32) == state
    seed = rig.bundle.seed_adopt(target, rig.put(history))
    rig.tick([rig.admit(2, rig.put(history), seed_handle=seed)])
    assert _continue(rig, 2, 5) == want
    rig.tick(retires=[R(1), R(2)])
