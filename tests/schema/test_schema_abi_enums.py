"""``basertd.schema.abi`` against the tick ABI header (draft 7), one enum constant at a time.

The table below is transcribed from the header's enum blocks and #defines (116 enum constants,
4 defines). A check against ``native/basert_tick.h`` itself belongs to the native suite; this one
pins the Python side so a wrong or missing value fails here first (ABI rules 12-16)."""

from __future__ import annotations

import pytest

from basertd.schema import abi

# (enum class, C prefix stripped to get the Python member name, [(C name, value), ...])
HEADER_ENUMS: list[tuple[type, str, list[tuple[str, int]]]] = [
    (
        abi.Status,
        "BASERT_",
        [
            ("BASERT_STATUS_OK", 0),
            ("BASERT_REJECT_BAD_STRIDE", -100),
            ("BASERT_REJECT_BAD_ALIGNMENT", -101),
            ("BASERT_REJECT_BOUNDS", -102),
            ("BASERT_REJECT_BAD_REF_GENERATION", -103),
            ("BASERT_REJECT_UNKNOWN_LANE", -104),
            ("BASERT_REJECT_DUPLICATE_LANE", -105),
            ("BASERT_REJECT_ILLEGAL_COMBINATION", -106),
            ("BASERT_REJECT_BUDGET", -107),
            ("BASERT_REJECT_STALE_SEED", -108),
            ("BASERT_REJECT_HOST_RULES", -110),
            ("BASERT_REJECT_TRANSFER_LOCKED", -111),
            ("BASERT_REJECT_STALE_NONCE", -112),
            ("BASERT_NEEDS_REPLAN", -113),
            ("BASERT_REJECT_BAD_STRUCT", -114),
            ("BASERT_EBUSY", -120),
            ("BASERT_ERR_BUFFER_TOO_SMALL", -121),
            ("BASERT_ERR_STALE_SIZING", -122),
            ("BASERT_ERR_OUT_OF_BOUNDARY", -123),
            ("BASERT_ERR_ENVELOPE_MISMATCH", -124),
            ("BASERT_ERR_CHECKSUM", -125),
            ("BASERT_ERR_IDENTITY_MISMATCH", -126),
            ("BASERT_ERR_OP_UNSUPPORTED", -127),
            ("BASERT_ERR_REGISTRATION_REFUSED", -128),
            ("BASERT_ERR_UNKNOWN_HANDLE", -129),
            ("BASERT_ERR_SEED_UNSERVABLE", -130),
            ("BASERT_ERR_RING_LAYOUT", -131),
            ("BASERT_REJECT_CERT_UNMATCHED", -140),
            ("BASERT_ERR_FATAL", -1),
        ],
    ),
    (
        abi.FaultCode,
        "BASERT_FAULT_",
        [
            ("BASERT_FAULT_UNSPECIFIED", 0),
            ("BASERT_FAULT_GRAMMAR_OVERFLOW", 1),
            ("BASERT_FAULT_REF_SPAN_OOB", 2),
            ("BASERT_FAULT_STRATEGY", 3),
            ("BASERT_FAULT_OOM_TENTATIVE", 4),
            ("BASERT_FAULT_INTERNAL", 5),
            ("BASERT_FAULT_MEDIA", 6),
        ],
    ),
    (
        abi.Sampling,
        "BASERT_SAMPLING_",
        [("BASERT_SAMPLING_GPU_GREEDY", 0), ("BASERT_SAMPLING_GPU_GUMBEL", 1), ("BASERT_SAMPLING_HOST", 2)],
    ),
    (
        abi.DeterminismClass,
        "BASERT_DETERMINISM_",
        [("BASERT_DETERMINISM_BEST_EFFORT", 0), ("BASERT_DETERMINISM_DETERMINISTIC", 1)],
    ),
    (
        abi.Exactness,
        "BASERT_EXACTNESS_",
        [
            ("BASERT_EXACTNESS_APPROXIMATE", 0),
            ("BASERT_EXACTNESS_DISTRIBUTION_EXACT", 1),
            ("BASERT_EXACTNESS_SEED_PATH_INVARIANT", 2),
        ],
    ),
    (
        abi.TickFlag,
        "BASERT_TICK_",
        [
            ("BASERT_TICK_DRAIN", 1 << 0),
            ("BASERT_TICK_CAPTURE_OK", 1 << 1),
            ("BASERT_TICK_PARTIAL_EMITS", 1 << 2),
        ],
    ),
    (
        abi.TickStatus,
        "BASERT_TICK_",
        [
            ("BASERT_TICK_OK", 0),
            ("BASERT_TICK_SHED", 1),
            ("BASERT_TICK_LANE_ERRORS", 2),
            ("BASERT_TICK_FATAL", 3),
        ],
    ),
    (
        abi.AdmitStatus,
        "BASERT_ADMIT_",
        [("BASERT_ADMIT_UNSPECIFIED", 0), ("BASERT_ADMIT_ADMITTED", 1), ("BASERT_ADMIT_REJECTED", 2)],
    ),
    (
        abi.Finish,
        "BASERT_FINISH_",
        [
            ("BASERT_FINISH_NONE", 0),
            ("BASERT_FINISH_EOS", 1),
            ("BASERT_FINISH_LENGTH", 2),
            ("BASERT_FINISH_GRAMMAR", 3),
            ("BASERT_FINISH_CANCELLED", 4),
            ("BASERT_FINISH_ERROR", 5),
        ],
    ),
    (
        abi.OpState,
        "BASERT_OP_",
        [
            ("BASERT_OP_PENDING", 0),
            ("BASERT_OP_RUNNING", 1),
            ("BASERT_OP_DONE", 2),
            ("BASERT_OP_FAILED", 3),
            ("BASERT_OP_CANCELLED", 4),
        ],
    ),
    (
        abi.Encoding,
        "BASERT_ENCODING_",
        [("BASERT_ENCODING_LOSSLESS", 0), ("BASERT_ENCODING_Q8", 1), ("BASERT_ENCODING_Q4", 2)],
    ),
    (
        abi.SpaceKind,
        "BASERT_SPACE_KIND_",
        [
            ("BASERT_SPACE_KIND_UNSPECIFIED", 0),
            ("BASERT_SPACE_KIND_PAGED_TOKEN_KV", 1),
            ("BASERT_SPACE_KIND_RING_KV", 2),
            ("BASERT_SPACE_KIND_RECURRENT_BLOB", 3),
            ("BASERT_SPACE_KIND_DEPTH_PAGED_KV", 4),
            ("BASERT_SPACE_KIND_ENCODER_CACHE", 5),
        ],
    ),
    (
        abi.SpaceFlag,
        "BASERT_SPACE_FLAG_",
        [("BASERT_SPACE_FLAG_OPS_UNAVAILABLE", 1 << 0), ("BASERT_SPACE_FLAG_NO_PREFIX_CACHE", 1 << 1)],
    ),
    (
        abi.ArtifactRole,
        "BASERT_ARTIFACT_",
        [
            ("BASERT_ARTIFACT_UNSPECIFIED", 0),
            ("BASERT_ARTIFACT_DRAFT_WEIGHTS", 1),
            ("BASERT_ARTIFACT_AUX_HEAD", 2),
            ("BASERT_ARTIFACT_PROJECTION", 3),
            ("BASERT_ARTIFACT_DRAFT_TOKENIZER", 4),
        ],
    ),
    (
        abi.TapTensor,
        "BASERT_TAP_TENSOR_",
        [
            ("BASERT_TAP_TENSOR_UNSPECIFIED", 0),
            ("BASERT_TAP_TENSOR_HIDDEN", 1),
            ("BASERT_TAP_TENSOR_ATTN_OUT", 2),
            ("BASERT_TAP_TENSOR_EMBED", 3),
        ],
    ),
    (
        abi.CertMode,
        "BASERT_CERT_MODE_",
        [
            ("BASERT_CERT_MODE_GREEDY", 1 << 0),
            ("BASERT_CERT_MODE_GUMBEL", 1 << 1),
            ("BASERT_CERT_MODE_HOST", 1 << 2),
        ],
    ),
    (
        abi.CertDomain,
        "BASERT_CERT_DOMAIN_",
        [
            ("BASERT_CERT_DOMAIN_NONE", 0),
            ("BASERT_CERT_DOMAIN_GREEDY_ONLY", 1),
            ("BASERT_CERT_DOMAIN_PENALTY_FREE", 2),
            ("BASERT_CERT_DOMAIN_ANY", 3),
        ],
    ),
    (
        abi.StrategyCap,
        "BASERT_STRATEGY_CAP_",
        [
            ("BASERT_STRATEGY_CAP_UNSPECIFIED", 0),
            ("BASERT_STRATEGY_CAP_PROPOSAL_LINEAR", 1),
            ("BASERT_STRATEGY_CAP_PROPOSAL_BLOCK", 2),
            ("BASERT_STRATEGY_CAP_PROPOSAL_TREE", 3),
            ("BASERT_STRATEGY_CAP_MASK_ANCESTOR", 4),
            ("BASERT_STRATEGY_CAP_HOST_COMPATIBLE", 5),
        ],
    ),
    (
        abi.Taint,
        "BASERT_TAINT_",
        [("BASERT_TAINT_QUANTIZED_DEMOTION", 1 << 0), ("BASERT_TAINT_DECOMPOSITION", 1 << 1)],
    ),
    (abi.Tier, "BASERT_TIER_", [("BASERT_TIER_GPU", 0), ("BASERT_TIER_HOST", 1), ("BASERT_TIER_GONE", 2)]),
    (
        abi.ShedKind,
        "BASERT_SHED_",
        [("BASERT_SHED_UNSPECIFIED", 0), ("BASERT_SHED_PREFILL_CHUNK", 1), ("BASERT_SHED_CACHE_EVICTION", 2)],
    ),
    (abi.ForkFlag, "BASERT_FORK_", [("BASERT_FORK_EAGER", 1 << 0)]),
    (abi.ChecksumKind, "BASERT_CHECKSUM_", [("BASERT_CHECKSUM_XXH3_64", 1), ("BASERT_CHECKSUM_FNV1A64", 2)]),
    (abi.SamplingFlag, "BASERT_SAMPLING_FLAG_", [("BASERT_SAMPLING_FLAG_IGNORE_EOS", 1 << 0)]),
    (
        abi.RingKind,
        "BASERT_RING_KIND_",
        [("BASERT_RING_KIND_UNSPECIFIED", 0), ("BASERT_RING_KIND_TOKENS", 1), ("BASERT_RING_KIND_LOGITS", 2)],
    ),
    (
        abi.RingRole,
        "BASERT_RING_ROLE_",
        [
            ("BASERT_RING_ROLE_UNSPECIFIED", 0),
            ("BASERT_RING_ROLE_ENGINE_READS", 1),
            ("BASERT_RING_ROLE_ENGINE_WRITES", 2),
        ],
    ),
]

HEADER_DEFINES = {
    "BASERT_MAX_TOP_LOGPROBS": 20,
    "BASERT_RING_MAGIC": 0x42525452494E4731,
    "BASERT_ALL_SPACES": 0xFFFFFFFF,
    "BASERT_STATE_ENVELOPE_MAGIC": 0x4554415453545242,
}

# Python names that differ from the prefix rule.
RENAMED = {"BASERT_STATUS_OK": "OK"}


def _python_name(c_name: str, prefix: str) -> str:
    return RENAMED.get(c_name) or c_name.removeprefix(prefix)


def test_table_is_the_whole_header():
    assert sum(len(entries) for _, _, entries in HEADER_ENUMS) == 116
    c_names = [name for _, _, entries in HEADER_ENUMS for name, _ in entries]
    assert len(set(c_names)) == len(c_names)


@pytest.mark.parametrize("enum_cls,prefix,entries", HEADER_ENUMS, ids=lambda x: getattr(x, "__name__", ""))
def test_enum_matches_header(enum_cls, prefix, entries):
    expected = {_python_name(c, prefix): value for c, value in entries}
    actual = {m.name: int(m.value) for m in enum_cls.__members__.values()}
    assert actual == expected  # same names, same values, nothing extra, nothing missing


def test_defines():
    python = {
        "BASERT_MAX_TOP_LOGPROBS": abi.MAX_TOP_LOGPROBS,
        "BASERT_RING_MAGIC": abi.RING_MAGIC,
        "BASERT_ALL_SPACES": abi.ALL_SPACES,
        "BASERT_STATE_ENVELOPE_MAGIC": abi.STATE_ENVELOPE_MAGIC,
    }
    assert python == HEADER_DEFINES
    assert abi.STATE_ENVELOPE_MAGIC.to_bytes(8, "little") == b"BRTSTATE"  # ABI rule 12
    assert abi.RING_MAGIC.to_bytes(8, "little") == bytes.fromhex("31474E4952545242")  # ABI rule 123


def test_status_ranges():
    """ABI rules 13, 14, 16: rejections are -100..-108 and -110..-114 (no -109), -140 only in
    admit results, OP_UNSUPPORTED -127, FATAL -1."""
    rejections = {int(s) for s in abi.Status if -114 <= s <= -100}
    assert rejections == set(range(-114, -99)) - {-109}
    assert -109 not in {int(s) for s in abi.Status}
    assert abi.Status.REJECT_CERT_UNMATCHED == -140
    assert (abi.Status.ERR_OP_UNSUPPORTED, abi.Status.ERR_FATAL) == (-127, -1)
