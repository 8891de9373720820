/*
 * basert_ref.h: the test surface of basertd's C reference engine (baseRT_ref_*).
 *
 * The reference engine (native/ref_engine/, built into basertd/native/libbasert_ref.so) exports
 * every function of basert_tick.h plus the few functions below, which create and free a bundle
 * from a config and let tests steer it (force a finish, inject a lane fault, refuse admits,
 * read counters). Everything else goes through the tick ABI exactly as with a real libbaseRT.
 * This file is fed to cffi by the same mechanical pass as basert_tick.h (native/_cdef.py), so it
 * keeps to plain declarations; it declares nothing of the tick ABI itself.
 *
 * ------------------------------------------------------------------------------------------
 * What the reference engine does (the behaviour ../shared/abi/RULES.md states; rule numbers in
 * brackets). Units: tokens unless a name ends in _bytes; ticks count accepted baseRT_tick calls.
 *
 * Plans. A plan is validated completely before anything changes; a refused plan returns its
 * code and leaves lanes, pool, cache, leases, rings and the plan_seq watermark untouched
 * [rules 17-52]. Check order: struct_size [25]; the six arrays in field order (admits, commits,
 * prefills, decodes, retires, shed_policy.victim_lanes), each by alignment [20, 22], stride
 * [17, 24, 26] and size (a region over 64 MiB or wrapping the address space is BOUNDS) [23];
 * budgets [30, 31]; plan_seq [32]; DRAIN [33]; duplicates [27]; cross-array combinations
 * [28, 29]; then each admit, commit, prefill, decode and retire; the pool last [50-52].
 * Execution order within a tick: retires, armed test faults/finishes, cache evictions,
 * commits, admits, prefills, decodes [53].
 *
 * Engine-specific choices where the ABI leaves room:
 *  - prefill_token_budget is literal: 0 prefills nothing (every prefill record is shed).
 *  - An admit's prompt must be 1..context_length tokens of ids < vocab_size (else BOUNDS),
 *    read from an attached ENGINE_READS TOKENS ring (an unattached ring or stale span is
 *    BAD_REF_GENERATION) [35]; want_logprobs above 1 + 20 is BOUNDS; decode_replay >= prompt
 *    length is BOUNDS [71]; more live lanes than max_lanes after the plan is BUDGET.
 *  - Emitted tokens go to the ENGINE_WRITES TOKENS ring with the lowest ring_id; a plan whose
 *    decodes could emit more slots than that ring has (or that has GPU decodes and no such
 *    ring) is BOUNDS. HOST logits rows go to the ENGINE_WRITES LOGITS ring with the lowest
 *    ring_id, one slot per row of vocab_size floats; a HOST admit without such a ring, or with
 *    slots too small for a row, is HOST_RULES.
 *  - A decode grant of 0 tokens, a decode/prefill on a finished lane, and a prefill whose
 *    token_offset is not the lane's prefilled count are ILLEGAL_COMBINATION [45, 47, 48].
 *  - victim_lanes are validated but never shed: the engine sheds only prefill tokens over the
 *    budget and cache entries.
 *  - Every published cache entry has cache class 0 (bit 0 of evictable_cache_classes).
 *    In-tick evictions take unpinned entries of allowed classes, least recently used first,
 *    never exceeding min(max_evict_bytes, cache bytes - protected_quota_bytes) [50, 51, 58].
 *    Pool feasibility assumes every decode grant is used in full.
 *  - Shed entry reasons: 1 = prefill over the tick's budget, 2 = cache eviction for room.
 *
 * Sequences and the pool. Every lane owns a sequence (baseRT_tick_lane_sequence); bare
 * sequences are created, forked, published, adopted and freed through the ABI. A sequence
 * holds the tokens whose KV is resident and a table of pool blocks: one block holds
 * page_size_tokens tokens (block bytes = page_size_tokens * bytes_per_token of the bundle's
 * one paged space). Blocks are reference counted: cache entries, forks and seeded lanes share
 * them; appending into a shared partial block copies it first.
 *
 * Synthetic model. The next token of a lane is a hash of every token of its sequence (prompt,
 * replayed and generated), mixed with the lane's RNG counter for GPU_GUMBEL lanes with
 * temperature > 0, mod vocab_size. With eos_period = p > 0 the token is eos_token when the
 * hash says so (about one in p); otherwise it is never eos_token. scripted_tokens, when given,
 * replace the hash: the request's j-th generated token (j counts the admit's decode_replay
 * tokens too, so a resumed lane continues the script) is scripted_tokens[j] while j is in
 * range. The same plans therefore give the same tokens on every instance [63].
 *
 * RNG counter. The lane's i-th generated token (drawn by a decode or committed by the host;
 * i from 0, prompt and replay tokens not counted) uses counter rng_counter_base + i, and each
 * committed token advances the counter by one [67]. A lane resumed after k generated tokens is
 * admitted with the k tokens at the end of its prompt, decode_replay = k and rng_counter_base
 * = original base + k; it then generates exactly what the uninterrupted lane generated after
 * its k-th token [72, 73].
 *
 * Replay. Prefills must end at or before prompt_len - decode_replay [46]; decode grant units
 * then feed the replay tokens one per unit with no emitted token (n_tokens 0 while inside the
 * tail), and further units generate [72].
 *
 * Seeds. A cache seed (baseRT_seed_acquire) pins, in every space, an entry that can serve the
 * prefix; a lease acquired when `ticks` ticks have run (tick index T = ticks) is valid for
 * every tick whose index is <= T + seed_lease_ticks, after which its pins are dropped [83].
 * A seeded admit consumes the lease [81] and starts with the seed's tokens already prefilled,
 * so its first prefill has token_offset = the seed length [45]; it inherits the entries'
 * taint bits [85]. An adopted sequence (baseRT_seed_adopt) is taken over whole by its admit.
 *
 * HOST lanes. A HOST decode (max_new_tokens exactly 1) writes one logits row (argmax = the
 * token a greedy lane would draw) and emits n_tokens 0 with logits_row = the row's ring ref,
 * whose generation is the nonce [65]; the host answers with a commit quoting that nonce [41],
 * which appends the token (not re-emitted) and advances the counter [66, 67].
 *
 * State ops (ops.c, envelope.c) [rules 92-113]. Every refusal is synchronous (no handle, no byte
 * written); an accepted snapshot / demote / restore / promote is RUNNING until the next accepted
 * tick completes it and reports it in op_completions [69]; op_cancel ends a RUNNING op at once.
 * A (sequence, space) with an op in flight or a demoted range counts in the sequence's claims:
 * plans on its lane are TRANSFER_LOCKED [49], fork / trim / free / publish / adopt EBUSY [98].
 * Exports are 136-byte BRTSTATE envelopes + payloads that are a deterministic function of the
 * tokens (a paged record per token carrying its id, a blob of the history hash), so a restore into
 * a fresh sequence rebuilds the exact state and an adopted, admitted restore continues with the
 * original's tokens. FNV-1a-64 by default, XXH3-64 via baseRT_ref_set_export_checksum (libxxhash
 * dlopen'ed); checksum kind 0 / unknown is CHECKSUM [103]. Paged demote frees whole blocks of the
 * range when it completes [108]; lossy demote taints on promote [107]. Restore and trim change
 * caller-owned sequences only (a lane-owned one is UNKNOWN_HANDLE).
 *
 * Strategies (strategy.c) [rules 114-122] register fail-closed; certificates exist only for
 * combinations certified with baseRT_ref_certify; slot 0 decodes the model's own path
 * (SEED_PATH_INVARIANT). Media (media.c): OP_UNSUPPORTED until baseRT_ref_media_tower.
 *
 * Events are engine-owned and double-buffered: those of one tick stay readable until the
 * next accepted tick after it or baseRT_ref_free [70]. Logprob records are written for GPU
 * lanes admitted with want_logprobs (1 + n_top); HOST lanes get none (the host has the row).
 * The partial-emit callback gets each freshly drawn token of GPU lanes, one call per token, on
 * the ticking thread [64]. tick_delay_us sleeps (never spins) once per accepted tick (the decode
 * step); prefill_step_us sleeps once per prefill step of prefill_step_tokens tokens.
 *
 * Yield inside a tick (basertd.shm.control): with a yield word attached (baseRT_ref_set_yield_word),
 * the engine reads it before every prefill step but the tick's first; when it is nonzero the tick's
 * remaining prefill is not run and is reported exactly as a budget-shed chunk (one PREFILL_CHUNK
 * shed entry per cut lane, tokens = planned - done) [56, 57]; lanes whose prefill was cut do not
 * decode this tick; every other decode runs.
 *
 * Threading: one bundle is driven from one thread at a time; every entry point takes the
 * bundle's lock, and a call re-entering the engine from the partial-emit callback returns
 * BASERT_EBUSY (or 0/NULL for calls that return handles).
 * ------------------------------------------------------------------------------------------
 */

#ifndef BASERT_REF_H
#define BASERT_REF_H

#include <stdint.h>

#include "basert_tick.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One state space of a reference bundle (becomes a BaseRTStateSpaceDesc). At most one space
 * may be paged (PAGED_TOKEN_KV or DEPTH_PAGED_KV); its page size and bytes per token must be 0
 * (take the bundle's) or equal the bundle's. Blob kinds (RECURRENT_BLOB, RING_KV) record a
 * snapshot boundary every snapshot_interval_tokens tokens (cadence 2) or at the published
 * length (cadence 1, tool boundary); cadence 0 records none, so such a space cannot serve seeds. */
typedef struct BaseRTRefSpace {
    uint32_t space_id;
    uint32_t kind;                     /* BASERT_SPACE_KIND_* */
    uint32_t flags;                    /* BASERT_SPACE_FLAG_* */
    uint32_t page_size_tokens;         /* paged: 0 = the bundle's */
    uint64_t bytes_per_token;          /* paged: 0 = the bundle's */
    uint64_t blob_bytes;               /* blob kinds: bytes of one state snapshot */
    uint64_t version_tag;
    uint32_t snapshot_cadence;         /* 0 none, 1 tool boundary, 2 interval */
    uint32_t snapshot_interval_tokens; /* cadence 2 */
    char name[32];                     /* NUL-terminated */
} BaseRTRefSpace; /* 80 */

/* Configuration of a reference bundle. Fill with baseRT_ref_config_init, then change fields. */
typedef struct BaseRTRefConfig {
    uint64_t struct_size;             /* sizeof(BaseRTRefConfig) */
    uint32_t vocab_size;              /* token ids 0..vocab_size-1; >= 2 */
    uint32_t max_lanes;               /* live lanes at most */
    uint32_t max_batch_size;          /* a plan's max_decode_lanes at most (rule 31) */
    uint32_t page_size_tokens;        /* tokens per pool block; >= 1 */
    uint64_t bytes_per_token;         /* KV bytes per token of the paged space; >= 1 */
    uint64_t pool_bytes;              /* pool capacity; blocks = pool_bytes / block bytes */
    uint32_t context_length;          /* tokens one lane may hold (prompt + generated) */
    uint32_t eos_token;               /* < vocab_size */
    uint32_t eos_period;              /* EOS about once per eos_period tokens; 0 = never */
    uint32_t tick_delay_us;           /* real sleep per accepted tick, microseconds */
    uint64_t seed_lease_ticks;        /* seed lease TTL in ticks (rule 84; default 8) */
    const uint32_t *scripted_tokens;  /* NULL or n_scripted_tokens ids < vocab_size; copied */
    uint32_t n_scripted_tokens;
    uint32_t n_spaces;                /* 0 = one PAGED_TOKEN_KV space, id 0, named "kv" */
    const BaseRTRefSpace *spaces;     /* copied */
    uint8_t identity[32];             /* model identity; all zero = derived from the config */
    uint64_t kernel_caps;             /* device capability bits offered to strategies */
    uint32_t n_layers;                /* model layers (for strategy taps) */
    uint32_t _pad0;
    const char *arch;                 /* NULL = "ref-arch"; copied */
    uint32_t prefill_step_tokens;     /* prefill runs in steps of at most this many tokens; 0 = one
                                       * step per tick */
    uint32_t prefill_step_us;         /* real sleep per prefill step, microseconds (a prefill rate) */
} BaseRTRefConfig; /* 160 */

/* Counters and gauges of a bundle (baseRT_ref_stats). Bytes are pool bytes unless named. */
typedef struct BaseRTRefStats {
    uint64_t struct_size;
    uint64_t ticks;                 /* accepted ticks */
    uint64_t last_plan_seq;         /* plan_seq of the last accepted tick (0 before any) */
    uint64_t prefill_tokens_total;  /* tokens prefilled (seeded and replayed tokens excluded) */
    uint64_t decode_tokens_total;   /* tokens generated: GPU draws and HOST commits */
    uint64_t replay_tokens_total;   /* decode_replay tokens fed by decode units */
    uint64_t live_lanes;            /* lanes known to the engine (live, finished or faulted) */
    uint64_t live_seed_leases;      /* unexpired, unconsumed leases */
    uint64_t cache_entries;
    uint64_t cache_bytes;           /* bytes of every cache entry (shared blocks counted per entry) */
    uint64_t pool_bytes_used;
    uint64_t pool_bytes_total;      /* blocks * block bytes */
    uint64_t pool_blocks_used;
    uint64_t pool_blocks_total;
    uint64_t evictions_total;       /* cache entries evicted, in ticks and by cache_evict */
    uint64_t faults_total;
    uint64_t bare_sequences;        /* sequences no lane owns */
    uint64_t rejected_plans;        /* refused ticks: the only counter a refused plan moves */
} BaseRTRefStats; /* 144 */

enum { /* BaseRTRefLaneInfo.state */
    BASERT_REF_LANE_LIVE = 0,
    BASERT_REF_LANE_FINISHED = 1,
    BASERT_REF_LANE_FAULTED = 2
};

/* One lane as the engine sees it (baseRT_ref_lane_info). */
typedef struct BaseRTRefLaneInfo {
    uint64_t struct_size;
    uint32_t state;          /* BASERT_REF_LANE_* */
    uint32_t finish;         /* BASERT_FINISH_* once finished */
    uint32_t sampling;
    uint32_t prompt_len;     /* tokens */
    uint32_t prefill_end;    /* prompt_len - decode_replay */
    uint32_t prefilled;      /* prompt tokens resident (seeded, prefilled or replayed) */
    uint64_t committed;      /* tokens resident in the lane's sequence */
    uint64_t generated;      /* tokens drawn or committed by this lane */
    uint64_t rng_counter;    /* counter of the next generated token */
    uint64_t row_nonce;      /* pending HOST row's generation, 0 = none pending */
    uint32_t taint_bits;
    uint32_t blocks;         /* pool blocks the lane's sequence references */
} BaseRTRefLaneInfo; /* 72 */

enum { /* baseRT_ref_refuse_admits predicate kinds */
    BASERT_REF_REFUSE_NONE = 0,          /* refuse nothing (the default) */
    BASERT_REF_REFUSE_TAG_MASK = 1,      /* lane_tag & param != 0 */
    BASERT_REF_REFUSE_TAG_EQUALS = 2,    /* lane_tag == param */
    BASERT_REF_REFUSE_ALL = 3,           /* every admit */
    BASERT_REF_REFUSE_PROMPT_OVER = 4    /* prompt longer than param tokens */
};

/* Fills *cfg with working defaults: vocab 512, 16 lanes, batch 16, 16-token pages of 64 bytes
 * per token, a 1 MiB pool, context 1024, EOS 2 never drawn (eos_period 0), no delay, lease
 * TTL 8, one paged space. */
void baseRT_ref_config_init(BaseRTRefConfig *cfg);

/* Creates a bundle from *cfg (copied). Returns OK and *out, or BAD_STRUCT (NULL cfg/out or
 * struct_size too small), BOUNDS (a value out of range: vocab < 2, eos >= vocab, a zero size,
 * a scripted token >= vocab, two paged spaces, duplicate space ids, an unknown space kind) or
 * BASERT_ERR_FATAL (out of memory). */
baseRT_status baseRT_ref_create_checked(const BaseRTRefConfig *cfg, baseRT_model_t *out);

/* As baseRT_ref_create_checked, NULL on any refusal. */
baseRT_model_t baseRT_ref_create(const BaseRTRefConfig *cfg);

/* Attaches the control segment's yield word: words[0] is read (relaxed atomic 64-bit loads) before
 * each prefill step but a tick's first; words[1] is incremented by the engine for every tick it
 * ends early. NULL detaches. The words must stay mapped until detached or baseRT_ref_free.
 * BAD_STRUCT for a pointer not 8-byte aligned; FATAL for a dead bundle; EBUSY on re-entry. */
baseRT_status baseRT_ref_set_yield_word(baseRT_model_t bundle, uint64_t *words);

/* Frees the bundle and everything it holds (lanes, sequences, cache, leases, events). NULL is
 * ignored. Handles of the bundle are invalid afterwards. */
void baseRT_ref_free(baseRT_model_t bundle);

/* The lane's next tick ends it with `finish` (BASERT_FINISH_EOS..ERROR): its emit carries the
 * finish and no further tokens. UNKNOWN_LANE unless the lane is live and unfinished; BOUNDS for
 * finish 0 or above ERROR. */
baseRT_status baseRT_ref_force_finish(baseRT_model_t bundle, uint64_t lane_tag, uint32_t finish);

/* The lane faults with `code` (BASERT_FAULT_*) in its next tick: a fault record, pool bytes
 * released, later records on it UNKNOWN_LANE except one retire (rules 60-62). UNKNOWN_LANE unless
 * the lane is live and unfaulted; BOUNDS for a code above BASERT_FAULT_MEDIA. */
baseRT_status baseRT_ref_inject_fault(baseRT_model_t bundle, uint64_t lane_tag, uint32_t code);

/* From now on, admits matching the predicate (kind BASERT_REF_REFUSE_*, param) are REJECTED in
 * admit_results with reject_code = status (two's complement bits) and create no lane; the plan
 * itself is accepted. BOUNDS for an unknown kind or status 0 with a kind other than NONE. */
baseRT_status baseRT_ref_refuse_admits(baseRT_model_t bundle, uint32_t kind, uint64_t param,
                                       int32_t status);

/* Copies the bundle's counters into *out (out->struct_size must be >= sizeof). */
baseRT_status baseRT_ref_stats(baseRT_model_t bundle, BaseRTRefStats *out);

/* Copies one lane's state into *out; UNKNOWN_LANE for a tag the engine does not hold. */
baseRT_status baseRT_ref_lane_info(baseRT_model_t bundle, uint64_t lane_tag, BaseRTRefLaneInfo *out);

/* ---- state ops (ops.c) and strategies (strategy.c) ---- */

/* One (sequence, space) as the engine sees it (baseRT_ref_space_info). Tokens unless named. */
typedef struct BaseRTRefSpaceInfo {
    uint64_t struct_size;
    uint64_t valid_len;      /* tokens of state the space holds */
    uint64_t content_gen;    /* the sizing generation export_size reports (rule 96) */
    uint64_t seq_len;        /* tokens the sequence holds (its longest space) */
    uint32_t taint_bits;     /* BASERT_TAINT_* */
    uint32_t n_boundaries;   /* recorded snapshot boundaries (blob kinds) */
    uint32_t n_demoted;      /* ranges demoted and not yet promoted */
    uint32_t claimed;        /* 1 while a state op holds the pair (rule 98) */
    uint32_t ops_in_flight;  /* the sequence's claims + spaces with demoted ranges (rule 49) */
    uint32_t tokens_known;   /* 0 after a blob-only restore, until seed_adopt names them */
    uint32_t blocks;         /* pool blocks the sequence holds */
    uint32_t lane_owned;
    uint32_t leased;         /* held by a seed_adopt lease */
    uint32_t _pad0;
} BaseRTRefSpaceInfo; /* 72 */

/* Copies one space of a sequence into *out (out->struct_size must be >= sizeof).
 * UNKNOWN_HANDLE for an unknown sequence or space id; BAD_STRUCT for a NULL or short out. */
baseRT_status baseRT_ref_space_info(baseRT_sequence_t seq, uint32_t space_id, BaseRTRefSpaceInfo *out);

/* The checksum kind later exports carry: BASERT_CHECKSUM_FNV1A64 (the default) or
 * BASERT_CHECKSUM_XXH3_64 (libxxhash.so.0 loaded at first use, or the library named by
 * $BASERT_REF_XXHASH_LIB). BOUNDS for any other kind; OP_UNSUPPORTED when XXH3 cannot be loaded.
 * Restore and promote verify both kinds whatever is set here (rule 103). */
baseRT_status baseRT_ref_set_export_checksum(baseRT_model_t bundle, uint32_t checksum_kind);

/* Certifies the combination (strategy_id, impl_hash[32], config_hash[32]) with `certs`
 * (BaseRTExactnessCert records; cert_id ignored, admissible_host_identities copied): a later
 * registration of exactly that combination is granted copies of them with fresh cert_ids; the same
 * strategy_id with any other hash gets none (rule 117). Calling again for a strategy_id replaces
 * its combination; an empty array removes it; strategies already registered keep their grant.
 * BAD_STRUCT for a NULL or empty strategy_id or a NULL hash; the section-C array codes for a
 * malformed array; BOUNDS for an exactness, sampling_modes, param_domain or flag out of range. */
baseRT_status baseRT_ref_certify(baseRT_model_t bundle, const char *strategy_id, const uint8_t *impl_hash,
                                 const uint8_t *config_hash, BaseRTArray certs);

/* Gives the bundle a synthetic vision tower (media.c): from now on baseRT_media_probe / encode
 * answer that every image (keyed by its path, never opened) expands to tokens_per_image
 * placeholders of image_token_id, wrapped by boi_token_id / eoi_token_id (0 = none). Without it
 * probe and encode are OP_UNSUPPORTED. BOUNDS for tokens_per_image 0 or a token id >= vocab_size. */
baseRT_status baseRT_ref_media_tower(baseRT_model_t bundle, uint32_t image_token_id, uint32_t tokens_per_image,
                                     uint32_t boi_token_id, uint32_t eoi_token_id);

#ifdef __cplusplus
}
#endif

#endif /* BASERT_REF_H */
