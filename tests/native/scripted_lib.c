/*
 * A scripted tick-ABI library for the binding's own tests (tests/native/test_abi_library.py).
 *
 * It is not an engine: each call does what the test scripted through scripted_set_mode(), so
 * the binding can be driven through a real dlopen against well-formed and deliberately broken
 * output (RULES.md section C seen from the reader's side) without the reference engine.
 * Every function of basert_tick.h is exported; the ones a test does not script answer
 * BASERT_ERR_OP_UNSUPPORTED.
 */
#include <stdlib.h>
#include <string.h>

#include "basert_tick.h"

enum {
    MODE_ECHO = 0,         /* one emit per decode, tokens = lane_tag + i */
    MODE_MISALIGNED = 1,   /* emits.data off by 4 bytes */
    MODE_NULL_DATA = 2,    /* emits.count 1 with NULL data */
    MODE_SHORT_STRIDE = 3, /* emits.elem_size 64 (< 72) */
    MODE_HUGE = 4,         /* emits.count * elem_size over any sane cap */
    MODE_NULL_EVENTS = 5,  /* OK with *events_out = NULL */
    MODE_BAD_SEQ = 6,      /* plan_seq not echoed */
    MODE_REJECT = 7,       /* return BASERT_REJECT_DUPLICATE_LANE */
    MODE_LONG_STRIDE = 8,  /* emits at elem_size 80 with a garbage tail */
    MODE_SMALL_EVENTS = 9  /* events.struct_size 200 */
};

static int g_mode;
static uint64_t g_last_plan_size;
static uint32_t g_last_plan_flags;
static uint32_t g_last_decodes;
static BaseRTTickEvents g_events;
static uint64_t g_emit_mem[256 * 10 + 1];
static uint32_t g_tokens[64];
static uint8_t g_bytes[64];

void scripted_set_mode(int mode) { g_mode = mode; }
uint64_t scripted_last_plan_size(void) { return g_last_plan_size; }
uint32_t scripted_last_plan_flags(void) { return g_last_plan_flags; }
uint32_t scripted_last_decodes(void) { return g_last_decodes; }

baseRT_status baseRT_tick(baseRT_model_t bundle, const BaseRTTickPlan *plan, const BaseRTTickEvents **events_out) {
    (void)bundle;
    g_last_plan_size = plan->struct_size;
    g_last_plan_flags = plan->flags;
    g_last_decodes = plan->decodes.count;
    if (g_mode == MODE_REJECT) return BASERT_REJECT_DUPLICATE_LANE;
    memset(&g_events, 0, sizeof g_events);
    g_events.struct_size = sizeof g_events;
    g_events.plan_seq = g_mode == MODE_BAD_SEQ ? plan->plan_seq + 1 : plan->plan_seq;
    uint32_t n = plan->decodes.count > 256 ? 256 : plan->decodes.count;
    uint32_t stride = g_mode == MODE_LONG_STRIDE ? 80 : (uint32_t)sizeof(BaseRTLaneEmit);
    memset(g_emit_mem, 0xAB, sizeof g_emit_mem);
    const BaseRTLaneDecode *dec = (const BaseRTLaneDecode *)plan->decodes.data;
    for (uint32_t i = 0; i < n; i++) {
        BaseRTLaneEmit e;
        memset(&e, 0, sizeof e);
        e.lane_tag = dec[i].lane_tag;
        e.n_tokens = dec[i].max_new_tokens;
        e.finish = BASERT_FINISH_NONE;
        e.token_ref.ring_id = 2;
        e.token_ref.count = e.n_tokens;
        e.token_ref.generation = i + 1;
        memcpy((char *)g_emit_mem + (size_t)i * stride, &e, sizeof e);
        if ((plan->flags & BASERT_TICK_PARTIAL_EMITS) && plan->struct_size >= 168 && plan->on_partial_emit) {
            uint32_t k = e.n_tokens > 64 ? 64 : e.n_tokens;
            for (uint32_t t = 0; t < k; t++) g_tokens[t] = (uint32_t)(dec[i].lane_tag + t);
            plan->on_partial_emit(plan->partial_emit_user, dec[i].lane_tag, g_tokens, k);
        }
    }
    g_events.emits.data = g_emit_mem;
    g_events.emits.count = n;
    g_events.emits.elem_size = stride;
    g_events.mem.pool_blocks_total = 99;
    g_events.timings.wall_ns = 12345;
    switch (g_mode) {
    case MODE_MISALIGNED: g_events.emits.data = (const char *)g_emit_mem + 4; break;
    case MODE_NULL_DATA: g_events.emits.data = NULL; g_events.emits.count = 1; break;
    case MODE_SHORT_STRIDE: g_events.emits.elem_size = 64; break;
    case MODE_HUGE: g_events.emits.count = 0xFFFFFFFFu; g_events.emits.elem_size = 72; break;
    case MODE_SMALL_EVENTS: g_events.struct_size = 200; break;
    default: break;
    }
    *events_out = g_mode == MODE_NULL_EVENTS ? NULL : &g_events;
    return BASERT_STATUS_OK;
}

/* A snapshot writes a sealed envelope with a 7-byte payload; polls say DONE at once. */
static baseRT_op_t g_next_op = 1;

baseRT_status baseRT_space_snapshot(baseRT_sequence_t seq, uint32_t space_id, uint64_t boundary_pos, BaseRTBuf dst,
                                    uint64_t sizing_gen, baseRT_op_t *op) {
    (void)seq; (void)space_id; (void)boundary_pos; (void)sizing_gen;
    if (dst.len < sizeof(BaseRTStateEnvelope) + 7) return BASERT_ERR_BUFFER_TOO_SMALL;
    BaseRTStateEnvelope env;
    memset(&env, 0, sizeof env);
    env.magic = BASERT_STATE_ENVELOPE_MAGIC;
    env.envelope_version = 1;
    env.payload_len = 7;
    memcpy(dst.ptr, &env, sizeof env);
    memcpy((char *)dst.ptr + sizeof env, "payload", 7);
    *op = g_next_op++;
    return BASERT_STATUS_OK;
}

baseRT_status baseRT_op_poll(baseRT_model_t bundle, baseRT_op_t op, BaseRTOpStatus *out) {
    (void)bundle;
    if (op == 0 || op >= g_next_op) return BASERT_ERR_UNKNOWN_HANDLE;
    out->state = BASERT_OP_DONE;
    out->bytes_moved = sizeof(BaseRTStateEnvelope) + 7;
    return BASERT_STATUS_OK;
}

struct baseRT_sequence_s { int owned; };

baseRT_sequence_t baseRT_tick_sequence_create(baseRT_model_t bundle) {
    (void)bundle;
    baseRT_sequence_t s = (baseRT_sequence_t)calloc(1, sizeof *s);
    if (s) s->owned = 1;
    return s;
}

baseRT_status baseRT_tick_sequence_free(baseRT_model_t bundle, baseRT_sequence_t seq) {
    (void)bundle;
    if (!seq || !seq->owned) return BASERT_ERR_UNKNOWN_HANDLE;
    free(seq);
    return BASERT_STATUS_OK;
}

/* State spaces: one paged space named "kv"; mode MODE_MISALIGNED hands out a bad pointer. */
static BaseRTStateSpaceDesc g_space;

baseRT_status baseRT_state_spaces(baseRT_model_t bundle, BaseRTArray *out) {
    (void)bundle;
    memset(&g_space, 0, sizeof g_space);
    g_space.space_id = 0;
    g_space.kind = BASERT_SPACE_KIND_PAGED_TOKEN_KV;
    g_space.page_size_tokens = 16;
    g_space.bytes_per_token = 64;
    strcpy(g_space.name, "kv");
    out->data = g_mode == MODE_MISALIGNED ? (const void *)((const char *)&g_space + 4) : &g_space;
    out->count = 1;
    out->elem_size = sizeof g_space;
    return BASERT_STATUS_OK;
}

baseRT_status baseRT_seed_lease_ticks(baseRT_model_t bundle, uint64_t *ticks) {
    (void)bundle;
    *ticks = 8;
    return BASERT_STATUS_OK;
}

/* Logit bias: echoes n as the handle (0 for n <= 0, like the ABI says). */
uint32_t baseRT_tick_logit_bias_create(baseRT_model_t bundle, const int32_t *tokens, const float *values, int n) {
    (void)bundle;
    if (n <= 0 || !tokens || !values) return 0;
    g_bytes[0] = (uint8_t)tokens[n - 1];
    return (uint32_t)n;
}

/* Everything else is not scripted. */
#define UNSCRIPTED return BASERT_ERR_OP_UNSUPPORTED
baseRT_status baseRT_rings_attach(baseRT_model_t b, const BaseRTRingDesc *d, uint32_t n) { (void)b; (void)d; (void)n; UNSCRIPTED; }
baseRT_status baseRT_strategy_register(baseRT_model_t b, const BaseRTStrategyRegistration *r, const BaseRTStrategyGrant **g) { (void)b; (void)r; (void)g; UNSCRIPTED; }
baseRT_status baseRT_op_cancel(baseRT_model_t b, baseRT_op_t op) { (void)b; (void)op; UNSCRIPTED; }
baseRT_status baseRT_space_match(baseRT_model_t b, uint32_t s, BaseRTTokenRef sp, BaseRTArray m, const BaseRTMatchResult **o) { (void)b; (void)s; (void)sp; (void)m; (void)o; UNSCRIPTED; }
baseRT_status baseRT_seed_acquire(baseRT_model_t b, BaseRTTokenRef sp, uint64_t p, uint8_t d, uint64_t *h) { (void)b; (void)sp; (void)p; (void)d; (void)h; UNSCRIPTED; }
baseRT_status baseRT_seed_release(baseRT_model_t b, uint64_t h) { (void)b; (void)h; return BASERT_ERR_UNKNOWN_HANDLE; }
baseRT_status baseRT_seq_fork(baseRT_sequence_t p, baseRT_sequence_t *c, uint32_t f) { (void)p; (void)c; (void)f; UNSCRIPTED; }
baseRT_status baseRT_space_export_size(baseRT_sequence_t s, uint32_t id, BaseRTTokenRange r, uint8_t e, uint64_t *q, uint64_t *g) { (void)s; (void)id; (void)r; (void)e; (void)q; (void)g; UNSCRIPTED; }
baseRT_status baseRT_space_restore(baseRT_sequence_t s, uint32_t id, BaseRTBuf src, baseRT_op_t *op) { (void)s; (void)id; (void)src; (void)op; UNSCRIPTED; }
baseRT_status baseRT_space_snapshot_boundary(baseRT_sequence_t s, uint32_t id, uint64_t c, uint64_t *o) { (void)s; (void)id; (void)c; (void)o; UNSCRIPTED; }
baseRT_status baseRT_space_trim(baseRT_sequence_t s, uint32_t id, uint64_t n) { (void)s; (void)id; (void)n; UNSCRIPTED; }
baseRT_status baseRT_space_demote(baseRT_sequence_t s, uint32_t id, BaseRTTokenRange r, uint8_t e, BaseRTBuf d, uint64_t g, baseRT_op_t *op) { (void)s; (void)id; (void)r; (void)e; (void)d; (void)g; (void)op; UNSCRIPTED; }
baseRT_status baseRT_space_promote(baseRT_sequence_t s, uint32_t id, BaseRTTokenRange r, BaseRTBuf src, baseRT_op_t *op) { (void)s; (void)id; (void)r; (void)src; (void)op; UNSCRIPTED; }
baseRT_status baseRT_cache_evict(baseRT_model_t b, const BaseRTShedPolicy *p, uint64_t t, uint64_t *f) { (void)b; (void)p; (void)t; (void)f; UNSCRIPTED; }
baseRT_status baseRT_cache_evict_entries(baseRT_model_t b, BaseRTArray k) { (void)b; (void)k; UNSCRIPTED; }
baseRT_sequence_t baseRT_tick_lane_sequence(baseRT_model_t b, uint64_t t) { (void)b; (void)t; return NULL; }
baseRT_status baseRT_tick_sequence_publish(baseRT_model_t b, baseRT_sequence_t s, const uint32_t *t, uint32_t n) { (void)b; (void)s; (void)t; (void)n; UNSCRIPTED; }
uint32_t baseRT_tick_grammar_create(baseRT_model_t b, const char *j) { (void)b; (void)j; return 0; }
uint32_t baseRT_tick_grammar_create_structural(baseRT_model_t b, const char *j) { (void)b; (void)j; return 0; }
baseRT_status baseRT_tick_grammar_free(baseRT_model_t b, uint32_t h) { (void)b; (void)h; return BASERT_ERR_UNKNOWN_HANDLE; }
baseRT_status baseRT_tick_logit_bias_free(baseRT_model_t b, uint32_t h) { (void)b; (void)h; return BASERT_ERR_UNKNOWN_HANDLE; }
baseRT_status baseRT_seed_adopt(baseRT_model_t b, baseRT_sequence_t s, BaseRTTokenRef sp, uint64_t *h) { (void)b; (void)s; (void)sp; (void)h; UNSCRIPTED; }
baseRT_status baseRT_media_probe(baseRT_model_t b, const char *p, BaseRTMediaInfo *o) { (void)b; (void)p; (void)o; UNSCRIPTED; }
baseRT_status baseRT_media_encode(baseRT_model_t b, const char *p, uint64_t *h, BaseRTMediaInfo *o) { (void)b; (void)p; (void)h; (void)o; UNSCRIPTED; }
baseRT_status baseRT_media_release(baseRT_model_t b, uint64_t h) { (void)b; (void)h; UNSCRIPTED; }
baseRT_status baseRT_media_bind(baseRT_model_t b, uint64_t t, uint64_t h, uint32_t o) { (void)b; (void)t; (void)h; (void)o; UNSCRIPTED; }
