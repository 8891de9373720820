"""The draft-model strategy's registration, shared by the worker that registers it and the engines
that serve it (tick ABI §2 ``BaseRTStrategyRegistration``; RULES.md section I).

A draft model is a second, smaller GGUF with the target's vocabulary; it drafts ``m`` tokens per
round greedily and the target verifies them in its own batch
(``basertd.worker.engines.llamacpp.draft_model``). The registration carries it as one
DRAFT_WEIGHTS artifact (``load_path``, ``byte_size`` the file's size in bytes) and ``DraftConfig``
as the one record of its PROPOSAL_LINEAR capability (four little-endian u32); the SHA-256 of that
record is the ``config_hash`` an engine certifies (rule 117). The certificates (greedy, and
sampled by the rejection rule) do not depend on which draft file is loaded: verification commits
the target's own argmax chain, or on a sampled lane the target's own draw with the lane's uniform,
whatever the drafts are, so the draft model only moves the acceptance rate, never the tokens' law.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

from basertd.native.abi import Artifact, CapabilityReq, StrategyRegistration
from basertd.schema.abi import ArtifactRole, Exactness, StrategyCap

DRAFT_MODEL = "draft-model"
"""Speculation with a smaller model of the same vocabulary drafting greedily."""

DRAFT_IMPL_VERSION = "1.1.0"
DRAFT_IMPL_HASH = hashlib.sha256(
    b"basertd llamacpp draft-model, linear, greedy and sampled (rejection rule) verification v2"
).digest()
"""The implementation identity certificates are bound to (rule 117): change it with the drafter
or the verification."""

_DRAFT_PARAMS = struct.Struct("<4I")  # one PROPOSAL_LINEAR record: the DraftConfig fields


@dataclass(frozen=True)
class DraftConfig:
    """Draft-model tuning: a round drafts ``draft_min`` .. ``draft_max`` tokens (the lane's
    adaptive length, ``speculation.LaneSpec``); a round with more than ``max_batch_lanes`` decoding
    lanes drafts nothing; a lane whose recent acceptance falls below ``min_accept_permille`` /
    1000 pauses drafting for a while. The field names are ``LookupConfig``'s, so the lane state
    and the round bounds of prompt-lookup serve both. ValueError for bounds out of order or out of
    1..64."""

    draft_min: int = 1
    draft_max: int = 8
    max_batch_lanes: int = 4
    min_accept_permille: int = 150

    def __post_init__(self) -> None:
        if not 1 <= self.draft_min <= self.draft_max <= 64:
            raise ValueError(f"draft length bounds {self.draft_min}..{self.draft_max} not in 1..64")
        if self.max_batch_lanes < 1 or not 0 <= self.min_accept_permille <= 1000:
            raise ValueError("max_batch_lanes must be >= 1 and min_accept_permille in 0..1000")

    def params(self) -> bytes:
        """The PROPOSAL_LINEAR capability record (four little-endian u32, in field order)."""
        return _DRAFT_PARAMS.pack(
            self.draft_min, self.draft_max, self.max_batch_lanes, self.min_accept_permille
        )

    def config_hash(self) -> bytes:
        """SHA-256 of ``params()``: the canonical config identity of rule 117."""
        return hashlib.sha256(self.params()).digest()

    @classmethod
    def from_params(cls, raw: bytes) -> DraftConfig:
        """Decode ``params()``; ValueError when it is not one record or out of bounds."""
        if len(raw) != _DRAFT_PARAMS.size:
            raise ValueError(f"draft-model params are {_DRAFT_PARAMS.size} bytes, got {len(raw)}")
        return cls(*_DRAFT_PARAMS.unpack(raw))


def draft_registration(cfg: DraftConfig, path: str | os.PathLike[str]) -> StrategyRegistration:
    """The registration of draft-model with ``cfg`` and the draft GGUF at ``path`` that the
    llama.cpp engine certifies. ``est_state_bytes`` is the file's size in bytes (0 when it cannot
    be read: the engine then refuses the registration); the draft's KV comes on top and is
    reported by the engine (``draft_bytes`` in its stats)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return StrategyRegistration(
        strategy_id=DRAFT_MODEL,
        impl_version=DRAFT_IMPL_VERSION,
        impl_hash=DRAFT_IMPL_HASH,
        config_hash=cfg.config_hash(),
        artifacts=[Artifact(role=ArtifactRole.DRAFT_WEIGHTS, load_path=str(path), byte_size=size)],
        capabilities=[
            CapabilityReq(kind_id=StrategyCap.PROPOSAL_LINEAR, params=cfg.params(), param_elem_size=16)
        ],
        est_state_bytes=size,
        claimed_exactness=Exactness.DISTRIBUTION_EXACT,
    )
