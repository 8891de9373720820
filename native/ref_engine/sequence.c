/* sequence.c: sequences (the state a lane decodes on) and their ABI entry points.
 *
 * A sequence holds the tokens whose KV is resident, the pool blocks covering them and one
 * ref_space_state per state space. A lane owns exactly one; bare sequences (no owner) are made
 * by baseRT_tick_sequence_create or baseRT_seq_fork and end by free, publish or adoption.
 * Handles (baseRT_sequence_t) are integers, (bundle serial << 32) | a per-bundle counter: unique
 * in the process, never reused and never dereferenced; every call looks them up, so a stale or
 * foreign handle is refused, not followed. */

#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"

baseRT_sequence_t ref_seq_handle(const ref_seq *s) { return (baseRT_sequence_t)(uintptr_t)s->handle; }

ref_seq *ref_seq_find(ref_bundle *b, baseRT_sequence_t h) {
    if (!h)
        return NULL;
    return ref_map_get(&b->seq_index, (uint64_t)(uintptr_t)h);
}

ref_seq *ref_seq_new(ref_bundle *b) {
    ref_seq *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->sp = calloc(b->n_spaces ? b->n_spaces : 1, sizeof *s->sp);
    if (!s->sp || ref_reserve((void **)&b->seqs, &b->cap_seqs, (uint64_t)b->n_seqs + 1, sizeof *b->seqs)) {
        free(s->sp);
        free(s);
        return NULL;
    }
    s->handle = (b->serial << 32) | ++b->next_seq_serial;
    s->b = b;
    s->hist_hash = b->model_seed;
    if (ref_map_put(&b->seq_index, s->handle, s)) {
        free(s->sp);
        free(s);
        return NULL;
    }
    b->seqs[b->n_seqs++] = s;
    return s;
}

void ref_seq_release_blocks(ref_bundle *b, ref_seq *s) {
    for (uint32_t i = 0; i < s->n_blocks; i++)
        ref_pool_unref(&b->pool, s->blocks[i]);
    s->n_blocks = 0;
}

void ref_seq_clear(ref_bundle *b, ref_seq *s) {
    ref_seq_release_blocks(b, s);
    s->len = 0;
    s->hist_hash = b->model_seed;
    for (uint32_t i = 0; i < b->n_spaces; i++) {
        s->sp[i].valid_len = 0;
        s->sp[i].n_boundaries = 0;
        s->sp[i].content_gen++;
    }
    ref_ops_seq_cleared(b, s);
}

void ref_seq_destroy(ref_bundle *b, ref_seq *s) {
    ref_seq_release_blocks(b, s);
    for (uint32_t i = 0; i < b->n_spaces; i++) {
        ref_ops_space_free(b, &s->sp[i]);
        free(s->sp[i].boundaries);
    }
    ref_map_del(&b->seq_index, s->handle);
    for (uint32_t i = 0; i < b->n_seqs; i++)
        if (b->seqs[i] == s) {
            b->seqs[i] = b->seqs[--b->n_seqs];
            break;
        }
    free(s->sp);
    free(s->tokens);
    free(s->blocks);
    free(s);
}

static int push_boundary(ref_space_state *sp, uint64_t pos) {
    if (sp->n_boundaries && sp->boundaries[sp->n_boundaries - 1] >= pos)
        return 0;
    if (ref_reserve((void **)&sp->boundaries, &sp->cap_boundaries, (uint64_t)sp->n_boundaries + 1,
                    sizeof *sp->boundaries))
        return -1;
    sp->boundaries[sp->n_boundaries++] = pos;
    return 0;
}

/* Per-space bookkeeping after the sequence grew from old_len by n tokens. */
static int spaces_grew(ref_bundle *b, ref_seq *s, uint64_t n) {
    for (uint32_t i = 0; i < b->n_spaces; i++) {
        ref_space_state *sp = &s->sp[i];
        const BaseRTRefSpace *c = &b->space_cfg[i];
        if (c->kind == BASERT_SPACE_KIND_ENCODER_CACHE)
            continue;
        uint64_t from = sp->valid_len;
        sp->valid_len += n;
        sp->content_gen++;
        if (ref_space_is_blob(b, i) && c->snapshot_cadence == 2 && c->snapshot_interval_tokens) {
            uint64_t iv = c->snapshot_interval_tokens;
            for (uint64_t p = (from / iv + 1) * iv; p <= sp->valid_len; p += iv)
                if (push_boundary(sp, p))
                    return -1;
        }
    }
    return 0;
}

int ref_seq_append(ref_bundle *b, ref_seq *s, const uint32_t *tokens, uint32_t n) {
    if (!n)
        return 0;
    if ((uint64_t)s->len + n > 0xFFFFFFFFull)
        return -1;
    if (ref_reserve((void **)&s->tokens, &s->cap, (uint64_t)s->len + n, sizeof *s->tokens))
        return -1;
    ref_pool *p = &b->pool;
    if (p->block_bytes) {
        uint32_t need = ref_pool_blocks_for(p, (uint64_t)s->len + n);
        if (ref_reserve((void **)&s->blocks, &s->cap_blocks, need, sizeof *s->blocks))
            return -1;
        if (s->len % p->block_tokens && s->n_blocks && p->rc[s->blocks[s->n_blocks - 1]] > 1) {
            uint32_t fresh = ref_pool_alloc(p); /* copy of a shared partial block */
            if (fresh == REF_NO_BLOCK)
                return -1;
            ref_pool_unref(p, s->blocks[s->n_blocks - 1]);
            s->blocks[s->n_blocks - 1] = fresh;
        }
        while (s->n_blocks < need) {
            uint32_t fresh = ref_pool_alloc(p);
            if (fresh == REF_NO_BLOCK)
                return -1;
            s->blocks[s->n_blocks++] = fresh;
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        s->tokens[s->len++] = tokens[i];
        s->hist_hash = ref_token_step(s->hist_hash, tokens[i]);
    }
    return spaces_grew(b, s, n);
}

int ref_seq_seed(ref_bundle *b, ref_seq *s, const uint32_t *tokens, uint32_t n, const uint32_t *blocks,
                 uint32_t n_blocks, uint32_t taint_bits, uint64_t prov_salt) {
    if (ref_reserve((void **)&s->tokens, &s->cap, n, sizeof *s->tokens) ||
        ref_reserve((void **)&s->blocks, &s->cap_blocks, n_blocks, sizeof *s->blocks))
        return -1;
    if (n)
        memcpy(s->tokens, tokens, (size_t)n * sizeof *tokens);
    s->len = n;
    s->hist_hash = b->model_seed;
    for (uint32_t i = 0; i < n; i++)
        s->hist_hash = ref_token_step(s->hist_hash, tokens[i]);
    for (uint32_t i = 0; i < n_blocks; i++) {
        ref_pool_ref(&b->pool, blocks[i]);
        s->blocks[i] = blocks[i];
    }
    s->n_blocks = n_blocks;
    for (uint32_t i = 0; i < b->n_spaces; i++) {
        ref_space_state *sp = &s->sp[i];
        if (b->space_cfg[i].kind == BASERT_SPACE_KIND_ENCODER_CACHE)
            continue;
        sp->valid_len = n;
        sp->content_gen++;
        sp->taint_bits |= taint_bits;
        sp->prov_salt = prov_salt;
        if (ref_space_is_blob(b, i) && push_boundary(sp, n))
            return -1;
    }
    return 0;
}

/* ---- ABI entry points ---- */

baseRT_sequence_t baseRT_tick_lane_sequence(baseRT_model_t bundle, uint64_t lane_tag) {
    baseRT_status err;
    ref_bundle *b = ref_lock(bundle, &err);
    if (!b)
        return NULL;
    ref_lane *l = ref_lane_find(b, lane_tag);
    baseRT_sequence_t h = (l && l->state != REF_LANE_FAULTED && l->seq) ? ref_seq_handle(l->seq) : NULL;
    ref_unlock(b);
    return h;
}

baseRT_sequence_t baseRT_tick_sequence_create(baseRT_model_t bundle) {
    baseRT_status err;
    ref_bundle *b = ref_lock(bundle, &err);
    if (!b)
        return NULL;
    ref_seq *s = ref_seq_new(b);
    baseRT_sequence_t h = s ? ref_seq_handle(s) : NULL;
    ref_unlock(b);
    return h;
}

/* Frees a bare sequence of this bundle (ABI rule 112): UNKNOWN_HANDLE for an unknown, foreign,
 * already freed or lane-owned handle; EBUSY while a state op or an adopt lease holds it. */
baseRT_status baseRT_tick_sequence_free(baseRT_model_t bundle, baseRT_sequence_t seq) {
    baseRT_status err;
    ref_bundle *b = ref_lock(bundle, &err);
    if (!b)
        return err;
    ref_seq *s = ref_seq_find(b, seq);
    baseRT_status rc = BASERT_STATUS_OK;
    if (!s || s->owner)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else if (s->ops_in_flight || s->leased)
        rc = BASERT_EBUSY;
    else
        ref_seq_destroy(b, s);
    ref_unlock(b);
    return rc;
}

/* Publishes a bare sequence's whole-block prefix of `tokens` (n_tokens, at most its length) to
 * the cache and consumes it (ABI rule 91). A sub-block tail publishes nothing and still consumes
 * it. Refusals leave it untouched: UNKNOWN_HANDLE (not a bare sequence of this bundle), EBUSY (an
 * op or lease holds it), BOUNDS (NULL tokens with n_tokens > 0), OUT_OF_BOUNDARY (more tokens than
 * it holds), IDENTITY_MISMATCH (tokens differ from the ones it holds). */
baseRT_status baseRT_tick_sequence_publish(baseRT_model_t bundle, baseRT_sequence_t seq, const uint32_t *tokens,
                                           uint32_t n_tokens) {
    baseRT_status err;
    ref_bundle *b = ref_lock(bundle, &err);
    if (!b)
        return err;
    ref_seq *s = ref_seq_find(b, seq);
    baseRT_status rc = BASERT_STATUS_OK;
    if (!s || s->owner)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else if (s->ops_in_flight || s->leased)
        rc = BASERT_EBUSY;
    else if (n_tokens && !tokens)
        rc = BASERT_REJECT_BOUNDS;
    else if (n_tokens > s->len)
        rc = BASERT_ERR_OUT_OF_BOUNDARY;
    else if (!s->tokens_unknown && n_tokens && memcmp(tokens, s->tokens, (size_t)n_tokens * 4))
        rc = BASERT_ERR_IDENTITY_MISMATCH;
    else {
        for (uint32_t i = 0; i < n_tokens && !rc; i++)
            if (tokens[i] >= b->cfg.vocab_size)
                rc = BASERT_REJECT_BOUNDS;
        if (!rc) {
            if (ref_cache_publish(b, s, tokens, n_tokens))
                rc = BASERT_ERR_FATAL;
            else
                ref_seq_destroy(b, s);
        }
    }
    ref_unlock(b);
    return rc;
}

/* A logical copy of `parent` (any sequence of a live bundle, lane-owned included): the child is
 * bare, shares every block (a shared partial block is copied when either side appends to it) and
 * copies the per-space state. BASERT_FORK_EAGER is accepted; the reference's blob state is copied
 * at once either way. EBUSY while a state op holds the parent (rule 98), UNKNOWN_HANDLE for an
 * unknown parent, BAD_STRUCT for a NULL child pointer, BOUNDS for unknown flag bits. */
baseRT_status baseRT_seq_fork(baseRT_sequence_t parent, baseRT_sequence_t *child, uint32_t flags) {
    ref_bundle *b;
    ref_seq *p;
    baseRT_status rc = ref_seq_lock(parent, &b, &p);
    if (rc)
        return rc;
    ref_seq *c = NULL;
    if (!child)
        rc = BASERT_REJECT_BAD_STRUCT;
    else if (flags & ~(uint32_t)BASERT_FORK_EAGER)
        rc = BASERT_REJECT_BOUNDS;
    else if (p->ops_in_flight)
        rc = BASERT_EBUSY;
    else if (!(c = ref_seq_new(b)))
        rc = BASERT_ERR_FATAL;
    else if (ref_seq_seed(b, c, p->tokens, p->len, p->blocks, p->n_blocks, 0, 0))
        rc = BASERT_ERR_FATAL;
    else {
        c->tokens_unknown = p->tokens_unknown;
        c->hist_hash = p->hist_hash;
        for (uint32_t i = 0; i < b->n_spaces && !rc; i++) {
            ref_space_state *d = &c->sp[i];
            const ref_space_state *src = &p->sp[i];
            d->valid_len = src->valid_len;
            d->taint_bits = src->taint_bits;
            d->prov_salt = src->prov_salt;
            d->content_gen = 1;
            d->n_boundaries = 0;
            for (uint32_t k = 0; k < src->n_boundaries && !rc; k++)
                if (push_boundary(d, src->boundaries[k]))
                    rc = BASERT_ERR_FATAL;
        }
    }
    if (rc && c)
        ref_seq_destroy(b, c);
    if (!rc)
        *child = ref_seq_handle(c);
    ref_unlock(b);
    return rc;
}
