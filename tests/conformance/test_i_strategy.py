"""RULES.md section I, strategy registration and admission certificates: rules 114-122.

Every refused registration is paired with the same registration minus its fault, which must be
granted, so an engine refusing everything fails (or, if it registers no strategy at all, the test
skips saying so). Certificates need a certified (strategy_id, impl_hash, config_hash); the
reference engine's test surface ``certify`` provides one (rules 117-121 are reference-only).
"""

from __future__ import annotations

import pytest
from hkit import is_ref, status_of
from lanekit import D, P

from basertd.native.abi import AbiError, Artifact, CapabilityReq, StrategyRegistration, TapSpec
from basertd.native.ref import cert
from basertd.schema.abi import (
    AdmitStatus,
    ArtifactRole,
    CertDomain,
    CertMode,
    Exactness,
    Sampling,
    Status,
    StrategyCap,
    TapTensor,
)

REFUSED = Status.ERR_REGISTRATION_REFUSED
CERT_UNMATCHED_BITS = 0xFFFFFF74  # -140 as two's complement (rules 14, 15)
H1, H2, C1, C2 = (bytes([i]) * 32 for i in (1, 2, 3, 4))
LINEAR = CapabilityReq(kind_id=StrategyCap.PROPOSAL_LINEAR)
HOST_OK = CapabilityReq(kind_id=StrategyCap.HOST_COMPATIBLE)


def reg(strategy_id: str | None = "draft", **fields) -> StrategyRegistration:
    fields.setdefault("capabilities", [LINEAR])
    return StrategyRegistration(strategy_id=strategy_id, **fields)


def _register(rig):
    fn = getattr(rig.bundle, "strategy_register", None)
    if fn is None:
        pytest.skip("this engine has no strategy registration")
    return fn


def granted(rig, registration: StrategyRegistration):
    """The grant of a registration the rule says is legal; skips on an engine registering nothing."""
    try:
        return _register(rig)(registration)
    except AbiError as e:
        if e.status in (REFUSED, Status.ERR_OP_UNSUPPORTED) and not is_ref(rig):
            pytest.skip("this engine registers no speculation strategies")
        raise


def refused(rig, registration: StrategyRegistration) -> None:
    assert status_of(_register(rig), registration) == REFUSED


def admit(rig, tag: int, slot: int, **fields):
    """Admit lane ``tag`` on strategy ``slot`` (admit only); returns its AdmitResult."""
    (res,) = rig.tick([rig.admit(tag, rig.put([5, 6, 7, 8]), strategy_slot=slot, **fields)]).admit_results
    assert res.lane_tag == tag
    return res


def assert_rejected(rig, res) -> None:
    assert res.status == AdmitStatus.REJECTED
    assert res.reject_code == CERT_UNMATCHED_BITS and res.reject_status is Status.REJECT_CERT_UNMATCHED
    assert res.cert_id == 0
    rig.rejects(Status.REJECT_UNKNOWN_LANE, decodes=[D(res.lane_tag)])  # no lane was made


@pytest.mark.parametrize("kind", [0, 6, 99, 0xFFFFFFFF])
# ABI rule 114
def test_rule_114_unknown_capability_kind_refuses(rig, kind):
    refused(rig, reg(capabilities=[LINEAR, CapabilityReq(kind_id=kind)]))
    every_known = [CapabilityReq(kind_id=k) for k in StrategyCap if k != StrategyCap.UNSPECIFIED]
    assert granted(rig, reg(capabilities=every_known)).strategy_slot


# ABI rule 115
def test_rule_115_tap_layer_beyond_the_model(make_rig):
    rig = make_rig(n_layers=12)
    for layer in (12, 13, 2**32 - 1):
        refused(rig, reg(taps=[TapSpec(layer=0, tensor=TapTensor.HIDDEN), TapSpec(layer, TapTensor.HIDDEN)]))
    assert granted(rig, reg(taps=[TapSpec(layer=11, tensor=TapTensor.ATTN_OUT)])).strategy_slot


# ABI rule 115
def test_rule_115_target_archs_without_the_engines_arch(make_rig):
    rig = make_rig(arch="tiny-arch")
    refused(rig, reg(target_archs=["other-arch"]))
    refused(rig, reg(target_archs=["tiny", "tiny-arch2"]))
    assert granted(rig, reg(target_archs=["other-arch", "tiny-arch"])).strategy_slot
    assert granted(rig, reg(target_archs=[])).strategy_slot  # empty: any architecture


# ABI rule 116
def test_rule_116_kernel_caps_not_offered(make_rig):
    rig = make_rig(kernel_caps=0b0101)
    for need in (0b0010, 0b0111, 1 << 31):
        refused(rig, reg(kernel_caps_required=need))
    for need in (0, 0b0001, 0b0100, 0b0101):
        assert granted(rig, reg(kernel_caps_required=need)).strategy_slot


@pytest.mark.parametrize("field", ["strategy_id", "artifact load_path", "target arch"])
# ABI rule 116
def test_rule_116_null_pointers_refuse(rig, field):
    weights = Artifact(role=ArtifactRole.DRAFT_WEIGHTS, load_path="/models/draft.gguf")
    arch = rig.bundle.config.arch if is_ref(rig) else None
    archs = [arch] if arch else []
    good, bad = {
        "strategy_id": (dict(strategy_id="draft"), dict(strategy_id=None)),
        "artifact load_path": (
            dict(artifacts=[weights]),
            dict(artifacts=[weights, Artifact(role=ArtifactRole.AUX_HEAD, load_path=None)]),
        ),
        "target arch": (dict(target_archs=archs), dict(target_archs=[*archs, None])),
    }[field]
    refused(rig, reg(**{"strategy_id": "draft", **bad}))
    assert granted(rig, reg(**{"strategy_id": "draft", **good})).strategy_slot


# ABI rule 117
def test_rule_117_certificates_only_for_the_certified_combination(rig):
    ref = rig.ref
    assert granted(rig, reg("lookup", impl_hash=H1, config_hash=C1)).certificates == []  # none yet
    ref.certify("lookup", H1, C1, [cert(), cert(Exactness.DISTRIBUTION_EXACT, CertMode.GUMBEL)])
    first = granted(rig, reg("lookup", impl_hash=H1, config_hash=C1))
    assert [(c.exactness, c.sampling_modes) for c in first.certificates] == [
        (Exactness.SEED_PATH_INVARIANT, 0b111),
        (Exactness.DISTRIBUTION_EXACT, CertMode.GUMBEL),
    ]
    ids = [c.cert_id for c in first.certificates]
    assert all(ids) and len(set(ids)) == 2
    for impl, config in ((H2, C1), (H1, C2), (H2, C2)):  # a changed hash under the same name
        assert granted(rig, reg("lookup", impl_hash=impl, config_hash=config)).certificates == []
    assert granted(rig, reg("other", impl_hash=H1, config_hash=C1)).certificates == []
    again = granted(rig, reg("lookup", impl_hash=H1, config_hash=C1))
    assert len(again.certificates) == 2 and not {c.cert_id for c in again.certificates} & set(ids)
    assert again.strategy_slot != first.strategy_slot


@pytest.mark.parametrize("est", [0, 1, 4096, 2**40])
# ABI rule 118
def test_rule_118_reserved_bytes_equal_the_estimate(rig, est):
    assert granted(rig, reg(est_state_bytes=est)).reserved_bytes == est


def _certified(rig, certs, capabilities=(LINEAR,)):
    """Register a strategy certified with ``certs``; returns (slot, [cert ids])."""
    rig.ref.certify("spec", H1, C1, certs)
    g = granted(rig, reg("spec", impl_hash=H1, config_hash=C1, capabilities=list(capabilities)))
    assert len(g.certificates) == len(certs)
    return g.strategy_slot, [c.cert_id for c in g.certificates]


# ABI rule 119
def test_rule_119_required_cert_matches_only_that_certificate(rig):
    strict = cert(Exactness.SEED_PATH_INVARIANT, CertMode.GREEDY | CertMode.GUMBEL, CertDomain.GREEDY_ONLY)
    loose = cert(Exactness.DISTRIBUTION_EXACT, CertMode.GREEDY | CertMode.GUMBEL, CertDomain.ANY)
    slot, (a, b) = _certified(rig, [strict, loose])
    res = admit(rig, 1, slot)  # the engine picks: the strictest that matches
    assert (res.status, res.cert_id, res.granted_class) == (
        AdmitStatus.ADMITTED,
        a,
        Exactness.SEED_PATH_INVARIANT,
    )
    res = admit(rig, 2, slot, required_cert_id=b)
    assert (res.status, res.cert_id, res.granted_class) == (
        AdmitStatus.ADMITTED,
        b,
        Exactness.DISTRIBUTION_EXACT,
    )
    # An id the slot does not hold, or one that does not match the lane, is REJECTED even though
    # another certificate would match and approximation is allowed.
    assert_rejected(rig, admit(rig, 3, slot, required_cert_id=b + 1000, allow_approximate=1))
    gumbel = dict(sampling=Sampling.GPU_GUMBEL, temperature=0.8)
    assert_rejected(rig, admit(rig, 4, slot, required_cert_id=a, allow_approximate=1, **gumbel))
    res = admit(rig, 5, slot, **gumbel)  # without the requirement the loose one serves it
    assert (res.status, res.cert_id) == (AdmitStatus.ADMITTED, b)


# ABI rule 120
def test_rule_120_greedy_only_rejects_gumbel_with_temperature(rig):
    slot, (a,) = _certified(rig, [cert(Exactness.SEED_PATH_INVARIANT, 0b011, CertDomain.GREEDY_ONLY)])
    assert admit(rig, 1, slot).cert_id == a  # a greedy lane
    assert admit(rig, 2, slot, sampling=Sampling.GPU_GUMBEL, temperature=0.0).cert_id == a
    assert_rejected(rig, admit(rig, 3, slot, sampling=Sampling.GPU_GUMBEL, temperature=0.7))
    res = admit(rig, 4, slot, sampling=Sampling.GPU_GUMBEL, temperature=0.7, allow_approximate=1)
    assert (res.status, res.cert_id, res.granted_class) == (AdmitStatus.ADMITTED, 0, Exactness.APPROXIMATE)


# ABI rule 121
def test_rule_121_host_cert_admits_only_listed_identities(rig):
    listed, other, zero = b"\x11" * 32, b"\x22" * 32, bytes(32)
    host_cert = cert(
        Exactness.DISTRIBUTION_EXACT, CertMode.HOST, CertDomain.ANY, host_identities=[listed, zero]
    )
    slot, (a,) = _certified(rig, [host_cert], capabilities=(LINEAR, HOST_OK))
    host = dict(sampling=Sampling.HOST)
    res = admit(rig, 1, slot, host_sampler_identity=listed, **host)
    assert (res.status, res.cert_id, res.granted_class) == (
        AdmitStatus.ADMITTED,
        a,
        Exactness.DISTRIBUTION_EXACT,
    )
    assert_rejected(rig, admit(rig, 2, slot, host_sampler_identity=other, **host))
    assert_rejected(rig, admit(rig, 3, slot, host_sampler_identity=zero, **host))  # listed, yet never matches
    assert_rejected(rig, admit(rig, 4, slot))  # the certificate holds no GPU mode


# ABI rule 122
def test_rule_122_no_certificate_approximate_or_rejected(rig):
    slot = granted(rig, reg("uncertified")).strategy_slot
    res = admit(rig, 1, slot, allow_approximate=1)
    assert (res.status, res.cert_id, res.granted_class) == (AdmitStatus.ADMITTED, 0, Exactness.APPROXIMATE)
    events = rig.tick(prefills=[P(1, 0, 4)], decodes=[D(1, 3)])  # an ordinary lane
    assert len(rig.emitted(events, 1)) == 3
    assert_rejected(rig, admit(rig, 2, slot, allow_approximate=0))
