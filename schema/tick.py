"""Tick plan and tick events, field for field with the baseRT tick ABI (draft 7).

Every record here mirrors a C struct of ``native/basert_tick.h``: same field names, same integer
widths (documented per field as u8/u16/u32/u64), same enum values (``basertd.schema.abi``).
Explicit ``_pad`` fields and ``struct_size`` guards are C concerns and are left out; a
``BaseRTArray`` of records is a ``list``. These Structs cross Link W inside msgpack frames; the
tokens they point at cross through BRTRING1 rings (``TokenRef``), never inside a frame.

Structs are ``array_like`` (encoded as msgpack arrays in field order), so fields are only ever
appended, like the ABI's own append-only growth.
"""

from __future__ import annotations

import struct

import msgspec

from basertd.schema.abi import STATE_ENVELOPE_MAGIC, Status

_ZERO32 = bytes(32)


class _Rec(msgspec.Struct, array_like=True, kw_only=True):
    """Base of every ABI record (array-like msgpack encoding, keyword construction)."""


# --- common value types ---------------------------------------------------------------------


class TokenRef(_Rec):
    """A span of u32 token ids in a ring (BaseRTTokenRef, 24 bytes in C).

    ``index`` is the first slot, ``count`` the number of tokens (the span may cover consecutive
    slots), ``generation`` the first slot's generation (0 never resolves, ABI rule 127)."""

    ring_id: int = 0  # u32
    index: int = 0  # u32
    count: int = 0  # u32
    generation: int = 0  # u64


class RingRef(_Rec):
    """One row of a logits ring (BaseRTRingRef, 16 bytes); ``generation`` is the logits nonce."""

    ring_id: int = 0  # u32
    index: int = 0  # u32
    generation: int = 0  # u64


class TokenRange(_Rec):
    """Half-open token range ``[start, end)`` (BaseRTTokenRange, 16 bytes)."""

    start: int = 0  # u64
    end: int = 0  # u64


# --- plan records ---------------------------------------------------------------------------


class SamplingParams(_Rec):
    """BaseRTSamplingParams (32 bytes). Zero disables a knob: top_k 0, top_p 0 (or >= 1),
    min_p 0, repeat_penalty 0 (means 1.0); ``flags`` holds ``SamplingFlag`` bits."""

    temperature: float = 0.0  # f32
    top_p: float = 0.0  # f32
    min_p: float = 0.0  # f32
    top_k: int = 0  # u32
    freq_penalty: float = 0.0  # f32
    presence_penalty: float = 0.0  # f32
    repeat_penalty: float = 0.0  # f32
    flags: int = 0  # u32, SamplingFlag


class ShedPolicy(_Rec):
    """The envelope inside which the engine may shed or evict (BaseRTShedPolicy, 40 bytes).

    ``victim_lanes`` are lane tags in eviction order; ``evictable_cache_classes`` a bitset over
    daemon-defined classes; ``protected_quota_bytes`` the bytes that must stay (UINT64_MAX makes
    nothing evictable, ABI rule 51); ``max_evict_bytes`` the most one tick may evict."""

    victim_lanes: list[int] = msgspec.field(default_factory=list)  # u64 each
    evictable_cache_classes: int = 0  # u64
    protected_quota_bytes: int = 0  # u64
    max_evict_bytes: int = 0  # u64


class LaneAdmit(_Rec):
    """Admit a lane (BaseRTLaneAdmit, 144 bytes; the v1 prefix is 136).

    ``prompt`` names the prompt tokens in the prompt ring; ``seed_handle`` is 0 for a cold admit;
    ``decode_replay`` counts the prompt's trailing tokens this request generated before a
    preemption (ABI rules 71-73)."""

    lane_tag: int  # u64, opaque
    prompt: TokenRef = msgspec.field(default_factory=TokenRef)
    seed_handle: int = 0  # u64
    sampling: int = 0  # u32, Sampling
    logit_bias_handle: int = 0  # u32
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    rng_counter_base: int = 0  # u64
    grammar_handle: int = 0  # u32
    strategy_slot: int = 0  # u32
    determinism_class: int = 0  # u8, DeterminismClass
    minimum_exactness: int = 0  # u8, Exactness
    allow_approximate: int = 0  # u8
    want_logprobs: int = 0  # u8: 0 = off, else 1 + number of top alternatives
    required_cert_id: int = 0  # u32
    host_sampler_identity: bytes = _ZERO32  # 32 bytes
    grammar_replay: int = 0  # u32
    decode_replay: int = 0  # u32


class LaneCommit(_Rec):
    """HOST-sampled feedback: exactly one token for the row whose nonce is ``logits_nonce``
    (BaseRTLaneCommit, 24 bytes; ABI rules 39-42)."""

    lane_tag: int  # u64
    token_id: int = 0  # u32
    logits_nonce: int = 0  # u64


class LanePrefill(_Rec):
    """Prefill ``token_count`` prompt tokens from ``token_offset`` (BaseRTLanePrefill, 16 bytes)."""

    lane_tag: int  # u64
    token_offset: int = 0  # u32
    token_count: int = 0  # u32


class LaneDecode(_Rec):
    """Decode up to ``max_new_tokens`` this tick (BaseRTLaneDecode, 16 bytes; HOST lanes: 1)."""

    lane_tag: int  # u64
    max_new_tokens: int = 1  # u16
    overshoot: int = 0  # u16


class LaneRetire(_Rec):
    """Retire a lane, optionally publishing its KV to the prefix cache (BaseRTLaneRetire, 16 bytes)."""

    lane_tag: int  # u64
    publish_to_cache: int = 0  # u8


class TickPlan(_Rec):
    """One tick's plan (BaseRTTickPlan, 168 bytes with the partial-emit tail).

    ``plan_seq`` must rise strictly per bundle (ABI rule 32). The C callback fields are not
    carried: ``flags & TickFlag.PARTIAL_EMITS`` asks the worker to install its own callback and
    forward partial emits as TICK_EMIT frames."""

    plan_seq: int  # u64
    flags: int = 0  # u32, TickFlag
    prefill_token_budget: int = 0  # u32, tokens
    max_decode_lanes: int = 0  # u32
    admits: list[LaneAdmit] = msgspec.field(default_factory=list)
    commits: list[LaneCommit] = msgspec.field(default_factory=list)
    prefills: list[LanePrefill] = msgspec.field(default_factory=list)
    decodes: list[LaneDecode] = msgspec.field(default_factory=list)
    retires: list[LaneRetire] = msgspec.field(default_factory=list)
    shed_policy: ShedPolicy = msgspec.field(default_factory=ShedPolicy)


# --- event records --------------------------------------------------------------------------


class AdmitResult(_Rec):
    """Per-lane admission outcome (BaseRTAdmitResult, 24 bytes).

    ``reject_code`` holds the status's two's-complement bits as a u32 (ABI rule 15); use
    ``reject_status`` for the signed ``Status``."""

    lane_tag: int  # u64
    status: int = 0  # u32, AdmitStatus
    reject_code: int = 0  # u32
    cert_id: int = 0  # u32
    granted_class: int = 0  # u8, Exactness

    @property
    def reject_status(self) -> Status:
        """``reject_code`` read back as a signed ``Status`` (raises ValueError if unknown)."""
        signed = self.reject_code - (1 << 32) if self.reject_code >= 1 << 31 else self.reject_code
        return Status(signed)


class SpecStats(_Rec):
    """Speculation counters of one emit (BaseRTSpecStats, 16 bytes)."""

    proposed: int = 0  # u32
    accepted: int = 0  # u32
    cert_id_in_effect: int = 0  # u32


class LaneEmit(_Rec):
    """Tokens a lane committed this tick (BaseRTLaneEmit, 72 bytes).

    ``token_ref`` names ``n_tokens`` tokens in the emit ring; ``logits_row`` is zero except on
    HOST lanes, where its generation is the nonce the next commit must echo (ABI rule 65)."""

    lane_tag: int  # u64
    token_ref: TokenRef = msgspec.field(default_factory=TokenRef)
    n_tokens: int = 0  # u32
    finish: int = 0  # u32, Finish
    logits_row: RingRef = msgspec.field(default_factory=RingRef)
    spec: SpecStats = msgspec.field(default_factory=SpecStats)


class LaneFault(_Rec):
    """A per-lane fault: the lane stops, the tick goes on (BaseRTLaneFault, 24 bytes; rule 60)."""

    lane_tag: int  # u64
    code: int = 0  # u32, FaultCode
    detail: int = 0  # u64


class ShedEntry(_Rec):
    """One shed item (BaseRTShedEntry, 32 bytes): a dropped prefill chunk or a cache eviction."""

    lane_tag: int = 0  # u64, 0 for non-lane cache evictions
    kind: int = 0  # u32, ShedKind
    reason: int = 0  # u32
    bytes: int = 0  # u64
    tokens: int = 0  # u64


class ShedReport(_Rec):
    """What the tick shed; never silent (BaseRTShedReport, 32 bytes; ABI rules 56, 58)."""

    prefill_chunks_dropped: int = 0  # u32
    evictions_performed: int = 0  # u32
    bytes_evicted: int = 0  # u64
    entries: list[ShedEntry] = msgspec.field(default_factory=list)


class OpComplete(_Rec):
    """A state op that reached a terminal state (BaseRTOpComplete, 24 bytes; ABI rule 69)."""

    op: int  # u64
    state: int = 0  # u8, OpState
    error: int = 0  # u32
    bytes_moved: int = 0  # u64


class TickTimings(_Rec):
    """Coarse per-tick timings in nanoseconds (BaseRTTickTimings, 32 bytes)."""

    wall_ns: int = 0  # u64
    prefill_ns: int = 0  # u64
    decode_ns: int = 0  # u64
    graph_hits: int = 0  # u32
    graph_misses: int = 0  # u32


class MemCounters(_Rec):
    """The engine's memory ledger after the tick (BaseRTMemCounters, 48 bytes)."""

    allocated_bytes: int = 0  # u64
    host_retained_bytes: int = 0  # u64
    pool_blocks_total: int = 0  # u64
    pool_blocks_used: int = 0  # u64
    pool_bytes_evictable: int = 0  # u64
    tentative_bytes: int = 0  # u64


class LaneLogprob(_Rec):
    """Natural-log probability of one emitted token and its top alternatives, in emission order
    per lane (BaseRTLaneLogprob, 176 bytes; at most MAX_TOP_LOGPROBS alternatives)."""

    lane_tag: int  # u64
    logprob: float = 0.0  # f32
    n_top: int = 0  # u32
    top_ids: list[int] = msgspec.field(default_factory=list)  # u32 each, n_top long
    top_logprobs: list[float] = msgspec.field(default_factory=list)  # f32 each, n_top long


class TickEvents(_Rec):
    """What one tick did (BaseRTTickEvents, 216 bytes). ``plan_seq`` echoes the plan's (rule 55)."""

    plan_seq: int  # u64
    tick_status: int = 0  # u32, TickStatus
    admit_results: list[AdmitResult] = msgspec.field(default_factory=list)
    emits: list[LaneEmit] = msgspec.field(default_factory=list)
    faults: list[LaneFault] = msgspec.field(default_factory=list)
    shed: ShedReport = msgspec.field(default_factory=ShedReport)
    op_completions: list[OpComplete] = msgspec.field(default_factory=list)
    timings: TickTimings = msgspec.field(default_factory=TickTimings)
    mem: MemCounters = msgspec.field(default_factory=MemCounters)
    logprobs: list[LaneLogprob] = msgspec.field(default_factory=list)


# --- state spaces, matching, state ops ------------------------------------------------------


class StateSpaceDesc(_Rec):
    """One state space of a bundle (BaseRTStateSpaceDesc, 96 bytes)."""

    space_id: int  # u32
    kind: int = 0  # u32, SpaceKind
    version_tag: int = 0  # u64
    bytes_per_token: int = 0  # u64, paged kinds
    blob_bytes: int = 0  # u64, blob kinds
    page_size_tokens: int = 0  # u32, paged kinds
    fork_cost_class: int = 0  # u32
    fork_cost_bytes: int = 0  # u64
    snapshot_cadence: int = 0  # u32
    snapshot_interval_tokens: int = 0  # u32
    placement: int = 0  # u32
    flags: int = 0  # u32, SpaceFlag
    name: str = ""  # at most 31 bytes of UTF-8 in C


class MatchCandidate(_Rec):
    """A cached prefix a space could serve (BaseRTMatchCandidate, 48 bytes)."""

    prefix_len: int  # u64, tokens
    provenance_digest: bytes = _ZERO32  # 32 bytes
    taint_bits: int = 0  # u32, Taint
    resident_tier: int = 0  # u8, Tier


class SpaceMatch(_Rec):
    """Candidates of one space (BaseRTSpaceMatch, 24 bytes)."""

    space_id: int  # u32
    candidates: list[MatchCandidate] = msgspec.field(default_factory=list)


class MatchResult(_Rec):
    """Result of ``space_match``: metadata only, pins nothing (BaseRTMatchResult; ABI rule 87)."""

    spaces: list[SpaceMatch] = msgspec.field(default_factory=list)


class OpStatus(_Rec):
    """Progress of a state op (BaseRTOpStatus, 24 bytes)."""

    state: int = 0  # u8, OpState
    error: int = 0  # u32
    bytes_moved: int = 0  # u64


class CacheKey(_Rec):
    """Physical cache-entry key for enumerated eviction (BaseRTCacheKey, 64 bytes)."""

    compat_key: bytes = _ZERO32  # 32 bytes
    provenance_digest: bytes = _ZERO32  # 32 bytes


class MediaInfo(_Rec):
    """What an image expands to (BaseRTMediaInfo, 24 bytes)."""

    n_tokens: int = 0  # u32
    image_token_id: int = 0  # u32
    boi_token_id: int = 0  # u32
    eoi_token_id: int = 0  # u32
    preprocess_fp: int = 0  # u64


_ENVELOPE = struct.Struct("<QII32sQ32sII QQ B3xI QQ".replace(" ", ""))
ENVELOPE_BYTES = 136
"""Size of the sealed state envelope header that leads every export (ABI rule 95)."""
assert _ENVELOPE.size == ENVELOPE_BYTES


class StateEnvelope(_Rec):
    """The engine-authored header of every exported payload (BaseRTStateEnvelope, 136 bytes).

    ``pack()`` / ``unpack()`` give the exact little-endian C layout, so an adapter written in
    Python seals and checks envelopes byte-compatible with a C engine (ABI rules 95, 101-103)."""

    magic: int = STATE_ENVELOPE_MAGIC  # u64
    envelope_version: int = 1  # u32
    space_kind: int = 0  # u32, SpaceKind
    compat_identity: bytes = _ZERO32  # 32 bytes
    version_tag: int = 0  # u64
    provenance_digest: bytes = _ZERO32  # 32 bytes
    taint_bits: int = 0  # u32, Taint
    range: TokenRange = msgspec.field(default_factory=TokenRange)
    encoding: int = 0  # u8, Encoding
    checksum_kind: int = 0  # u32, ChecksumKind
    payload_len: int = 0  # u64, bytes after the envelope
    content_checksum: int = 0  # u64

    def pack(self) -> bytes:
        """The 136-byte C image of this envelope."""
        return _ENVELOPE.pack(
            self.magic,
            self.envelope_version,
            self.space_kind,
            self.compat_identity,
            self.version_tag,
            self.provenance_digest,
            self.taint_bits,
            0,
            self.range.start,
            self.range.end,
            self.encoding,
            self.checksum_kind,
            self.payload_len,
            self.content_checksum,
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> StateEnvelope:
        """Read the first 136 bytes of ``data``; raises ValueError when ``data`` is shorter."""
        if len(data) < ENVELOPE_BYTES:
            raise ValueError(f"state envelope needs {ENVELOPE_BYTES} bytes, got {len(data)}")
        f = _ENVELOPE.unpack_from(data)
        return cls(
            magic=f[0],
            envelope_version=f[1],
            space_kind=f[2],
            compat_identity=f[3],
            version_tag=f[4],
            provenance_digest=f[5],
            taint_bits=f[6],
            range=TokenRange(start=f[8], end=f[9]),
            encoding=f[10],
            checksum_kind=f[11],
            payload_len=f[12],
            content_checksum=f[13],
        )
