"""RULES.md section B (rules 13-16): status codes, from the header through cffi, and their
parity with ``basertd.schema.abi`` (every header constant has its enum member with the same
value and every enum member its header constant)."""

from __future__ import annotations

import enum

import pytest
from lanekit import D

from basertd.native.abi import PLAN_REJECTION_RANGE, AbiError, EngineFatal, PlanRejected, error_for
from basertd.native.ref import RefuseKind
from basertd.schema import abi as schema_abi
from basertd.schema.abi import AdmitStatus, Status
from basertd.schema.tick import AdmitResult

# Header prefix -> schema enum. Longest prefix wins; the BASERT_TICK_ names split by member.
_PREFIXES = {
    "BASERT_FAULT_": schema_abi.FaultCode,
    "BASERT_SAMPLING_FLAG_": schema_abi.SamplingFlag,
    "BASERT_SAMPLING_": schema_abi.Sampling,
    "BASERT_DETERMINISM_": schema_abi.DeterminismClass,
    "BASERT_EXACTNESS_": schema_abi.Exactness,
    "BASERT_ADMIT_": schema_abi.AdmitStatus,
    "BASERT_FINISH_": schema_abi.Finish,
    "BASERT_OP_": schema_abi.OpState,
    "BASERT_ENCODING_": schema_abi.Encoding,
    "BASERT_SPACE_KIND_": schema_abi.SpaceKind,
    "BASERT_SPACE_FLAG_": schema_abi.SpaceFlag,
    "BASERT_ARTIFACT_": schema_abi.ArtifactRole,
    "BASERT_TAP_TENSOR_": schema_abi.TapTensor,
    "BASERT_CERT_MODE_": schema_abi.CertMode,
    "BASERT_CERT_DOMAIN_": schema_abi.CertDomain,
    "BASERT_STRATEGY_CAP_": schema_abi.StrategyCap,
    "BASERT_TAINT_": schema_abi.Taint,
    "BASERT_TIER_": schema_abi.Tier,
    "BASERT_SHED_": schema_abi.ShedKind,
    "BASERT_FORK_": schema_abi.ForkFlag,
    "BASERT_CHECKSUM_": schema_abi.ChecksumKind,
    "BASERT_RING_KIND_": schema_abi.RingKind,
    "BASERT_RING_ROLE_": schema_abi.RingRole,
}
_TICK_FLAGS = {"DRAIN", "CAPTURE_OK", "PARTIAL_EMITS"}
_MODULE_CONSTANTS = {
    "BASERT_MAX_TOP_LOGPROBS": "MAX_TOP_LOGPROBS",
    "BASERT_ALL_SPACES": "ALL_SPACES",
    "BASERT_STATE_ENVELOPE_MAGIC": "STATE_ENVELOPE_MAGIC",
    "BASERT_RING_MAGIC": "RING_MAGIC",
}


def _schema_name(header_name: str) -> tuple[type | None, str]:
    """(enum class or None for a module constant, member name) of a header constant."""
    if header_name in _MODULE_CONSTANTS:
        return None, _MODULE_CONSTANTS[header_name]
    if header_name.startswith("BASERT_TICK_"):
        member = header_name.removeprefix("BASERT_TICK_")
        return (schema_abi.TickFlag if member in _TICK_FLAGS else schema_abi.TickStatus), member
    for prefix in sorted(_PREFIXES, key=len, reverse=True):
        if header_name.startswith(prefix):
            return _PREFIXES[prefix], header_name.removeprefix(prefix)
    member = header_name.removeprefix("BASERT_")
    return Status, "OK" if member == "STATUS_OK" else member


@pytest.fixture(scope="module")
def header_constants(tick_ffi) -> dict[str, int]:
    lib = tick_ffi.dlopen(None)  # constants only; no symbol is looked up
    return {n: getattr(lib, n) for n in dir(lib) if n.startswith("BASERT_")}


def _status_constants(header_constants: dict[str, int]) -> dict[str, int]:
    return {n: v for n, v in header_constants.items() if _schema_name(n)[0] is Status}


def test_rule_13_plan_rejection_codes(header_constants):
    # ABI rule 13: plan-rejection codes are exactly -100..-108 and -110..-114; nothing is -109.
    statuses = _status_constants(header_constants)
    in_range = sorted(v for v in statuses.values() if -114 <= v <= -100)
    assert in_range == [*range(-114, -109), *range(-108, -99)]
    assert -109 not in header_constants.values()
    assert len(set(statuses.values())) == len(statuses), "two status names share a value"
    assert sorted(s.value for s in Status if s.value in PLAN_REJECTION_RANGE) == in_range


def test_rule_14_cert_unmatched_is_outside_the_rejection_range(header_constants):
    # ABI rule 14 (header half): -140 is not a plan-rejection code, so a tick status of -140 is
    # not something the binding classifies as a plan refusal.
    assert header_constants["BASERT_REJECT_CERT_UNMATCHED"] == -140
    assert -140 not in PLAN_REJECTION_RANGE
    err = error_for(-140, "baseRT_tick")
    assert type(err) is AbiError and err.status is Status.REJECT_CERT_UNMATCHED


def test_rule_15_reject_code_two_complement_bits(tick_ffi):
    # ABI rule 15 (encoding half): AdmitResult.reject_code is a uint32_t holding the status's
    # two's-complement bits; -140 reads 0xFFFFFF74 from C and back as Status.REJECT_CERT_UNMATCHED.
    res = tick_ffi.new("BaseRTAdmitResult *")
    res.reject_code = -140 & 0xFFFFFFFF
    raw = bytes(tick_ffi.buffer(res))[12:16]
    assert raw == (-140).to_bytes(4, "little", signed=True)
    assert res.reject_code == 0xFFFFFF74
    assert AdmitResult(lane_tag=1, reject_code=res.reject_code).reject_status is Status.REJECT_CERT_UNMATCHED
    with pytest.raises(OverflowError):
        res.reject_code = -140  # the field is unsigned: a writer must store the bits, not the int


def test_rule_16_op_unsupported_and_fatal(header_constants):
    # ABI rule 16: BASERT_ERR_OP_UNSUPPORTED = -127, BASERT_ERR_FATAL = -1.
    assert header_constants["BASERT_ERR_OP_UNSUPPORTED"] == -127
    assert header_constants["BASERT_ERR_FATAL"] == -1
    assert isinstance(error_for(-1, "baseRT_op_poll"), EngineFatal)


@pytest.mark.parametrize("code", sorted(s.value for s in Status if s.value in PLAN_REJECTION_RANGE))
def test_rules_13_16_binding_classifies_tick_status(code):
    # ABI rules 13 and 16: the binding turns -100..-114 from baseRT_tick into PlanRejected with
    # the schema Status, the same code from another call into a plain AbiError.
    err = error_for(code, "baseRT_tick")
    assert isinstance(err, PlanRejected) and err.status == code and isinstance(err.status, Status)
    other = error_for(code, "baseRT_op_poll")
    assert type(other) is AbiError


def test_rules_13_16_every_header_constant_is_in_the_schema(header_constants):
    # ABI rules 12-16: basertd.schema.abi carries every header constant with the same value.
    assert len(header_constants) == 120
    for name, value in header_constants.items():
        cls, member = _schema_name(name)
        got = getattr(schema_abi, member) if cls is None else cls[member].value
        assert got == value, f"{name} = {value}, schema has {got}"


def test_rules_13_16_every_schema_code_is_in_the_header(header_constants):
    # ABI rules 12-16, the other direction: no schema enum member lacks a header constant.
    mapped: dict[type, set[str]] = {}
    for name in header_constants:
        cls, member = _schema_name(name)
        if cls is not None:
            mapped.setdefault(cls, set()).add(member)
    enums = [
        obj
        for obj in vars(schema_abi).values()
        if isinstance(obj, type) and issubclass(obj, enum.Enum) and obj.__module__ == schema_abi.__name__
    ]
    assert len(enums) == 26
    for cls in enums:
        assert {m.name for m in cls} == mapped.get(cls, set()), cls.__name__
    for const in _MODULE_CONSTANTS.values():
        assert hasattr(schema_abi, const)


def _admit_only(rig, tag: int, **fields):
    span = rig.put([5, 6, 7, 8])
    return rig.tick([rig.admit(tag, span, **fields)])


def test_rule_14_cert_unmatched_is_an_admit_result_not_a_tick_status(make_rig):
    # ABI rules 14 and 119: an admit requiring a certificate the engine does not hold is REJECTED
    # with -140 in admit_results; baseRT_tick itself returns OK and no lane is created.
    rig = make_rig()
    ev = _admit_only(rig, 1, required_cert_id=0x7777, allow_approximate=0)  # raises on any non-OK
    (res,) = ev.admit_results
    assert (res.lane_tag, res.status) == (1, AdmitStatus.REJECTED)
    assert res.reject_code == 0xFFFFFF74 and res.reject_status is Status.REJECT_CERT_UNMATCHED
    rig.rejects(Status.REJECT_UNKNOWN_LANE, decodes=[D(1)])


def test_rule_15_engine_writes_two_complement_bits(make_rig):
    # ABI rule 15 [D]: the engine stores a rejected admit's status as its two's-complement bits.
    # The reference engine's refuse_admits hook rejects chosen admits with a chosen status.
    rig = make_rig()
    ref = rig.ref  # skips on a real libbaseRT: the hook is reference-only
    ref.refuse_admits(RefuseKind.TAG_EQUALS, 2, Status.REJECT_CERT_UNMATCHED)
    ev = _admit_only(rig, 2)
    (res,) = ev.admit_results
    assert res.status == AdmitStatus.REJECTED and res.reject_code == 0xFFFFFF74
    ref.refuse_admits(RefuseKind.TAG_EQUALS, 3, Status.REJECT_BOUNDS)
    (res,) = _admit_only(rig, 3).admit_results
    assert res.reject_code == 0xFFFFFF9A and res.reject_status is Status.REJECT_BOUNDS
    ref.refuse_admits(RefuseKind.NONE)
    (res,) = _admit_only(rig, 4).admit_results
    assert (res.status, res.reject_code) == (AdmitStatus.ADMITTED, 0)
