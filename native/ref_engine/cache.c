/* cache.c: the prefix cache (entries per state space), space_match, seed leases, eviction.
 *
 * An entry holds the state of one space for a token prefix: paged spaces hold the pool blocks
 * of a whole-block prefix (shared by reference count with whoever else holds them), blob spaces
 * hold snapshots at recorded boundaries. Entries are keyed by (space, tokens, provenance digest);
 * publishing an identical key again reuses the entry (ABI rule 90). Seed leases pin entries until
 * an admit consumes them, they are released, or they expire (rules 75-84). Eviction never takes a
 * pinned entry and stays inside the caller's envelope (rules 50-51, 58, 87, 89). */

#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"

/* ---- identities ---- */

void ref_provenance(const ref_bundle *b, uint32_t space, const uint32_t *tokens, uint32_t n, uint32_t taint,
                    uint64_t salt, uint8_t out[32]) {
    ref_digest d;
    ref_digest_init(&d, 0x50524F56u); /* "PROV" */
    ref_digest_update(&d, b->identity, 32);
    ref_digest_u64(&d, b->spaces[space].space_id);
    ref_digest_u64(&d, b->spaces[space].version_tag);
    ref_digest_u64(&d, taint);
    ref_digest_u64(&d, salt);
    ref_digest_u64(&d, n);
    ref_digest_update(&d, tokens, (size_t)n * sizeof *tokens);
    ref_digest_final(&d, out);
}

void ref_compat_key(const ref_bundle *b, uint32_t space, const uint32_t *tokens, uint32_t n, uint8_t out[32]) {
    ref_digest d;
    ref_digest_init(&d, 0x434F4D50u); /* "COMP" */
    ref_digest_update(&d, b->identity, 32);
    ref_digest_u64(&d, b->spaces[space].space_id);
    ref_digest_u64(&d, b->spaces[space].kind);
    ref_digest_u64(&d, b->spaces[space].version_tag);
    ref_digest_u64(&d, n);
    ref_digest_update(&d, tokens, (size_t)n * sizeof *tokens);
    ref_digest_final(&d, out);
}

void ref_space_identity(const ref_bundle *b, uint32_t space, uint8_t out[32]) {
    const BaseRTStateSpaceDesc *d = &b->spaces[space];
    ref_digest g;
    ref_digest_init(&g, 0x4944454Eu); /* "IDEN" */
    ref_digest_update(&g, b->identity, 32);
    ref_digest_u64(&g, d->space_id);
    ref_digest_u64(&g, d->kind);
    ref_digest_u64(&g, d->version_tag);
    ref_digest_u64(&g, d->bytes_per_token);
    ref_digest_u64(&g, d->blob_bytes);
    ref_digest_u64(&g, d->page_size_tokens);
    ref_digest_final(&g, out);
}

static int cacheable(const ref_bundle *b, uint32_t i) {
    return b->space_cfg[i].kind != BASERT_SPACE_KIND_ENCODER_CACHE &&
           !(b->space_cfg[i].flags & BASERT_SPACE_FLAG_NO_PREFIX_CACHE);
}

static void touch(ref_bundle *b, ref_entry *e) { e->lru = ++b->lru_clock; }

uint64_t ref_cache_bytes(const ref_bundle *b) {
    uint64_t t = 0;
    for (uint32_t i = 0; i < b->n_entries; i++)
        t += b->entries[i]->bytes;
    return t;
}

uint32_t ref_entry_pins_at(const ref_bundle *b, const ref_entry *e, uint64_t tick_index) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < b->n_leases; i++) {
        const ref_lease *l = b->leases[i];
        if (ref_lease_expired(b, l, tick_index))
            continue;
        for (uint32_t k = 0; k < l->n_pinned; k++)
            n += l->pinned[k] == e;
    }
    return n;
}

uint64_t ref_cache_evictable_bytes(const ref_bundle *b) {
    uint64_t t = 0;
    for (uint32_t i = 0; i < b->n_entries; i++)
        if (!ref_entry_pins_at(b, b->entries[i], b->ticks))
            t += b->entries[i]->bytes;
    return t;
}

static ref_entry *find_entry(ref_bundle *b, uint32_t space, const uint32_t *tokens, uint32_t n,
                             const uint8_t prov[32]) {
    for (uint32_t i = 0; i < b->n_entries; i++) {
        ref_entry *e = b->entries[i];
        if (e->space == space && e->n_tokens == n && !memcmp(e->provenance, prov, 32) &&
            !memcmp(e->tokens, tokens, (size_t)n * sizeof *tokens))
            return e;
    }
    return NULL;
}

/* ---- publish ---- */

/* What space i of s would publish under key tokens[0..n): its length (0 = nothing) and, for blob
 * spaces, the boundaries (<= that length) it would carry. */
static uint32_t publish_len(const ref_bundle *b, const ref_seq *s, uint32_t i, uint32_t n) {
    const ref_space_state *sp = &s->sp[i];
    if (n > sp->valid_len)
        n = (uint32_t)sp->valid_len;
    if (ref_space_is_paged(b, i))
        return n / b->pool.block_tokens * b->pool.block_tokens;
    if (!ref_space_is_blob(b, i))
        return 0;
    uint32_t best = 0;
    for (uint32_t k = 0; k < sp->n_boundaries; k++)
        if (sp->boundaries[k] <= n && sp->boundaries[k] > best)
            best = (uint32_t)sp->boundaries[k];
    if (b->space_cfg[i].snapshot_cadence == 1 && n > best)
        best = n; /* tool-boundary cadence: the published end is a boundary */
    return best;
}

void ref_cache_sim_publish(ref_bundle *b, const ref_seq *s) {
    if (b->paged_space < 0 || !cacheable(b, (uint32_t)b->paged_space) || s->tokens_unknown)
        return;
    uint32_t i = (uint32_t)b->paged_space;
    uint32_t n = publish_len(b, s, i, s->len);
    if (!n)
        return;
    uint8_t prov[32];
    ref_provenance(b, i, s->tokens, n, s->sp[i].taint_bits, s->sp[i].prov_salt, prov);
    if (find_entry(b, i, s->tokens, n, prov))
        return;
    for (uint32_t k = 0; k < n / b->pool.block_tokens; k++)
        ref_sim_ref(&b->pool, s->blocks[k]);
}

int ref_cache_publish(ref_bundle *b, ref_seq *s, const uint32_t *tokens, uint32_t n) {
    if (!tokens) {
        if (s->tokens_unknown)
            return 0;
        tokens = s->tokens;
    }
    if (n > s->len)
        n = s->len;
    for (uint32_t i = 0; i < b->n_spaces; i++) {
        if (!cacheable(b, i))
            continue;
        const ref_space_state *sp = &s->sp[i];
        uint32_t len = publish_len(b, s, i, n);
        if (!len)
            continue;
        uint8_t prov[32];
        ref_provenance(b, i, tokens, len, sp->taint_bits, sp->prov_salt, prov);
        ref_entry *e = find_entry(b, i, tokens, len, prov);
        if (e) {
            touch(b, e);
            continue;
        }
        if (ref_reserve((void **)&b->entries, &b->cap_entries, (uint64_t)b->n_entries + 1, sizeof *b->entries))
            return -1;
        e = calloc(1, sizeof *e);
        if (!e)
            return -1;
        e->tokens = malloc((size_t)len * sizeof *tokens);
        if (!e->tokens) {
            free(e);
            return -1;
        }
        memcpy(e->tokens, tokens, (size_t)len * sizeof *tokens);
        e->n_tokens = len;
        e->space = i;
        memcpy(e->provenance, prov, 32);
        ref_compat_key(b, i, tokens, len, e->compat_key);
        e->taint_bits = sp->taint_bits;
        e->prov_salt = sp->prov_salt;
        e->cache_class = REF_CACHE_CLASS_DEFAULT;
        if (ref_space_is_paged(b, i)) {
            e->n_blocks = len / b->pool.block_tokens;
            e->blocks = malloc((size_t)(e->n_blocks ? e->n_blocks : 1) * sizeof *e->blocks);
            if (!e->blocks) {
                free(e->tokens);
                free(e);
                return -1;
            }
            for (uint32_t k = 0; k < e->n_blocks; k++) {
                e->blocks[k] = s->blocks[k];
                ref_pool_ref(&b->pool, s->blocks[k]);
            }
            e->bytes = (uint64_t)e->n_blocks * b->pool.block_bytes;
        } else {
            uint32_t nb = 0;
            for (uint32_t k = 0; k < sp->n_boundaries; k++)
                nb += sp->boundaries[k] <= len;
            int extra = !nb || sp->boundaries[nb - 1] != len; /* tool-boundary end */
            e->boundaries = malloc((size_t)(nb + 1) * sizeof *e->boundaries);
            if (!e->boundaries) {
                free(e->tokens);
                free(e);
                return -1;
            }
            if (nb)
                memcpy(e->boundaries, sp->boundaries, (size_t)nb * sizeof *e->boundaries);
            if (extra)
                e->boundaries[nb++] = len;
            e->n_boundaries = nb;
            e->bytes = (uint64_t)nb * b->space_cfg[i].blob_bytes;
        }
        e->id = ++b->next_entry_id;
        touch(b, e);
        b->entries[b->n_entries++] = e;
    }
    return 0;
}

static void entry_free(ref_bundle *b, ref_entry *e) {
    for (uint32_t k = 0; k < e->n_blocks; k++)
        ref_pool_unref(&b->pool, e->blocks[k]);
    free(e->blocks);
    free(e->boundaries);
    free(e->tokens);
    free(e);
}

void ref_cache_remove(ref_bundle *b, ref_entry *e) {
    for (uint32_t i = 0; i < b->n_entries; i++)
        if (b->entries[i] == e) {
            b->entries[i] = b->entries[--b->n_entries];
            break;
        }
    entry_free(b, e);
}

/* ---- leases ---- */

ref_lease *ref_lease_find(ref_bundle *b, uint64_t handle) {
    for (uint32_t i = 0; i < b->n_leases; i++)
        if (b->leases[i]->handle == handle)
            return b->leases[i];
    return NULL;
}

int ref_lease_expired(const ref_bundle *b, const ref_lease *l, uint64_t tick_index) {
    return tick_index > l->acquired_tick + b->cfg.seed_lease_ticks;
}

void ref_lease_drop(ref_bundle *b, ref_lease *l, int free_adopted) {
    for (uint32_t k = 0; k < l->n_pinned; k++)
        l->pinned[k]->pins--;
    if (l->adopted) {
        l->adopted->leased = 0;
        if (free_adopted)
            ref_seq_destroy(b, l->adopted);
    }
    for (uint32_t i = 0; i < b->n_leases; i++)
        if (b->leases[i] == l) {
            b->leases[i] = b->leases[--b->n_leases];
            break;
        }
    free(l->prefix);
    free(l->pinned);
    free(l);
}

void ref_leases_sweep(ref_bundle *b, uint64_t tick_index) {
    for (uint32_t i = 0; i < b->n_leases;) {
        if (ref_lease_expired(b, b->leases[i], tick_index))
            ref_lease_drop(b, b->leases[i], 1); /* swaps another lease into slot i */
        else
            i++;
    }
}

/* ---- eviction ---- */

static int by_lru(const void *x, const void *y) {
    const ref_entry *a = *(ref_entry *const *)x, *c = *(ref_entry *const *)y;
    return (a->lru > c->lru) - (a->lru < c->lru);
}

static uint64_t evict_cap(const ref_bundle *b, const BaseRTShedPolicy *policy, uint64_t target) {
    uint64_t total = ref_cache_bytes(b);
    uint64_t room = total > policy->protected_quota_bytes ? total - policy->protected_quota_bytes : 0;
    uint64_t cap = policy->max_evict_bytes < room ? policy->max_evict_bytes : room;
    return target < cap ? target : cap;
}

int ref_cache_plan_evictions(ref_bundle *b, const BaseRTShedPolicy *policy, uint64_t tick_index, ref_work *w) {
    w->n_evict = 0;
    ref_pool *p = &b->pool;
    if (p->sim_free >= 0)
        return 0;
    if (ref_reserve((void **)&w->evict, &w->cap_evict, b->n_entries, sizeof *w->evict))
        return -2;
    uint32_t n = 0;
    for (uint32_t i = 0; i < b->n_entries; i++) {
        ref_entry *e = b->entries[i];
        if (e->n_blocks && (e->cache_class & policy->evictable_cache_classes) &&
            !ref_entry_pins_at(b, e, tick_index))
            w->evict[n++] = e;
    }
    if (n)
        qsort(w->evict, n, sizeof *w->evict, by_lru);
    uint64_t cap = evict_cap(b, policy, UINT64_MAX), taken = 0;
    uint32_t chosen = 0;
    for (uint32_t i = 0; i < n && p->sim_free < 0; i++) {
        ref_entry *e = w->evict[i];
        if (taken + e->bytes > cap)
            continue;
        uint32_t frees = 0;
        for (uint32_t k = 0; k < e->n_blocks; k++)
            frees += ref_sim_rc(p, e->blocks[k]) == 1;
        if (!frees)
            continue; /* every block is still held elsewhere: evicting it would free nothing */
        for (uint32_t k = 0; k < e->n_blocks; k++)
            ref_sim_unref(p, e->blocks[k]);
        taken += e->bytes;
        w->evict[chosen++] = e;
    }
    w->n_evict = chosen;
    return p->sim_free >= 0 ? 0 : -1;
}

/* ---- spans ---- */

baseRT_status ref_read_span(ref_bundle *b, BaseRTTokenRef span, uint32_t *dst) {
    if (!span.count || span.count > b->cfg.context_length)
        return BASERT_REJECT_BOUNDS;
    ref_ring *r = ref_ring_find(b, span.ring_id);
    if (!r || r->role != BASERT_RING_ROLE_ENGINE_READS || r->kind != BASERT_RING_KIND_TOKENS)
        return BASERT_REJECT_BAD_REF_GENERATION;
    if (brt_ring_read(&r->r, span.index, span.generation, span.count, 4, dst))
        return BASERT_REJECT_BAD_REF_GENERATION;
    for (uint32_t i = 0; i < span.count; i++)
        if (dst[i] >= b->cfg.vocab_size)
            return BASERT_REJECT_BOUNDS;
    return BASERT_STATUS_OK;
}

baseRT_status ref_read_span_buf(ref_bundle *b, BaseRTTokenRef span) {
    if (!span.count || span.count > b->cfg.context_length)
        return BASERT_REJECT_BOUNDS;
    if (ref_reserve((void **)&b->span_buf, &b->cap_span, span.count, sizeof *b->span_buf))
        return BASERT_ERR_FATAL;
    return ref_read_span(b, span, b->span_buf);
}

static uint32_t common_prefix(const uint32_t *a, uint32_t na, const uint32_t *c, uint32_t nc) {
    uint32_t n = na < nc ? na : nc, i = 0;
    while (i < n && a[i] == c[i])
        i++;
    return i;
}

/* ---- ABI entry points ---- */

static int by_len_desc(const void *x, const void *y) {
    const BaseRTMatchCandidate *a = x, *c = y;
    return (a->prefix_len < c->prefix_len) - (a->prefix_len > c->prefix_len);
}

/* Candidates per space for the tokens of `span` (ABI rules 87-88): paged spaces answer the
 * longest common prefix with each entry rounded down to whole blocks, blob spaces the largest
 * recorded boundary within it; longest first, duplicates merged. Pins and touches nothing.
 * media_deps are ignored (the reference has no media-dependent entries). *out is valid until the
 * next call on the bundle. BAD_STRUCT (NULL out), UNKNOWN_HANDLE (unknown space id), BOUNDS,
 * BAD_REF_GENERATION (span, see ref_read_span). */
baseRT_status baseRT_space_match(baseRT_model_t bundle, uint32_t space_id, BaseRTTokenRef span,
                                 BaseRTArray media_deps, const BaseRTMatchResult **out) {
    (void)media_deps;
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    int only = space_id == BASERT_ALL_SPACES ? -1 : ref_space_index(b, space_id);
    if (!out)
        rc = BASERT_REJECT_BAD_STRUCT;
    else if (space_id != BASERT_ALL_SPACES && only < 0)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else
        rc = ref_read_span_buf(b, span);
    if (!rc && (ref_reserve((void **)&b->match_spaces, &b->cap_match_spaces, b->n_spaces, sizeof *b->match_spaces) ||
                ref_reserve((void **)&b->match_cands, &b->cap_match_cands, (uint64_t)b->n_entries + 1,
                            sizeof *b->match_cands)))
        rc = BASERT_ERR_FATAL;
    if (rc) {
        ref_unlock(b);
        return rc;
    }
    uint32_t n_sp = 0, n_c = 0;
    for (uint32_t i = 0; i < b->n_spaces; i++) {
        if (only >= 0 && (uint32_t)only != i)
            continue;
        uint32_t first = n_c;
        for (uint32_t k = 0; k < b->n_entries; k++) {
            const ref_entry *e = b->entries[k];
            if (e->space != i)
                continue;
            uint32_t lcp = common_prefix(e->tokens, e->n_tokens, b->span_buf, span.count), len = 0;
            if (ref_space_is_paged(b, i))
                len = lcp / b->pool.block_tokens * b->pool.block_tokens;
            else
                for (uint32_t q = 0; q < e->n_boundaries; q++)
                    if (e->boundaries[q] <= lcp && e->boundaries[q] > len)
                        len = (uint32_t)e->boundaries[q];
            if (!len)
                continue;
            BaseRTMatchCandidate c;
            memset(&c, 0, sizeof c);
            c.prefix_len = len;
            c.taint_bits = e->taint_bits;
            c.resident_tier = BASERT_TIER_GPU;
            ref_provenance(b, i, b->span_buf, len, e->taint_bits, e->prov_salt, c.provenance_digest);
            int dup = 0;
            for (uint32_t q = first; q < n_c && !dup; q++)
                dup = b->match_cands[q].prefix_len == c.prefix_len &&
                      !memcmp(b->match_cands[q].provenance_digest, c.provenance_digest, 32);
            if (!dup)
                b->match_cands[n_c++] = c;
        }
        qsort(b->match_cands + first, n_c - first, sizeof *b->match_cands, by_len_desc);
        BaseRTSpaceMatch *m = &b->match_spaces[n_sp++];
        memset(m, 0, sizeof *m);
        m->space_id = b->spaces[i].space_id;
        m->candidates.count = n_c - first;
        m->candidates.elem_size = sizeof(BaseRTMatchCandidate);
        m->candidates.data = n_c > first ? (const void *)(b->match_cands + first) : NULL;
    }
    memset(&b->match, 0, sizeof b->match);
    b->match.struct_size = sizeof b->match;
    b->match.spaces.data = n_sp ? b->match_spaces : NULL;
    b->match.spaces.count = n_sp;
    b->match.spaces.elem_size = sizeof(BaseRTSpaceMatch);
    *out = &b->match;
    ref_unlock(b);
    return BASERT_STATUS_OK;
}

static ref_entry *pick_entry(ref_bundle *b, uint32_t space, const uint32_t *prefix, uint32_t len, int deterministic) {
    ref_entry *best = NULL;
    for (uint32_t k = 0; k < b->n_entries; k++) {
        ref_entry *e = b->entries[k];
        if (e->space != space || e->n_tokens < len || memcmp(e->tokens, prefix, (size_t)len * 4))
            continue;
        if (deterministic && e->taint_bits)
            continue;
        if (ref_space_is_paged(b, space)) {
            if (len % b->pool.block_tokens)
                continue;
        } else {
            int at = 0;
            for (uint32_t q = 0; q < e->n_boundaries && !at; q++)
                at = e->boundaries[q] == len;
            if (!at)
                continue;
        }
        if (!best || (e->taint_bits == 0 && best->taint_bits) ||
            ((e->taint_bits == 0) == (best->taint_bits == 0) && e->lru > best->lru))
            best = e;
    }
    return best;
}

/* Pins the first prefix_len tokens of `span` in every space and returns a lease handle
 * (ABI rules 75-79, 83). BOUNDS: prefix_len 0 or beyond the span, a determinism class above
 * DETERMINISTIC, a bad span; BAD_REF_GENERATION: stale span; SEED_UNSERVABLE: a space flagged
 * OPS_UNAVAILABLE or NO_PREFIX_CACHE, or a space with no entry serving exactly that prefix
 * (paged: a whole-block prefix of an entry; blob: a recorded boundary; DETERMINISTIC: untainted
 * entries only). Nothing is pinned on refusal. */
baseRT_status baseRT_seed_acquire(baseRT_model_t bundle, BaseRTTokenRef span, uint64_t prefix_len,
                                  uint8_t determinism_class, uint64_t *seed_handle) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (!seed_handle)
        rc = BASERT_REJECT_BAD_STRUCT;
    else if (!prefix_len || prefix_len > span.count || determinism_class > BASERT_DETERMINISM_DETERMINISTIC)
        rc = BASERT_REJECT_BOUNDS;
    else
        rc = ref_read_span_buf(b, span);
    for (uint32_t i = 0; !rc && i < b->n_spaces; i++)
        if (b->space_cfg[i].flags & (BASERT_SPACE_FLAG_OPS_UNAVAILABLE | BASERT_SPACE_FLAG_NO_PREFIX_CACHE))
            rc = BASERT_ERR_SEED_UNSERVABLE;
    ref_lease *l = NULL;
    if (!rc) {
        ref_leases_sweep(b, b->ticks);
        l = calloc(1, sizeof *l);
        if (!l || !(l->pinned = calloc(b->n_spaces, sizeof *l->pinned)) ||
            !(l->prefix = malloc((size_t)prefix_len * 4)) ||
            ref_reserve((void **)&b->leases, &b->cap_leases, (uint64_t)b->n_leases + 1, sizeof *b->leases))
            rc = BASERT_ERR_FATAL;
    }
    for (uint32_t i = 0; !rc && i < b->n_spaces; i++) {
        if (b->space_cfg[i].kind == BASERT_SPACE_KIND_ENCODER_CACHE)
            continue;
        ref_entry *e = pick_entry(b, i, b->span_buf, (uint32_t)prefix_len,
                                  determinism_class == BASERT_DETERMINISM_DETERMINISTIC);
        if (!e)
            rc = BASERT_ERR_SEED_UNSERVABLE;
        else
            l->pinned[l->n_pinned++] = e;
    }
    if (rc) {
        if (l) {
            free(l->pinned);
            free(l->prefix);
            free(l);
        }
        ref_unlock(b);
        return rc;
    }
    memcpy(l->prefix, b->span_buf, (size_t)prefix_len * 4);
    l->prefix_len = (uint32_t)prefix_len;
    l->determinism_class = determinism_class;
    l->acquired_tick = b->ticks;
    l->handle = ++b->next_seed;
    for (uint32_t k = 0; k < l->n_pinned; k++) {
        ref_entry *e = l->pinned[k];
        e->pins++;
        touch(b, e);
        l->taint_bits |= e->taint_bits;
        if (ref_space_is_paged(b, e->space) || !l->prov_salt)
            l->prov_salt = e->prov_salt;
    }
    b->leases[b->n_leases++] = l;
    *seed_handle = l->handle;
    ref_unlock(b);
    return BASERT_STATUS_OK;
}

/* Releases an unconsumed lease (its pins drop; an adopted sequence goes back to its caller).
 * UNKNOWN_HANDLE for a handle never issued, already consumed, released or expired (rule 81). */
baseRT_status baseRT_seed_release(baseRT_model_t bundle, uint64_t seed_handle) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_leases_sweep(b, b->ticks);
    ref_lease *l = ref_lease_find(b, seed_handle);
    if (!l)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else
        ref_lease_drop(b, l, 0);
    ref_unlock(b);
    return rc;
}

/* The lease TTL in ticks (rule 84): config seed_lease_ticks, 8 by default. */
baseRT_status baseRT_seed_lease_ticks(baseRT_model_t bundle, uint64_t *ticks) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (!ticks)
        rc = BASERT_REJECT_BAD_STRUCT;
    else
        *ticks = b->cfg.seed_lease_ticks;
    ref_unlock(b);
    return rc;
}

/* Leases a whole bare sequence as the seed of one admit (rule 86). UNKNOWN_HANDLE: not a sequence
 * of this bundle, or lane-owned; EBUSY: a state op or another lease holds it; SEED_UNSERVABLE: the
 * span is empty, differs in length from any space of the sequence, or names other tokens than it
 * holds; BAD_STRUCT: NULL handle pointer; BOUNDS / BAD_REF_GENERATION: unreadable span. The lease
 * has the TTL of rule 83; expiry frees the sequence, release hands it back. An admit of any
 * determinism class may consume it, except a DETERMINISTIC one when it carries taint. */
baseRT_status baseRT_seed_adopt(baseRT_model_t bundle, baseRT_sequence_t seq, BaseRTTokenRef span,
                                uint64_t *seed_handle) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_seq *s = ref_seq_find(b, seq);
    if (!seed_handle)
        rc = BASERT_REJECT_BAD_STRUCT;
    else if (!s || s->owner)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else if (s->ops_in_flight || s->leased)
        rc = BASERT_EBUSY;
    else if (!span.count || span.count != s->len)
        rc = BASERT_ERR_SEED_UNSERVABLE;
    for (uint32_t i = 0; !rc && i < b->n_spaces; i++)
        if (b->space_cfg[i].kind != BASERT_SPACE_KIND_ENCODER_CACHE && s->sp[i].valid_len != span.count)
            rc = BASERT_ERR_SEED_UNSERVABLE;
    if (!rc)
        rc = ref_read_span_buf(b, span);
    if (!rc && !s->tokens_unknown && memcmp(s->tokens, b->span_buf, (size_t)span.count * 4))
        rc = BASERT_ERR_SEED_UNSERVABLE;
    ref_lease *l = NULL;
    if (!rc) {
        ref_leases_sweep(b, b->ticks);
        l = calloc(1, sizeof *l);
        if (!l || !(l->prefix = malloc((size_t)span.count * 4)) ||
            ref_reserve((void **)&b->leases, &b->cap_leases, (uint64_t)b->n_leases + 1, sizeof *b->leases)) {
            if (l)
                free(l->prefix);
            free(l);
            rc = BASERT_ERR_FATAL;
        }
    }
    if (!rc) {
        memcpy(l->prefix, b->span_buf, (size_t)span.count * 4);
        l->prefix_len = span.count;
        l->determinism_class = BASERT_DETERMINISM_BEST_EFFORT;
        l->acquired_tick = b->ticks;
        l->adopted = s;
        for (uint32_t i = 0; i < b->n_spaces; i++)
            l->taint_bits |= s->sp[i].taint_bits;
        l->handle = ++b->next_seed;
        if (s->tokens_unknown) {
            if (ref_reserve((void **)&s->tokens, &s->cap, span.count, sizeof *s->tokens)) {
                free(l->prefix);
                free(l);
                ref_unlock(b);
                return BASERT_ERR_FATAL;
            }
            memcpy(s->tokens, b->span_buf, (size_t)span.count * 4);
            s->hist_hash = b->model_seed;
            for (uint32_t i = 0; i < span.count; i++)
                s->hist_hash = ref_token_step(s->hist_hash, s->tokens[i]);
            s->tokens_unknown = 0;
        }
        s->leased = 1;
        b->leases[b->n_leases++] = l;
        *seed_handle = l->handle;
    }
    ref_unlock(b);
    return rc;
}

/* Evicts unpinned entries of the allowed classes, least recently used first, freeing at most
 * min(bytes_target, max_evict_bytes, cache bytes - protected_quota_bytes) entry bytes; *bytes_freed
 * is what the evicted entries were charged (rule 89). BAD_STRUCT for NULL pointers; the
 * victim_lanes array is checked by the rules of section C. */
baseRT_status baseRT_cache_evict(baseRT_model_t bundle, const BaseRTShedPolicy *policy, uint64_t bytes_target,
                                 uint64_t *bytes_freed) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (!policy || !bytes_freed)
        rc = BASERT_REJECT_BAD_STRUCT;
    else
        rc = ref_check_array(&policy->victim_lanes, 8);
    if (rc) {
        ref_unlock(b);
        return rc;
    }
    ref_leases_sweep(b, b->ticks);
    uint64_t cap = evict_cap(b, policy, bytes_target), freed = 0;
    for (;;) {
        ref_entry *victim = NULL;
        for (uint32_t i = 0; i < b->n_entries; i++) {
            ref_entry *e = b->entries[i];
            if (e->pins || !(e->cache_class & policy->evictable_cache_classes) || freed + e->bytes > cap)
                continue;
            if (!victim || e->lru < victim->lru)
                victim = e;
        }
        if (!victim)
            break;
        freed += victim->bytes;
        ref_cache_remove(b, victim);
        b->evictions_total++;
    }
    *bytes_freed = freed;
    ref_unlock(b);
    return BASERT_STATUS_OK;
}

static int key_matches(const ref_entry *e, const BaseRTCacheKey *k) {
    static const uint8_t zero[32];
    if (memcmp(e->provenance, k->provenance_digest, 32))
        return 0;
    return !memcmp(k->compat_key, zero, 32) || !memcmp(k->compat_key, e->compat_key, 32);
}

/* Drops every entry named by a BaseRTCacheKey (compat_key, provenance_digest); an all-zero
 * compat_key names every entry with that provenance digest (space_match reports digests, not
 * compat keys). Keys naming nothing are ignored. All or nothing: EBUSY when a named entry is
 * pinned by a seed lease; section C codes for a malformed array. */
baseRT_status baseRT_cache_evict_entries(baseRT_model_t bundle, BaseRTArray entry_keys) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    rc = ref_check_array(&entry_keys, sizeof(BaseRTCacheKey));
    if (!rc)
        ref_leases_sweep(b, b->ticks);
    const uint8_t *base = entry_keys.data;
    for (uint32_t q = 0; !rc && q < entry_keys.count; q++) {
        BaseRTCacheKey k;
        memcpy(&k, base + (size_t)q * entry_keys.elem_size, sizeof k);
        for (uint32_t i = 0; i < b->n_entries && !rc; i++)
            if (key_matches(b->entries[i], &k) && b->entries[i]->pins)
                rc = BASERT_EBUSY;
    }
    for (uint32_t q = 0; !rc && q < entry_keys.count; q++) {
        BaseRTCacheKey k;
        memcpy(&k, base + (size_t)q * entry_keys.elem_size, sizeof k);
        for (uint32_t i = 0; i < b->n_entries;) {
            if (key_matches(b->entries[i], &k)) {
                ref_cache_remove(b, b->entries[i]);
                b->evictions_total++;
            } else {
                i++;
            }
        }
    }
    ref_unlock(b);
    return rc;
}
