"""Every code of the baseRT tick ABI (draft 7) as Python enums, values equal to the C header's.

Names drop the ``BASERT_`` prefix and the group prefix (``BASERT_FINISH_EOS`` is ``Finish.EOS``).
``native/basert_tick.h`` is checked against this module by the conformance suite (ABI rules 12-16).
"""

from enum import IntEnum, IntFlag

MAX_TOP_LOGPROBS = 20
"""Alternatives carried inline per BaseRTLaneLogprob record (ABI rule 12)."""
ALL_SPACES = 0xFFFFFFFF
"""space_id meaning every state space (ABI rule 12)."""
STATE_ENVELOPE_MAGIC = 0x4554415453545242
"""u64 whose little-endian bytes spell ``BRTSTATE`` (ABI rule 12)."""
RING_MAGIC = 0x42525452494E4731
"""u64 of ABI rule 123: little-endian bytes 31 47 4E 49 52 54 52 42, i.e. ``BRTRING1`` read big-endian."""


class Status(IntEnum):
    """baseRT_status. 0 OK; -100..-114 plan rejections (the tick changes nothing); -120..-131
    synchronous op errors; -140 appears only in AdmitResult.reject_code; -1 fatal (ABI rules 13-16)."""

    OK = 0
    REJECT_BAD_STRIDE = -100
    REJECT_BAD_ALIGNMENT = -101
    REJECT_BOUNDS = -102
    REJECT_BAD_REF_GENERATION = -103
    REJECT_UNKNOWN_LANE = -104
    REJECT_DUPLICATE_LANE = -105
    REJECT_ILLEGAL_COMBINATION = -106
    REJECT_BUDGET = -107
    REJECT_STALE_SEED = -108
    REJECT_HOST_RULES = -110
    REJECT_TRANSFER_LOCKED = -111
    REJECT_STALE_NONCE = -112
    NEEDS_REPLAN = -113
    REJECT_BAD_STRUCT = -114
    EBUSY = -120
    ERR_BUFFER_TOO_SMALL = -121
    ERR_STALE_SIZING = -122
    ERR_OUT_OF_BOUNDARY = -123
    ERR_ENVELOPE_MISMATCH = -124
    ERR_CHECKSUM = -125
    ERR_IDENTITY_MISMATCH = -126
    ERR_OP_UNSUPPORTED = -127
    ERR_REGISTRATION_REFUSED = -128
    ERR_UNKNOWN_HANDLE = -129
    ERR_SEED_UNSERVABLE = -130
    ERR_RING_LAYOUT = -131
    REJECT_CERT_UNMATCHED = -140
    ERR_FATAL = -1

    @classmethod
    def of(cls, code: int) -> "Status | int":
        """``code`` as a ``Status`` when it is an assigned code, else the raw int (an unknown code
        is kept as it is, ABI rule 13)."""
        try:
            return cls(code)
        except ValueError:
            return code


def status_name(status: Status | int) -> str:
    """The name of a ``Status``, or ``"status N"`` for an unknown code."""
    return status.name if isinstance(status, Status) else f"status {status}"


class FaultCode(IntEnum):
    """Per-lane fault codes (BaseRTLaneFault.code): the lane stops, the tick goes on (ABI rule 60)."""

    UNSPECIFIED = 0
    GRAMMAR_OVERFLOW = 1
    REF_SPAN_OOB = 2
    STRATEGY = 3
    OOM_TENTATIVE = 4
    INTERNAL = 5
    MEDIA = 6


class Sampling(IntEnum):
    """BaseRTLaneAdmit.sampling."""

    GPU_GREEDY = 0
    GPU_GUMBEL = 1
    HOST = 2


class DeterminismClass(IntEnum):
    """Seed and admit determinism class."""

    BEST_EFFORT = 0
    DETERMINISTIC = 1


class Exactness(IntEnum):
    """Exactness classes, ordered so minimum_exactness floors compare numerically."""

    APPROXIMATE = 0
    DISTRIBUTION_EXACT = 1
    SEED_PATH_INVARIANT = 2


class TickFlag(IntFlag):
    """BaseRTTickPlan.flags."""

    DRAIN = 1 << 0
    CAPTURE_OK = 1 << 1
    PARTIAL_EMITS = 1 << 2


class TickStatus(IntEnum):
    """BaseRTTickEvents.tick_status (ABI rule 59)."""

    OK = 0
    SHED = 1
    LANE_ERRORS = 2
    FATAL = 3


class AdmitStatus(IntEnum):
    """BaseRTAdmitResult.status."""

    UNSPECIFIED = 0
    ADMITTED = 1
    REJECTED = 2


class Finish(IntEnum):
    """BaseRTLaneEmit.finish."""

    NONE = 0
    EOS = 1
    LENGTH = 2
    GRAMMAR = 3
    CANCELLED = 4
    ERROR = 5


class OpState(IntEnum):
    """BaseRTOpStatus.state / BaseRTOpComplete.state."""

    PENDING = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4


class Encoding(IntEnum):
    """Snapshot / demote payload encoding."""

    LOSSLESS = 0
    Q8 = 1
    Q4 = 2


class SpaceKind(IntEnum):
    """State-space kinds."""

    UNSPECIFIED = 0
    PAGED_TOKEN_KV = 1
    RING_KV = 2
    RECURRENT_BLOB = 3
    DEPTH_PAGED_KV = 4
    ENCODER_CACHE = 5


class SpaceFlag(IntFlag):
    """BaseRTStateSpaceDesc.flags."""

    OPS_UNAVAILABLE = 1 << 0
    NO_PREFIX_CACHE = 1 << 1


class ArtifactRole(IntEnum):
    """BaseRTArtifact.role."""

    UNSPECIFIED = 0
    DRAFT_WEIGHTS = 1
    AUX_HEAD = 2
    PROJECTION = 3
    DRAFT_TOKENIZER = 4


class TapTensor(IntEnum):
    """BaseRTTapSpec.tensor."""

    UNSPECIFIED = 0
    HIDDEN = 1
    ATTN_OUT = 2
    EMBED = 3


class CertMode(IntFlag):
    """Certificate applicability: sampling-mode bitset."""

    GREEDY = 1 << 0
    GUMBEL = 1 << 1
    HOST = 1 << 2


class CertDomain(IntEnum):
    """Certificate parameter domain; NONE matches nothing."""

    NONE = 0
    GREEDY_ONLY = 1
    PENALTY_FREE = 2
    ANY = 3


class StrategyCap(IntEnum):
    """Strategy capability kinds; an unknown kind_id refuses registration (ABI rule 114)."""

    UNSPECIFIED = 0
    PROPOSAL_LINEAR = 1
    PROPOSAL_BLOCK = 2
    PROPOSAL_TREE = 3
    MASK_ANCESTOR = 4
    HOST_COMPATIBLE = 5


class Taint(IntFlag):
    """Provenance taint reason bits."""

    QUANTIZED_DEMOTION = 1 << 0
    DECOMPOSITION = 1 << 1


class Tier(IntEnum):
    """Resident tier of a match candidate."""

    GPU = 0
    HOST = 1
    GONE = 2


class ShedKind(IntEnum):
    """BaseRTShedEntry.kind."""

    UNSPECIFIED = 0
    PREFILL_CHUNK = 1
    CACHE_EVICTION = 2


class ForkFlag(IntFlag):
    """baseRT_seq_fork flags."""

    EAGER = 1 << 0


class ChecksumKind(IntEnum):
    """BaseRTStateEnvelope.checksum_kind; 0 is reserved-invalid (ABI rule 103)."""

    XXH3_64 = 1
    FNV1A64 = 2


class SamplingFlag(IntFlag):
    """BaseRTSamplingParams.flags."""

    IGNORE_EOS = 1 << 0


class RingKind(IntEnum):
    """BaseRTRingDesc.kind."""

    UNSPECIFIED = 0
    TOKENS = 1
    LOGITS = 2


class RingRole(IntEnum):
    """BaseRTRingDesc.role, from the engine's side."""

    UNSPECIFIED = 0
    ENGINE_READS = 1
    ENGINE_WRITES = 2
