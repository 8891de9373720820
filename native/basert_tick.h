/*
 * basert_tick.h: basertd's own declaration of the baseRT tick ABI (draft 7).
 *
 * What this file is: the in-process interface between an engine worker and any
 * shared library that exports the tick ABI (a real libbaseRT, or basertd's C
 * reference engine in native/ref_engine/). Every name, numeric value, struct
 * size and field offset below is a fact of that ABI and must match it byte for
 * byte; ../shared/abi/RULES.md section A lists the sizes the layout test checks.
 *
 * Layout discipline (ABI rules 1-11):
 *   - every struct is 8-byte aligned at most and spells out its padding as
 *     `_padN` fields, so no layout depends on a compiler's padding choices;
 *   - top-level records start with `uint64_t struct_size` and only ever grow
 *     at the end;
 *   - a list of records is a BaseRTArray {data, count, elem_size}, where
 *     elem_size is the writer's record size; readers zero-fill and copy
 *     min(elem_size, their own size), reject elem_size below the record's
 *     minimum prefix, and check alignment and count*elem_size before reading.
 *
 * Machine-readability: basertd.native feeds this file to cffi after a
 * mechanical pass (comments and preprocessor lines removed, the C++ and
 * static-assert blocks skipped, integer #defines kept). Keep declarations in
 * plain C that cffi parses: no macros inside declarations, no bit-fields.
 *
 * Status: synchronous calls return baseRT_status (0 = OK, negative = typed
 * refusal). Nothing here crosses a process boundary; raw pointers are legal.
 */

#ifndef BASERT_TICK_H
#define BASERT_TICK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Opaque handles. baseRT.h (model loading, not part of this header) hands
 * out the bundle; sequences belong to a bundle. */
typedef void *baseRT_model_t;
typedef struct baseRT_sequence_s *baseRT_sequence_t;

/* ======================================================================== */
/* Status codes                                                             */
/* ======================================================================== */

typedef int32_t baseRT_status;

enum {
    BASERT_STATUS_OK = 0,

    /* Whole-plan refusals from baseRT_tick: nothing in the engine changes.
     * -109 is deliberately unassigned (ABI rule 13). */
    BASERT_REJECT_BAD_STRIDE = -100,          /* elem_size under the record's minimum prefix */
    BASERT_REJECT_BAD_ALIGNMENT = -101,       /* array data pointer not 8-byte aligned */
    BASERT_REJECT_BOUNDS = -102,              /* count*elem_size overflow, or out of range */
    BASERT_REJECT_BAD_REF_GENERATION = -103,  /* a ring ref whose slot was recycled */
    BASERT_REJECT_UNKNOWN_LANE = -104,        /* a record names a lane the engine lacks */
    BASERT_REJECT_DUPLICATE_LANE = -105,      /* one lane_tag twice in one array */
    BASERT_REJECT_ILLEGAL_COMBINATION = -106, /* records that contradict each other */
    BASERT_REJECT_BUDGET = -107,              /* a budget above what the engine can run */
    BASERT_REJECT_STALE_SEED = -108,          /* seed lease consumed, expired or unknown */
    BASERT_REJECT_HOST_RULES = -110,          /* a HOST-sampling rule broken */
    BASERT_REJECT_TRANSFER_LOCKED = -111,     /* lane's sequence has a state op in flight */
    BASERT_REJECT_STALE_NONCE = -112,         /* commit names a logits row that is not current */
    BASERT_NEEDS_REPLAN = -113,               /* no fit even after every allowed eviction */
    BASERT_REJECT_BAD_STRUCT = -114,          /* struct_size below the v1 minimum */

    /* Refusals of synchronous calls and op submissions. */
    BASERT_EBUSY = -120,                      /* the (sequence, space) pair is claimed */
    BASERT_ERR_BUFFER_TOO_SMALL = -121,
    BASERT_ERR_STALE_SIZING = -122,           /* sizing_gen no longer current */
    BASERT_ERR_OUT_OF_BOUNDARY = -123,        /* position is not a snapshot boundary */
    BASERT_ERR_ENVELOPE_MISMATCH = -124,      /* envelope does not fit the target */
    BASERT_ERR_CHECKSUM = -125,
    BASERT_ERR_IDENTITY_MISMATCH = -126,
    BASERT_ERR_OP_UNSUPPORTED = -127,         /* this op is not served for this space/encoding */
    BASERT_ERR_REGISTRATION_REFUSED = -128,   /* strategy registration fails closed */
    BASERT_ERR_UNKNOWN_HANDLE = -129,         /* op, seed, sequence, grammar or bias handle */
    BASERT_ERR_SEED_UNSERVABLE = -130,        /* some space cannot serve the prefix */
    BASERT_ERR_RING_LAYOUT = -131,            /* ring header/descriptor disagreement */

    /* Per-lane admission outcome, found only in BaseRTAdmitResult.reject_code
     * (as two's-complement bits); never returned by baseRT_tick (rule 14). */
    BASERT_REJECT_CERT_UNMATCHED = -140,

    /* The engine is no longer usable. */
    BASERT_ERR_FATAL = -1
};

/* BaseRTLaneFault.code: one lane stops, the tick carries on. */
enum {
    BASERT_FAULT_UNSPECIFIED = 0,
    BASERT_FAULT_GRAMMAR_OVERFLOW = 1,
    BASERT_FAULT_REF_SPAN_OOB = 2,
    BASERT_FAULT_STRATEGY = 3,
    BASERT_FAULT_OOM_TENTATIVE = 4,
    BASERT_FAULT_INTERNAL = 5,
    BASERT_FAULT_MEDIA = 6
};

/* ======================================================================== */
/* Small value types                                                        */
/* ======================================================================== */

/* A list of records. `elem_size` is the size the writer used per record;
 * `data` is 8-byte aligned (or NULL when count is 0). */
typedef struct BaseRTArray {
    const void *data;
    uint32_t count;
    uint32_t elem_size;
} BaseRTArray; /* 16 */

/* `count` token ids starting at slot `index` of ring `ring_id`; the
 * generation lets a reader tell a recycled slot from the intended one. */
typedef struct BaseRTTokenRef {
    uint32_t ring_id;
    uint32_t index;
    uint32_t count;
    uint32_t _pad0;
    uint64_t generation;
} BaseRTTokenRef; /* 24 */

/* One logits row of a ring; its generation is also the row's nonce. */
typedef struct BaseRTRingRef {
    uint32_t ring_id;
    uint32_t index;
    uint64_t generation;
} BaseRTRingRef; /* 16 */

/* Host memory owned by the caller, lent to the engine for one op. */
typedef struct BaseRTBuf {
    void *ptr;
    uint64_t len;
} BaseRTBuf; /* 16 */

/* Tokens [start, end). */
typedef struct BaseRTTokenRange {
    uint64_t start;
    uint64_t end;
} BaseRTTokenRange; /* 16 */

/* ======================================================================== */
/* Enumerations carried in fixed-width record fields                        */
/* ======================================================================== */

enum { /* BaseRTLaneAdmit.sampling */
    BASERT_SAMPLING_GPU_GREEDY = 0,
    BASERT_SAMPLING_GPU_GUMBEL = 1,
    BASERT_SAMPLING_HOST = 2
};

enum { /* determinism class of admits and seed leases */
    BASERT_DETERMINISM_BEST_EFFORT = 0,
    BASERT_DETERMINISM_DETERMINISTIC = 1
};

enum { /* exactness; higher is stricter, so floors compare as numbers */
    BASERT_EXACTNESS_APPROXIMATE = 0,
    BASERT_EXACTNESS_DISTRIBUTION_EXACT = 1,
    BASERT_EXACTNESS_SEED_PATH_INVARIANT = 2
};

enum { /* BaseRTTickPlan.flags */
    BASERT_TICK_DRAIN = 1u << 0,
    BASERT_TICK_CAPTURE_OK = 1u << 1,
    /* on_partial_emit is set and struct_size covers it: tokens are streamed
     * to the callback during the tick; the final emit is still complete. */
    BASERT_TICK_PARTIAL_EMITS = 1u << 2
};

enum { /* BaseRTTickEvents.tick_status */
    BASERT_TICK_OK = 0,
    BASERT_TICK_SHED = 1,
    BASERT_TICK_LANE_ERRORS = 2,
    BASERT_TICK_FATAL = 3
};

enum { /* BaseRTAdmitResult.status */
    BASERT_ADMIT_UNSPECIFIED = 0,
    BASERT_ADMIT_ADMITTED = 1,
    BASERT_ADMIT_REJECTED = 2
};

enum { /* BaseRTLaneEmit.finish */
    BASERT_FINISH_NONE = 0,
    BASERT_FINISH_EOS = 1,
    BASERT_FINISH_LENGTH = 2,
    BASERT_FINISH_GRAMMAR = 3,
    BASERT_FINISH_CANCELLED = 4,
    BASERT_FINISH_ERROR = 5
};

enum { /* state op lifecycle (BaseRTOpStatus.state, BaseRTOpComplete.state) */
    BASERT_OP_PENDING = 0,
    BASERT_OP_RUNNING = 1,
    BASERT_OP_DONE = 2,
    BASERT_OP_FAILED = 3,
    BASERT_OP_CANCELLED = 4
};

enum { /* payload encoding of snapshot / demote */
    BASERT_ENCODING_LOSSLESS = 0,
    BASERT_ENCODING_Q8 = 1,
    BASERT_ENCODING_Q4 = 2
};

enum { /* BaseRTStateSpaceDesc.kind */
    BASERT_SPACE_KIND_UNSPECIFIED = 0,
    BASERT_SPACE_KIND_PAGED_TOKEN_KV = 1,
    BASERT_SPACE_KIND_RING_KV = 2,
    BASERT_SPACE_KIND_RECURRENT_BLOB = 3,
    BASERT_SPACE_KIND_DEPTH_PAGED_KV = 4,
    BASERT_SPACE_KIND_ENCODER_CACHE = 5
};

enum { /* BaseRTStateSpaceDesc.flags */
    /* The space is real but no state op serves it: seeds, snapshots,
     * demotes, restores and trims touching it are refused. */
    BASERT_SPACE_FLAG_OPS_UNAVAILABLE = 1u << 0,
    /* The prefix cache never holds this space, so cache seeds cannot cover
     * it; such bundles warm-start only through adopted sequences. */
    BASERT_SPACE_FLAG_NO_PREFIX_CACHE = 1u << 1
};

enum { /* BaseRTArtifact.role */
    BASERT_ARTIFACT_UNSPECIFIED = 0,
    BASERT_ARTIFACT_DRAFT_WEIGHTS = 1,
    BASERT_ARTIFACT_AUX_HEAD = 2,
    BASERT_ARTIFACT_PROJECTION = 3,
    BASERT_ARTIFACT_DRAFT_TOKENIZER = 4
};

enum { /* BaseRTTapSpec.tensor */
    BASERT_TAP_TENSOR_UNSPECIFIED = 0,
    BASERT_TAP_TENSOR_HIDDEN = 1,
    BASERT_TAP_TENSOR_ATTN_OUT = 2,
    BASERT_TAP_TENSOR_EMBED = 3
};

enum { /* BaseRTExactnessCert.sampling_modes bits */
    BASERT_CERT_MODE_GREEDY = 1u << 0,
    BASERT_CERT_MODE_GUMBEL = 1u << 1,
    BASERT_CERT_MODE_HOST = 1u << 2
};

enum { /* BaseRTExactnessCert.param_domain; NONE matches no lane */
    BASERT_CERT_DOMAIN_NONE = 0,
    BASERT_CERT_DOMAIN_GREEDY_ONLY = 1,
    BASERT_CERT_DOMAIN_PENALTY_FREE = 2,
    BASERT_CERT_DOMAIN_ANY = 3
};

enum { /* BaseRTCapabilityReq.kind_id; an unknown kind refuses registration */
    BASERT_STRATEGY_CAP_UNSPECIFIED = 0,
    BASERT_STRATEGY_CAP_PROPOSAL_LINEAR = 1,
    BASERT_STRATEGY_CAP_PROPOSAL_BLOCK = 2,
    BASERT_STRATEGY_CAP_PROPOSAL_TREE = 3,
    BASERT_STRATEGY_CAP_MASK_ANCESTOR = 4,
    BASERT_STRATEGY_CAP_HOST_COMPATIBLE = 5
};

enum { /* provenance taint reasons (sticky along derivations) */
    BASERT_TAINT_QUANTIZED_DEMOTION = 1u << 0,
    BASERT_TAINT_DECOMPOSITION = 1u << 1
};

enum { /* BaseRTMatchCandidate.resident_tier */
    BASERT_TIER_GPU = 0,
    BASERT_TIER_HOST = 1,
    BASERT_TIER_GONE = 2
};

enum { /* BaseRTShedEntry.kind */
    BASERT_SHED_UNSPECIFIED = 0,
    BASERT_SHED_PREFILL_CHUNK = 1,
    BASERT_SHED_CACHE_EVICTION = 2
};

enum { /* baseRT_seq_fork flags */
    BASERT_FORK_EAGER = 1u << 0
};

enum { /* BaseRTStateEnvelope.checksum_kind; 0 is invalid, never "skip" */
    BASERT_CHECKSUM_XXH3_64 = 1,
    BASERT_CHECKSUM_FNV1A64 = 2
};

enum { /* BaseRTSamplingParams.flags */
    /* EOS does not end the lane; it runs to its max_new_tokens. */
    BASERT_SAMPLING_FLAG_IGNORE_EOS = 1u << 0
};

enum { /* BaseRTRingDesc.kind */
    BASERT_RING_KIND_UNSPECIFIED = 0,
    BASERT_RING_KIND_TOKENS = 1, /* payload: uint32_t token ids */
    BASERT_RING_KIND_LOGITS = 2  /* payload: float logits row */
};

enum { /* BaseRTRingDesc.role, seen from the engine */
    BASERT_RING_ROLE_UNSPECIFIED = 0,
    BASERT_RING_ROLE_ENGINE_READS = 1,
    BASERT_RING_ROLE_ENGINE_WRITES = 2
};

/* ======================================================================== */
/* Constants                                                                */
/* ======================================================================== */

/* Alternatives stored inline per BaseRTLaneLogprob record. */
#define BASERT_MAX_TOP_LOGPROBS 20
/* space_id that selects every state space of a bundle. */
#define BASERT_ALL_SPACES 0xFFFFFFFFu
/* First 8 bytes of every exported state payload: "BRTSTATE" in LE memory. */
#define BASERT_STATE_ENVELOPE_MAGIC 0x4554415453545242ull
/* First 8 bytes of every ring. Unlike the envelope magic, this value spells
 * "BRTRING1" only when written most significant byte first: in LE memory its
 * bytes are 31 47 4E 49 52 54 52 42 ("1GNIRTRB"), ABI rule 123. */
#define BASERT_RING_MAGIC 0x42525452494E4731ull

/* ======================================================================== */
/* Tick plan                                                                */
/* ======================================================================== */

typedef struct BaseRTSamplingParams {
    float temperature;
    float top_p;
    float min_p;
    uint32_t top_k;         /* 0 disables */
    float freq_penalty;
    float presence_penalty;
    float repeat_penalty;   /* 0 disables (same as 1.0) */
    uint32_t flags;         /* BASERT_SAMPLING_FLAG_* */
} BaseRTSamplingParams; /* 32 */

/* Limits on what the engine may drop or evict to make a plan fit; also the
 * argument of baseRT_cache_evict. */
typedef struct BaseRTShedPolicy {
    BaseRTArray victim_lanes;          /* uint64_t lane tags, first evicted first */
    uint64_t evictable_cache_classes;  /* bitset over caller-defined classes */
    uint64_t protected_quota_bytes;    /* bytes that must stay resident */
    uint64_t max_evict_bytes;
} BaseRTShedPolicy; /* 40 */

typedef struct BaseRTLaneAdmit {
    uint64_t lane_tag;                  /* caller's opaque lane id */
    BaseRTTokenRef prompt;              /* prompt tokens in an engine-read ring */
    uint64_t seed_handle;               /* from seed_acquire / seed_adopt; 0 = cold */
    uint32_t sampling;                  /* BASERT_SAMPLING_* */
    uint32_t logit_bias_handle;         /* 0 = none */
    BaseRTSamplingParams params;
    uint64_t rng_counter_base;          /* counter-based RNG position of token 0 */
    uint32_t grammar_handle;            /* 0 = none */
    uint32_t strategy_slot;             /* 0 = no speculation */
    uint8_t determinism_class;          /* BASERT_DETERMINISM_* */
    uint8_t minimum_exactness;          /* BASERT_EXACTNESS_* floor */
    uint8_t allow_approximate;          /* 1 = accept an uncertified path */
    uint8_t want_logprobs;              /* 0 = off, else 1 + top alternatives */
    uint32_t required_cert_id;          /* 0 = engine picks */
    uint8_t host_sampler_identity[32];  /* HOST lanes; all-zero never certifies */
    /* Fields past the 136-byte v1 prefix; a v1 writer reads as 0 here. */
    uint32_t grammar_replay;            /* trailing prompt tokens the grammar accepted */
    uint32_t decode_replay;             /* trailing prompt tokens this request generated */
} BaseRTLaneAdmit; /* 144; minimum prefix 136 */

/* One host-chosen token for a HOST lane; the engine advances the RNG
 * counter by one per committed token. */
typedef struct BaseRTLaneCommit {
    uint64_t lane_tag;
    uint32_t token_id;
    uint32_t _pad0;
    uint64_t logits_nonce;  /* generation of the logits row it answers */
} BaseRTLaneCommit; /* 24 */

typedef struct BaseRTLanePrefill {
    uint64_t lane_tag;
    uint32_t token_offset;  /* into the admitted prompt */
    uint32_t token_count;
} BaseRTLanePrefill; /* 16 */

typedef struct BaseRTLaneDecode {
    uint64_t lane_tag;
    uint16_t max_new_tokens;  /* HOST lanes: exactly 1 */
    uint16_t overshoot;       /* extra tokens a speculative round may commit */
    uint32_t _pad1;
} BaseRTLaneDecode; /* 16 */

typedef struct BaseRTLaneRetire {
    uint64_t lane_tag;
    uint8_t publish_to_cache;
    uint8_t _pad0[7];
} BaseRTLaneRetire; /* 16 */

typedef struct BaseRTTickPlan {
    uint64_t struct_size;           /* 152 (v1) or 168 (with the callback tail) */
    uint64_t plan_seq;              /* strictly increasing per bundle; echoed */
    uint32_t flags;                 /* BASERT_TICK_* */
    uint32_t _pad0;
    uint32_t prefill_token_budget;  /* prompt tokens this tick may prefill */
    uint32_t max_decode_lanes;      /* at most the engine's batch size */
    BaseRTArray admits;             /* BaseRTLaneAdmit */
    BaseRTArray commits;            /* BaseRTLaneCommit */
    BaseRTArray prefills;           /* BaseRTLanePrefill */
    BaseRTArray decodes;            /* BaseRTLaneDecode */
    BaseRTArray retires;            /* BaseRTLaneRetire */
    BaseRTShedPolicy shed_policy;
    /* Tail read only when struct_size >= 168 and BASERT_TICK_PARTIAL_EMITS is
     * set: called on the ticking thread, before baseRT_tick returns, with
     * each lane's freshly committed tokens. It must not call the engine. */
    void (*on_partial_emit)(void *user, uint64_t lane_tag, const uint32_t *tokens, uint32_t n_tokens);
    void *partial_emit_user;
} BaseRTTickPlan; /* 168; legacy prefix 152 */

/* ======================================================================== */
/* Tick events                                                              */
/* ======================================================================== */

typedef struct BaseRTAdmitResult {
    uint64_t lane_tag;
    uint32_t status;         /* BASERT_ADMIT_* */
    uint32_t reject_code;    /* a baseRT_status as uint32_t bits, when REJECTED */
    uint32_t cert_id;        /* certificate in force, 0 = none */
    uint8_t granted_class;   /* BASERT_EXACTNESS_* granted */
    uint8_t _pad0[3];
} BaseRTAdmitResult; /* 24 */

typedef struct BaseRTSpecStats {
    uint32_t proposed;
    uint32_t accepted;
    uint32_t cert_id_in_effect;
    uint32_t _pad0;
} BaseRTSpecStats; /* 16 */

typedef struct BaseRTLaneEmit {
    uint64_t lane_tag;
    BaseRTTokenRef token_ref;   /* tokens committed this tick, in the emit ring */
    uint32_t n_tokens;
    uint32_t finish;            /* BASERT_FINISH_* */
    BaseRTRingRef logits_row;   /* HOST lanes: row to sample; zero otherwise */
    BaseRTSpecStats spec;
} BaseRTLaneEmit; /* 72 */

typedef struct BaseRTLaneFault {
    uint64_t lane_tag;
    uint32_t code;     /* BASERT_FAULT_* */
    uint32_t _pad0;
    uint64_t detail;
} BaseRTLaneFault; /* 24 */

typedef struct BaseRTShedEntry {
    uint64_t lane_tag;  /* 0 for a cache eviction */
    uint32_t kind;      /* BASERT_SHED_* */
    uint32_t reason;
    uint64_t bytes;
    uint64_t tokens;
} BaseRTShedEntry; /* 32 */

typedef struct BaseRTShedReport {
    uint32_t prefill_chunks_dropped;
    uint32_t evictions_performed;
    uint64_t bytes_evicted;
    BaseRTArray entries;  /* BaseRTShedEntry */
} BaseRTShedReport; /* 32 */

typedef struct BaseRTOpComplete {
    uint64_t op;          /* baseRT_op_t */
    uint8_t state;        /* terminal BASERT_OP_* */
    uint8_t _pad0[3];
    uint32_t error;
    uint64_t bytes_moved;
} BaseRTOpComplete; /* 24 */

typedef struct BaseRTTickTimings {
    uint64_t wall_ns;
    uint64_t prefill_ns;
    uint64_t decode_ns;
    uint32_t graph_hits;
    uint32_t graph_misses;
} BaseRTTickTimings; /* 32 */

typedef struct BaseRTMemCounters {
    uint64_t allocated_bytes;
    uint64_t host_retained_bytes;
    uint64_t pool_blocks_total;
    uint64_t pool_blocks_used;
    uint64_t pool_bytes_evictable;
    uint64_t tentative_bytes;
} BaseRTMemCounters; /* 48 */

/* One emitted token's natural-log probability plus its best alternatives,
 * in emission order per lane. */
typedef struct BaseRTLaneLogprob {
    uint64_t lane_tag;
    float logprob;
    uint32_t n_top;  /* valid entries below, 0..BASERT_MAX_TOP_LOGPROBS */
    uint32_t top_ids[BASERT_MAX_TOP_LOGPROBS];
    float top_logprobs[BASERT_MAX_TOP_LOGPROBS];
} BaseRTLaneLogprob; /* 176 */

typedef struct BaseRTTickEvents {
    uint64_t struct_size;
    uint64_t plan_seq;            /* the plan's, echoed */
    uint32_t tick_status;         /* BASERT_TICK_* */
    uint32_t _pad0;
    BaseRTArray admit_results;    /* BaseRTAdmitResult */
    BaseRTArray emits;            /* BaseRTLaneEmit */
    BaseRTArray faults;           /* BaseRTLaneFault */
    BaseRTShedReport shed;
    BaseRTArray op_completions;   /* BaseRTOpComplete */
    BaseRTTickTimings timings;
    BaseRTMemCounters mem;
    BaseRTArray logprobs;         /* BaseRTLaneLogprob */
} BaseRTTickEvents; /* 216 */

/* Run one tick. Blocks until the tick's work is done. On OK *events_out
 * points at engine-owned events that stay readable until the next
 * baseRT_tick or model free on this bundle. */
baseRT_status baseRT_tick(baseRT_model_t bundle, const BaseRTTickPlan *plan,
                          const BaseRTTickEvents **events_out);

/* ======================================================================== */
/* Rings                                                                    */
/* ======================================================================== */
/*
 * Ring memory: a 64-byte header {uint64 magic = BASERT_RING_MAGIC,
 * uint32 ring_id, uint32 slot_bytes, uint32 slots, zeros}, then `slots`
 * slots of `slot_bytes` each: {uint64 generation, uint32 payload_len,
 * uint32 pad, payload}. One writer per ring publishes the payload, then the
 * generation (release order); readers check the generation before and after
 * copying. Generation 0 means "never written"; a fresh writer starts at slot
 * 0 with generation 1.
 */

typedef struct BaseRTRingDesc {
    uint64_t struct_size;
    uint32_t ring_id;
    uint32_t kind;        /* BASERT_RING_KIND_* */
    uint32_t role;        /* BASERT_RING_ROLE_* */
    uint32_t slots;
    uint32_t slot_bytes;  /* includes the 16-byte slot header */
    uint32_t _pad0;
    void *base;           /* caller's mapping, header first */
    uint64_t len;         /* at least 64 + slots * slot_bytes */
} BaseRTRingDesc; /* 48 */

/* Attach or re-attach (by ring_id) rings; all or nothing, resetting the
 * engine's writer cursors. The mappings stay the caller's and must outlive
 * their use by the bundle. */
baseRT_status baseRT_rings_attach(baseRT_model_t bundle, const BaseRTRingDesc *descs, uint32_t count);

/* ======================================================================== */
/* State spaces                                                             */
/* ======================================================================== */

typedef struct BaseRTStateSpaceDesc {
    uint32_t space_id;
    uint32_t kind;                      /* BASERT_SPACE_KIND_* */
    uint64_t version_tag;
    uint64_t bytes_per_token;           /* paged kinds */
    uint64_t blob_bytes;                /* blob kinds */
    uint32_t page_size_tokens;          /* paged kinds */
    uint32_t fork_cost_class;           /* 0 unspecified, 1 refcount, 2 copy */
    uint64_t fork_cost_bytes;
    uint32_t snapshot_cadence;          /* 0 none, 1 tool boundary, 2 interval */
    uint32_t snapshot_interval_tokens;
    uint32_t placement;
    uint32_t flags;                     /* BASERT_SPACE_FLAG_* */
    char name[32];                      /* NUL-terminated */
} BaseRTStateSpaceDesc; /* 96 */

/* The bundle's spaces as an engine-owned array of BaseRTStateSpaceDesc,
 * readable until the next call on the bundle. */
baseRT_status baseRT_state_spaces(baseRT_model_t bundle, BaseRTArray *out_descs);

/* ======================================================================== */
/* Speculation strategies and exactness certificates                        */
/* ======================================================================== */

typedef struct BaseRTArtifact {
    uint32_t role;              /* BASERT_ARTIFACT_* */
    uint32_t _pad0;
    uint8_t content_hash[32];
    uint64_t byte_size;
    const char *load_path;
} BaseRTArtifact; /* 56 */

typedef struct BaseRTTapSpec {
    uint32_t layer;
    uint32_t tensor;  /* BASERT_TAP_TENSOR_* */
    uint32_t dtype;
    uint32_t layout;
} BaseRTTapSpec; /* 16 */

typedef struct BaseRTCapabilityReq {
    uint32_t kind_id;     /* BASERT_STRATEGY_CAP_* */
    uint32_t _pad0;
    BaseRTArray params;   /* records defined by the kind */
} BaseRTCapabilityReq; /* 24 */

typedef struct BaseRTStrategyRegistration {
    uint64_t struct_size;
    const char *strategy_id;
    const char *impl_version;
    uint8_t impl_hash[32];
    uint8_t config_hash[32];
    BaseRTArray artifacts;      /* BaseRTArtifact */
    BaseRTArray taps;           /* BaseRTTapSpec */
    BaseRTArray capabilities;   /* BaseRTCapabilityReq */
    BaseRTArray target_archs;   /* const char * */
    uint32_t kernel_caps_required;
    uint32_t _pad0;
    uint64_t est_state_bytes;
    uint8_t claimed_exactness;  /* a claim; the engine decides */
    uint8_t _pad1[3];
    uint32_t rng_contract_version;
} BaseRTStrategyRegistration; /* 176 */

typedef struct BaseRTExactnessCert {
    uint32_t cert_id;            /* nonzero */
    uint8_t exactness;           /* BASERT_EXACTNESS_* */
    uint8_t sampling_modes;      /* BASERT_CERT_MODE_* bits */
    uint8_t grammar_allowed;
    uint8_t logit_bias_allowed;
    uint32_t param_domain;       /* BASERT_CERT_DOMAIN_* */
    uint32_t verification_shape_class;
    BaseRTArray admissible_host_identities;  /* uint8_t[32] each */
} BaseRTExactnessCert; /* 32 */

typedef struct BaseRTStrategyGrant {
    uint64_t struct_size;
    uint32_t strategy_slot;     /* what admits put in strategy_slot */
    uint32_t _pad0;
    BaseRTArray certificates;   /* BaseRTExactnessCert */
    BaseRTArray state_spaces;   /* BaseRTStateSpaceDesc */
    uint64_t reserved_bytes;
} BaseRTStrategyGrant; /* 56 */

/* Register a strategy. On OK *grant_out is engine-owned until the next
 * registration or model free; refusals are typed and change nothing. */
baseRT_status baseRT_strategy_register(baseRT_model_t bundle, const BaseRTStrategyRegistration *reg,
                                       const BaseRTStrategyGrant **grant_out);

/* ======================================================================== */
/* State operations                                                         */
/* ======================================================================== */

typedef uint64_t baseRT_op_t; /* unique per bundle, never reused */

typedef struct BaseRTOpStatus {
    uint64_t struct_size;
    uint8_t state;        /* BASERT_OP_* */
    uint8_t _pad0[3];
    uint32_t error;       /* when FAILED */
    uint64_t bytes_moved;
} BaseRTOpStatus; /* 24 */

baseRT_status baseRT_op_poll(baseRT_model_t bundle, baseRT_op_t op, BaseRTOpStatus *out);
/* Asks for cancellation; the op reports its terminal state later. */
baseRT_status baseRT_op_cancel(baseRT_model_t bundle, baseRT_op_t op);

typedef struct BaseRTMatchCandidate {
    uint64_t prefix_len;            /* tokens */
    uint8_t provenance_digest[32];
    uint32_t taint_bits;            /* BASERT_TAINT_* */
    uint8_t resident_tier;          /* BASERT_TIER_* */
    uint8_t _pad0[3];
} BaseRTMatchCandidate; /* 48 */

typedef struct BaseRTSpaceMatch {
    uint32_t space_id;
    uint32_t _pad0;
    BaseRTArray candidates;  /* BaseRTMatchCandidate */
} BaseRTSpaceMatch; /* 24 */

typedef struct BaseRTMatchResult {
    uint64_t struct_size;
    BaseRTArray spaces;  /* BaseRTSpaceMatch */
} BaseRTMatchResult; /* 24 */

/* What the cache could serve for `span` (metadata only, pins nothing).
 * *out is engine-owned until the next call on the bundle. */
baseRT_status baseRT_space_match(baseRT_model_t bundle, uint32_t space_id, BaseRTTokenRef span,
                                 BaseRTArray media_deps, const BaseRTMatchResult **out);

/* Pin the first prefix_len tokens of `span` in every space until one admit
 * consumes the lease, it is released, or it outlives the lease TTL. */
baseRT_status baseRT_seed_acquire(baseRT_model_t bundle, BaseRTTokenRef span, uint64_t prefix_len,
                                  uint8_t determinism_class, uint64_t *seed_handle);
baseRT_status baseRT_seed_release(baseRT_model_t bundle, uint64_t seed_handle);
/* The lease TTL in ticks: a lease taken at tick T serves ticks up to T+ticks. */
baseRT_status baseRT_seed_lease_ticks(baseRT_model_t bundle, uint64_t *ticks);

/* Logical copy of a sequence (refcounted pages, copy-on-write blobs; eager
 * with BASERT_FORK_EAGER). */
baseRT_status baseRT_seq_fork(baseRT_sequence_t parent, baseRT_sequence_t *child, uint32_t flags);

/* Bytes an export of `range` needs (136-byte envelope included) and the
 * content generation that the later submission must quote. */
baseRT_status baseRT_space_export_size(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range,
                                       uint8_t encoding, uint64_t *required_bytes, uint64_t *sizing_gen);

/* Header the engine writes in front of every exported payload and checks
 * on restore / promote. */
typedef struct BaseRTStateEnvelope {
    uint64_t magic;                 /* BASERT_STATE_ENVELOPE_MAGIC */
    uint32_t envelope_version;
    uint32_t space_kind;            /* BASERT_SPACE_KIND_* */
    uint8_t compat_identity[32];
    uint64_t version_tag;
    uint8_t provenance_digest[32];
    uint32_t taint_bits;            /* travels with the digest */
    uint32_t _pad0;
    BaseRTTokenRange range;
    uint8_t encoding;               /* BASERT_ENCODING_* */
    uint8_t _pad1[3];
    uint32_t checksum_kind;         /* BASERT_CHECKSUM_* */
    uint64_t payload_len;           /* bytes after the envelope */
    uint64_t content_checksum;
} BaseRTStateEnvelope; /* 136 */

/* Asynchronous export / import. The buffer is lent to the engine until the
 * op is terminal. */
baseRT_status baseRT_space_snapshot(baseRT_sequence_t seq, uint32_t space_id, uint64_t boundary_pos,
                                    BaseRTBuf dst, uint64_t sizing_gen, baseRT_op_t *op);
baseRT_status baseRT_space_restore(baseRT_sequence_t seq, uint32_t space_id, BaseRTBuf src, baseRT_op_t *op);

/* Newest durable snapshot position <= cap (0 if none). */
baseRT_status baseRT_space_snapshot_boundary(baseRT_sequence_t seq, uint32_t space_id, uint64_t cap,
                                             uint64_t *boundary_out);

/* Shorten a space to new_len tokens (blob/ring spaces: boundaries only). */
baseRT_status baseRT_space_trim(baseRT_sequence_t seq, uint32_t space_id, uint64_t new_len);

/* Asynchronous move of a range to host memory and back. */
baseRT_status baseRT_space_demote(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range,
                                  uint8_t encoding, BaseRTBuf dst, uint64_t sizing_gen, baseRT_op_t *op);
baseRT_status baseRT_space_promote(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range,
                                   BaseRTBuf src, baseRT_op_t *op);

/* Free up to bytes_target cache bytes within `policy`; pinned entries stay. */
baseRT_status baseRT_cache_evict(baseRT_model_t bundle, const BaseRTShedPolicy *policy,
                                 uint64_t bytes_target, uint64_t *bytes_freed);

typedef struct BaseRTCacheKey {
    uint8_t compat_key[32];
    uint8_t provenance_digest[32];
} BaseRTCacheKey; /* 64 */

/* Drop the named cache variants (BaseRTCacheKey records). */
baseRT_status baseRT_cache_evict_entries(baseRT_model_t bundle, BaseRTArray entry_keys);

/* ======================================================================== */
/* Sequences, grammars, logit biases                                        */
/* ======================================================================== */

/* The sequence a live lane owns, or NULL. */
baseRT_sequence_t baseRT_tick_lane_sequence(baseRT_model_t bundle, uint64_t lane_tag);
/* A new empty sequence owned by the caller (a restore target). */
baseRT_sequence_t baseRT_tick_sequence_create(baseRT_model_t bundle);
/* Free a caller-owned sequence; anything else is BASERT_ERR_UNKNOWN_HANDLE. */
baseRT_status baseRT_tick_sequence_free(baseRT_model_t bundle, baseRT_sequence_t seq);
/* Publish a caller-owned sequence's whole blocks to the prefix cache under
 * `tokens`; consumes the sequence on OK, leaves it alone on error. */
baseRT_status baseRT_tick_sequence_publish(baseRT_model_t bundle, baseRT_sequence_t seq,
                                           const uint32_t *tokens, uint32_t n_tokens);

/* Grammar from a JSON schema, or from a structural tag; 0 on failure. */
uint32_t baseRT_tick_grammar_create(baseRT_model_t bundle, const char *json_schema);
uint32_t baseRT_tick_grammar_create_structural(baseRT_model_t bundle, const char *tag_json);
baseRT_status baseRT_tick_grammar_free(baseRT_model_t bundle, uint32_t handle);

/* Add values[i] to the logit of tokens[i]; 0 when n <= 0 or an array is NULL. */
uint32_t baseRT_tick_logit_bias_create(baseRT_model_t bundle, const int32_t *tokens, const float *values,
                                       int n);
baseRT_status baseRT_tick_logit_bias_free(baseRT_model_t bundle, uint32_t handle);

/* Lease a whole caller-owned sequence (every space) as the seed of the next
 * admit; `span` names the tokens it holds. */
baseRT_status baseRT_seed_adopt(baseRT_model_t bundle, baseRT_sequence_t seq, BaseRTTokenRef span,
                                uint64_t *seed_handle);

/* ======================================================================== */
/* Media                                                                    */
/* ======================================================================== */

typedef struct BaseRTMediaInfo {
    uint32_t n_tokens;        /* placeholder tokens the image becomes */
    uint32_t image_token_id;
    uint32_t boi_token_id;    /* 0 = none */
    uint32_t eoi_token_id;    /* 0 = none */
    uint64_t preprocess_fp;
} BaseRTMediaInfo; /* 24 */

baseRT_status baseRT_media_probe(baseRT_model_t bundle, const char *image_path, BaseRTMediaInfo *out);
baseRT_status baseRT_media_encode(baseRT_model_t bundle, const char *image_path, uint64_t *media_handle,
                                  BaseRTMediaInfo *out);
baseRT_status baseRT_media_release(baseRT_model_t bundle, uint64_t media_handle);
/* Attach encoded media to a lane at the prompt offset of its placeholders. */
baseRT_status baseRT_media_bind(baseRT_model_t bundle, uint64_t lane_tag, uint64_t media_handle,
                                uint32_t token_offset);

/* ======================================================================== */
/* Compile-time layout checks (RULES.md section A)                          */
/* ======================================================================== */

#ifndef BASERT_TICK_NO_LAYOUT_ASSERTS
#ifdef __cplusplus
#define BASERT_LAYOUT_ASSERT(cond, what) static_assert(cond, what)
#else
#define BASERT_LAYOUT_ASSERT(cond, what) _Static_assert(cond, what)
#endif
BASERT_LAYOUT_ASSERT(sizeof(BaseRTArray) == 16, "BaseRTArray");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTArray, count) == 8, "BaseRTArray.count");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTArray, elem_size) == 12, "BaseRTArray.elem_size");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTTokenRef) == 24, "BaseRTTokenRef");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTTokenRef, generation) == 16, "BaseRTTokenRef.generation");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTRingRef) == 16, "BaseRTRingRef");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTBuf) == 16, "BaseRTBuf");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTTokenRange) == 16, "BaseRTTokenRange");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTSamplingParams) == 32, "BaseRTSamplingParams");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTSamplingParams, flags) == 28, "BaseRTSamplingParams.flags");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTShedPolicy) == 40, "BaseRTShedPolicy");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTLaneAdmit) == 144, "BaseRTLaneAdmit");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTLaneAdmit, host_sampler_identity) == 104, "host_sampler_identity");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTLaneAdmit, grammar_replay) == 136, "grammar_replay");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTLaneAdmit, decode_replay) == 140, "decode_replay");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTLaneCommit) == 24, "BaseRTLaneCommit");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTLanePrefill) == 16, "BaseRTLanePrefill");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTLaneDecode) == 16, "BaseRTLaneDecode");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTLaneDecode, overshoot) == 10, "BaseRTLaneDecode.overshoot");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTLaneRetire) == 16, "BaseRTLaneRetire");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTTickPlan) == 168, "BaseRTTickPlan");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTTickPlan, on_partial_emit) == 152, "on_partial_emit");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTTickPlan, partial_emit_user) == 160, "partial_emit_user");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTAdmitResult) == 24, "BaseRTAdmitResult");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTSpecStats) == 16, "BaseRTSpecStats");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTLaneEmit) == 72, "BaseRTLaneEmit");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTLaneEmit, logits_row) == 40, "BaseRTLaneEmit.logits_row");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTLaneEmit, spec) == 56, "BaseRTLaneEmit.spec");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTLaneFault) == 24, "BaseRTLaneFault");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTShedEntry) == 32, "BaseRTShedEntry");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTShedReport) == 32, "BaseRTShedReport");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTOpComplete) == 24, "BaseRTOpComplete");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTTickTimings) == 32, "BaseRTTickTimings");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTMemCounters) == 48, "BaseRTMemCounters");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTLaneLogprob) == 176, "BaseRTLaneLogprob");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTTickEvents) == 216, "BaseRTTickEvents");
BASERT_LAYOUT_ASSERT(offsetof(BaseRTTickEvents, logprobs) == 200, "BaseRTTickEvents.logprobs");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTRingDesc) == 48, "BaseRTRingDesc");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTStateSpaceDesc) == 96, "BaseRTStateSpaceDesc");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTArtifact) == 56, "BaseRTArtifact");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTTapSpec) == 16, "BaseRTTapSpec");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTCapabilityReq) == 24, "BaseRTCapabilityReq");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTStrategyRegistration) == 176, "BaseRTStrategyRegistration");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTExactnessCert) == 32, "BaseRTExactnessCert");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTStrategyGrant) == 56, "BaseRTStrategyGrant");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTOpStatus) == 24, "BaseRTOpStatus");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTMatchCandidate) == 48, "BaseRTMatchCandidate");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTSpaceMatch) == 24, "BaseRTSpaceMatch");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTMatchResult) == 24, "BaseRTMatchResult");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTStateEnvelope) == 136, "BaseRTStateEnvelope");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTCacheKey) == 64, "BaseRTCacheKey");
BASERT_LAYOUT_ASSERT(sizeof(BaseRTMediaInfo) == 24, "BaseRTMediaInfo");
#undef BASERT_LAYOUT_ASSERT
#endif /* BASERT_TICK_NO_LAYOUT_ASSERTS */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* BASERT_TICK_H */
