"""The reference engine's own choices around state ops, strategies and media, where RULES.md
leaves room (documented in native/ref_engine/ops.c, strategy.c and media.c). Not rule tests: they
pin what the reference does so basertd can rely on it."""

from __future__ import annotations

import pytest
from gkit import PAGED, wait_op
from hkit import bare, demoted_bytes, envelope, lane, restored, rng, sealed, sized, status_of
from lanekit import D, P, R, need_ref

from basertd.native.abi import ArgumentError, StrategyRegistration
from basertd.native.ref import RefSpace, cert
from basertd.schema.abi import (
    AdmitStatus,
    ChecksumKind,
    Encoding,
    Exactness,
    OpState,
    SpaceKind,
    Status,
    Taint,
)

DONE = OpState.DONE
H = bytes(32)


@pytest.fixture
def ref_rig(make_rig):
    def make(**config):
        rig = make_rig(**config)
        need_ref(rig.bundle)  # skips on engines without the test surface
        return rig

    return make


def test_restore_and_trim_refuse_lane_owned_sequences(ref_rig):
    rig = ref_rig()
    seq, _ = lane(rig)
    data = sealed(rig, seq, 0, 32)
    assert status_of(rig.bundle.restore, seq, 0, data) == Status.ERR_UNKNOWN_HANDLE
    assert status_of(rig.bundle.trim, seq, 0, 16) == Status.ERR_UNKNOWN_HANDLE
    rig.tick(decodes=[D(1, 1)])  # the lane is untouched


def test_restore_needs_room_in_the_pool(ref_rig):
    rig = ref_rig(pool_bytes=4 * 1024)  # four 16-token blocks
    seq, _ = lane(rig, tokens=list(range(40, 88)))  # three of them
    data = sealed(rig, seq, 0, 48)
    target = rig.bundle.sequence_create()
    assert status_of(rig.bundle.restore, target, 0, data) == Status.NEEDS_REPLAN
    assert rig.ref.space_info(target, 0).valid_len == 0
    rig.tick(retires=[R(1)])
    assert restored(rig, target, 0, data) == DONE


def test_promote_needs_room_in_the_pool(ref_rig):
    rig = ref_rig(pool_bytes=4 * 1024)
    seq, _ = lane(rig)  # two blocks
    data = demoted_bytes(rig, seq, 0, 0, 32)  # both back in the pool
    lane(rig, tag=2, tokens=list(range(100, 164)))  # all four blocks
    assert status_of(rig.bundle.promote, seq, 0, rng(0, 32), data) == Status.NEEDS_REPLAN
    rig.tick(retires=[R(2)])
    assert wait_op(rig, rig.bundle.promote(seq, 0, rng(0, 32), data)) == DONE
    rig.tick(decodes=[D(1, 2)])


def test_cancelled_restore_gives_its_blocks_back(ref_rig):
    rig = ref_rig()
    seq, _ = lane(rig)
    data = sealed(rig, seq, 0, 32)
    before = rig.ref.stats()["pool_bytes_used"]
    op = rig.bundle.restore(rig.bundle.sequence_create(), 0, data)
    assert rig.ref.stats()["pool_bytes_used"] == before + 2048  # taken at submission
    rig.bundle.op_cancel(op)
    assert rig.ref.stats()["pool_bytes_used"] == before


def test_a_faulted_lane_with_a_demoted_range_retires_at_once(ref_rig):
    rig = ref_rig()
    seq, _ = lane(rig)
    demoted_bytes(rig, seq, 0, 0, 16)
    rig.ref.inject_fault(1, 5)
    rig.tick()
    rig.tick(retires=[R(1)])  # rule 61: accepted once, not TRANSFER_LOCKED by stale ranges
    assert rig.ref.stats()["pool_bytes_used"] == 0


def test_blob_demote_and_promote(make_rig):
    blob = RefSpace(
        1, SpaceKind.RECURRENT_BLOB, blob_bytes=64, snapshot_cadence=2, snapshot_interval_tokens=16
    )
    rig = make_rig(spaces=[PAGED, blob])
    need_ref(rig.bundle)
    seq, _ = bare(rig)
    size, gen = sized(rig, seq, 1, 16)
    assert status_of(rig.bundle.demote, seq, 1, rng(0, 16), Encoding.LOSSLESS, gen, size) == (
        Status.ERR_OUT_OF_BOUNDARY  # a blob demote takes the current state only
    )
    data = demoted_bytes(rig, seq, 1, 32, 32)
    assert (envelope(data).range.start, envelope(data).range.end) == (32, 32)
    size, gen = sized(rig, seq, 1, 16)
    assert status_of(rig.bundle.snapshot, seq, 1, 16, gen, size) == Status.REJECT_BOUNDS  # not resident
    assert wait_op(rig, rig.bundle.promote(seq, 1, rng(32, 32), data)) == DONE
    assert len(sealed(rig, seq, 1, 16)) == size


def test_restore_of_a_lossy_demote_is_tainted(ref_rig):
    rig = ref_rig()
    seq, _ = bare(rig)
    data = demoted_bytes(rig, seq, 0, 0, 32, Encoding.Q8)
    target = rig.bundle.sequence_create()
    assert restored(rig, target, 0, data) == DONE
    assert rig.ref.space_info(target, 0).taint_bits == Taint.QUANTIZED_DEMOTION


def test_partial_range_envelopes_do_not_restore(ref_rig):
    rig = ref_rig()
    seq, _ = bare(rig)
    data = demoted_bytes(rig, seq, 0, 16, 32)
    target = rig.bundle.sequence_create()
    assert status_of(rig.bundle.restore, target, 0, data) == Status.ERR_ENVELOPE_MISMATCH


@pytest.mark.parametrize(
    ("bytes_per_token", "served"),
    [(2, set()), (4, {Encoding.LOSSLESS}), (8, {Encoding.LOSSLESS, Encoding.Q8}), (64, set(Encoding))],
)
def test_paged_records_carry_a_token_id(ref_rig, bytes_per_token, served):
    rig = ref_rig(bytes_per_token=bytes_per_token, pool_bytes=bytes_per_token * 16 * 8)
    seq, _ = lane(rig, tokens=[5, 6, 7])
    for enc in Encoding:
        if enc in served:
            sized(rig, seq, 0, 3, enc=enc)
        else:
            assert status_of(rig.bundle.export_size, seq, 0, rng(0, 3), enc) == Status.ERR_OP_UNSUPPORTED


def test_set_export_checksum_refuses_unknown_kinds(ref_rig):
    rig = ref_rig()
    for kind in (0, 3, 99):
        assert status_of(rig.ref.set_export_checksum, kind) == Status.REJECT_BOUNDS
    rig.ref.set_export_checksum(ChecksumKind.XXH3_64)
    seq, _ = lane(rig)
    assert envelope(sealed(rig, seq, 0, 16)).checksum_kind == ChecksumKind.XXH3_64


def test_certify_checks_its_arguments(ref_rig):
    ref = ref_rig().ref
    for bad in (cert(exactness=3), cert(sampling_modes=8), cert(param_domain=4), cert(grammar_allowed=2)):
        assert status_of(ref.certify, "s", H, H, [bad]) == Status.REJECT_BOUNDS
    assert status_of(ref.certify, "", H, H, [cert()]) == Status.REJECT_BAD_STRUCT
    with pytest.raises(ArgumentError):
        ref.certify("s", H[:31], H, [cert()])
    with pytest.raises(ArgumentError):
        ref.certify("s", H, H, [cert(host_identities=[b"short"])])
    ref.certify("s", H, H, [cert()])
    ref.certify("s", H, H, [])  # removed again
    assert ref.strategy_register(StrategyRegistration("s")).certificates == []


def test_strategy_free_admission_rules(ref_rig):
    rig = ref_rig()
    (res,) = rig.tick([rig.admit(1, rig.put([5, 6]), required_cert_id=3, allow_approximate=1)]).admit_results
    assert res.status == AdmitStatus.REJECTED  # slot 0 holds no certificate to require
    slot = rig.ref.strategy_register(StrategyRegistration("plain")).strategy_slot
    floor = dict(strategy_slot=slot, allow_approximate=1, minimum_exactness=Exactness.DISTRIBUTION_EXACT)
    (res,) = rig.tick([rig.admit(2, rig.put([5, 6]), **floor)]).admit_results
    assert res.status == AdmitStatus.REJECTED  # approximate would break the floor
    (res,) = rig.tick([rig.admit(3, rig.put([5, 6]))]).admit_results
    assert (res.status, res.cert_id, res.granted_class) == (
        AdmitStatus.ADMITTED,
        0,
        Exactness.SEED_PATH_INVARIANT,
    )


def test_media_without_a_tower(ref_rig):
    b = ref_rig().bundle
    assert status_of(b.media_probe, "/img/a.png") == Status.ERR_OP_UNSUPPORTED
    assert status_of(b.media_encode, "/img/a.png") == Status.ERR_OP_UNSUPPORTED
    assert status_of(b.media_release, 1) == Status.ERR_UNKNOWN_HANDLE
    assert status_of(b.media_bind, 1, 1, 0) == Status.ERR_UNKNOWN_HANDLE


def test_media_with_a_synthetic_tower(ref_rig):
    rig = ref_rig()
    b = rig.ref
    assert status_of(b.media_tower, 600, 16) == Status.REJECT_BOUNDS  # beyond the 512-token vocabulary
    assert status_of(b.media_tower, 300, 0) == Status.REJECT_BOUNDS
    b.media_tower(300, 4, 301, 302)
    info = b.media_probe("/img/a.png")
    assert (info.n_tokens, info.image_token_id, info.boi_token_id, info.eoi_token_id) == (4, 300, 301, 302)
    h1, i1 = b.media_encode("/img/a.png")
    h2, _ = b.media_encode("/img/a.png")
    assert h1 != h2 and i1 == info
    rig.tick([rig.admit(1, rig.put([301, 300, 300, 300, 300, 302, 9]))])
    b.media_bind(1, h1, 1)
    assert status_of(b.media_bind, 1, h2, 3) == Status.REJECT_BOUNDS  # overlaps the first run
    assert status_of(b.media_bind, 1, h2, 6) == Status.REJECT_BOUNDS  # runs past the prompt
    b.media_bind(77, h2, 0)  # a lane not admitted yet
    rig.tick(prefills=[P(1, 0, 7)])
    rig.tick(retires=[R(1)])
    b.media_release(h1)
    assert status_of(b.media_release, h1) == Status.ERR_UNKNOWN_HANDLE
    assert status_of(b.media_bind, 2, h1, 0) == Status.ERR_UNKNOWN_HANDLE
