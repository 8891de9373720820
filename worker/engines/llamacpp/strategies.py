"""Speculation-strategy registration and admission certificates on the llama.cpp engine (tick ABI
§2; RULES.md section I, rules 36, 37, 114-122).

``Strategies.strategy_register`` fails closed like the reference engine: an unknown capability
kind, a tap layer past the model's, ``target_archs`` without the model's architecture, kernel
capabilities (this engine offers none), a NULL ``strategy_id`` / ``impl_version`` / artifact
``load_path`` / arch, or a ``claimed_exactness`` above SEED_PATH_INVARIANT refuse the whole
registration with ERR_REGISTRATION_REFUSED and change nothing. A granted strategy gets the next
slot (1, 2, ...; never reused) and ``reserved_bytes = est_state_bytes`` (rule 118).

Certificates (rule 117) are granted only to the two combinations this engine has tested:
``strategy_id`` "prompt-lookup" with ``impl_hash == LOOKUP_IMPL_HASH`` and ``config_hash`` the
hash of the ``LookupConfig`` its PROPOSAL_LINEAR capability carries
(``basertd.worker.engines.lookup.lookup_registration`` builds such a registration), and
"draft-model" with ``impl_hash == DRAFT_IMPL_HASH`` and ``config_hash`` the hash of its
``DraftConfig`` (``basertd.worker.engines.draft.draft_registration``). Each gets two certificates,
each saying what the tests show, both of exactness DISTRIBUTION_EXACT, the class a plain lane of
this engine has (``work.GRANTED_CLASS``; nothing speculative can be more than the lane it speeds
up), logit bias allowed, no grammar:

- greedy: GREEDY (and GUMBEL at temperature <= 0) lanes, domain GREEDY_ONLY. Greedy verification
  commits the argmax chain, equal to a non-speculative run's tokens up to near-ties that batch
  shape may flip.
- sampled: GUMBEL lanes, domain ANY (temperature > 0 with top-k, top-p, min-p, penalties).
  Verification is the rejection rule for a one-hot draft (``speculation``: accept ``d`` with
  probability ``p(d)``, else draw from ``p`` without ``d``), so every committed token has the law
  a plain lane's token has: the tests compare the token histograms over fixed RNG seeds with
  speculation on and off, with and without penalties and a logit bias, for both strategies. The
  rule needs a proposal that is fixed by the lane's history and independent of the verifying
  uniform: a prompt-lookup continuation is, and so is a draft model's, which drafts greedily (its
  argmax given the lane's committed tokens, no RNG). Not SEED_PATH_INVARIANT: the rows a
  verification batch computes differ in the last bits from one-row decoding.

The greedy certificate comes first, so a temperature-0 GUMBEL lane, which both cover, is granted
it (equal classes: the lower id wins). A "draft-model" registration's DRAFT_WEIGHTS artifact is
loaded after every other check (``draft_model.DraftHost.open``: a file that does not load or a
vocabulary that differs from the target's is ERR_REGISTRATION_REFUSED), kept only when certified,
and bound as the drafter of both its certificates (``DraftHost.bind``: one draft model, one
sequence per lane, whichever certificate the lane holds; freed once at ``DraftHost.close``). Any
other registration is granted a slot with no certificate and no drafter: lanes admitted on it with
``allow_approximate`` run without speculation (rule 122).

Admission (``admit_grant``) picks, as the reference engine does, the best matching certificate of
the slot (highest exactness, then lowest id); a match needs ``required_cert_id`` 0 or its id, the
lane's sampling mode in ``sampling_modes``, its parameters in ``param_domain`` (GREEDY_ONLY: a
greedy lane or temperature <= 0; PENALTY_FREE: no penalties; ANY), ``grammar_allowed`` /
``logit_bias_allowed`` when the lane has one, and ``exactness >= minimum_exactness``. No match:
APPROXIMATE with ``allow_approximate`` (and no required id or floor), else REJECTED.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from basertd.native.abi import ExactnessCert, StrategyGrant, StrategyRegistration
from basertd.schema.abi import CertDomain, CertMode, Exactness, Sampling, Status, StrategyCap
from basertd.schema.tick import LaneAdmit
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.draft import DRAFT_IMPL_HASH, DRAFT_MODEL, DraftConfig
from basertd.worker.engines.llamacpp.draft_model import DraftHost
from basertd.worker.engines.llamacpp.work import GRANTED_CLASS
from basertd.worker.engines.lookup import LOOKUP_IMPL_HASH, PROMPT_LOOKUP, LookupConfig

_KNOWN_CAPS = frozenset(int(k) for k in StrategyCap if k != StrategyCap.UNSPECIFIED)


@dataclass
class Registered:
    """A granted strategy: its slot, id, certificates, whether HOST lanes may use it (rule 37),
    and the prompt-lookup or draft-model config when it drafts (None: no drafter)."""

    slot: int
    strategy_id: str
    certificates: list[ExactnessCert] = field(default_factory=list)
    host_compatible: bool = False
    lookup: LookupConfig | DraftConfig | None = None


@dataclass(frozen=True)
class AdmitGrant:
    """What admission grants a lane on a strategy slot: ``cert_id`` (0 none), the exactness class,
    and the drafter config when the lane speculates (None: it decodes plainly)."""

    cert_id: int
    granted: int
    lookup: LookupConfig | DraftConfig | None


def _refused(why: str) -> EngineError:
    return EngineError(Status.ERR_REGISTRATION_REFUSED, why)


class Strategies:
    """The strategies registered on one engine, by slot. ``arch`` is the model's architecture
    name, ``n_layers`` its layer count (rule 115); ``drafts`` loads draft models (None: a
    "draft-model" registration is refused)."""

    def __init__(self, arch: str, n_layers: int, drafts: DraftHost | None = None) -> None:
        self.arch = arch
        self.n_layers = n_layers
        self.drafts = drafts
        self.slots: dict[int, Registered] = {}
        self._slot = itertools.count(1).__next__
        self._cert = itertools.count(1).__next__

    def strategy_register(self, reg: StrategyRegistration) -> StrategyGrant:
        """Register ``reg`` (module docstring); returns the grant or raises
        EngineError(ERR_REGISTRATION_REFUSED) with nothing registered (rules 114-118)."""
        if not reg.strategy_id or reg.impl_version is None:
            raise _refused("strategy_id and impl_version are required")
        if reg.claimed_exactness > Exactness.SEED_PATH_INVARIANT:
            raise _refused(f"claimed_exactness {reg.claimed_exactness} is not a class")
        for cap in reg.capabilities:
            if cap.kind_id not in _KNOWN_CAPS:
                raise _refused(f"unknown capability kind {cap.kind_id}")  # rule 114
        for tap in reg.taps:
            if tap.layer >= self.n_layers:
                raise _refused(f"tap layer {tap.layer} >= {self.n_layers} layers")  # rule 115
        if reg.target_archs and (None in reg.target_archs or self.arch not in reg.target_archs):
            raise _refused(f"target_archs do not include {self.arch!r}")  # rules 115, 116
        if reg.kernel_caps_required:
            raise _refused("this engine offers no kernel capabilities")  # rule 116
        if any(a.load_path is None for a in reg.artifacts):
            raise _refused("an artifact has no load_path")  # rule 116
        lookup: LookupConfig | DraftConfig | None = None
        drafter = None
        linear = [c for c in reg.capabilities if c.kind_id == StrategyCap.PROPOSAL_LINEAR]
        if reg.strategy_id == PROMPT_LOOKUP:
            raw = linear[0].params if linear and linear[0].params else LookupConfig().params()
            try:
                lookup = LookupConfig.from_params(raw)
            except ValueError as exc:
                raise _refused(f"prompt-lookup config: {exc}") from None
        elif reg.strategy_id == DRAFT_MODEL:  # loaded last: every other check has passed
            if self.drafts is None:
                raise _refused("this engine loads no draft models")
            raw = linear[0].params if linear and linear[0].params else DraftConfig().params()
            lookup, drafter = self.drafts.open(reg, raw)
        impl_hash = {PROMPT_LOOKUP: LOOKUP_IMPL_HASH, DRAFT_MODEL: DRAFT_IMPL_HASH}.get(reg.strategy_id)
        host = any(c.kind_id == StrategyCap.HOST_COMPATIBLE for c in reg.capabilities)
        certs: list[ExactnessCert] = []
        if lookup is not None and reg.impl_hash == impl_hash and reg.config_hash == lookup.config_hash():
            kinds = [
                (CertMode.GREEDY | CertMode.GUMBEL, CertDomain.GREEDY_ONLY),  # greedy verification
                (CertMode.GUMBEL, CertDomain.ANY),  # sampled: the rejection rule
            ]
            for modes, domain in kinds:
                certs.append(
                    ExactnessCert(
                        cert_id=self._cert(),
                        exactness=GRANTED_CLASS,
                        sampling_modes=modes,
                        grammar_allowed=0,
                        logit_bias_allowed=1,
                        param_domain=domain,
                        verification_shape_class=1,
                    )
                )
        if drafter is not None and self.drafts is not None:
            if certs:  # one drafter for every certificate of the slot: its lanes share its sequences
                for c in certs:
                    self.drafts.bind(c.cert_id, drafter)
            else:  # an uncertified slot drafts nothing: the draft model is not kept
                drafter.close()
                lookup = None
        slot = self._slot()
        self.slots[slot] = Registered(slot, reg.strategy_id, certs, host, lookup)
        return StrategyGrant(strategy_slot=slot, certificates=list(certs), reserved_bytes=reg.est_state_bytes)

    def known(self, slot: int) -> bool:
        """``slot`` is 0 (no strategy) or registered (rule 36)."""
        return slot == 0 or slot in self.slots

    def host_compatible(self, slot: int) -> bool:
        """A HOST lane may use ``slot`` (rule 37)."""
        return slot == 0 or (slot in self.slots and self.slots[slot].host_compatible)

    def admit_grant(self, a: LaneAdmit) -> AdmitGrant | None:
        """What ``a`` (a nonzero ``strategy_slot``, already ``known``) is granted, or None when it
        is REJECTED with CERT_UNMATCHED (rules 119-122)."""
        s = self.slots[a.strategy_slot]
        best = None
        for c in s.certificates:
            if _matches(c, a) and (best is None or c.exactness > best.exactness):
                best = c
        if best is not None:
            return AdmitGrant(best.cert_id, best.exactness, s.lookup)
        if (
            a.allow_approximate == 1
            and not a.required_cert_id
            and a.minimum_exactness == Exactness.APPROXIMATE
        ):
            return AdmitGrant(0, Exactness.APPROXIMATE, None)
        return None


def _matches(c: ExactnessCert, a: LaneAdmit) -> bool:
    mode = {Sampling.GPU_GREEDY: CertMode.GREEDY, Sampling.GPU_GUMBEL: CertMode.GUMBEL}.get(
        Sampling(a.sampling), CertMode.HOST
    )
    p = a.params
    if a.required_cert_id and c.cert_id != a.required_cert_id:
        return False
    if not c.sampling_modes & mode:
        return False
    greedy = a.sampling == Sampling.GPU_GREEDY or p.temperature <= 0.0
    penalty_free = p.freq_penalty == 0.0 and p.presence_penalty == 0.0 and p.repeat_penalty in (0.0, 1.0)
    domain_ok = {CertDomain.GREEDY_ONLY: greedy, CertDomain.PENALTY_FREE: penalty_free, CertDomain.ANY: True}
    if not domain_ok.get(int(c.param_domain), False):  # NONE and unknown domains match no lane
        return False
    if (a.grammar_handle and not c.grammar_allowed) or (a.logit_bias_handle and not c.logit_bias_allowed):
        return False
    if c.exactness < a.minimum_exactness:
        return False
    if mode == CertMode.HOST:
        ident = bytes(a.host_sampler_identity)
        return ident != bytes(32) and ident in c.admissible_host_identities
    return True
