/* bundle.c: a reference bundle's life (config, create, free, locking), its rings and state-space
 * descriptors, and the baseRT_ref_* test surface (basert_ref.h). */

#define _XOPEN_SOURCE 700 /* pthread_mutexattr_settype, clock_gettime, nanosleep under -std=c11 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"

/* ---- the process-wide list of live bundles (handle checks, sequence lookup) ---- */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static ref_bundle *g_live;
static uint64_t g_serial;

static int live_has(const ref_bundle *b) {
    for (ref_bundle *p = g_live; p; p = p->next_live)
        if (p == b)
            return 1;
    return 0;
}

static baseRT_status lock_bundle(ref_bundle *b) {
    int e = pthread_mutex_lock(&b->lock);
    if (e == EDEADLK)
        return BASERT_EBUSY;
    return e ? BASERT_ERR_FATAL : BASERT_STATUS_OK;
}

ref_bundle *ref_lock(baseRT_model_t h, baseRT_status *err) {
    ref_bundle *b = h;
    pthread_mutex_lock(&g_lock);
    int ok = b && live_has(b);
    pthread_mutex_unlock(&g_lock);
    if (!ok) {
        *err = BASERT_ERR_FATAL;
        return NULL;
    }
    *err = lock_bundle(b);
    return *err ? NULL : b;
}

void ref_unlock(ref_bundle *b) { pthread_mutex_unlock(&b->lock); }

baseRT_status ref_seq_lock(baseRT_sequence_t h, ref_bundle **out_b, ref_seq **out_s) {
    /* A handle carries its bundle's serial in the high 32 bits (sequence.c). */
    uint64_t serial = (uint64_t)(uintptr_t)h >> 32;
    ref_bundle *found = NULL;
    pthread_mutex_lock(&g_lock);
    for (ref_bundle *p = g_live; p && !found; p = p->next_live)
        if (p->serial == serial)
            found = p;
    pthread_mutex_unlock(&g_lock);
    if (!found || !h)
        return BASERT_ERR_UNKNOWN_HANDLE;
    baseRT_status rc = lock_bundle(found);
    if (rc)
        return rc;
    ref_seq *s = ref_seq_find(found, h);
    if (!s) {
        ref_unlock(found);
        return BASERT_ERR_UNKNOWN_HANDLE;
    }
    *out_b = found;
    *out_s = s;
    return BASERT_STATUS_OK;
}

/* ---- spaces, rings, lanes ---- */

static int is_paged_kind(uint32_t k) {
    return k == BASERT_SPACE_KIND_PAGED_TOKEN_KV || k == BASERT_SPACE_KIND_DEPTH_PAGED_KV;
}

static int is_blob_kind(uint32_t k) {
    return k == BASERT_SPACE_KIND_RECURRENT_BLOB || k == BASERT_SPACE_KIND_RING_KV;
}

int ref_space_index(const ref_bundle *b, uint32_t space_id) {
    for (uint32_t i = 0; i < b->n_spaces; i++)
        if (b->spaces[i].space_id == space_id)
            return (int)i;
    return -1;
}

int ref_space_is_paged(const ref_bundle *b, uint32_t space) { return is_paged_kind(b->space_cfg[space].kind); }

int ref_space_is_blob(const ref_bundle *b, uint32_t space) { return is_blob_kind(b->space_cfg[space].kind); }

ref_ring *ref_ring_find(ref_bundle *b, uint32_t ring_id) {
    for (uint32_t i = 0; i < b->n_rings; i++)
        if (b->rings[i].r.ring_id == ring_id)
            return &b->rings[i];
    return NULL;
}

static ref_ring *lowest(ref_bundle *b, uint32_t kind) {
    ref_ring *best = NULL;
    for (uint32_t i = 0; i < b->n_rings; i++) {
        ref_ring *r = &b->rings[i];
        if (r->kind == kind && r->role == BASERT_RING_ROLE_ENGINE_WRITES && (!best || r->r.ring_id < best->r.ring_id))
            best = r;
    }
    return best;
}

ref_ring *ref_emit_ring(ref_bundle *b) { return lowest(b, BASERT_RING_KIND_TOKENS); }

ref_ring *ref_logits_ring(ref_bundle *b) { return lowest(b, BASERT_RING_KIND_LOGITS); }

ref_lane *ref_lane_find(ref_bundle *b, uint64_t tag) { return ref_map_get(&b->lane_index, tag); }

void ref_lane_destroy(ref_bundle *b, ref_lane *l) {
    ref_map_del(&b->lane_index, l->tag);
    for (uint32_t i = 0; i < b->n_lanes; i++)
        if (b->lanes[i] == l) {
            b->lanes[i] = b->lanes[--b->n_lanes];
            break;
        }
    if (l->seq)
        ref_seq_destroy(b, l->seq);
    free(l->prompt);
    free(l);
}

/* ---- config ---- */

void baseRT_ref_config_init(BaseRTRefConfig *cfg) {
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->vocab_size = 512;
    cfg->max_lanes = 16;
    cfg->max_batch_size = 16;
    cfg->page_size_tokens = 16;
    cfg->bytes_per_token = 64;
    cfg->pool_bytes = 1u << 20;
    cfg->context_length = 1024;
    cfg->eos_token = 2;
    cfg->eos_period = 0;
    cfg->tick_delay_us = 0;
    cfg->seed_lease_ticks = 8;
    cfg->n_layers = 32;
}

static baseRT_status check_config(const BaseRTRefConfig *c) {
    if (c->struct_size < sizeof *c)
        return BASERT_REJECT_BAD_STRUCT;
    if (c->vocab_size < 2 || c->vocab_size > (1u << 24) || c->eos_token >= c->vocab_size || !c->max_lanes ||
        !c->max_batch_size || !c->page_size_tokens || !c->bytes_per_token || !c->context_length ||
        (c->n_scripted_tokens && !c->scripted_tokens) || (c->n_spaces && !c->spaces) || c->n_spaces > 64)
        return BASERT_REJECT_BOUNDS;
    for (uint32_t i = 0; i < c->n_scripted_tokens; i++)
        if (c->scripted_tokens[i] >= c->vocab_size)
            return BASERT_REJECT_BOUNDS;
    uint32_t paged = 0;
    for (uint32_t i = 0; i < c->n_spaces; i++) {
        const BaseRTRefSpace *s = &c->spaces[i];
        if (s->kind < BASERT_SPACE_KIND_PAGED_TOKEN_KV || s->kind > BASERT_SPACE_KIND_ENCODER_CACHE ||
            s->space_id == BASERT_ALL_SPACES || s->snapshot_cadence > 2 ||
            (s->snapshot_cadence == 2 && !s->snapshot_interval_tokens) ||
            (s->flags & ~(uint32_t)(BASERT_SPACE_FLAG_OPS_UNAVAILABLE | BASERT_SPACE_FLAG_NO_PREFIX_CACHE)))
            return BASERT_REJECT_BOUNDS;
        if (is_paged_kind(s->kind)) {
            if (paged++ || (s->page_size_tokens && s->page_size_tokens != c->page_size_tokens) ||
                (s->bytes_per_token && s->bytes_per_token != c->bytes_per_token))
                return BASERT_REJECT_BOUNDS;
        }
        for (uint32_t k = 0; k < i; k++)
            if (c->spaces[k].space_id == s->space_id)
                return BASERT_REJECT_BOUNDS;
    }
    return BASERT_STATUS_OK;
}

static void derive_identity(ref_bundle *b) {
    static const uint8_t zero[32];
    if (memcmp(b->cfg.identity, zero, 32)) {
        memcpy(b->identity, b->cfg.identity, 32);
    } else {
        ref_digest d;
        ref_digest_init(&d, 0x4D4F44454Cu); /* "MODEL" */
        ref_digest_u64(&d, b->cfg.vocab_size);
        ref_digest_u64(&d, b->cfg.eos_token);
        ref_digest_u64(&d, b->cfg.eos_period);
        ref_digest_u64(&d, b->cfg.page_size_tokens);
        ref_digest_u64(&d, b->cfg.bytes_per_token);
        ref_digest_update(&d, b->script, (size_t)b->cfg.n_scripted_tokens * 4);
        for (uint32_t i = 0; i < b->n_spaces; i++) {
            ref_digest_u64(&d, b->space_cfg[i].space_id);
            ref_digest_u64(&d, b->space_cfg[i].kind);
            ref_digest_u64(&d, b->space_cfg[i].version_tag);
        }
        ref_digest_final(&d, b->identity);
    }
    uint64_t seed = 0;
    for (int i = 0; i < 8; i++)
        seed |= (uint64_t)b->identity[i] << (8 * i);
    b->model_seed = ref_mix64(seed);
}

static void build_descs(ref_bundle *b) {
    for (uint32_t i = 0; i < b->n_spaces; i++) {
        BaseRTRefSpace *s = &b->space_cfg[i];
        BaseRTStateSpaceDesc *d = &b->spaces[i];
        memset(d, 0, sizeof *d);
        s->name[31] = 0;
        d->space_id = s->space_id;
        d->kind = s->kind;
        d->version_tag = s->version_tag;
        if (is_paged_kind(s->kind)) {
            s->page_size_tokens = b->cfg.page_size_tokens;
            s->bytes_per_token = b->cfg.bytes_per_token;
            d->bytes_per_token = s->bytes_per_token;
            d->page_size_tokens = s->page_size_tokens;
            d->fork_cost_class = 1;
        } else {
            d->blob_bytes = s->blob_bytes;
            d->fork_cost_class = 2;
            d->fork_cost_bytes = s->blob_bytes;
        }
        d->snapshot_cadence = s->snapshot_cadence;
        d->snapshot_interval_tokens = s->snapshot_interval_tokens;
        d->flags = s->flags;
        memcpy(d->name, s->name, 32);
    }
}

static void bundle_destroy(ref_bundle *b) {
    ref_ops_free_all(b);
    ref_strategy_free_all(b);
    ref_media_free_all(b);
    while (b->n_leases)
        ref_lease_drop(b, b->leases[0], 0);
    while (b->n_lanes)
        ref_lane_destroy(b, b->lanes[0]);
    while (b->n_seqs)
        ref_seq_destroy(b, b->seqs[0]);
    while (b->n_entries)
        ref_cache_remove(b, b->entries[0]);
    for (int i = 0; i < 2; i++) {
        ref_events *e = &b->events[i];
        free(e->admits);
        free(e->emits);
        free(e->faults);
        free(e->shed);
        free(e->ops);
        free(e->logprobs);
    }
    ref_work_free(&b->work);
    ref_grammar_free_all(b);
    ref_pool_destroy(&b->pool);
    ref_map_free(&b->lane_index);
    ref_map_free(&b->seq_index);
    free(b->lanes);
    free(b->seqs);
    free(b->entries);
    free(b->leases);
    free(b->match_spaces);
    free(b->match_cands);
    free(b->span_buf);
    free(b->row_buf);
    free(b->emit_buf);
    free(b->script);
    free(b->space_cfg);
    free(b->spaces);
    free(b->arch);
    b->magic = 0;
    pthread_mutex_destroy(&b->lock);
    free(b);
}

baseRT_status baseRT_ref_create_checked(const BaseRTRefConfig *cfg, baseRT_model_t *out) {
    if (!cfg || !out)
        return BASERT_REJECT_BAD_STRUCT;
    *out = NULL;
    baseRT_status rc = check_config(cfg);
    if (rc)
        return rc;
    ref_bundle *b = calloc(1, sizeof *b);
    if (!b)
        return BASERT_ERR_FATAL;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    pthread_mutex_init(&b->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    b->magic = REF_MAGIC;
    b->cfg = *cfg;
    b->cfg.struct_size = sizeof b->cfg;
    b->n_spaces = cfg->n_spaces ? cfg->n_spaces : 1;
    const char *arch = cfg->arch ? cfg->arch : "ref-arch";
    size_t arch_len = strlen(arch) + 1;
    b->space_cfg = calloc(b->n_spaces, sizeof *b->space_cfg);
    b->spaces = calloc(b->n_spaces, sizeof *b->spaces);
    b->script = malloc(((size_t)cfg->n_scripted_tokens + 1) * sizeof *b->script);
    b->arch = malloc(arch_len);
    b->row_buf = malloc((size_t)cfg->vocab_size * sizeof *b->row_buf);
    if (!b->space_cfg || !b->spaces || !b->script || !b->arch || !b->row_buf) {
        bundle_destroy(b);
        return BASERT_ERR_FATAL;
    }
    memcpy(b->arch, arch, arch_len);
    memcpy(b->script, cfg->scripted_tokens ? cfg->scripted_tokens : b->script,
           (size_t)cfg->n_scripted_tokens * sizeof *b->script);
    b->cfg.scripted_tokens = b->script;
    b->cfg.arch = b->arch;
    if (cfg->n_spaces) {
        memcpy(b->space_cfg, cfg->spaces, b->n_spaces * sizeof *b->space_cfg);
    } else {
        b->space_cfg[0].space_id = 0;
        b->space_cfg[0].kind = BASERT_SPACE_KIND_PAGED_TOKEN_KV;
        b->space_cfg[0].version_tag = 1;
        memcpy(b->space_cfg[0].name, "kv", 3);
    }
    b->cfg.spaces = b->space_cfg;
    b->cfg.n_spaces = b->n_spaces;
    b->paged_space = -1;
    for (uint32_t i = 0; i < b->n_spaces; i++)
        if (is_paged_kind(b->space_cfg[i].kind))
            b->paged_space = (int32_t)i;
    build_descs(b);
    derive_identity(b);
    uint64_t block_bytes = b->paged_space >= 0 ? (uint64_t)cfg->page_size_tokens * cfg->bytes_per_token : 0;
    if (ref_pool_init(&b->pool, cfg->page_size_tokens, block_bytes, cfg->pool_bytes)) {
        bundle_destroy(b);
        return BASERT_ERR_FATAL;
    }
    pthread_mutex_lock(&g_lock);
    b->serial = ++g_serial;
    b->next_live = g_live;
    g_live = b;
    pthread_mutex_unlock(&g_lock);
    *out = b;
    return BASERT_STATUS_OK;
}

baseRT_model_t baseRT_ref_create(const BaseRTRefConfig *cfg) {
    baseRT_model_t out = NULL;
    return baseRT_ref_create_checked(cfg, &out) ? NULL : out;
}

void baseRT_ref_free(baseRT_model_t bundle) {
    ref_bundle *b = bundle;
    if (!b)
        return;
    pthread_mutex_lock(&g_lock);
    int found = 0;
    for (ref_bundle **p = &g_live; *p; p = &(*p)->next_live)
        if (*p == b) {
            *p = b->next_live;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    if (found)
        bundle_destroy(b);
}

/* ---- ABI: rings, spaces ---- */

/* Attaches or re-attaches rings by ring_id, all or nothing (ABI rules 125, 130): RING_LAYOUT for a
 * NULL array with count > 0, more than 8 rings in one call, a struct_size under 48, an unknown
 * kind or role, a LOGITS ring the engine would read, a ring_id twice, or a header that does not
 * match the descriptor (magic, ring_id, slot_bytes, slots, reserved bytes, alignment, len). Every
 * attached ring's writer cursor restarts at (index 0, generation 1). */
baseRT_status baseRT_rings_attach(baseRT_model_t bundle, const BaseRTRingDesc *descs, uint32_t count) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_ring fresh[REF_MAX_RINGS];
    if ((count && !descs) || count > REF_MAX_RINGS)
        rc = BASERT_ERR_RING_LAYOUT;
    for (uint32_t i = 0; !rc && i < count; i++) {
        BaseRTRingDesc d;
        memset(&d, 0, sizeof d);
        memcpy(&d, &descs[i], sizeof d);
        int kind_ok = d.kind == BASERT_RING_KIND_TOKENS || d.kind == BASERT_RING_KIND_LOGITS;
        int role_ok = d.role == BASERT_RING_ROLE_ENGINE_READS || d.role == BASERT_RING_ROLE_ENGINE_WRITES;
        if (d.struct_size < sizeof d || !kind_ok || !role_ok ||
            (d.kind == BASERT_RING_KIND_LOGITS && d.role == BASERT_RING_ROLE_ENGINE_READS))
            rc = BASERT_ERR_RING_LAYOUT;
        for (uint32_t k = 0; !rc && k < i; k++)
            if (fresh[k].r.ring_id == d.ring_id)
                rc = BASERT_ERR_RING_LAYOUT;
        if (!rc && brt_ring_attach(&fresh[i].r, d.base, d.len, d.ring_id, d.slot_bytes, d.slots))
            rc = BASERT_ERR_RING_LAYOUT;
        fresh[i].kind = d.kind;
        fresh[i].role = d.role;
    }
    uint32_t added = 0;
    for (uint32_t i = 0; !rc && i < count; i++)
        added += ref_ring_find(b, fresh[i].r.ring_id) == NULL;
    if (!rc && b->n_rings + added > REF_MAX_RINGS)
        rc = BASERT_ERR_RING_LAYOUT;
    for (uint32_t i = 0; !rc && i < count; i++) {
        ref_ring *slot = ref_ring_find(b, fresh[i].r.ring_id);
        if (!slot)
            slot = &b->rings[b->n_rings++];
        *slot = fresh[i];
    }
    ref_unlock(b);
    return rc;
}

/* The bundle's state spaces: an engine-owned array of BaseRTStateSpaceDesc (96 bytes each),
 * valid until the bundle is freed. BAD_STRUCT for a NULL out. */
baseRT_status baseRT_state_spaces(baseRT_model_t bundle, BaseRTArray *out_descs) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (!out_descs) {
        rc = BASERT_REJECT_BAD_STRUCT;
    } else {
        out_descs->data = b->spaces;
        out_descs->count = b->n_spaces;
        out_descs->elem_size = sizeof(BaseRTStateSpaceDesc);
    }
    ref_unlock(b);
    return rc;
}

/* ---- the test surface ---- */

baseRT_status baseRT_ref_force_finish(baseRT_model_t bundle, uint64_t lane_tag, uint32_t finish) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_lane *l = ref_lane_find(b, lane_tag);
    if (finish < BASERT_FINISH_EOS || finish > BASERT_FINISH_ERROR)
        rc = BASERT_REJECT_BOUNDS;
    else if (!l || l->state != REF_LANE_LIVE)
        rc = BASERT_REJECT_UNKNOWN_LANE;
    else {
        l->finish_armed = 1;
        l->finish_code = finish;
    }
    ref_unlock(b);
    return rc;
}

baseRT_status baseRT_ref_inject_fault(baseRT_model_t bundle, uint64_t lane_tag, uint32_t code) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_lane *l = ref_lane_find(b, lane_tag);
    if (code > BASERT_FAULT_MEDIA)
        rc = BASERT_REJECT_BOUNDS;
    else if (!l || l->state == REF_LANE_FAULTED)
        rc = BASERT_REJECT_UNKNOWN_LANE;
    else {
        l->fault_armed = 1;
        l->fault_code = code;
    }
    ref_unlock(b);
    return rc;
}

baseRT_status baseRT_ref_refuse_admits(baseRT_model_t bundle, uint32_t kind, uint64_t param, int32_t status) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (kind > BASERT_REF_REFUSE_PROMPT_OVER || (kind != BASERT_REF_REFUSE_NONE && status == 0)) {
        rc = BASERT_REJECT_BOUNDS;
    } else {
        b->refuse_kind = kind;
        b->refuse_param = param;
        b->refuse_status = status;
    }
    ref_unlock(b);
    return rc;
}

baseRT_status baseRT_ref_set_yield_word(baseRT_model_t bundle, uint64_t *words) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if ((uintptr_t)words % 8u) {
        ref_unlock(b);
        return BASERT_REJECT_BAD_STRUCT;
    }
    b->yield_words = words;
    ref_unlock(b);
    return BASERT_STATUS_OK;
}

baseRT_status baseRT_ref_stats(baseRT_model_t bundle, BaseRTRefStats *out) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (!out || out->struct_size < sizeof *out) {
        ref_unlock(b);
        return BASERT_REJECT_BAD_STRUCT;
    }
    BaseRTRefStats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    s.ticks = b->ticks;
    s.last_plan_seq = b->last_plan_seq;
    s.prefill_tokens_total = b->prefill_total;
    s.decode_tokens_total = b->decode_total;
    s.replay_tokens_total = b->replay_total;
    s.live_lanes = b->n_lanes;
    for (uint32_t i = 0; i < b->n_leases; i++)
        s.live_seed_leases += !ref_lease_expired(b, b->leases[i], b->ticks);
    s.cache_entries = b->n_entries;
    s.cache_bytes = ref_cache_bytes(b);
    s.pool_blocks_used = b->pool.used;
    s.pool_blocks_total = b->pool.n_blocks;
    s.pool_bytes_used = (uint64_t)b->pool.used * b->pool.block_bytes;
    s.pool_bytes_total = (uint64_t)b->pool.n_blocks * b->pool.block_bytes;
    s.evictions_total = b->evictions_total;
    s.faults_total = b->faults_total;
    for (uint32_t i = 0; i < b->n_seqs; i++)
        s.bare_sequences += b->seqs[i]->owner == NULL;
    s.rejected_plans = b->rejected;
    *out = s;
    ref_unlock(b);
    return BASERT_STATUS_OK;
}

baseRT_status baseRT_ref_lane_info(baseRT_model_t bundle, uint64_t lane_tag, BaseRTRefLaneInfo *out) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_lane *l = ref_lane_find(b, lane_tag);
    if (!out || out->struct_size < sizeof *out)
        rc = BASERT_REJECT_BAD_STRUCT;
    else if (!l)
        rc = BASERT_REJECT_UNKNOWN_LANE;
    else {
        BaseRTRefLaneInfo s;
        memset(&s, 0, sizeof s);
        s.struct_size = sizeof s;
        s.state = l->state;
        s.finish = l->finish;
        s.sampling = l->sampling;
        s.prompt_len = l->prompt_len;
        s.prefill_end = l->prefill_end;
        s.prefilled = l->fed;
        s.committed = l->seq ? l->seq->len : 0;
        s.generated = l->generated;
        s.rng_counter = l->rng_base + l->generated;
        s.row_nonce = l->row_pending ? l->row_nonce : 0;
        if (l->seq)
            for (uint32_t i = 0; i < b->n_spaces; i++)
                s.taint_bits |= l->seq->sp[i].taint_bits;
        s.blocks = l->seq ? l->seq->n_blocks : 0;
        *out = s;
    }
    ref_unlock(b);
    return rc;
}
