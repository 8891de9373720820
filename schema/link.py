"""Link W: the coordinator <-> worker protocol (DESIGN.md "Link W").

One Link W message is a zmq multipart message: an ``Envelope`` frame (24 bytes, fixed layout), a
msgpack body frame (one Struct below, chosen by ``Envelope.msg_type``), then zero or more side
frames carrying large arrays (token ids, sealed state bytes) without copying them into the body.
``basertd.schema.codec.LinkCodec`` turns messages into frames and back.

Handshake (DESIGN.md "Link W"): the worker sends HELLO with the version range it speaks; the
coordinator answers WELCOME with ``negotiate()``'s choice (or ERROR and closes); the worker sends
CAPABILITIES; the coordinator sends RINGS_ATTACH and the worker answers RINGS_ATTACHED. HELLO,
WELCOME and ERROR are the *handshake types*: their body layout is frozen across all versions, so
they decode before (or without) a negotiated version.

Every request may be answered with ERROR (an ABI ``Status`` and a message); ``REPLIES`` lists the
normal answer of each request. ``Envelope.corr`` of a reply is the request's ``seq``.

Bodies are ``array_like`` Structs (msgpack arrays in field order): fields are only ever appended,
with defaults, and a version bump is needed to change anything else. Several names here also exist
in ``basertd.schema.client`` / ``control`` (``Tokenize``, ``Drain``, ``Shutdown``, ``Error``), so
import the module (``from basertd.schema import link``) rather than the names.

Array fields (``tokens``, ``values``, ``data``) hold 1-D numpy arrays: token ids as ``uint32``,
logit-bias values as ``float32``, state bytes as ``uint8``. Constructors accept a list, bytes or an
array of another integer dtype and convert it (values out of range raise ValueError).
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any, ClassVar

import msgspec
import numpy as np

from basertd.schema.abi import ALL_SPACES, Status
from basertd.schema.errors import MalformedFrame, TruncatedFrame, UnknownMessageType, VersionMismatch
from basertd.schema.tick import (
    CacheKey,
    MatchResult,
    MemCounters,
    ShedPolicy,
    StateSpaceDesc,
    TickEvents,
    TickPlan,
    TokenRange,
    TokenRef,
)

PROTOCOL_VERSION = 1
"""The newest Link W version this build speaks."""
MIN_PROTOCOL_VERSION = 1
"""The oldest Link W version this build still speaks."""


def negotiate(
    offered_min: int,
    offered_max: int,
    supported_min: int = MIN_PROTOCOL_VERSION,
    supported_max: int = PROTOCOL_VERSION,
) -> int:
    """The highest Link W version in both ``[offered_min, offered_max]`` (the peer's HELLO) and
    ``[supported_min, supported_max]`` (ours). Versions are integers >= 1 (u16 on the wire).

    Raises ``VersionMismatch`` (``FrameErrorCode.BAD_VERSION``) when either range is empty or out
    of 1..65535, or the two ranges do not overlap (DESIGN.md "Link W", handshake)."""
    for lo, hi, who in ((offered_min, offered_max, "offered"), (supported_min, supported_max, "supported")):
        if not (isinstance(lo, int) and isinstance(hi, int)) or isinstance(lo, bool) or isinstance(hi, bool):
            raise VersionMismatch(f"{who} version range must be integers, got {lo!r}..{hi!r}")
        if not 1 <= lo <= hi <= 0xFFFF:
            raise VersionMismatch(f"{who} version range {lo}..{hi} is empty or outside 1..65535")
    best = min(offered_max, supported_max)
    if best < max(offered_min, supported_min):
        raise VersionMismatch(
            f"no common version: offered {offered_min}..{offered_max}, "
            f"supported {supported_min}..{supported_max}"
        )
    return best


class MsgType(IntEnum):
    """Link W message type codes (``Envelope.msg_type``, u16). Stable: never renumber, never reuse.

    Groups of 16: handshake 1-15, tick 16-31, prefix cache and seeds 32-47, state ops 48-63,
    eviction 64-79, grammar and logit bias 80-95, vocabulary 96-111, liveness and lifecycle 112-127.
    """

    HELLO = 1
    WELCOME = 2
    CAPABILITIES = 3
    RINGS_ATTACH = 4
    RINGS_ATTACHED = 5
    OK = 8
    ERROR = 9

    TICK_SUBMIT = 16
    TICK_RESULT = 17
    TICK_REJECTED = 18
    TICK_EMIT = 19

    MATCH = 32
    MATCH_RESULT = 33
    SEED_ACQUIRE = 34
    SEED_GRANT = 35
    SEED_RELEASE = 36
    SEED_ADOPT = 37

    STATE_OP = 48
    STATE_OP_ACCEPTED = 49
    STATE_OP_DONE = 50
    STATE_OP_CANCEL = 51

    CACHE_EVICT = 64
    CACHE_EVICTED = 65
    CACHE_EVICT_ENTRIES = 66

    GRAMMAR_CREATE = 80
    GRAMMAR_CREATED = 81
    GRAMMAR_FREE = 82
    LOGIT_BIAS_CREATE = 83
    LOGIT_BIAS_CREATED = 84
    LOGIT_BIAS_FREE = 85

    TOKENIZE = 96
    TOKENIZE_RESULT = 97
    DETOKENIZE = 98
    DETOKENIZE_RESULT = 99
    EMBED = 100
    EMBED_RESULT = 101
    SCORE = 102
    SCORE_RESULT = 103
    EMBED_CANCEL = 104

    PING = 112
    PONG = 113
    DRAIN = 114
    DRAINED = 115
    SHUTDOWN = 116


_MSG_TYPES_BY_CODE: dict[int, MsgType] = {int(t): t for t in MsgType}

HANDSHAKE_TYPES = frozenset({MsgType.HELLO, MsgType.WELCOME, MsgType.ERROR})
"""Types whose body layout is frozen across versions; they decode at any envelope version."""


# --- envelope -------------------------------------------------------------------------------

ENVELOPE_MAGIC = b"BRTW"
_ENV = struct.Struct("<4sHHQQ")
ENVELOPE_BYTES = 24
"""Size of the envelope frame: magic "BRTW", version u16, msg_type u16, seq u64, corr u64 (LE)."""
assert _ENV.size == ENVELOPE_BYTES


class Envelope(msgspec.Struct, frozen=True):
    """The first frame of every Link W message (24 bytes, little-endian, fixed layout).

    ``version``: the negotiated protocol version (handshake types: the sender's newest).
    ``msg_type``: a ``MsgType`` code (u16; decoded as the ``MsgType`` member when known).
    ``seq``: per-sender counter, strictly increasing from 1 (u64). ``corr``: the ``seq`` of the
    request this frame answers, 0 when it answers none (u64)."""

    version: int
    msg_type: int
    seq: int
    corr: int = 0

    def pack(self) -> bytes:
        """The 24-byte frame; raises ``MalformedFrame`` if a field is out of its integer range."""
        try:
            return _ENV.pack(ENVELOPE_MAGIC, self.version, self.msg_type, self.seq, self.corr)
        except (struct.error, TypeError) as exc:
            raise MalformedFrame(f"envelope field out of range: {exc}") from None

    @classmethod
    def unpack(cls, frame: Any) -> Envelope:
        """Read an envelope frame (any buffer). Raises ``TruncatedFrame`` when shorter than 24
        bytes, ``MalformedFrame`` when longer, not a buffer, or without the "BRTW" magic."""
        try:
            view = memoryview(frame).cast("B")
        except (TypeError, ValueError) as exc:
            raise MalformedFrame(f"envelope frame is not a byte buffer: {exc}") from None
        if view.nbytes < ENVELOPE_BYTES:
            raise TruncatedFrame(f"envelope frame is {view.nbytes} bytes, needs {ENVELOPE_BYTES}")
        if view.nbytes > ENVELOPE_BYTES:
            raise MalformedFrame(f"envelope frame is {view.nbytes} bytes, expected {ENVELOPE_BYTES}")
        magic, version, msg_type, seq, corr = _ENV.unpack(view)
        if magic != ENVELOPE_MAGIC:
            raise MalformedFrame(f"bad envelope magic {magic!r}")
        return cls(version, _MSG_TYPES_BY_CODE.get(msg_type, msg_type), seq, corr)


# --- array fields ---------------------------------------------------------------------------

_U32_MAX = 0xFFFFFFFF
_ARRAY_DTYPES = {"u1": np.dtype("<u1"), "u4": np.dtype("<u4"), "f4": np.dtype("<f4")}


def as_array(value: Any, kind: str) -> np.ndarray:
    """``value`` as a 1-D little-endian array of ``kind`` ("u4" token ids, "f4" values, "u1"
    bytes), without copying when it already is one.

    Accepts numpy arrays, lists/tuples of numbers and (for "u1") any bytes-like object. Raises
    TypeError for other types or a float array where integers are needed, ValueError for a
    multi-dimensional array or integers outside the dtype's range."""
    dtype = _ARRAY_DTYPES[kind]
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        if kind != "u1":
            raise TypeError(f"a {kind} array cannot be built from bytes")
        return np.frombuffer(memoryview(value).cast("B"), dtype=dtype)
    elif isinstance(value, (list, tuple)):
        arr = np.asarray(value) if value else np.empty(0, dtype=dtype)
    else:
        raise TypeError(f"expected an array, list or bytes, got {type(value).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D array, got shape {arr.shape}")
    if arr.dtype == dtype:
        return arr
    if arr.size == 0:
        return np.empty(0, dtype=dtype)
    if dtype.kind == "f":
        if arr.dtype.kind not in "fiu":
            raise TypeError(f"expected numbers, got dtype {arr.dtype}")
        return arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"expected integers, got dtype {arr.dtype}")
    hi = np.iinfo(dtype).max
    if int(arr.min()) < 0 or int(arr.max()) > hi:
        raise ValueError(f"values outside 0..{hi}")
    return arr.astype(dtype)


class _Msg(msgspec.Struct, array_like=True, kw_only=True):
    """Base of every Link W body that is not an ABI record (array-like msgpack, keyword args)."""


class _ArrayMsg(_Msg):
    """A body with 1-D numpy array fields, named with their kinds in ``_arrays``; they are
    converted on construction and on decode (a bad array fails the decode). Compare such
    messages field by field: ``==`` on a numpy array is elementwise, so ``==`` on the message
    raises ValueError."""

    _arrays: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        for name, kind in self._arrays.items():
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, as_array(value, kind))


def _empty(kind: str) -> Any:
    return msgspec.field(default_factory=lambda: np.empty(0, dtype=_ARRAY_DTYPES[kind]))


# --- handshake ------------------------------------------------------------------------------


class Hello(_Msg):
    """HELLO, worker -> coordinator, the worker's first frame: the versions it speaks, its id in
    the coordinator's config and its pid. Frozen layout (a handshake type)."""

    min_version: int
    max_version: int
    worker_id: int
    pid: int


class Welcome(_Msg):
    """WELCOME, coordinator -> worker: the version ``negotiate()`` chose. Frozen layout."""

    version: int


class TokenizerDesc(_Msg):
    """How the coordinator rebuilds the engine's tokenizer: ``kind`` "bytes" (reference engine)
    or "gguf" (vocab-only load of ``path``); mirrors ``TokenizerSpec`` of the engine protocol."""

    kind: str
    path: str = ""


class StrategyOffer(_Msg):
    """A speculation strategy the worker registered at load (tick ABI §2): its ``strategy_id``,
    the ``strategy_slot`` admits name, and one of its certificates (a strategy with several
    certificates is offered once per certificate, same slot; ``cert_id`` 0: none, so no lane may
    use it without consenting to approximation): ``exactness`` (an ``Exactness``),
    ``sampling_modes`` (``CertMode`` bits), ``param_domain`` (a ``CertDomain``), whether grammar
    and logit-bias lanes are covered."""

    strategy_id: str
    strategy_slot: int
    cert_id: int = 0
    exactness: int = 0
    sampling_modes: int = 0
    param_domain: int = 0
    grammar_allowed: bool = False
    logit_bias_allowed: bool = False


class RingSpec(_Msg):
    """One BRTRING1 ring (DESIGN.md "Rings"): ``ring_id`` (1 prompt, 2 emit, 3 logits), ``kind``
    a ``RingKind``, ``role`` a ``RingRole`` from the engine's side, ``slots`` count,
    ``slot_bytes`` per slot including its 16-byte header, ``length`` bytes of the whole segment
    (>= 64 + slots * slot_bytes, ABI rule 125)."""

    ring_id: int
    kind: int = 0
    role: int = 0
    slots: int = 0
    slot_bytes: int = 0
    length: int = 0


class RingAttachSpec(RingSpec):
    """A ring for RINGS_ATTACH: the spec plus the inherited memfd number in the worker (``fd``,
    passed with ``pass_fds``) and the ring's byte ``offset`` inside that segment."""

    fd: int = -1
    offset: int = 0


class Capabilities(_Msg):
    """CAPABILITIES, worker -> coordinator after WELCOME: the capability record.

    Mirrors ``EngineInfo`` of ``basertd.worker.engines.base`` plus the state spaces and the rings
    the worker wants. Sizes are tokens unless named ``_bytes``; ``model_id`` is a hex digest of the
    weights; ``bos_token_id`` is -1 when none; ``seed_lease_ticks`` is the TTL of ABI rule 84;
    ``max_batch_size`` bounds ``max_decode_lanes`` (ABI rule 31); ``strategies`` the speculation
    strategies registered at load (``StrategyOffer``)."""

    engine: str
    engine_version: str
    model: str
    model_id: str
    vocab_size: int
    context_length: int
    max_lanes: int
    max_batch_size: int
    page_size_tokens: int
    pool_bytes: int
    seed_lease_ticks: int
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    bos_token_id: int = -1
    add_bos: bool = False
    tokenizer: TokenizerDesc = msgspec.field(default_factory=lambda: TokenizerDesc(kind="bytes"))
    state_spaces: list[StateSpaceDesc] = msgspec.field(default_factory=list)
    rings: list[RingSpec] = msgspec.field(default_factory=list)
    extra: dict[str, str] = msgspec.field(default_factory=dict)
    strategies: list[StrategyOffer] = msgspec.field(default_factory=list)


class RingsAttach(_Msg):
    """RINGS_ATTACH, coordinator -> worker: attach these rings (all or nothing, ABI rule 125);
    fresh rings per worker incarnation, so the first emit's generation is 1 (rule 130)."""

    rings: list[RingAttachSpec] = msgspec.field(default_factory=list)


class RingsAttached(_Msg):
    """RINGS_ATTACHED, worker -> coordinator: ``status`` an ABI ``Status`` (OK, or
    ERR_RING_LAYOUT with nothing attached) and a human ``message``."""

    status: int = Status.OK
    message: str = ""


class Ok(_Msg):
    """OK: the request succeeded and has nothing to return."""


class Error(_Msg):
    """ERROR: the request was refused with ``status`` (an ABI ``Status`` value, or FATAL -1 for a
    worker-side failure) and a human ``message``; nothing changed. Frozen layout (handshake type)."""

    status: int
    message: str = ""


# --- tick -----------------------------------------------------------------------------------


class TickRejected(_Msg):
    """TICK_REJECTED, worker -> coordinator: the plan ``plan_seq`` was refused with ``status``
    (-100..-114); engine state is unchanged (ABI rules 13, 17-52)."""

    plan_seq: int
    status: int
    message: str = ""


class TickEmit(_ArrayMsg):
    """TICK_EMIT, worker -> coordinator, mid-tick: ``tokens`` (u32 ids) freshly committed by lane
    ``lane_tag`` during plan ``plan_seq`` (ABI rule 64). Display-path deltas: the TICK_RESULT's
    emits stay authoritative. ``proposed`` / ``accepted``: the lane's drafts proposed and accepted
    so far this tick, up to and with these tokens (the emit's SpecStats so far; 0 from an engine
    that does not report them mid-tick). ``corr`` is the TICK_SUBMIT's seq."""

    _arrays: ClassVar[dict[str, str]] = {"tokens": "u4"}

    plan_seq: int
    lane_tag: int
    tokens: np.ndarray = _empty("u4")
    proposed: int = 0
    accepted: int = 0


# --- prefix cache and seeds -----------------------------------------------------------------


class Match(_Msg):
    """MATCH: cached prefixes of ``span`` (tokens in the prompt ring) in ``space_id`` (ALL_SPACES
    for every space); answered with MATCH_RESULT (a ``MatchResult``). Pins nothing (ABI rule 87)."""

    span: TokenRef
    space_id: int = ALL_SPACES


class SeedAcquire(_Msg):
    """SEED_ACQUIRE: pin ``span[:prefix_len]`` (tokens) for one admit; answered with SEED_GRANT
    (ABI rules 75-83). ``determinism_class`` is a ``DeterminismClass``."""

    span: TokenRef
    prefix_len: int
    determinism_class: int = 0


class SeedGrant(_Msg):
    """SEED_GRANT: the seed handle for LaneAdmit.seed_handle, ``lease_ticks`` its TTL and ``tick``
    the engine tick count when it was granted (valid for ticks starting <= tick + TTL, rule 83)."""

    seed_handle: int
    lease_ticks: int = 0
    tick: int = 0


class SeedRelease(_Msg):
    """SEED_RELEASE: release an unconsumed seed; OK, or ERROR(ERR_UNKNOWN_HANDLE) (ABI rule 81)."""

    seed_handle: int


class SeedAdopt(_Msg):
    """SEED_ADOPT: lease the bare restored sequence ``seq`` covering ``span`` as the seed of the
    next admit; answered with SEED_GRANT (ABI rule 86)."""

    seq: int
    span: TokenRef


# --- state ops (one STATE_OP message type, a tagged union of ops) ---------------------------


class _Op(_Msg, tag_field="op", tag=True):
    """Base of the STATE_OP union; the tag is the op's first array element."""


class OpExportSize(_Op, tag=1):
    """Size an export of ``range`` (tokens) of ``space_id`` at ``encoding``: accepted with
    ``value`` = required bytes and ``sizing_gen`` (ABI rules 92-96)."""

    seq: int
    space_id: int
    range: TokenRange
    encoding: int = 0


class OpSnapshot(_Op, tag=2):
    """Start a snapshot up to ``boundary_pos`` (tokens) into ``dst_bytes`` bytes; accepted with an
    op handle, and STATE_OP_DONE carries the sealed bytes (ABI rules 95-98, 110)."""

    seq: int
    space_id: int
    boundary_pos: int
    sizing_gen: int
    dst_bytes: int


class OpRestore(_ArrayMsg, _Op, tag=3):
    """Start restoring the sealed export ``data`` (u8, envelope + payload) into bare sequence
    ``seq``; accepted with an op handle (ABI rules 101-104)."""

    _arrays: ClassVar[dict[str, str]] = {"data": "u1"}

    seq: int
    space_id: int
    data: np.ndarray = _empty("u1")


class OpDemote(_Op, tag=4):
    """Start moving ``range`` to the host tier at ``encoding``; accepted with an op handle, and
    STATE_OP_DONE carries the sealed bytes (ABI rules 105-108)."""

    seq: int
    space_id: int
    range: TokenRange
    encoding: int
    sizing_gen: int
    dst_bytes: int


class OpPromote(_ArrayMsg, _Op, tag=5):
    """Start bringing demoted ``range`` back from the sealed bytes ``data`` (u8); accepted with an
    op handle (ABI rule 105)."""

    _arrays: ClassVar[dict[str, str]] = {"data": "u1"}

    seq: int
    space_id: int
    range: TokenRange
    data: np.ndarray = _empty("u1")


class OpTrim(_Op, tag=6):
    """Trim ``space_id`` of ``seq`` to ``new_len`` tokens; synchronous (ABI rule 109)."""

    seq: int
    space_id: int
    new_len: int


class OpSnapshotBoundary(_Op, tag=7):
    """Newest durable boundary <= ``cap`` tokens; accepted with ``value`` (ABI rule 111)."""

    seq: int
    space_id: int
    cap: int


class OpFork(_Op, tag=8):
    """Fork sequence ``parent`` with ``ForkFlag`` bits; accepted with ``value`` = child (rule 98)."""

    parent: int
    flags: int = 0


class OpLaneSequence(_Op, tag=9):
    """The sequence live lane ``lane_tag`` owns; accepted with ``value`` = handle, 0 if none."""

    lane_tag: int


class OpSequenceCreate(_Op, tag=10):
    """Create a bare empty sequence (a restore target); accepted with ``value`` = handle."""


class OpSequenceFree(_Op, tag=11):
    """Free bare sequence ``seq`` (ABI rule 112)."""

    seq: int


class OpSequencePublish(_ArrayMsg, _Op, tag=12):
    """Publish bare sequence ``seq``'s whole-page prefix under ``tokens`` (u32); consumes it
    (ABI rule 91)."""

    _arrays: ClassVar[dict[str, str]] = {"tokens": "u4"}

    seq: int
    tokens: np.ndarray = _empty("u4")


StateOp = (
    OpExportSize
    | OpSnapshot
    | OpRestore
    | OpDemote
    | OpPromote
    | OpTrim
    | OpSnapshotBoundary
    | OpFork
    | OpLaneSequence
    | OpSequenceCreate
    | OpSequenceFree
    | OpSequencePublish
)
"""The body of STATE_OP: one op per message, told apart by its integer tag."""
STATE_OPS: tuple[type, ...] = StateOp.__args__


class StateOpAccepted(_Msg):
    """STATE_OP_ACCEPTED: ``op`` the op handle of an async op (snapshot, restore, demote, promote;
    never reused, ABI rule 99), else 0 with the immediate result in ``value`` (export size in
    bytes, boundary in tokens, a sequence handle) and, for export sizing, ``sizing_gen``."""

    op: int = 0
    value: int = 0
    sizing_gen: int = 0


class StateOpDone(_ArrayMsg):
    """STATE_OP_DONE, worker -> coordinator when an async op reaches a terminal state: ``state``
    an ``OpState``, ``error`` an ABI ``Status`` (0 when DONE), ``bytes_moved``, and for a DONE
    snapshot or demote the sealed bytes in ``data`` (u8, sent as a side frame; else None).
    ``corr`` is the STATE_OP's seq."""

    _arrays: ClassVar[dict[str, str]] = {"data": "u1"}

    op: int
    state: int
    error: int = 0
    bytes_moved: int = 0
    data: np.ndarray | None = None


class StateOpCancel(_Msg):
    """STATE_OP_CANCEL: request cancellation of ``op``; OK (ABI rule 100)."""

    op: int


# --- eviction -------------------------------------------------------------------------------


class CacheEvict(_Msg):
    """CACHE_EVICT: evict up to ``bytes_target`` bytes inside ``policy``; CACHE_EVICTED (rule 89)."""

    policy: ShedPolicy
    bytes_target: int


class CacheEvicted(_Msg):
    """CACHE_EVICTED: the bytes actually freed."""

    bytes_freed: int


class CacheEvictEntries(_Msg):
    """CACHE_EVICT_ENTRIES: drop the named physical cache variants; OK."""

    keys: list[CacheKey] = msgspec.field(default_factory=list)


# --- grammar and logit bias -----------------------------------------------------------------


class GrammarCreate(_Msg):
    """GRAMMAR_CREATE: compile a grammar; GRAMMAR_CREATED (handle 0 = failed).

    ``json_schema`` carries the spec text, whose form ``kind`` names: "json_schema" (the default,
    and all a sender that omits ``kind`` can mean), "lark" or "regex". Engines serving only JSON
    schemas answer 0 for the other kinds."""

    json_schema: str
    kind: str = "json_schema"


class GrammarCreated(_Msg):
    """GRAMMAR_CREATED: the grammar handle for LaneAdmit.grammar_handle; 0 when compilation failed."""

    handle: int


class GrammarFree(_Msg):
    """GRAMMAR_FREE: free a grammar; OK or ERROR(ERR_UNKNOWN_HANDLE) (ABI rule 113)."""

    handle: int


class LogitBiasCreate(_ArrayMsg):
    """LOGIT_BIAS_CREATE: bias ``values[i]`` (f32, added to the logit) on token ``tokens[i]`` (u32);
    LOGIT_BIAS_CREATED (handle 0 when empty, ABI rule 113)."""

    _arrays: ClassVar[dict[str, str]] = {"tokens": "u4", "values": "f4"}

    tokens: np.ndarray = _empty("u4")
    values: np.ndarray = _empty("f4")


class LogitBiasCreated(_Msg):
    """LOGIT_BIAS_CREATED: the handle for LaneAdmit.logit_bias_handle, 0 when none was made."""

    handle: int


class LogitBiasFree(_Msg):
    """LOGIT_BIAS_FREE: free a logit-bias table; OK or ERROR(ERR_UNKNOWN_HANDLE) (rule 113)."""

    handle: int


# --- vocabulary -----------------------------------------------------------------------------


class Tokenize(_Msg):
    """TOKENIZE: token ids of ``text`` (raw bytes, usually UTF-8) with the worker's vocabulary,
    with BOS/special handling when ``add_special``; TOKENIZE_RESULT."""

    text: bytes
    add_special: bool = True


class TokenizeResult(_ArrayMsg):
    """TOKENIZE_RESULT: the token ids (u32)."""

    _arrays: ClassVar[dict[str, str]] = {"tokens": "u4"}

    tokens: np.ndarray = _empty("u4")


class Detokenize(_ArrayMsg):
    """DETOKENIZE: the bytes of ``tokens`` (u32); DETOKENIZE_RESULT."""

    _arrays: ClassVar[dict[str, str]] = {"tokens": "u4"}

    tokens: np.ndarray = _empty("u4")


class DetokenizeResult(_Msg):
    """DETOKENIZE_RESULT: the bytes (may end inside a UTF-8 character)."""

    text: bytes


class Embed(_ArrayMsg):
    """EMBED: the pooled embeddings of ``len(lengths)`` inputs whose token ids (u32) stand one
    after another in ``tokens`` (input i is the next ``lengths[i]`` ids); EMBED_RESULT, or ERROR
    (ERR_OP_UNSUPPORTED: the engine has no embeddings; REJECT_BOUNDS: an input is empty, longer
    than the context length, or holds an id outside the vocabulary; EBUSY: a chunked input is
    open). Served between ticks.

    Chunked (``input_id`` != 0): ``tokens`` are chunk ``chunk`` (0, 1, ... in order) of one long
    input, ``lengths`` holds their count; the worker keeps the input's state between EMBEDs, so
    its ticks run between the chunks, and answers EMBED_RESULT with no values (``dim`` 0) until
    the chunk with ``last``, whose reply carries the whole input's vector (equal to the one-pass
    one up to float noise). One chunked input is open per worker: ERROR EBUSY for chunk 0 while
    another is (EMBED_CANCEL it), ERR_UNKNOWN_HANDLE for a later chunk of an input not open (the
    worker restarted: start again), REJECT_BOUNDS for a chunk out of order; a refused chunk
    changes nothing."""

    _arrays: ClassVar[dict[str, str]] = {"tokens": "u4", "lengths": "u4"}

    tokens: np.ndarray = _empty("u4")
    lengths: np.ndarray = _empty("u4")
    input_id: int = 0
    chunk: int = 0
    last: bool = True


class EmbedCancel(_Msg):
    """EMBED_CANCEL: drop the open chunked input ``input_id`` (an EMBED's); OK, or ERROR
    (ERR_UNKNOWN_HANDLE: it is not the one open). Served between ticks."""

    input_id: int


class Score(_ArrayMsg):
    """SCORE: each token of ``tokens`` (u32, at least 2) after the first, scored given the ones
    before it, with the ``top_k`` (0..20) likeliest tokens at each position; SCORE_RESULT, or ERROR
    (ERR_OP_UNSUPPORTED: the engine scores nothing; REJECT_BOUNDS: too few or too many tokens, an
    id outside the vocabulary, a bad ``top_k``). Served between ticks."""

    _arrays: ClassVar[dict[str, str]] = {"tokens": "u4"}

    tokens: np.ndarray = _empty("u4")
    top_k: int = 0


class ScoreResult(_ArrayMsg):
    """SCORE_RESULT: ``logprobs`` (f32, n-1: log P(token i+1 | tokens 0..i), natural log), and
    ``top_k`` ids (u32) and log-probabilities (f32) per position, position after position,
    likeliest first."""

    _arrays: ClassVar[dict[str, str]] = {"logprobs": "f4", "top_ids": "u4", "top_logprobs": "f4"}

    top_k: int = 0
    logprobs: np.ndarray = _empty("f4")
    top_ids: np.ndarray = _empty("u4")
    top_logprobs: np.ndarray = _empty("f4")


class EmbedResult(_ArrayMsg):
    """EMBED_RESULT: ``dim`` values (f32) per input, input after input, in ``values``."""

    _arrays: ClassVar[dict[str, str]] = {"values": "f4"}

    dim: int = 0
    values: np.ndarray = _empty("f4")


# --- liveness and lifecycle -----------------------------------------------------------------


class Ping(_Msg):
    """PING: liveness probe; answered with PONG even while a tick runs."""


class Pong(_Msg):
    """PONG: ``queue_depth`` requests waiting in the worker, ``ticks_run`` since start,
    ``last_plan_seq`` of the last finished tick, ``lanes_active``, whether a tick is in flight,
    the pool counters of the last tick (``MemCounters``, bytes and blocks), and ``stats``: the
    engine's counters and gauges (``Engine.stats()``: ticks, prefill/decode tokens, live lanes and
    seed leases, cache entries, pool bytes, evictions), for metrics and cache-policy checks."""

    queue_depth: int = 0
    ticks_run: int = 0
    last_plan_seq: int = 0
    lanes_active: int = 0
    tick_in_flight: bool = False
    mem: MemCounters = msgspec.field(default_factory=MemCounters)
    stats: dict[str, int] = msgspec.field(default_factory=dict)


class Drain(_Msg):
    """DRAIN: accept no new admits; DRAINED once no lane is live."""


class Drained(_Msg):
    """DRAINED: the worker holds no live lane (``lanes_active`` is 0 unless the drain timed out)."""

    lanes_active: int = 0


class Shutdown(_Msg):
    """SHUTDOWN: free the engine and exit (no reply; the coordinator sees the process exit)."""

    reason: str = ""


# --- the catalog ----------------------------------------------------------------------------

MESSAGE_TYPES: dict[MsgType, Any] = {
    MsgType.HELLO: Hello,
    MsgType.WELCOME: Welcome,
    MsgType.CAPABILITIES: Capabilities,
    MsgType.RINGS_ATTACH: RingsAttach,
    MsgType.RINGS_ATTACHED: RingsAttached,
    MsgType.OK: Ok,
    MsgType.ERROR: Error,
    MsgType.TICK_SUBMIT: TickPlan,
    MsgType.TICK_RESULT: TickEvents,
    MsgType.TICK_REJECTED: TickRejected,
    MsgType.TICK_EMIT: TickEmit,
    MsgType.MATCH: Match,
    MsgType.MATCH_RESULT: MatchResult,
    MsgType.SEED_ACQUIRE: SeedAcquire,
    MsgType.SEED_GRANT: SeedGrant,
    MsgType.SEED_RELEASE: SeedRelease,
    MsgType.SEED_ADOPT: SeedAdopt,
    MsgType.STATE_OP: StateOp,
    MsgType.STATE_OP_ACCEPTED: StateOpAccepted,
    MsgType.STATE_OP_DONE: StateOpDone,
    MsgType.STATE_OP_CANCEL: StateOpCancel,
    MsgType.CACHE_EVICT: CacheEvict,
    MsgType.CACHE_EVICTED: CacheEvicted,
    MsgType.CACHE_EVICT_ENTRIES: CacheEvictEntries,
    MsgType.GRAMMAR_CREATE: GrammarCreate,
    MsgType.GRAMMAR_CREATED: GrammarCreated,
    MsgType.GRAMMAR_FREE: GrammarFree,
    MsgType.LOGIT_BIAS_CREATE: LogitBiasCreate,
    MsgType.LOGIT_BIAS_CREATED: LogitBiasCreated,
    MsgType.LOGIT_BIAS_FREE: LogitBiasFree,
    MsgType.TOKENIZE: Tokenize,
    MsgType.TOKENIZE_RESULT: TokenizeResult,
    MsgType.DETOKENIZE: Detokenize,
    MsgType.DETOKENIZE_RESULT: DetokenizeResult,
    MsgType.EMBED: Embed,
    MsgType.EMBED_RESULT: EmbedResult,
    MsgType.SCORE: Score,
    MsgType.SCORE_RESULT: ScoreResult,
    MsgType.EMBED_CANCEL: EmbedCancel,
    MsgType.PING: Ping,
    MsgType.PONG: Pong,
    MsgType.DRAIN: Drain,
    MsgType.DRAINED: Drained,
    MsgType.SHUTDOWN: Shutdown,
}
"""Body type of each message type (a Struct, or the ``StateOp`` union for STATE_OP)."""


def _msg_type_of() -> dict[type, MsgType]:
    out: dict[type, MsgType] = {}
    for code, body in MESSAGE_TYPES.items():
        for cls in getattr(body, "__args__", (body,)):
            if cls in out:
                raise RuntimeError(f"{cls.__name__} is the body of two message types")
            out[cls] = code
    return out


MSG_TYPE_OF: dict[type, MsgType] = _msg_type_of()
"""The message type of each body class (every class is the body of exactly one type)."""


def msg_type_of(msg: Any) -> MsgType:
    """The ``MsgType`` whose body ``msg`` is; raises ``UnknownMessageType`` for other objects."""
    try:
        return MSG_TYPE_OF[type(msg)]
    except KeyError:
        raise UnknownMessageType(f"{type(msg).__name__} is not a Link W message") from None


REPLIES: dict[MsgType, frozenset[MsgType]] = {
    MsgType.HELLO: frozenset({MsgType.WELCOME}),
    MsgType.WELCOME: frozenset({MsgType.CAPABILITIES}),
    MsgType.RINGS_ATTACH: frozenset({MsgType.RINGS_ATTACHED}),
    MsgType.TICK_SUBMIT: frozenset({MsgType.TICK_RESULT, MsgType.TICK_REJECTED}),
    MsgType.MATCH: frozenset({MsgType.MATCH_RESULT}),
    MsgType.SEED_ACQUIRE: frozenset({MsgType.SEED_GRANT}),
    MsgType.SEED_ADOPT: frozenset({MsgType.SEED_GRANT}),
    MsgType.SEED_RELEASE: frozenset({MsgType.OK}),
    MsgType.STATE_OP: frozenset({MsgType.STATE_OP_ACCEPTED}),
    MsgType.STATE_OP_CANCEL: frozenset({MsgType.OK}),
    MsgType.CACHE_EVICT: frozenset({MsgType.CACHE_EVICTED}),
    MsgType.CACHE_EVICT_ENTRIES: frozenset({MsgType.OK}),
    MsgType.GRAMMAR_CREATE: frozenset({MsgType.GRAMMAR_CREATED}),
    MsgType.GRAMMAR_FREE: frozenset({MsgType.OK}),
    MsgType.LOGIT_BIAS_CREATE: frozenset({MsgType.LOGIT_BIAS_CREATED}),
    MsgType.LOGIT_BIAS_FREE: frozenset({MsgType.OK}),
    MsgType.TOKENIZE: frozenset({MsgType.TOKENIZE_RESULT}),
    MsgType.DETOKENIZE: frozenset({MsgType.DETOKENIZE_RESULT}),
    MsgType.EMBED: frozenset({MsgType.EMBED_RESULT}),
    MsgType.SCORE: frozenset({MsgType.SCORE_RESULT}),
    MsgType.EMBED_CANCEL: frozenset({MsgType.OK}),
    MsgType.PING: frozenset({MsgType.PONG}),
    MsgType.DRAIN: frozenset({MsgType.DRAINED}),
}
"""The normal reply types of each request (ERROR answers any of them). TICK_EMIT and
STATE_OP_DONE are unsolicited but carry ``corr`` of the TICK_SUBMIT / STATE_OP they belong to;
SHUTDOWN has no reply."""
