/* validate.c: decoding a BaseRTTickPlan (RULES.md section C) and validating it (section D).
 *
 * ref_validate reads the caller's plan exactly once, into local zero-filled copies (records of a
 * longer writer are cut to our size, those of a v1 writer read as zero past their prefix), then
 * checks it against the engine's state without changing anything: every refusal code is decided
 * here, and tick.c executes only what passed. The order of checks is documented in basert_ref.h.
 * The result is a ref_work: the copies, each admit's prompt tokens and lease, each prefill's
 * length within the budget, per-tag bookkeeping and the cache entries the tick must evict. */

#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"

#define PLAN_V1_BYTES 152u
#define ADMIT_V1_BYTES 136u

enum { A_ADMIT, A_COMMIT, A_PREFILL, A_DECODE, A_RETIRE, A_VICTIM };

baseRT_status ref_check_array(const BaseRTArray *a, uint32_t min_size) {
    if (a->data && ((uintptr_t)a->data & 7u))
        return BASERT_REJECT_BAD_ALIGNMENT; /* rule 20, even with count 0 */
    if (a->count && !a->data)
        return BASERT_REJECT_BAD_ALIGNMENT; /* rule 22 */
    if (!(a->count == 0 && a->elem_size == 0) && a->elem_size < min_size)
        return BASERT_REJECT_BAD_STRIDE; /* rules 17, 24, 26 */
    uint64_t bytes = (uint64_t)a->count * a->elem_size;
    if (bytes > REF_MAX_ARRAY_BYTES || (a->data && (uintptr_t)a->data + bytes < (uintptr_t)a->data))
        return BASERT_REJECT_BOUNDS; /* rule 23: before any element is read */
    return BASERT_STATUS_OK;
}

/* Checks array `a` and copies its records into *dst (elem bytes each, zero-filled). */
static baseRT_status decode(ref_work *w, int which, const BaseRTArray *a, uint32_t min_size, size_t elem, void **dst) {
    baseRT_status rc = ref_check_array(a, min_size);
    if (rc)
        return rc;
    w->n[which] = 0;
    if (!a->count)
        return BASERT_STATUS_OK;
    if (ref_reserve(dst, &w->cap[which], a->count, elem))
        return BASERT_ERR_FATAL;
    size_t take = a->elem_size < elem ? a->elem_size : elem;
    const uint8_t *src = a->data;
    uint8_t *out = *dst;
    for (uint32_t i = 0; i < a->count; i++) {
        memset(out + i * elem, 0, elem);
        memcpy(out + i * elem, src + (size_t)i * a->elem_size, take);
    }
    w->n[which] = a->count;
    return BASERT_STATUS_OK;
}

ref_plan_tag *ref_work_tag(const ref_work *w, uint64_t tag) {
    uintptr_t i = (uintptr_t)ref_map_get(&w->tag_index, tag);
    return i ? &w->tags[i - 1] : NULL;
}

/* Records that record `idx` of array `which` names `tag`; DUPLICATE_LANE when that array
 * already named it (rule 27). */
static baseRT_status note_tag(ref_work *w, uint64_t tag, int which, int32_t idx) {
    ref_plan_tag *t = ref_work_tag(w, tag);
    if (!t) {
        if (ref_reserve((void **)&w->tags, &w->cap_tags, (uint64_t)w->n_tags + 1, sizeof *w->tags))
            return BASERT_ERR_FATAL;
        t = &w->tags[w->n_tags++];
        memset(t, 0, sizeof *t);
        t->tag = tag;
        t->admit = t->commit = t->prefill = t->decode = t->retire = -1;
        if (ref_map_put(&w->tag_index, tag, (void *)(uintptr_t)w->n_tags))
            return BASERT_ERR_FATAL;
    }
    int32_t *slot = which == A_ADMIT     ? &t->admit
                    : which == A_COMMIT  ? &t->commit
                    : which == A_PREFILL ? &t->prefill
                    : which == A_DECODE  ? &t->decode
                                         : &t->retire;
    if (*slot >= 0)
        return BASERT_REJECT_DUPLICATE_LANE;
    *slot = idx;
    return BASERT_STATUS_OK;
}

/* An existing lane that a commit, prefill or decode may act on: UNKNOWN_LANE when the engine
 * does not hold it or it faulted (rules 38, 61), TRANSFER_LOCKED while a state op holds its
 * sequence (rule 49). */
static baseRT_status usable(const ref_plan_tag *t) {
    if (!t->lane || t->lane->state == REF_LANE_FAULTED)
        return BASERT_REJECT_UNKNOWN_LANE;
    if (t->lane->seq && t->lane->seq->ops_in_flight)
        return BASERT_REJECT_TRANSFER_LOCKED;
    return BASERT_STATUS_OK;
}

static int logits_ring_ok(ref_bundle *b) {
    ref_ring *r = ref_logits_ring(b);
    return r && brt_ring_capacity(&r->r, 4) >= b->cfg.vocab_size;
}

static baseRT_status check_admit(ref_bundle *b, ref_work *w, uint32_t i) {
    const BaseRTLaneAdmit *a = &w->admits[i];
    ref_plan_tag *t = ref_work_tag(w, a->lane_tag);
    if (ref_lane_find(b, a->lane_tag))
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 34 */
    if (a->sampling > BASERT_SAMPLING_HOST || a->determinism_class > BASERT_DETERMINISM_DETERMINISTIC ||
        a->minimum_exactness > BASERT_EXACTNESS_SEED_PATH_INVARIANT)
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 36 */
    if (a->strategy_slot && !ref_strategy_known(b, a->strategy_slot))
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 36 */
    if (a->sampling == BASERT_SAMPLING_HOST &&
        (!ref_strategy_host_compatible(b, a->strategy_slot) || !logits_ring_ok(b)))
        return BASERT_REJECT_HOST_RULES; /* rule 37 */
    if ((a->grammar_handle && !ref_grammar_known(b, a->grammar_handle)) ||
        (a->logit_bias_handle && !ref_bias_known(b, a->logit_bias_handle)))
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 74 */
    if (a->want_logprobs > 1 + BASERT_MAX_TOP_LOGPROBS)
        return BASERT_REJECT_BOUNDS;
    uint32_t n = a->prompt.count;
    if (!n || n > b->cfg.context_length)
        return BASERT_REJECT_BOUNDS;
    if (a->grammar_replay && (!a->grammar_handle || a->grammar_replay > n))
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 74 */
    if (a->decode_replay >= n)
        return BASERT_REJECT_BOUNDS; /* rule 71 */
    if (ref_reserve((void **)&w->tok_buf, &w->tok_cap, (uint64_t)w->tok_len + n, sizeof *w->tok_buf))
        return BASERT_ERR_FATAL;
    baseRT_status rc = ref_read_span(b, a->prompt, w->tok_buf + w->tok_len); /* rule 35 */
    if (rc)
        return rc;
    w->admit_tok_off[i] = w->tok_len;
    w->tok_len += n;
    const uint32_t *prompt = w->tok_buf + w->admit_tok_off[i];
    uint32_t fed0 = 0;
    w->admit_lease[i] = NULL;
    if (a->seed_handle) {
        ref_lease *l = ref_lease_find(b, a->seed_handle);
        if (!l || ref_lease_expired(b, l, b->ticks))
            return BASERT_REJECT_STALE_SEED; /* rules 81, 83 */
        for (uint32_t k = 0; k < i; k++)
            if (w->admit_lease[k] == l)
                return BASERT_REJECT_STALE_SEED; /* rule 82 */
        if (l->adopted) {
            if (l->adopted->ops_in_flight)
                return BASERT_REJECT_TRANSFER_LOCKED;
            if (a->determinism_class == BASERT_DETERMINISM_DETERMINISTIC && l->taint_bits)
                return BASERT_REJECT_STALE_SEED;
        } else if (a->determinism_class != l->determinism_class) {
            return BASERT_REJECT_STALE_SEED; /* rule 80 */
        }
        if (l->prefix_len > n || memcmp(l->prefix, prompt, (size_t)l->prefix_len * 4))
            return BASERT_REJECT_STALE_SEED; /* rule 80 */
        w->admit_lease[i] = l;
        fed0 = l->prefix_len;
    }
    t->fed0 = t->fed_after = fed0;
    t->prompt_len = n;
    t->prefill_end = n - a->decode_replay;
    return BASERT_STATUS_OK;
}

static baseRT_status check_commit(ref_bundle *b, ref_work *w, uint32_t i) {
    const BaseRTLaneCommit *c = &w->commits[i];
    ref_plan_tag *t = ref_work_tag(w, c->lane_tag);
    baseRT_status rc = usable(t);
    if (rc)
        return rc;
    ref_lane *l = t->lane;
    if (l->sampling != BASERT_SAMPLING_HOST || l->state == REF_LANE_FINISHED)
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rules 39, 42 */
    if (!l->row_pending)
        return BASERT_REJECT_HOST_RULES; /* rule 40 */
    if (c->logits_nonce != l->row_nonce)
        return BASERT_REJECT_STALE_NONCE; /* rule 41 */
    if (c->token_id >= b->cfg.vocab_size)
        return BASERT_REJECT_BOUNDS; /* rule 42 */
    return BASERT_STATUS_OK;
}

/* Fills t->fed0 / prompt_len / prefill_end for an existing lane (admits did it for new ones). */
static baseRT_status lane_view(ref_plan_tag *t) {
    if (t->admit >= 0)
        return BASERT_STATUS_OK;
    baseRT_status rc = usable(t);
    if (rc)
        return rc;
    if (t->lane->state == REF_LANE_FINISHED)
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 48 */
    if (!t->prompt_len) { /* first look at this lane in the plan (a prefill may have moved fed_after) */
        t->fed0 = t->fed_after = t->lane->fed;
        t->prompt_len = t->lane->prompt_len;
        t->prefill_end = t->lane->prefill_end;
    }
    return BASERT_STATUS_OK;
}

static baseRT_status check_prefills(ref_work *w) {
    uint32_t budget = w->plan.prefill_token_budget;
    for (uint32_t i = 0; i < w->n[A_PREFILL]; i++) {
        const BaseRTLanePrefill *p = &w->prefills[i];
        ref_plan_tag *t = ref_work_tag(w, p->lane_tag);
        baseRT_status rc = lane_view(t);
        if (rc)
            return rc;
        if (p->token_offset != t->fed0)
            return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 45 */
        if ((uint64_t)p->token_offset + p->token_count > t->prefill_end)
            return BASERT_REJECT_BOUNDS; /* rule 46 */
        uint32_t eff = p->token_count < budget ? p->token_count : budget; /* rule 56 */
        budget -= eff;
        w->prefill_eff[i] = eff;
        t->fed_after = t->fed0 + eff;
    }
    return BASERT_STATUS_OK;
}

static baseRT_status check_decodes(ref_bundle *b, ref_work *w) {
    uint64_t emit_slots = 0, rows = 0;
    ref_ring *er = ref_emit_ring(b);
    uint32_t per_slot = er ? brt_ring_capacity(&er->r, 4) : 0;
    for (uint32_t i = 0; i < w->n[A_DECODE]; i++) {
        const BaseRTLaneDecode *d = &w->decodes[i];
        ref_plan_tag *t = ref_work_tag(w, d->lane_tag);
        baseRT_status rc = lane_view(t);
        if (rc)
            return rc;
        uint32_t sampling = t->admit >= 0 ? w->admits[t->admit].sampling : t->lane->sampling;
        if (!d->max_new_tokens)
            return BASERT_REJECT_ILLEGAL_COMBINATION;
        if (sampling == BASERT_SAMPLING_HOST) {
            if (d->max_new_tokens != 1)
                return BASERT_REJECT_HOST_RULES; /* rule 43 */
            if (t->lane && t->lane->row_pending && t->commit < 0)
                return BASERT_REJECT_HOST_RULES; /* rule 44 */
            if (!logits_ring_ok(b))
                return BASERT_REJECT_HOST_RULES;
            rows++;
        } else {
            if (!per_slot)
                return BASERT_REJECT_BOUNDS;
            emit_slots += (d->max_new_tokens + per_slot - 1) / per_slot;
        }
        if (t->fed_after < t->prefill_end)
            return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 47 */
    }
    if (emit_slots && emit_slots > er->r.slots)
        return BASERT_REJECT_BOUNDS;
    if (rows && rows > ref_logits_ring(b)->r.slots)
        return BASERT_REJECT_HOST_RULES;
    return BASERT_STATUS_OK;
}

/* Tokens a decode may append at most: the whole grant for GPU lanes (within the context),
 * one replayed token for a HOST lane still inside its replay tail, else none. */
static uint64_t decode_worst(const ref_bundle *b, const ref_work *w, const ref_plan_tag *t, uint64_t len) {
    if (t->decode < 0)
        return 0;
    uint32_t sampling = t->admit >= 0 ? w->admits[t->admit].sampling : t->lane->sampling;
    if (sampling == BASERT_SAMPLING_HOST)
        return t->fed_after < t->prompt_len;
    uint64_t grant = w->decodes[t->decode].max_new_tokens;
    uint64_t room = b->cfg.context_length > len ? b->cfg.context_length - len : 0;
    return grant < room ? grant : room;
}

/* Pool feasibility (rules 50-52): retires release, commits / admits / prefills / decodes take,
 * then evictions inside the envelope must cover any deficit. */
static baseRT_status check_pool(ref_bundle *b, ref_work *w) {
    ref_pool *p = &b->pool;
    w->n_evict = 0;
    if (!p->block_bytes)
        return BASERT_STATUS_OK;
    ref_sim_begin(p);
    for (uint32_t i = 0; i < w->n[A_RETIRE]; i++) {
        ref_lane *l = ref_work_tag(w, w->retires[i].lane_tag)->lane;
        if (!l->seq || l->state == REF_LANE_FAULTED)
            continue;
        if (w->retires[i].publish_to_cache)
            ref_cache_sim_publish(b, l->seq);
        for (uint32_t k = 0; k < l->seq->n_blocks; k++)
            ref_sim_unref(p, l->seq->blocks[k]);
    }
    for (uint32_t i = 0; i < w->n_tags; i++) {
        const ref_plan_tag *t = &w->tags[i];
        if (t->retire >= 0)
            continue;
        uint32_t prefill = t->prefill >= 0 ? w->prefill_eff[t->prefill] : 0;
        if (t->admit < 0) {
            const ref_seq *s = t->lane ? t->lane->seq : NULL;
            if (!s || t->lane->state == REF_LANE_FAULTED)
                continue;
            uint64_t len = (uint64_t)s->len + (t->commit >= 0) + prefill;
            uint64_t n = (t->commit >= 0) + prefill + decode_worst(b, w, t, len);
            ref_sim_append(p, s->blocks, s->n_blocks, s->len, n);
            continue;
        }
        const ref_lease *l = w->admit_lease[t->admit];
        const uint32_t *blocks = NULL;
        uint32_t nb = 0;
        uint64_t len0 = 0;
        if (l && l->adopted) {
            blocks = l->adopted->blocks;
            nb = l->adopted->n_blocks;
            len0 = l->adopted->len;
        } else if (l) {
            for (uint32_t k = 0; k < l->n_pinned; k++)
                if (ref_space_is_paged(b, l->pinned[k]->space)) {
                    blocks = l->pinned[k]->blocks;
                    nb = l->prefix_len / p->block_tokens;
                    len0 = l->prefix_len;
                }
            for (uint32_t k = 0; k < nb; k++)
                ref_sim_ref(p, blocks[k]);
        }
        uint64_t n = prefill + decode_worst(b, w, t, len0 + prefill);
        ref_sim_append(p, blocks, nb, len0, n);
    }
    int fit = ref_cache_plan_evictions(b, &w->plan.shed_policy, b->ticks, w);
    if (fit == -2)
        return BASERT_ERR_FATAL;
    return fit ? BASERT_NEEDS_REPLAN : BASERT_STATUS_OK;
}

void ref_work_free(ref_work *w) {
    free(w->admits);
    free(w->commits);
    free(w->prefills);
    free(w->decodes);
    free(w->retires);
    free(w->victims);
    free(w->admit_tok_off);
    free(w->admit_lease);
    free(w->tok_buf);
    free(w->prefill_eff);
    free(w->tags);
    free(w->evict);
    ref_map_free(&w->tag_index);
    memset(w, 0, sizeof *w);
}

baseRT_status ref_validate(ref_bundle *b, const BaseRTTickPlan *plan, ref_work *w) {
    if (!plan)
        return BASERT_REJECT_BAD_STRUCT;
    uint64_t size;
    memcpy(&size, plan, sizeof size);
    if (size < PLAN_V1_BYTES)
        return BASERT_REJECT_BAD_STRUCT; /* rule 25 */
    memset(&w->plan, 0, sizeof w->plan);
    memcpy(&w->plan, plan, size < sizeof w->plan ? size : sizeof w->plan);
    const BaseRTTickPlan *pl = &w->plan;
    w->partial = size >= sizeof w->plan && (pl->flags & BASERT_TICK_PARTIAL_EMITS) && pl->on_partial_emit;

    baseRT_status rc;
    if ((rc = decode(w, A_ADMIT, &pl->admits, ADMIT_V1_BYTES, sizeof *w->admits, (void **)&w->admits)) ||
        (rc = decode(w, A_COMMIT, &pl->commits, sizeof *w->commits, sizeof *w->commits, (void **)&w->commits)) ||
        (rc = decode(w, A_PREFILL, &pl->prefills, sizeof *w->prefills, sizeof *w->prefills, (void **)&w->prefills)) ||
        (rc = decode(w, A_DECODE, &pl->decodes, sizeof *w->decodes, sizeof *w->decodes, (void **)&w->decodes)) ||
        (rc = decode(w, A_RETIRE, &pl->retires, sizeof *w->retires, sizeof *w->retires, (void **)&w->retires)) ||
        (rc = decode(w, A_VICTIM, &pl->shed_policy.victim_lanes, 8, 8, (void **)&w->victims)))
        return rc;

    if (pl->max_decode_lanes > b->cfg.max_batch_size || w->n[A_DECODE] > pl->max_decode_lanes)
        return BASERT_REJECT_BUDGET; /* rules 30, 31 */
    if (b->has_plan_seq && pl->plan_seq <= b->last_plan_seq)
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 32 */
    if ((pl->flags & BASERT_TICK_DRAIN) && w->n[A_ADMIT])
        return BASERT_REJECT_ILLEGAL_COMBINATION; /* rule 33 */

    w->n_tags = 0;
    w->tok_len = 0;
    ref_map_clear(&w->tag_index);
    uint32_t na = w->n[A_ADMIT], np = w->n[A_PREFILL];
    if (ref_reserve((void **)&w->admit_tok_off, &w->cap_admit_extra, na, sizeof *w->admit_tok_off) ||
        ref_reserve((void **)&w->prefill_eff, &w->cap_prefill_eff, np, sizeof *w->prefill_eff))
        return BASERT_ERR_FATAL;
    if (na) { /* admit_lease shares the admit_tok_off capacity */
        ref_lease **p = realloc(w->admit_lease, (size_t)w->cap_admit_extra * sizeof *p);
        if (!p)
            return BASERT_ERR_FATAL;
        w->admit_lease = p;
        memset(w->admit_lease, 0, (size_t)na * sizeof *p);
    }
    for (uint32_t i = 0; i < na; i++)
        if ((rc = note_tag(w, w->admits[i].lane_tag, A_ADMIT, (int32_t)i)))
            return rc;
    for (uint32_t i = 0; i < w->n[A_COMMIT]; i++)
        if ((rc = note_tag(w, w->commits[i].lane_tag, A_COMMIT, (int32_t)i)))
            return rc;
    for (uint32_t i = 0; i < np; i++)
        if ((rc = note_tag(w, w->prefills[i].lane_tag, A_PREFILL, (int32_t)i)))
            return rc;
    for (uint32_t i = 0; i < w->n[A_DECODE]; i++)
        if ((rc = note_tag(w, w->decodes[i].lane_tag, A_DECODE, (int32_t)i)))
            return rc;
    for (uint32_t i = 0; i < w->n[A_RETIRE]; i++)
        if ((rc = note_tag(w, w->retires[i].lane_tag, A_RETIRE, (int32_t)i)))
            return rc;

    for (uint32_t i = 0; i < w->n_tags; i++) { /* rules 28, 29 */
        ref_plan_tag *t = &w->tags[i];
        if ((t->admit >= 0 && (t->retire >= 0 || t->commit >= 0)) ||
            (t->retire >= 0 && (t->commit >= 0 || t->decode >= 0 || t->prefill >= 0)))
            return BASERT_REJECT_ILLEGAL_COMBINATION;
        t->lane = t->admit >= 0 ? NULL : ref_lane_find(b, t->tag);
    }

    for (uint32_t i = 0; i < na; i++)
        if ((rc = check_admit(b, w, i)))
            return rc;
    for (uint32_t i = 0; i < w->n[A_COMMIT]; i++)
        if ((rc = check_commit(b, w, i)))
            return rc;
    if ((rc = check_prefills(w)) || (rc = check_decodes(b, w)))
        return rc;
    for (uint32_t i = 0; i < w->n[A_RETIRE]; i++) {
        ref_plan_tag *t = ref_work_tag(w, w->retires[i].lane_tag);
        if (!t->lane)
            return BASERT_REJECT_UNKNOWN_LANE; /* rules 38, 61 */
        if (t->lane->seq && t->lane->seq->ops_in_flight)
            return BASERT_REJECT_TRANSFER_LOCKED; /* rule 49 */
    }
    if ((uint64_t)b->n_lanes - w->n[A_RETIRE] + na > b->cfg.max_lanes)
        return BASERT_REJECT_BUDGET;
    return check_pool(b, w);
}
