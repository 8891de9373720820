/* tick.c: baseRT_tick, executing a validated plan (RULES.md section E).
 *
 * Order within a tick (rule 53): expired leases are dropped and state ops advanced, then
 * retires (publishing first when asked), armed test faults and finishes, the cache evictions the
 * feasibility check chose, commits, admits, prefills (cut to the budget), decodes. Nothing here
 * can refuse: ref_validate decided every refusal, so the only failure left is running out of
 * memory, reported as BASERT_ERR_FATAL. Events go to the half of the double buffer not handed out
 * by the previous tick, so those stay readable until this tick returns (rule 70). */

#define _XOPEN_SOURCE 700 /* pthread_mutexattr_settype, clock_gettime, nanosleep under -std=c11 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref_internal.h"

#define PUSH(ev, arr, n, cap)                                                                    \
    (ref_reserve((void **)&(ev)->arr, &(ev)->cap, (uint64_t)(ev)->n + 1, sizeof *(ev)->arr) \
         ? NULL                                                                              \
         : memset(&(ev)->arr[(ev)->n++], 0, sizeof *(ev)->arr))

/* The emit record of `tag` in this tick (one per lane), appended on first use. */
static BaseRTLaneEmit *emit_of(ref_events *ev, uint64_t tag) {
    for (uint32_t i = 0; i < ev->n_emits; i++)
        if (ev->emits[i].lane_tag == tag)
            return &ev->emits[i];
    BaseRTLaneEmit *e = PUSH(ev, emits, n_emits, cap_emits);
    if (e)
        e->lane_tag = tag;
    return e;
}

static int finish(ref_events *ev, ref_lane *l, uint32_t why) {
    l->state = REF_LANE_FINISHED;
    l->finish = why;
    l->row_pending = 0;
    BaseRTLaneEmit *e = emit_of(ev, l->tag);
    if (!e)
        return -1;
    e->finish = why;
    return 0;
}

static int is_eos(const ref_bundle *b, const ref_lane *l, uint32_t tok) {
    return tok == b->cfg.eos_token && !(l->params.flags & BASERT_SAMPLING_FLAG_IGNORE_EOS);
}

static int run_retires(ref_bundle *b, ref_work *w) {
    for (uint32_t i = 0; i < w->n[4]; i++) {
        ref_lane *l = ref_lane_find(b, w->retires[i].lane_tag);
        if (w->retires[i].publish_to_cache && l->state != REF_LANE_FAULTED && l->seq &&
            ref_cache_publish(b, l->seq, NULL, l->seq->len))
            return -1;
        ref_media_lane_retired(b, l->tag);
        ref_lane_destroy(b, l);
    }
    return 0;
}

static int run_hooks(ref_bundle *b, ref_events *ev) {
    for (uint32_t i = 0; i < b->n_lanes; i++) {
        ref_lane *l = b->lanes[i];
        if (l->fault_armed) {
            l->fault_armed = 0;
            BaseRTLaneFault *f = PUSH(ev, faults, n_faults, cap_faults);
            if (!f)
                return -1;
            f->lane_tag = l->tag;
            f->code = l->fault_code;
            f->detail = l->seq ? l->seq->len : 0;
            if (l->seq)
                ref_seq_clear(b, l->seq); /* its state is gone, pool bytes released: rule 62 */
            l->state = REF_LANE_FAULTED;
            l->row_pending = 0;
            b->faults_total++;
        } else if (l->finish_armed && l->state == REF_LANE_LIVE) {
            l->finish_armed = 0;
            if (finish(ev, l, l->finish_code))
                return -1;
        }
    }
    return 0;
}

static int run_evictions(ref_bundle *b, ref_work *w, ref_events *ev) {
    for (uint32_t i = 0; i < w->n_evict; i++) {
        ref_entry *e = w->evict[i];
        BaseRTShedEntry *s = PUSH(ev, shed, n_shed, cap_shed);
        if (!s)
            return -1;
        s->lane_tag = 0;
        s->kind = BASERT_SHED_CACHE_EVICTION;
        s->reason = REF_SHED_REASON_EVICTION;
        s->bytes = e->bytes;
        s->tokens = e->n_tokens;
        ev->ev.shed.evictions_performed++;
        ev->ev.shed.bytes_evicted += e->bytes;
        ref_cache_remove(b, e);
        b->evictions_total++;
    }
    return 0;
}

static int run_commits(ref_bundle *b, ref_work *w, ref_events *ev) {
    for (uint32_t i = 0; i < w->n[1]; i++) {
        const BaseRTLaneCommit *c = &w->commits[i];
        ref_lane *l = ref_lane_find(b, c->lane_tag);
        if (!l || l->state != REF_LANE_LIVE)
            continue; /* finished or faulted by a test hook this tick */
        if (ref_seq_append(b, l->seq, &c->token_id, 1))
            return -1;
        l->generated++; /* rule 67 */
        l->row_pending = 0;
        b->decode_total++;
        if (is_eos(b, l, c->token_id)) {
            if (finish(ev, l, BASERT_FINISH_EOS))
                return -1;
        } else if (l->seq->len >= b->cfg.context_length && finish(ev, l, BASERT_FINISH_LENGTH)) {
            return -1;
        }
    }
    return 0;
}

static int refused(const ref_bundle *b, const BaseRTLaneAdmit *a) {
    switch (b->refuse_kind) {
    case BASERT_REF_REFUSE_TAG_MASK:
        return (a->lane_tag & b->refuse_param) != 0;
    case BASERT_REF_REFUSE_TAG_EQUALS:
        return a->lane_tag == b->refuse_param;
    case BASERT_REF_REFUSE_ALL:
        return 1;
    case BASERT_REF_REFUSE_PROMPT_OVER:
        return a->prompt.count > b->refuse_param;
    default:
        return 0;
    }
}

static int admit_one(ref_bundle *b, ref_work *w, uint32_t i, BaseRTAdmitResult *res) {
    const BaseRTLaneAdmit *a = &w->admits[i];
    if (refused(b, a)) {
        memset(res, 0, sizeof *res);
        res->lane_tag = a->lane_tag;
        res->status = BASERT_ADMIT_REJECTED;
        res->reject_code = (uint32_t)b->refuse_status; /* rule 15 */
        return 0;
    }
    ref_strategy_admit(b, a, res);
    if (res->status != BASERT_ADMIT_ADMITTED)
        return 0;
    ref_lane *l = calloc(1, sizeof *l);
    if (!l)
        return -1;
    uint32_t n = a->prompt.count;
    l->prompt = malloc((size_t)n * sizeof *l->prompt);
    if (!l->prompt || ref_reserve((void **)&b->lanes, &b->cap_lanes, (uint64_t)b->n_lanes + 1, sizeof *b->lanes) ||
        ref_map_put(&b->lane_index, a->lane_tag, l)) {
        free(l->prompt);
        free(l);
        return -1;
    }
    b->lanes[b->n_lanes++] = l;
    memcpy(l->prompt, w->tok_buf + w->admit_tok_off[i], (size_t)n * sizeof *l->prompt);
    l->tag = a->lane_tag;
    l->prompt_len = n;
    l->decode_replay = a->decode_replay;
    l->grammar_replay = a->grammar_replay;
    l->prefill_end = n - a->decode_replay;
    l->sampling = a->sampling;
    l->params = a->params;
    l->rng_base = a->rng_counter_base;
    l->grammar_handle = a->grammar_handle;
    l->logit_bias_handle = a->logit_bias_handle;
    l->strategy_slot = a->strategy_slot;
    l->determinism_class = a->determinism_class;
    l->want_logprobs = a->want_logprobs;
    l->cert_id = res->cert_id;
    l->granted_class = res->granted_class;
    ref_lease *lease = w->admit_lease[i];
    if (lease && lease->adopted) { /* the adopted sequence becomes the lane's, whole */
        l->seq = lease->adopted;
        lease->adopted = NULL;
        l->seq->leased = 0;
    } else if (!(l->seq = ref_seq_new(b))) {
        return -1;
    }
    l->seq->owner = l;
    if (lease) {
        if (lease->n_pinned) {
            const ref_entry *paged = NULL;
            for (uint32_t k = 0; k < lease->n_pinned; k++)
                if (ref_space_is_paged(b, lease->pinned[k]->space))
                    paged = lease->pinned[k];
            uint32_t nb = paged ? lease->prefix_len / b->pool.block_tokens : 0;
            if (ref_seq_seed(b, l->seq, lease->prefix, lease->prefix_len, paged ? paged->blocks : NULL, nb,
                             lease->taint_bits, lease->prov_salt)) /* rule 85 */
                return -1;
        }
        l->fed = lease->prefix_len; /* rule 45: the first prefill starts here */
        ref_lease_drop(b, lease, 0); /* consumed, rule 81 */
    }
    return 0;
}

static int run_admits(ref_bundle *b, ref_work *w, ref_events *ev) {
    for (uint32_t i = 0; i < w->n[0]; i++) {
        BaseRTAdmitResult *res = PUSH(ev, admits, n_admits, cap_admits);
        if (!res || admit_one(b, w, i, res))
            return -1;
    }
    return 0;
}

static void sleep_us(uint32_t us) {
    struct timespec ts = {us / 1000000u, (long)(us % 1000000u) * 1000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Whether the coordinator asked this tick to end early (basertd.shm.control): a relaxed atomic
 * load of the yield word; no data is published through it, so no ordering is needed. */
static int yield_requested(const ref_bundle *b) {
    return b->yield_words && __atomic_load_n(&b->yield_words[0], __ATOMIC_RELAXED) != 0;
}

static int shed_chunk(ref_bundle *b, ref_events *ev, const ref_lane *l, uint32_t dropped) {
    BaseRTShedEntry *s = PUSH(ev, shed, n_shed, cap_shed);
    if (!s)
        return -1;
    s->lane_tag = l->tag;
    s->kind = BASERT_SHED_PREFILL_CHUNK;
    s->reason = REF_SHED_REASON_BUDGET;
    s->tokens = dropped;
    s->bytes = (uint64_t)dropped * (b->pool.block_bytes ? b->cfg.bytes_per_token : 0);
    ev->ev.shed.prefill_chunks_dropped++;
    return 0;
}

/* Prefills in steps of prefill_step_tokens (each followed by a prefill_step_us sleep). Before every
 * step but the tick's first the yield word is read; once set, what is left of every chunk is
 * dropped exactly like a budget cut [56, 57]: one shed entry per lane, tokens = planned - done. */
static int run_prefills(ref_bundle *b, ref_work *w, ref_events *ev) {
    uint32_t step = b->cfg.prefill_step_tokens, steps = 0;
    int yielded = 0;
    for (uint32_t i = 0; i < w->n[2]; i++) {
        const BaseRTLanePrefill *p = &w->prefills[i];
        ref_lane *l = ref_lane_find(b, p->lane_tag);
        if (!l || l->state != REF_LANE_LIVE)
            continue; /* admit refused this tick, or a test hook ended it */
        uint32_t eff = w->prefill_eff[i], done = 0;
        while (done < eff) {
            if (steps && !yielded && yield_requested(b))
                yielded = 1;
            if (yielded)
                break;
            uint32_t n = step && eff - done > step ? step : eff - done;
            if (ref_seq_append(b, l->seq, l->prompt + l->fed, n))
                return -1;
            l->fed += n;
            done += n;
            b->prefill_total += n;
            steps++;
            if (b->cfg.prefill_step_us)
                sleep_us(b->cfg.prefill_step_us);
        }
        if (done < p->token_count && shed_chunk(b, ev, l, p->token_count - done)) /* rule 56 */
            return -1;
    }
    if (yielded)
        __atomic_fetch_add(&b->yield_words[1], 1, __ATOMIC_RELAXED);
    return 0;
}

static int decode_host(ref_bundle *b, ref_lane *l, ref_events *ev) {
    BaseRTLaneEmit *e = emit_of(ev, l->tag);
    if (!e)
        return -1;
    if (l->seq->len >= b->cfg.context_length)
        return finish(ev, l, BASERT_FINISH_LENGTH);
    if (l->fed < l->prompt_len) { /* replay tail: one token, no row (rule 72) */
        if (ref_seq_append(b, l->seq, l->prompt + l->fed, 1))
            return -1;
        l->fed++;
        b->replay_total++;
        return 0;
    }
    ref_ring *r = ref_logits_ring(b);
    brt_span span;
    ref_model_row(b, l, b->row_buf);
    if (brt_ring_write(&r->r, b->row_buf, b->cfg.vocab_size, 4, &span))
        return -1;
    l->row_pending = 1;
    l->row_nonce = span.generation; /* rules 41, 65, 66 */
    e->logits_row.ring_id = r->r.ring_id;
    e->logits_row.index = span.index;
    e->logits_row.generation = span.generation;
    return 0;
}

static int decode_gpu(ref_bundle *b, ref_work *w, ref_lane *l, uint32_t grant, ref_events *ev) {
    if (ref_reserve((void **)&b->emit_buf, &b->cap_emit, grant, sizeof *b->emit_buf))
        return -1;
    BaseRTLaneEmit *e = emit_of(ev, l->tag);
    if (!e)
        return -1;
    uint32_t n_out = 0, n_top = l->want_logprobs ? l->want_logprobs - 1u : 0;
    for (uint32_t u = 0; u < grant && l->state == REF_LANE_LIVE; u++) {
        if (l->seq->len >= b->cfg.context_length) {
            if (finish(ev, l, BASERT_FINISH_LENGTH))
                return -1;
            break;
        }
        if (l->fed < l->prompt_len) { /* replay tail (rule 72) */
            if (ref_seq_append(b, l->seq, l->prompt + l->fed, 1))
                return -1;
            l->fed++;
            b->replay_total++;
            continue;
        }
        uint32_t tok = ref_model_next(b, l);
        if (l->want_logprobs) {
            BaseRTLaneLogprob *lp = PUSH(ev, logprobs, n_logprobs, cap_logprobs);
            if (!lp)
                return -1;
            ref_model_logprob(b, l, tok, n_top, lp);
            lp->lane_tag = l->tag;
        }
        if (ref_seq_append(b, l->seq, &tok, 1))
            return -1;
        l->generated++; /* rule 67 */
        b->decode_total++;
        b->emit_buf[n_out++] = tok;
        if (w->partial) /* rule 64: on this thread, before the tick returns */
            w->plan.on_partial_emit(w->plan.partial_emit_user, l->tag, &b->emit_buf[n_out - 1], 1);
        if (is_eos(b, l, tok)) {
            if (finish(ev, l, BASERT_FINISH_EOS))
                return -1;
        } else if (l->seq->len >= b->cfg.context_length && finish(ev, l, BASERT_FINISH_LENGTH)) {
            return -1;
        }
    }
    e = emit_of(ev, l->tag); /* finish() may have grown the array */
    if (!e)
        return -1;
    if (n_out) {
        ref_ring *r = ref_emit_ring(b);
        brt_span span;
        if (brt_ring_write(&r->r, b->emit_buf, n_out, 4, &span))
            return -1;
        e->token_ref.ring_id = r->r.ring_id;
        e->token_ref.index = span.index;
        e->token_ref.count = span.count;
        e->token_ref.generation = span.generation;
    }
    e->n_tokens = n_out;
    return 0;
}

static int run_decodes(ref_bundle *b, ref_work *w, ref_events *ev) {
    for (uint32_t i = 0; i < w->n[3]; i++) {
        const BaseRTLaneDecode *d = &w->decodes[i];
        ref_lane *l = ref_lane_find(b, d->lane_tag);
        if (!l || l->state != REF_LANE_LIVE || l->fed < l->prefill_end)
            continue; /* its prefill was cut by a yield: it decodes once the prefill resumes */
        int rc = l->sampling == BASERT_SAMPLING_HOST ? decode_host(b, l, ev)
                                                     : decode_gpu(b, w, l, d->max_new_tokens, ev);
        if (rc)
            return -1;
    }
    return 0;
}

static void fill_mem(const ref_bundle *b, BaseRTMemCounters *m) {
    uint64_t blob = 0;
    for (uint32_t i = 0; i < b->n_spaces; i++)
        if (ref_space_is_blob(b, i))
            blob += b->space_cfg[i].blob_bytes * b->n_seqs;
    for (uint32_t i = 0; i < b->n_entries; i++)
        if (!ref_space_is_paged(b, b->entries[i]->space))
            blob += b->entries[i]->bytes;
    memset(m, 0, sizeof *m);
    m->allocated_bytes = (uint64_t)b->pool.used * b->pool.block_bytes + blob;
    m->host_retained_bytes = 0;
    m->pool_blocks_total = b->pool.n_blocks;
    m->pool_blocks_used = b->pool.used;
    m->pool_bytes_evictable = ref_cache_evictable_bytes(b);
    m->tentative_bytes = 0;
}

static void set_array(BaseRTArray *a, const void *data, uint32_t n, uint32_t elem) {
    a->data = n ? data : NULL;
    a->count = n;
    a->elem_size = elem;
}

static baseRT_status execute(ref_bundle *b, ref_work *w, uint64_t t0, const BaseRTTickEvents **events_out) {
    uint32_t slot = b->cur_events ^ 1u;
    ref_events *ev = &b->events[slot];
    ev->n_admits = ev->n_emits = ev->n_faults = ev->n_shed = ev->n_ops = ev->n_logprobs = 0;
    memset(&ev->ev, 0, sizeof ev->ev);

    ref_leases_sweep(b, b->ticks); /* rule 83 */
    ref_ops_pump(b);
    if (run_retires(b, w) || run_hooks(b, ev) || run_evictions(b, w, ev) || run_commits(b, w, ev) ||
        run_admits(b, w, ev))
        return BASERT_ERR_FATAL;
    uint64_t t1 = ref_now_ns();
    if (run_prefills(b, w, ev))
        return BASERT_ERR_FATAL;
    uint64_t t2 = ref_now_ns();
    if (run_decodes(b, w, ev))
        return BASERT_ERR_FATAL;
    if (b->cfg.tick_delay_us)
        sleep_us(b->cfg.tick_delay_us);
    uint64_t t3 = ref_now_ns();
    uint32_t pending = ref_ops_pending(b);
    if (pending) {
        if (ref_reserve((void **)&ev->ops, &ev->cap_ops, pending, sizeof *ev->ops))
            return BASERT_ERR_FATAL;
        ev->n_ops = ref_ops_drain(b, ev->ops, pending); /* rule 69 */
    }

    BaseRTTickEvents *e = &ev->ev;
    e->struct_size = sizeof *e;
    e->plan_seq = w->plan.plan_seq; /* rule 55 */
    e->tick_status = ev->n_faults                                        ? BASERT_TICK_LANE_ERRORS
                     : (e->shed.prefill_chunks_dropped || ev->n_shed) ? BASERT_TICK_SHED
                                                                       : BASERT_TICK_OK; /* rule 59 */
    set_array(&e->admit_results, ev->admits, ev->n_admits, sizeof *ev->admits);
    set_array(&e->emits, ev->emits, ev->n_emits, sizeof *ev->emits);
    set_array(&e->faults, ev->faults, ev->n_faults, sizeof *ev->faults);
    set_array(&e->shed.entries, ev->shed, ev->n_shed, sizeof *ev->shed);
    set_array(&e->op_completions, ev->ops, ev->n_ops, sizeof *ev->ops);
    set_array(&e->logprobs, ev->logprobs, ev->n_logprobs, sizeof *ev->logprobs);
    fill_mem(b, &e->mem);
    b->ticks++;
    b->last_plan_seq = w->plan.plan_seq;
    b->has_plan_seq = 1;
    b->cur_events = slot;
    uint64_t t4 = ref_now_ns();
    e->timings.wall_ns = t4 - t0;
    e->timings.prefill_ns = t2 - t1;
    e->timings.decode_ns = t3 - t2;
    *events_out = e;
    return BASERT_STATUS_OK;
}

/* Runs one tick (ABI §1; RULES.md sections C-E). BAD_STRUCT for NULL plan or events_out; every
 * refusal of ref_validate leaves the engine unchanged and *events_out NULL; on OK *events_out
 * points at this tick's events until the tick after next or baseRT_ref_free. */
baseRT_status baseRT_tick(baseRT_model_t bundle, const BaseRTTickPlan *plan, const BaseRTTickEvents **events_out) {
    uint64_t t0 = ref_now_ns();
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (!events_out) {
        b->rejected++;
        ref_unlock(b);
        return BASERT_REJECT_BAD_STRUCT;
    }
    *events_out = NULL;
    rc = ref_validate(b, plan, &b->work);
    if (rc)
        b->rejected++;
    else
        rc = execute(b, &b->work, t0, events_out);
    ref_unlock(b);
    return rc;
}
