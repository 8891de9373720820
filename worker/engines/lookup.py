"""The prompt-lookup strategy's registration, shared by the worker that registers it and the engines
that serve it (tick ABI §2 ``BaseRTStrategyRegistration``; RULES.md section I).

``LookupConfig`` is the strategy's canonical config: it travels as the one record of the
registration's PROPOSAL_LINEAR capability (six little-endian u32) and its SHA-256 is the
registration's ``config_hash``, so an engine certifies exactly the config it tested (rule 117).
``LOOKUP_IMPL_HASH`` names the implementation (the llama.cpp engine's drafter and its greedy and
sampled verification, ``basertd.worker.engines.llamacpp.speculation``); an engine that registers the
strategy without drafting grants a slot without certificates.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from basertd.native.abi import CapabilityReq, StrategyRegistration
from basertd.schema.abi import Exactness, StrategyCap

PROMPT_LOOKUP = "prompt-lookup"
"""The one strategy this engine drafts for: n-gram lookup over the lane's own tokens."""

LOOKUP_IMPL_VERSION = "1.1.0"
LOOKUP_IMPL_HASH = hashlib.sha256(
    b"basertd llamacpp prompt-lookup, linear, greedy and sampled (rejection rule) verification v2"
).digest()
"""The implementation identity certificates are bound to (rule 117): change it with the drafter
or the verification."""

_LOOKUP_PARAMS = struct.Struct("<6I")  # one PROPOSAL_LINEAR record: the LookupConfig fields


@dataclass(frozen=True)
class LookupConfig:
    """Prompt-lookup tuning, in tokens: a round drafts ``draft_min`` .. ``draft_max`` tokens
    continuing the most recent earlier occurrence of the lane's last ``ngram_max`` .. ``ngram_min``
    tokens; a round with more than ``max_batch_lanes`` decoding lanes drafts nothing (verification
    rows then cost more than they save); a lane whose recent acceptance falls below
    ``min_accept_permille`` / 1000 pauses drafting for a while (``speculation.LaneSpec``).
    ValueError for bounds out of order or out of 1..64."""

    draft_min: int = 1
    draft_max: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch_lanes: int = 4
    min_accept_permille: int = 150

    def __post_init__(self) -> None:
        if not 1 <= self.draft_min <= self.draft_max <= 64:
            raise ValueError(f"draft length bounds {self.draft_min}..{self.draft_max} not in 1..64")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"n-gram bounds {self.ngram_min}..{self.ngram_max} not in 1..16")
        if self.max_batch_lanes < 1 or not 0 <= self.min_accept_permille <= 1000:
            raise ValueError("max_batch_lanes must be >= 1 and min_accept_permille in 0..1000")

    def params(self) -> bytes:
        """The PROPOSAL_LINEAR capability record (six little-endian u32, in field order)."""
        return _LOOKUP_PARAMS.pack(
            self.draft_min,
            self.draft_max,
            self.ngram_min,
            self.ngram_max,
            self.max_batch_lanes,
            self.min_accept_permille,
        )

    def config_hash(self) -> bytes:
        """SHA-256 of ``params()``: the canonical config identity of rule 117."""
        return hashlib.sha256(self.params()).digest()

    @classmethod
    def from_params(cls, raw: bytes) -> LookupConfig:
        """Decode ``params()``; ValueError when it is not one record or out of bounds."""
        if len(raw) != _LOOKUP_PARAMS.size:
            raise ValueError(f"prompt-lookup params are {_LOOKUP_PARAMS.size} bytes, got {len(raw)}")
        return cls(*_LOOKUP_PARAMS.unpack(raw))


def lookup_registration(cfg: LookupConfig) -> StrategyRegistration:
    """The registration of prompt-lookup with ``cfg`` that this engine certifies."""
    return StrategyRegistration(
        strategy_id=PROMPT_LOOKUP,
        impl_version=LOOKUP_IMPL_VERSION,
        impl_hash=LOOKUP_IMPL_HASH,
        config_hash=cfg.config_hash(),
        capabilities=[
            CapabilityReq(kind_id=StrategyCap.PROPOSAL_LINEAR, params=cfg.params(), param_elem_size=24)
        ],
        claimed_exactness=Exactness.DISTRIBUTION_EXACT,
    )
