/*
 * ref_internal.h: the reference engine's internal objects and the functions its files share.
 *
 * Files (one concept each):
 *   util.c      growable arrays, the u64 -> pointer map, digests (FNV-1a-64, 256-bit digest)
 *   bundle.c    config, create/free, locking, rings_attach, state_spaces, the baseRT_ref_* surface
 *   pool.c      pool blocks: allocation, reference counts, the feasibility simulation
 *   sequence.c  sequences: tokens, blocks, per-space state; lane_sequence, create/free/fork,
 *               publish, seed_adopt
 *   cache.c     prefix cache entries, publish, space_match, seed leases, cache_evict[_entries]
 *   model.c     the synthetic model: next token, logits rows, logprobs
 *   validate.c  plan decoding (RULES.md section C) and validation (section D) into a ref_work
 *   tick.c      baseRT_tick: executing a validated plan, events (section E)
 *   grammar.c   grammar and logit-bias handle registries
 *   ops.c       state ops (section H): export/snapshot/restore/trim/demote/promote/poll/cancel
 *   strategy.c  strategy registration and admission certificates (section I)
 *   media.c     media probe/encode/bind
 *
 * Locking: every exported function locks the bundle (ref_lock / ref_seq_lock) and unlocks it
 * before returning; internal functions assume the lock is held.
 *
 * Extension points for state ops (ops.c): ref_seq.ops_in_flight > 0 makes the sequence busy
 * (plans touching its lane are TRANSFER_LOCKED, rule 49; fork/free/publish/adopt EBUSY);
 * ref_space_state.content_gen is the sizing generation (rule 96) and is bumped by every tick
 * that changes the sequence; ref_space_state.ext and ref_bundle.ops are free for ops.c;
 * ref_ops_pump / ref_ops_drain are called by every accepted tick (rule 69).
 */

#ifndef REF_INTERNAL_H
#define REF_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "basert_ref.h"
#include "basert_tick.h"
#include "brt_ring.h"

#define REF_MAGIC 0x42525452454642ull        /* "BRTREFB" */
#define REF_MAX_RINGS 8u
#define REF_MAX_ARRAY_BYTES (64ull << 20)    /* readable region of one plan array (rule 23) */
#define REF_CACHE_CLASS_DEFAULT 1ull         /* class 0: every published entry */
#define REF_SHED_REASON_BUDGET 1u
#define REF_SHED_REASON_EVICTION 2u
#define REF_NO_BLOCK 0xFFFFFFFFu

typedef struct ref_bundle ref_bundle;
typedef struct ref_seq ref_seq;
typedef struct ref_lane ref_lane;
typedef struct ref_entry ref_entry;
typedef struct ref_lease ref_lease;
typedef struct ref_work ref_work;

/* ---------------------------------------------------------------------------------------- */
/* util.c                                                                                   */
/* ---------------------------------------------------------------------------------------- */

/* Grows *ptr (an array of elem-byte items with capacity *cap) to hold `need` items. 0 or -1. */
int ref_reserve(void **ptr, uint32_t *cap, uint64_t need, size_t elem);

/* Open-addressing map from u64 keys (any value, 0 included) to non-NULL pointers. */
typedef struct ref_map {
    uint64_t *keys;
    void **vals;  /* NULL = empty slot */
    uint32_t cap; /* power of two, or 0 */
    uint32_t len;
} ref_map;
void *ref_map_get(const ref_map *m, uint64_t key);
int ref_map_put(ref_map *m, uint64_t key, void *val); /* 0, or -1 out of memory */
void ref_map_del(ref_map *m, uint64_t key);
void ref_map_clear(ref_map *m);                       /* drops entries, keeps capacity */
void ref_map_free(ref_map *m);

uint64_t ref_mix64(uint64_t x);                                   /* splitmix64 finalizer */
uint64_t ref_fnv1a64(const void *data, size_t len);               /* FNV-1a-64 (checksum kind 2) */
uint64_t ref_token_step(uint64_t h, uint32_t token);              /* rolling history hash */
/* 256-bit digest of a byte string built from four FNV-1a-64 lanes (not cryptographic). */
typedef struct ref_digest {
    uint64_t s[4];
} ref_digest;
void ref_digest_init(ref_digest *d, uint64_t domain);
void ref_digest_update(ref_digest *d, const void *data, size_t len);
void ref_digest_u64(ref_digest *d, uint64_t v);
void ref_digest_final(const ref_digest *d, uint8_t out[32]);
uint64_t ref_now_ns(void); /* CLOCK_MONOTONIC */

/* ---------------------------------------------------------------------------------------- */
/* Pool (pool.c)                                                                            */
/* ---------------------------------------------------------------------------------------- */

/* Blocks of block_tokens tokens each; a block id indexes rc[]. rc 0 = free. The simulation
 * overlays rc with a stamped scratch copy so a plan can be tried without changing anything. */
typedef struct ref_pool {
    uint32_t block_tokens;  /* = page_size_tokens */
    uint64_t block_bytes;   /* block_tokens * bytes_per_token of the paged space; 0 = no paged space */
    uint32_t n_blocks;
    uint32_t used;          /* blocks with rc > 0 */
    uint32_t *rc;
    uint32_t *free_ids;     /* stack of free block ids */
    uint32_t n_free;
    /* simulation */
    uint32_t *sim_rc;
    uint32_t *sim_stamp;
    uint32_t stamp;
    int64_t sim_free;
} ref_pool;

int ref_pool_init(ref_pool *p, uint32_t block_tokens, uint64_t block_bytes, uint64_t pool_bytes);
void ref_pool_destroy(ref_pool *p);
uint32_t ref_pool_alloc(ref_pool *p); /* REF_NO_BLOCK when full */
void ref_pool_ref(ref_pool *p, uint32_t block);
void ref_pool_unref(ref_pool *p, uint32_t block);
/* Blocks needed to hold n tokens. */
uint32_t ref_pool_blocks_for(const ref_pool *p, uint64_t n_tokens);

void ref_sim_begin(ref_pool *p);
uint32_t ref_sim_rc(const ref_pool *p, uint32_t block);
void ref_sim_ref(ref_pool *p, uint32_t block);
void ref_sim_unref(ref_pool *p, uint32_t block);
void ref_sim_alloc(ref_pool *p, uint64_t n_blocks);
/* Simulates appending n tokens to a sequence of `len` tokens whose blocks are `blocks`
 * (copy of a shared partial last block included). */
void ref_sim_append(ref_pool *p, const uint32_t *blocks, uint32_t n_blocks, uint64_t len, uint64_t n);

/* ---------------------------------------------------------------------------------------- */
/* Sequences (sequence.c)                                                                   */
/* ---------------------------------------------------------------------------------------- */

/* Per-space state of one sequence. */
typedef struct ref_space_state {
    uint64_t valid_len;       /* tokens of state this space holds */
    uint64_t content_gen;     /* sizing generation; bumped on every change (rule 96) */
    uint32_t taint_bits;      /* BASERT_TAINT_*; sticky */
    uint32_t n_boundaries;    /* blob/ring kinds: recorded snapshot positions, ascending */
    uint64_t prov_salt;       /* derivations other than plain prefill (0 = clean) */
    uint64_t *boundaries;
    uint32_t cap_boundaries;
    uint32_t _pad0;
    void *ext;                /* owned by ops.c (freed by ref_ops_space_free) */
} ref_space_state;

struct ref_seq {
    uint64_t handle;          /* the baseRT_sequence_t value: bundle serial << 32 | counter */
    ref_bundle *b;
    ref_lane *owner;          /* the lane that owns it, NULL for a bare sequence */
    uint32_t *tokens;         /* resident tokens, oldest first */
    uint32_t len;
    uint32_t cap;
    uint64_t hist_hash;       /* ref_token_step over tokens[0..len) from the bundle's seed */
    uint32_t *blocks;         /* pool blocks covering tokens[0..len) */
    uint32_t n_blocks;
    uint32_t cap_blocks;
    ref_space_state *sp;      /* one per bundle space, same order */
    uint32_t ops_in_flight;   /* state ops holding a claim (ops.c) */
    uint32_t leased;          /* held by an adopt lease */
    uint32_t tokens_unknown;  /* state restored without its tokens: tokens[] and hist_hash are not
                                 valid until seed_adopt names them */
    uint32_t _pad0;
};

ref_seq *ref_seq_new(ref_bundle *b);                 /* registered, empty; NULL out of memory */
void ref_seq_destroy(ref_bundle *b, ref_seq *s);     /* unregisters, releases blocks and memory */
ref_seq *ref_seq_find(ref_bundle *b, baseRT_sequence_t h); /* this bundle's, or NULL (no deref) */
baseRT_sequence_t ref_seq_handle(const ref_seq *s);
/* Appends n tokens (blocks allocated, shared partial block copied, history hash, per-space
 * lengths, boundaries and generations updated). The caller has checked the pool fits: returns
 * 0, or -1 when memory or blocks run out (the caller treats that as fatal). */
int ref_seq_append(ref_bundle *b, ref_seq *s, const uint32_t *tokens, uint32_t n);
/* Makes `s` start with the first n_blocks blocks of `blocks` and tokens[0..n) (seeded start). */
int ref_seq_seed(ref_bundle *b, ref_seq *s, const uint32_t *tokens, uint32_t n, const uint32_t *blocks,
                 uint32_t n_blocks, uint32_t taint_bits, uint64_t prov_salt);
/* Releases every block of the sequence (its tokens stay; used on the way to destroying it). */
void ref_seq_release_blocks(ref_bundle *b, ref_seq *s);
/* Empties the sequence: no blocks, no tokens, every space at length 0 (a faulted lane's). */
void ref_seq_clear(ref_bundle *b, ref_seq *s);
/* Looks up a sequence handle in every live bundle and locks that bundle; UNKNOWN_HANDLE when no
 * bundle holds it, EBUSY when the bundle is locked by this thread. Unlock with ref_unlock. */
baseRT_status ref_seq_lock(baseRT_sequence_t h, ref_bundle **b, ref_seq **s);

/* ---------------------------------------------------------------------------------------- */
/* Lanes                                                                                    */
/* ---------------------------------------------------------------------------------------- */

enum { REF_LANE_LIVE = 0, REF_LANE_FINISHED = 1, REF_LANE_FAULTED = 2 };

struct ref_lane {
    uint64_t tag;
    ref_seq *seq;             /* owned; blocks released when the lane faults */
    uint32_t *prompt;         /* the admitted prompt, copied */
    uint32_t prompt_len;
    uint32_t prefill_end;     /* prompt_len - decode_replay */
    uint32_t fed;             /* prompt tokens resident (seed, prefill, replay) */
    uint32_t decode_replay;
    uint32_t grammar_replay;
    uint32_t sampling;        /* BASERT_SAMPLING_* */
    BaseRTSamplingParams params;
    uint64_t rng_base;
    uint64_t generated;       /* tokens drawn or committed */
    uint32_t grammar_handle;
    uint32_t logit_bias_handle;
    uint32_t strategy_slot;
    uint32_t cert_id;
    uint8_t determinism_class;
    uint8_t want_logprobs;
    uint8_t granted_class;
    uint8_t state;            /* REF_LANE_* */
    uint32_t finish;          /* BASERT_FINISH_* */
    uint8_t row_pending;      /* HOST: a row awaits its commit */
    uint8_t fault_armed;      /* baseRT_ref_inject_fault */
    uint8_t finish_armed;     /* baseRT_ref_force_finish */
    uint8_t _pad0;
    uint32_t fault_code;
    uint64_t row_nonce;
    uint32_t finish_code;
    uint32_t _pad1;
};

/* ---------------------------------------------------------------------------------------- */
/* Cache and seed leases (cache.c)                                                          */
/* ---------------------------------------------------------------------------------------- */

struct ref_entry {
    uint64_t id;
    uint32_t space;           /* index into ref_bundle.spaces */
    uint32_t n_tokens;
    uint32_t *tokens;         /* the prefix this entry holds state for */
    uint8_t provenance[32];
    uint8_t compat_key[32];
    uint32_t taint_bits;
    uint32_t pins;            /* seed leases holding it */
    uint64_t prov_salt;
    uint64_t *boundaries;     /* blob kinds */
    uint32_t n_boundaries;
    uint32_t n_blocks;        /* paged kinds: blocks covering tokens */
    uint32_t *blocks;
    uint64_t bytes;           /* what the entry is charged: blocks * block bytes, or blob snapshots */
    uint64_t cache_class;     /* bit mask */
    uint64_t lru;             /* larger = used more recently */
};

struct ref_lease {
    uint64_t handle;
    uint32_t *prefix;
    uint32_t prefix_len;
    uint8_t determinism_class;
    uint8_t _pad0[3];
    uint64_t acquired_tick;   /* T: valid for ticks with index <= T + ttl */
    ref_entry **pinned;       /* one per served space */
    uint32_t n_pinned;
    uint32_t taint_bits;
    uint64_t prov_salt;
    ref_seq *adopted;         /* seed_adopt: the sequence taken over whole */
};

/* Digest of a prefix's state in one space (tokens, taint and derivation salt). */
void ref_provenance(const ref_bundle *b, uint32_t space, const uint32_t *tokens, uint32_t n,
                    uint32_t taint, uint64_t salt, uint8_t out[32]);
void ref_compat_key(const ref_bundle *b, uint32_t space, const uint32_t *tokens, uint32_t n,
                    uint8_t out[32]);
/* The compatibility identity of one space of this bundle (model identity + space descriptor):
 * what a state envelope's compat_identity carries and a restore compares (rule 102). */
void ref_space_identity(const ref_bundle *b, uint32_t space, uint8_t out[32]);
/* Publishes a sequence's whole-block prefix (paged) and recorded boundaries (blob) into the
 * cache; identical (space, tokens, provenance) entries are reused (rule 90). `n` caps the tokens
 * published; `tokens` (NULL = the sequence's own) are the key. Returns 0 or -1 out of memory. */
int ref_cache_publish(ref_bundle *b, ref_seq *s, const uint32_t *tokens, uint32_t n);
/* Simulates the block references a publish of s would add (for plan feasibility). */
void ref_cache_sim_publish(ref_bundle *b, const ref_seq *s);
void ref_cache_remove(ref_bundle *b, ref_entry *e); /* evicts one entry (must be unpinned) */
ref_lease *ref_lease_find(ref_bundle *b, uint64_t handle);
int ref_lease_expired(const ref_bundle *b, const ref_lease *l, uint64_t tick_index);
/* Drops a lease: unpins its entries; frees an adopted sequence if free_adopted. */
void ref_lease_drop(ref_bundle *b, ref_lease *l, int free_adopted);
void ref_leases_sweep(ref_bundle *b, uint64_t tick_index); /* drops leases expired at tick_index */
/* After a plan's demand went through the pool simulation: chooses the entries to evict (least
 * recently used first, unpinned at tick_index, of allowed classes, within min(max_evict_bytes,
 * cache bytes - protected_quota_bytes)) until the simulated pool has no deficit. Returns 0 when
 * the plan fits (the entries in w->evict), -1 when it cannot (rule 50), -2 out of memory. */
int ref_cache_plan_evictions(ref_bundle *b, const BaseRTShedPolicy *policy, uint64_t tick_index,
                             ref_work *w);
/* Unexpired leases pinning e at tick_index. */
uint32_t ref_entry_pins_at(const ref_bundle *b, const ref_entry *e, uint64_t tick_index);
uint64_t ref_cache_bytes(const ref_bundle *b);
uint64_t ref_cache_evictable_bytes(const ref_bundle *b);
/* Copies the span.count tokens of `span` from an attached ENGINE_READS TOKENS ring into dst.
 * 0; BOUNDS for count 0 or above context_length or a token >= vocab_size; BAD_REF_GENERATION
 * for an unattached ring or a stale span (rules 35, 127-128). */
baseRT_status ref_read_span(ref_bundle *b, BaseRTTokenRef span, uint32_t *dst);
/* Reads span into b->span_buf (grown as needed). Same codes, BASERT_ERR_FATAL out of memory. */
baseRT_status ref_read_span_buf(ref_bundle *b, BaseRTTokenRef span);
/* The array rules of RULES.md section C for one array of records of min_size bytes (minimum
 * prefix): BAD_ALIGNMENT, BAD_STRIDE, BOUNDS or 0. */
baseRT_status ref_check_array(const BaseRTArray *a, uint32_t min_size);

/* ---------------------------------------------------------------------------------------- */
/* Rings                                                                                    */
/* ---------------------------------------------------------------------------------------- */

typedef struct ref_ring {
    brt_ring r;
    uint32_t kind;  /* BASERT_RING_KIND_* */
    uint32_t role;  /* BASERT_RING_ROLE_* */
} ref_ring;

ref_ring *ref_ring_find(ref_bundle *b, uint32_t ring_id);
ref_ring *ref_emit_ring(ref_bundle *b);   /* ENGINE_WRITES TOKENS, lowest id */
ref_ring *ref_logits_ring(ref_bundle *b); /* ENGINE_WRITES LOGITS, lowest id */

/* ---------------------------------------------------------------------------------------- */
/* Events (tick.c)                                                                          */
/* ---------------------------------------------------------------------------------------- */

typedef struct ref_events {
    BaseRTTickEvents ev;
    BaseRTAdmitResult *admits;
    uint32_t n_admits, cap_admits;
    BaseRTLaneEmit *emits;
    uint32_t n_emits, cap_emits;
    BaseRTLaneFault *faults;
    uint32_t n_faults, cap_faults;
    BaseRTShedEntry *shed;
    uint32_t n_shed, cap_shed;
    BaseRTOpComplete *ops;
    uint32_t n_ops, cap_ops;
    BaseRTLaneLogprob *logprobs;
    uint32_t n_logprobs, cap_logprobs;
} ref_events;

/* ---------------------------------------------------------------------------------------- */
/* A validated plan (validate.c -> tick.c)                                                  */
/* ---------------------------------------------------------------------------------------- */

/* Everything one tag does in the plan. */
typedef struct ref_plan_tag {
    uint64_t tag;
    int32_t admit, commit, prefill, decode, retire; /* record index, -1 = none */
    ref_lane *lane;                                 /* the existing lane, NULL for an admit */
    uint32_t fed0;                                  /* prompt tokens resident before prefill */
    uint32_t fed_after;                             /* ... after this tick's prefill */
    uint32_t prefill_end;
    uint32_t prompt_len;
} ref_plan_tag;

struct ref_work {
    BaseRTTickPlan plan;                 /* local copy, zero past struct_size */
    int partial;                         /* call plan.on_partial_emit */
    BaseRTLaneAdmit *admits;
    BaseRTLaneCommit *commits;
    BaseRTLanePrefill *prefills;
    BaseRTLaneDecode *decodes;
    BaseRTLaneRetire *retires;
    uint64_t *victims;
    uint32_t n[6];                       /* counts, in the order above */
    uint32_t cap[6];
    /* per admit */
    uint32_t *admit_tok_off;             /* offset of its prompt in tok_buf */
    ref_lease **admit_lease;
    uint32_t *tok_buf;
    uint32_t tok_len, tok_cap;
    uint32_t cap_admit_extra;
    /* per prefill: tokens kept within the budget */
    uint32_t *prefill_eff;
    uint32_t cap_prefill_eff;
    /* tags */
    ref_plan_tag *tags;
    uint32_t n_tags, cap_tags;
    ref_map tag_index;                   /* tag -> index + 1 into tags (as a pointer value) */
    /* evictions chosen by the feasibility check */
    ref_entry **evict;
    uint32_t n_evict, cap_evict;
};

baseRT_status ref_validate(ref_bundle *b, const BaseRTTickPlan *plan, ref_work *w);
void ref_work_free(ref_work *w);
ref_plan_tag *ref_work_tag(const ref_work *w, uint64_t tag);

/* ---------------------------------------------------------------------------------------- */
/* The bundle (bundle.c)                                                                    */
/* ---------------------------------------------------------------------------------------- */

struct ref_bundle {
    uint64_t magic;
    uint64_t serial;
    pthread_mutex_t lock;
    ref_bundle *next_live;              /* global list of live bundles (sequence lookup) */

    BaseRTRefConfig cfg;                /* copied; pointers below own the copies */
    uint32_t *script;
    BaseRTRefSpace *space_cfg;
    char *arch;
    uint32_t n_spaces;
    int32_t paged_space;                /* index of the paged space, -1 = none */
    BaseRTStateSpaceDesc *spaces;       /* n_spaces, handed out by baseRT_state_spaces */
    uint8_t identity[32];
    uint64_t model_seed;                /* history hash of the empty sequence */

    ref_pool pool;
    ref_ring rings[REF_MAX_RINGS];
    uint32_t n_rings;

    ref_lane **lanes;                   /* every lane the engine holds */
    uint32_t n_lanes, cap_lanes;
    ref_map lane_index;                 /* tag -> ref_lane* */

    ref_seq **seqs;                     /* every sequence of the bundle */
    uint32_t n_seqs, cap_seqs;
    ref_map seq_index;                  /* handle -> ref_seq* */
    uint32_t next_seq_serial;           /* low half of the next sequence handle */

    ref_entry **entries;
    uint32_t n_entries, cap_entries;
    uint64_t next_entry_id;
    uint64_t lru_clock;

    ref_lease **leases;
    uint32_t n_leases, cap_leases;
    uint64_t next_seed;

    uint64_t *yield_words;              /* control segment: [0] yield word, [1] yields taken */
    uint64_t ticks;                     /* accepted ticks = index of the next tick */
    uint64_t last_plan_seq;
    int has_plan_seq;

    /* test hooks */
    uint32_t refuse_kind;
    int32_t refuse_status;
    uint64_t refuse_param;

    /* counters */
    uint64_t prefill_total, decode_total, replay_total, evictions_total, faults_total, rejected;

    /* events: double buffer, and scratch */
    ref_events events[2];
    uint32_t cur_events;
    ref_work work;
    BaseRTMatchResult match;             /* space_match result storage */
    BaseRTSpaceMatch *match_spaces;
    uint32_t cap_match_spaces;
    BaseRTMatchCandidate *match_cands;
    uint32_t cap_match_cands;
    uint32_t *span_buf;                  /* ref_read_span */
    uint32_t cap_span;
    float *row_buf;                      /* logits rows */
    uint32_t *emit_buf;                  /* one lane's tokens in a tick */
    uint32_t cap_emit;

    /* grammar.c */
    uint32_t *grammars;
    uint32_t n_grammars, cap_grammars, next_grammar;
    uint32_t *biases;
    uint32_t n_biases, cap_biases, next_bias;

    void *ops;                           /* ops.c */
    void *strategies;                    /* strategy.c */
    void *media;                         /* media.c */
};

/* Locks a bundle handle: NULL when the handle is NULL or not a live reference bundle (*err =
 * BASERT_ERR_FATAL) or when this thread already holds it (*err = BASERT_EBUSY, re-entry from the
 * partial-emit callback). */
ref_bundle *ref_lock(baseRT_model_t h, baseRT_status *err);
void ref_unlock(ref_bundle *b);
int ref_space_index(const ref_bundle *b, uint32_t space_id); /* -1 when unknown */
int ref_space_is_paged(const ref_bundle *b, uint32_t space);
int ref_space_is_blob(const ref_bundle *b, uint32_t space);
ref_lane *ref_lane_find(ref_bundle *b, uint64_t tag);
void ref_lane_destroy(ref_bundle *b, ref_lane *l); /* removes from the bundle; frees its sequence */

/* ---------------------------------------------------------------------------------------- */
/* Synthetic model (model.c)                                                                */
/* ---------------------------------------------------------------------------------------- */

/* The token the lane draws next (counter = rng_base + generated). */
uint32_t ref_model_next(const ref_bundle *b, const ref_lane *l);
/* The greedy-path token for a history (what HOST rows and logprobs rank first). */
uint32_t ref_model_greedy(const ref_bundle *b, const ref_lane *l);
/* Writes the logits row of the lane's current history into row[vocab]. */
void ref_model_row(const ref_bundle *b, const ref_lane *l, float *row);
/* Fills one logprob record for `token` drawn at the lane's current history (before append). */
void ref_model_logprob(const ref_bundle *b, const ref_lane *l, uint32_t token, uint32_t n_top,
                       BaseRTLaneLogprob *out);

/* ---------------------------------------------------------------------------------------- */
/* Grammar / logit bias registries (grammar.c)                                              */
/* ---------------------------------------------------------------------------------------- */

int ref_grammar_known(const ref_bundle *b, uint32_t handle);
int ref_bias_known(const ref_bundle *b, uint32_t handle);
void ref_grammar_free_all(ref_bundle *b);

/* ---------------------------------------------------------------------------------------- */
/* Hooks implemented by ops.c, strategy.c, media.c                                          */
/* ---------------------------------------------------------------------------------------- */

/* ops.c: advance in-flight ops at the start of an accepted tick; move completions into dst
 * (returns how many it wrote, at most cap); count those waiting; free everything at teardown. */
void ref_ops_pump(ref_bundle *b);
uint32_t ref_ops_pending(const ref_bundle *b);
uint32_t ref_ops_drain(ref_bundle *b, BaseRTOpComplete *dst, uint32_t cap);
void ref_ops_space_free(ref_bundle *b, ref_space_state *sp);
/* ops.c: the sequence was emptied (ref_seq_clear): drop its demoted ranges and restored states. */
void ref_ops_seq_cleared(ref_bundle *b, ref_seq *s);
void ref_ops_free_all(ref_bundle *b);

/* strategy.c: is slot registered; may a HOST lane use it (rule 37); the admission outcome of
 * an admit (ADMITTED with cert/granted class, or REJECTED with a reject code, rules 119-122). */
int ref_strategy_known(const ref_bundle *b, uint32_t slot);
int ref_strategy_host_compatible(const ref_bundle *b, uint32_t slot);
void ref_strategy_admit(const ref_bundle *b, const BaseRTLaneAdmit *a, BaseRTAdmitResult *out);
void ref_strategy_free_all(ref_bundle *b);

/* media.c */
void ref_media_free_all(ref_bundle *b);
void ref_media_lane_retired(ref_bundle *b, uint64_t lane_tag);

#endif /* REF_INTERNAL_H */
