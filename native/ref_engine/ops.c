/* ops.c: state operations on sequences (tick ABI §3; RULES.md section H).
 *
 * Lifecycle. A snapshot, demote, restore or promote is checked completely when it is submitted:
 * every refusal is synchronous, returns its code, issues no op handle and changes nothing. An
 * accepted op is RUNNING and claims its (sequence, space) pair; it completes at the start of the
 * next accepted baseRT_tick (ref_ops_pump) and is reported in that tick's op_completions
 * (rule 69). op_cancel of a RUNNING op makes it CANCELLED at once, writes nothing, releases the
 * claim, and reports it in the next tick. Op handles are (bundle serial << 32 | counter): unique,
 * never reused, and unknown on any other bundle (rule 99). Terminal ops stay pollable.
 *
 * What an export reads is fixed when it is submitted (the sealed bytes are staged in engine memory)
 * and written into the caller's buffer only when the op completes, so a refused or cancelled op
 * writes no byte (rules 97, 100). Restore and promote take the pool blocks they will need when
 * they are submitted (NEEDS_REPLAN when the pool cannot give them), so completing them inside a
 * tick can never break the pool plan that tick was validated against.
 *
 * Claims and demoted ranges. A claimed pair refuses a second op, and trim, with EBUSY (rule 98).
 * A demoted range leaves the sequence's state partly outside the device until it is promoted.
 * Both count in ref_seq.ops_in_flight, which makes plans touching the owning lane
 * TRANSFER_LOCKED (rule 49) and seq_fork / sequence_free / publish / seed_adopt EBUSY.
 * A paged demote releases, when it completes, the pool blocks that lie wholly inside its range
 * (rule 108; the sequence keeps only its resident blocks, in order, while demoted); promote puts
 * fresh blocks back in their place. Demote and promote run on lane-owned sequences too; restore
 * and trim change a caller-owned sequence only (a lane's state changes through plans), so a
 * lane-owned target is UNKNOWN_HANDLE, like baseRT_tick_sequence_free.
 *
 * Reference choices where the ABI leaves room: blob spaces (RECURRENT_BLOB, RING_KV) hold their
 * state at one position q and export it LOSSLESS only (rule 93), with the range {q, q} in the
 * envelope; a blob snapshot needs q to be a recorded boundary, or the current length under
 * tool-boundary cadence (rule 110); a blob demote takes the current state (q = valid length).
 * Sizing generations (rule 96) are per (sequence, space): every tick that appends, every trim and
 * every completed restore, demote or promote bumps them; snapshots do not. Exports carry
 * FNV-1a-64 unless baseRT_ref_set_export_checksum chose XXH3-64. An envelope whose checksum kind
 * is 0 or unknown is refused with CHECKSUM. */

#include <stdlib.h>
#include <string.h>

#include "ops_internal.h"

enum { OP_SNAPSHOT = 1, OP_DEMOTE = 2, OP_RESTORE = 3, OP_PROMOTE = 4 };

/* A range of one space whose state was moved to host memory. Blob ranges are {q, q}. */
typedef struct ref_demoted {
    uint64_t start, end;
    uint32_t encoding;
    uint32_t first_block; /* paged: first block index (in the full layout) released */
    uint32_t n_blocks;    /* paged: blocks released */
    uint32_t _pad0;
} ref_demoted;

/* ops.c's part of one (sequence, space): ref_space_state.ext. */
typedef struct ref_space_ext {
    uint32_t claimed;     /* an op holds this pair */
    uint32_t n_demoted, cap_demoted;
    uint32_t has_key;     /* blob: the state at key_pos came from a restore */
    ref_demoted *demoted;
    uint64_t key_pos;
    uint64_t key;         /* history hash the restored blob state carries */
    uint8_t key_prov[32]; /* its provenance digest */
} ref_space_ext;

typedef struct ref_op {
    uint64_t handle;
    uint64_t seq;          /* sequence handle value, looked up again at completion */
    uint32_t space;        /* index into the bundle's spaces */
    uint32_t kind;         /* OP_* */
    uint32_t state;        /* BASERT_OP_* */
    uint32_t error;        /* a baseRT_status as uint32_t bits, when FAILED */
    uint64_t bytes_total;
    uint64_t bytes_moved;
    uint8_t *staged;       /* exports: the sealed bytes */
    uint8_t *dst;          /* exports: the caller's buffer, written at completion */
    BaseRTStateEnvelope env; /* imports: the checked envelope */
    uint32_t *tokens;      /* paged restore: the tokens the payload carries */
    uint32_t *blocks;      /* restore / promote: blocks taken at submission */
    uint32_t n_blocks;
    uint32_t _pad0;
    uint64_t key;          /* blob restore: the state's history hash */
    ref_demoted dem;       /* demote: the range; promote: the demoted range it ends */
} ref_op;

typedef struct ref_ops {
    ref_map index;             /* handle -> ref_op*, every op ever accepted */
    ref_op **all;
    uint32_t n_all, cap_all;
    ref_op **running;
    uint32_t n_running, cap_running;
    BaseRTOpComplete *done;    /* terminal, not yet reported by a tick */
    uint32_t n_done, cap_done;
    uint32_t next;
    uint32_t checksum_kind;    /* written into exports */
} ref_ops;

/* ---------------------------------------------------------------------------------------- */
/* Small helpers                                                                            */
/* ---------------------------------------------------------------------------------------- */

static ref_ops *ops_make(ref_bundle *b) {
    if (!b->ops) {
        ref_ops *o = calloc(1, sizeof *o);
        if (o)
            o->checksum_kind = BASERT_CHECKSUM_FNV1A64;
        b->ops = o;
    }
    return b->ops;
}

static ref_space_ext *ext_make(ref_space_state *sp) {
    if (!sp->ext)
        sp->ext = calloc(1, sizeof(ref_space_ext));
    return sp->ext;
}

static uint32_t claimed(const ref_space_state *sp) {
    const ref_space_ext *x = sp->ext;
    return x ? x->claimed : 0;
}

static uint32_t n_demoted(const ref_space_state *sp) {
    const ref_space_ext *x = sp->ext;
    return x ? x->n_demoted : 0;
}

/* ops_in_flight = claimed pairs + spaces holding demoted ranges (read by validate.c, sequence.c). */
static void recount(const ref_bundle *b, ref_seq *s) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < b->n_spaces; i++)
        n += (claimed(&s->sp[i]) != 0) + (n_demoted(&s->sp[i]) != 0);
    s->ops_in_flight = n;
}

static int overlaps_demoted(const ref_bundle *b, const ref_space_state *sp, uint32_t space, BaseRTTokenRange r) {
    const ref_space_ext *x = sp->ext;
    if (!x)
        return 0;
    if (!ref_space_is_paged(b, space))
        return x->n_demoted != 0; /* a blob is one state: any demote takes it */
    for (uint32_t i = 0; i < x->n_demoted; i++)
        if (r.start < x->demoted[i].end && x->demoted[i].start < r.end)
            return 1;
    return 0;
}

/* Index in the compacted block table of full-layout block `first` (blocks released by earlier
 * demoted ranges are missing from the table). */
static uint32_t compact_pos(const ref_space_ext *x, uint32_t first, const ref_demoted *skip) {
    uint32_t pos = first;
    for (uint32_t i = 0; x && i < x->n_demoted; i++)
        if (&x->demoted[i] != skip && x->demoted[i].first_block < first)
            pos -= x->demoted[i].n_blocks;
    return pos;
}

/* Whole blocks of a paged space of valid length `len` lying inside [start, end). */
static void whole_blocks(const ref_bundle *b, uint64_t len, uint64_t start, uint64_t end, uint32_t *first,
                         uint32_t *n) {
    uint64_t bt = b->pool.block_tokens;
    uint64_t kb = (start + bt - 1) / bt;
    uint64_t ke = end >= len ? ref_pool_blocks_for(&b->pool, len) : end / bt;
    *first = (uint32_t)kb;
    *n = ke > kb ? (uint32_t)(ke - kb) : 0;
}

/* s->len follows the longest space (after a trim or restore shortened some); the history hash
 * follows the tokens when they are known. */
static void relen(ref_bundle *b, ref_seq *s) {
    uint64_t len = 0;
    for (uint32_t i = 0; i < b->n_spaces; i++)
        if (b->space_cfg[i].kind != BASERT_SPACE_KIND_ENCODER_CACHE && s->sp[i].valid_len > len)
            len = s->sp[i].valid_len;
    if (len < s->len) {
        s->len = (uint32_t)len;
        if (!s->tokens_unknown)
            s->hist_hash = ref_env_history(b, s->tokens, s->len);
    }
}

static int lane_faulted(const ref_seq *s) { return s->owner && s->owner->state == REF_LANE_FAULTED; }

/* Resolves (seq, space_id) and locks the bundle. UNKNOWN_HANDLE: unknown sequence or space, or
 * the sequence of a faulted lane (its state is gone); OP_UNSUPPORTED: a space flagged
 * OPS_UNAVAILABLE or an ENCODER_CACHE space (rules 92, 93). On OK the caller unlocks. */
static baseRT_status gate(baseRT_sequence_t seq, uint32_t space_id, ref_bundle **b, ref_seq **s, uint32_t *space) {
    baseRT_status rc = ref_seq_lock(seq, b, s);
    if (rc)
        return rc;
    int i = ref_space_index(*b, space_id);
    if (i < 0 || lane_faulted(*s))
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else if (((*b)->space_cfg[i].flags & BASERT_SPACE_FLAG_OPS_UNAVAILABLE) ||
             (*b)->space_cfg[i].kind == BASERT_SPACE_KIND_ENCODER_CACHE)
        rc = BASERT_ERR_OP_UNSUPPORTED;
    if (rc)
        ref_unlock(*b);
    else
        *space = (uint32_t)i;
    return rc;
}

/* The blob state of space `space` at position q: its history hash and provenance. -1 when the
 * sequence cannot produce it (a restored state elsewhere, tokens not known). */
static int blob_key(const ref_bundle *b, const ref_seq *s, uint32_t space, uint64_t q, uint64_t *key,
                    uint8_t prov[32]) {
    const ref_space_state *sp = &s->sp[space];
    const ref_space_ext *x = sp->ext;
    if (x && x->has_key && x->key_pos == q) {
        *key = x->key;
        memcpy(prov, x->key_prov, 32);
        return 0;
    }
    if (s->tokens_unknown || q > s->len)
        return -1;
    *key = ref_env_history(b, s->tokens, q);
    ref_provenance(b, space, s->tokens, (uint32_t)q, sp->taint_bits, sp->prov_salt, prov);
    return 0;
}

static int is_boundary(const ref_space_state *sp, uint64_t q) {
    for (uint32_t i = 0; i < sp->n_boundaries; i++)
        if (sp->boundaries[i] == q)
            return 1;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Op records                                                                               */
/* ---------------------------------------------------------------------------------------- */

static void op_release(ref_bundle *b, ref_op *op) {
    for (uint32_t i = 0; i < op->n_blocks; i++)
        ref_pool_unref(&b->pool, op->blocks[i]);
    free(op->blocks);
    free(op->tokens);
    free(op->staged);
    op->blocks = NULL;
    op->tokens = NULL;
    op->staged = NULL;
    op->n_blocks = 0;
    op->dst = NULL;
}

/* A new RUNNING op claiming (s, space); NULL out of memory (nothing changed). */
static ref_op *op_new(ref_bundle *b, ref_seq *s, uint32_t space, uint32_t kind) {
    ref_ops *o = ops_make(b);
    ref_space_ext *x = ext_make(&s->sp[space]);
    ref_op *op = calloc(1, sizeof *op);
    if (!o || !x || !op || o->next == 0xFFFFFFFFu ||
        ref_reserve((void **)&o->all, &o->cap_all, (uint64_t)o->n_all + 1, sizeof *o->all) ||
        ref_reserve((void **)&o->running, &o->cap_running, (uint64_t)o->n_running + 1, sizeof *o->running) ||
        ref_reserve((void **)&o->done, &o->cap_done, (uint64_t)o->n_running + o->n_done + 1, sizeof *o->done)) {
        free(op);
        return NULL;
    }
    op->handle = (b->serial << 32) | ++o->next;
    if (ref_map_put(&o->index, op->handle, op)) {
        free(op);
        return NULL;
    }
    op->seq = (uint64_t)(uintptr_t)ref_seq_handle(s);
    op->space = space;
    op->kind = kind;
    op->state = BASERT_OP_RUNNING;
    o->all[o->n_all++] = op;
    o->running[o->n_running++] = op;
    x->claimed = 1;
    recount(b, s);
    return op;
}

/* Makes a RUNNING op terminal: frees what it held, releases its claim, queues its completion
 * for the next tick's events (rule 69). */
static void op_finish(ref_bundle *b, ref_op *op, uint32_t state, baseRT_status error) {
    ref_ops *o = b->ops;
    op->state = state;
    op->error = state == BASERT_OP_FAILED ? (uint32_t)error : 0;
    if (state == BASERT_OP_DONE)
        op->bytes_moved = op->bytes_total;
    op_release(b, op);
    ref_seq *s = ref_seq_find(b, (baseRT_sequence_t)(uintptr_t)op->seq);
    if (s) {
        ref_space_ext *x = s->sp[op->space].ext;
        if (x)
            x->claimed = 0;
        recount(b, s);
    }
    for (uint32_t i = 0; i < o->n_running; i++)
        if (o->running[i] == op) {
            memmove(&o->running[i], &o->running[i + 1], (size_t)(o->n_running - i - 1) * sizeof *o->running);
            o->n_running--;
            break;
        }
    BaseRTOpComplete *c = &o->done[o->n_done++]; /* capacity reserved by op_new */
    memset(c, 0, sizeof *c);
    c->op = op->handle;
    c->state = (uint8_t)state;
    c->error = op->error;
    c->bytes_moved = op->bytes_moved;
}

/* Submission: stores the handle and says OK. */
static baseRT_status issued(ref_op *op, baseRT_op_t *out) {
    *out = op->handle;
    return BASERT_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Completion                                                                               */
/* ---------------------------------------------------------------------------------------- */

static baseRT_status complete_demote(ref_bundle *b, ref_seq *s, ref_op *op) {
    ref_space_state *sp = &s->sp[op->space];
    ref_space_ext *x = sp->ext;
    if (ref_reserve((void **)&x->demoted, &x->cap_demoted, (uint64_t)x->n_demoted + 1, sizeof *x->demoted))
        return BASERT_ERR_FATAL;
    ref_demoted d = op->dem;
    if (ref_space_is_paged(b, op->space)) {
        whole_blocks(b, sp->valid_len, d.start, d.end, &d.first_block, &d.n_blocks);
        uint32_t pos = compact_pos(x, d.first_block, NULL);
        if (pos + d.n_blocks > s->n_blocks)
            return BASERT_ERR_FATAL; /* the table does not hold them: nothing is released */
        for (uint32_t k = 0; k < d.n_blocks; k++)
            ref_pool_unref(&b->pool, s->blocks[pos + k]); /* rule 108: only now */
        if (d.n_blocks)
            memmove(&s->blocks[pos], &s->blocks[pos + d.n_blocks],
                    (size_t)(s->n_blocks - pos - d.n_blocks) * sizeof *s->blocks);
        s->n_blocks -= d.n_blocks;
    }
    x->demoted[x->n_demoted++] = d;
    memcpy(op->dst, op->staged, (size_t)op->bytes_total);
    sp->content_gen++;
    return BASERT_STATUS_OK;
}

static baseRT_status complete_promote(ref_bundle *b, ref_seq *s, ref_op *op) {
    ref_space_state *sp = &s->sp[op->space];
    ref_space_ext *x = sp->ext;
    ref_demoted *d = NULL;
    for (uint32_t i = 0; x && i < x->n_demoted; i++)
        if (x->demoted[i].start == op->dem.start && x->demoted[i].end == op->dem.end)
            d = &x->demoted[i];
    if (!d)
        return BASERT_ERR_FATAL;
    if (ref_space_is_paged(b, op->space)) {
        uint32_t pos = compact_pos(x, d->first_block, d);
        if (pos > s->n_blocks || (uint64_t)s->n_blocks + op->n_blocks > s->cap_blocks)
            return BASERT_ERR_FATAL;
        if (op->n_blocks) {
            memmove(&s->blocks[pos + op->n_blocks], &s->blocks[pos],
                    (size_t)(s->n_blocks - pos) * sizeof *s->blocks);
            memcpy(&s->blocks[pos], op->blocks, (size_t)op->n_blocks * sizeof *s->blocks);
        }
        s->n_blocks += op->n_blocks;
        op->n_blocks = 0; /* the sequence holds them now */
    }
    if (d->encoding != BASERT_ENCODING_LOSSLESS)
        sp->taint_bits |= BASERT_TAINT_QUANTIZED_DEMOTION; /* rule 107 */
    *d = x->demoted[--x->n_demoted];
    sp->content_gen++;
    return BASERT_STATUS_OK;
}

static int push_boundary_only(ref_space_state *sp, uint64_t q) {
    sp->n_boundaries = 0;
    if (!q)
        return 0;
    if (ref_reserve((void **)&sp->boundaries, &sp->cap_boundaries, 1, sizeof *sp->boundaries))
        return -1;
    sp->boundaries[sp->n_boundaries++] = q;
    return 0;
}

static baseRT_status complete_restore(ref_bundle *b, ref_seq *s, ref_op *op) {
    ref_space_state *sp = &s->sp[op->space];
    ref_space_ext *x = sp->ext;
    const BaseRTStateEnvelope *e = &op->env;
    uint64_t q = e->range.end;
    uint32_t taint = e->taint_bits | (e->encoding != BASERT_ENCODING_LOSSLESS ? BASERT_TAINT_QUANTIZED_DEMOTION : 0);
    if (ref_space_is_paged(b, op->space)) {
        if (ref_reserve((void **)&s->tokens, &s->cap, q ? q : 1, sizeof *s->tokens))
            return BASERT_ERR_FATAL;
        ref_seq_release_blocks(b, s);
        if (op->n_blocks) /* capacity reserved at submission */
            memcpy(s->blocks, op->blocks, (size_t)op->n_blocks * sizeof *s->blocks);
        s->n_blocks = op->n_blocks;
        op->n_blocks = 0;
        if (q)
            memcpy(s->tokens, op->tokens, (size_t)q * sizeof *s->tokens);
        s->len = (uint32_t)q;
        s->tokens_unknown = 0;
        s->hist_hash = ref_env_history(b, s->tokens, q);
    } else {
        if (push_boundary_only(sp, q))
            return BASERT_ERR_FATAL;
        x->has_key = 1;
        x->key_pos = q;
        x->key = op->key;
        memcpy(x->key_prov, e->provenance_digest, 32);
        int fits = !s->tokens_unknown && q <= s->len && ref_env_history(b, s->tokens, q) == op->key;
        if (b->paged_space < 0 && !fits) { /* blob-only: the tokens are those of the state */
            if (ref_reserve((void **)&s->tokens, &s->cap, q ? q : 1, sizeof *s->tokens))
                return BASERT_ERR_FATAL;
            memset(s->tokens, 0, (size_t)q * sizeof *s->tokens);
            s->len = (uint32_t)q;
            s->tokens_unknown = 1; /* until seed_adopt names them */
            s->hist_hash = op->key;
        }
    }
    sp->valid_len = q;
    sp->taint_bits = taint;
    sp->prov_salt = 0;
    sp->content_gen++;
    relen(b, s);
    return BASERT_STATUS_OK;
}

static void complete(ref_bundle *b, ref_op *op) {
    ref_seq *s = ref_seq_find(b, (baseRT_sequence_t)(uintptr_t)op->seq);
    baseRT_status rc = BASERT_STATUS_OK;
    if (op->kind == OP_SNAPSHOT) {
        memcpy(op->dst, op->staged, (size_t)op->bytes_total); /* the state as it was submitted */
    } else if (!s || lane_faulted(s)) {
        rc = BASERT_ERR_UNKNOWN_HANDLE; /* the sequence's state went away (lease expiry, fault) */
        ref_space_ext *x = s ? s->sp[op->space].ext : NULL;
        for (uint32_t i = 0; op->kind == OP_PROMOTE && x && i < x->n_demoted; i++)
            if (x->demoted[i].start == op->dem.start && x->demoted[i].end == op->dem.end) {
                x->demoted[i] = x->demoted[--x->n_demoted]; /* nothing left to promote into */
                break;
            }
    } else if (op->kind == OP_DEMOTE) {
        rc = complete_demote(b, s, op);
    } else if (op->kind == OP_PROMOTE) {
        rc = complete_promote(b, s, op);
    } else {
        rc = complete_restore(b, s, op);
    }
    op_finish(b, op, rc ? BASERT_OP_FAILED : BASERT_OP_DONE, rc);
}

/* ---------------------------------------------------------------------------------------- */
/* Hooks (ref_internal.h)                                                                   */
/* ---------------------------------------------------------------------------------------- */

/* Completes every RUNNING op: all were submitted before this tick (rule 69). */
void ref_ops_pump(ref_bundle *b) {
    ref_ops *o = b->ops;
    while (o && o->n_running)
        complete(b, o->running[0]); /* op_finish removes it from running */
}

/* The sequence was emptied (its lane faulted): demoted ranges and restored blob states are gone
 * with it, so nothing is left to promote and its lane can be retired at once (rules 61, 62). A
 * RUNNING op keeps its claim until it completes, FAILED, at the next tick. */
void ref_ops_seq_cleared(ref_bundle *b, ref_seq *s) {
    for (uint32_t k = 0; k < b->n_spaces; k++) {
        ref_space_ext *x = s->sp[k].ext;
        if (x) {
            x->n_demoted = 0;
            x->has_key = 0;
        }
    }
    recount(b, s);
}

uint32_t ref_ops_pending(const ref_bundle *b) {
    const ref_ops *o = b->ops;
    return o ? o->n_done : 0;
}

uint32_t ref_ops_drain(ref_bundle *b, BaseRTOpComplete *dst, uint32_t cap) {
    ref_ops *o = b->ops;
    if (!o)
        return 0;
    uint32_t n = o->n_done < cap ? o->n_done : cap;
    memcpy(dst, o->done, (size_t)n * sizeof *dst);
    memmove(o->done, o->done + n, (size_t)(o->n_done - n) * sizeof *o->done);
    o->n_done -= n;
    return n;
}

void ref_ops_space_free(ref_bundle *b, ref_space_state *sp) {
    (void)b;
    ref_space_ext *x = sp->ext;
    if (x)
        free(x->demoted);
    free(x);
    sp->ext = NULL;
}

void ref_ops_free_all(ref_bundle *b) {
    ref_ops *o = b->ops;
    if (!o)
        return;
    for (uint32_t i = 0; i < o->n_all; i++) {
        op_release(b, o->all[i]);
        free(o->all[i]);
    }
    free(o->all);
    free(o->running);
    free(o->done);
    ref_map_free(&o->index);
    free(o);
    b->ops = NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* Exports: export_size, snapshot, demote                                                   */
/* ---------------------------------------------------------------------------------------- */

/* Bytes an export of `range` of space `space` needs, envelope included (ABI rules 92-95):
 * OP_UNSUPPORTED for an encoding the space is not served in (rule 93); BOUNDS for start > end or
 * end > the space's valid length (rule 94). */
static baseRT_status export_required(const ref_bundle *b, const ref_seq *s, uint32_t space, BaseRTTokenRange r,
                                     uint32_t encoding, uint64_t *required) {
    const ref_space_state *sp = &s->sp[space];
    if (!ref_env_unit_bytes(b, space, encoding) || (ref_space_is_paged(b, space) && s->tokens_unknown))
        return BASERT_ERR_OP_UNSUPPORTED;
    if (r.start > r.end || r.end > sp->valid_len)
        return BASERT_REJECT_BOUNDS;
    *required = REF_ENVELOPE_BYTES + ref_env_payload_bytes(b, space, r, encoding);
    return BASERT_STATUS_OK;
}

/* Bytes an export of `range` needs (136-byte envelope included) and the sizing generation the
 * submission must quote (ABI rules 92-96). UNKNOWN_HANDLE for an unknown sequence or space id;
 * OP_UNSUPPORTED for an OPS_UNAVAILABLE or ENCODER_CACHE space or an encoding not served there;
 * BOUNDS for a range beyond the valid length; BAD_STRUCT for a NULL output. */
baseRT_status baseRT_space_export_size(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range,
                                       uint8_t encoding, uint64_t *required_bytes, uint64_t *sizing_gen) {
    ref_bundle *b;
    ref_seq *s;
    uint32_t space;
    baseRT_status rc = gate(seq, space_id, &b, &s, &space);
    if (rc)
        return rc;
    uint64_t req = 0;
    if (!required_bytes || !sizing_gen)
        rc = BASERT_REJECT_BAD_STRUCT;
    else
        rc = export_required(b, s, space, range, encoding, &req);
    if (!rc) {
        *required_bytes = req;
        *sizing_gen = s->sp[space].content_gen;
    }
    ref_unlock(b);
    return rc;
}

/* Checks an export submission and stages its sealed bytes (nothing changes on refusal). */
static baseRT_status export_submit(ref_bundle *b, ref_seq *s, uint32_t space, BaseRTTokenRange r, uint32_t encoding,
                                   BaseRTBuf dst, uint64_t sizing_gen, baseRT_op_t *op_out, uint32_t kind) {
    ref_space_state *sp = &s->sp[space];
    int paged = ref_space_is_paged(b, space);
    uint64_t required = 0, key = 0;
    uint8_t prov[32];
    baseRT_status rc;
    if (!op_out)
        return BASERT_REJECT_BAD_STRUCT;
    if (claimed(sp) || (kind == OP_DEMOTE && s->leased))
        return BASERT_EBUSY; /* rule 98 */
    if (!ref_env_unit_bytes(b, space, encoding))
        return BASERT_ERR_OP_UNSUPPORTED; /* rule 93 */
    if (sizing_gen != sp->content_gen)
        return BASERT_ERR_STALE_SIZING; /* rule 96 */
    if ((rc = export_required(b, s, space, r, encoding, &required)))
        return rc; /* rule 94 */
    if (overlaps_demoted(b, sp, space, r) || (kind == OP_DEMOTE && paged && r.start == r.end))
        return BASERT_REJECT_BOUNDS; /* rule 106: demoted state is not resident */
    if (!dst.ptr || dst.len < required)
        return BASERT_ERR_BUFFER_TOO_SMALL; /* rule 97: no handle, no byte written */
    if (!paged) {
        uint64_t q = r.end;
        int at = kind == OP_DEMOTE ? q == sp->valid_len && q > 0
                                   : is_boundary(sp, q) || (b->space_cfg[space].snapshot_cadence == 1 && q == sp->valid_len);
        if (!at || blob_key(b, s, space, q, &key, prov))
            return BASERT_ERR_OUT_OF_BOUNDARY; /* rule 110 */
        r.start = q;
    } else {
        ref_provenance(b, space, s->tokens, (uint32_t)r.end, sp->taint_bits, sp->prov_salt, prov);
    }
    uint8_t *staged = malloc((size_t)required);
    if (!staged)
        return BASERT_ERR_FATAL;
    uint64_t payload = required - REF_ENVELOPE_BYTES;
    if (paged)
        ref_env_paged_payload(b, space, s->tokens, r.start, r.end, encoding, staged + REF_ENVELOPE_BYTES);
    else
        ref_env_blob_payload(b, space, key, staged + REF_ENVELOPE_BYTES);
    ref_ops *o = ops_make(b);
    rc = o ? ref_env_seal(b, space, r, encoding, prov, sp->taint_bits, o->checksum_kind, staged, payload)
           : BASERT_ERR_FATAL;
    ref_op *op = rc ? NULL : op_new(b, s, space, kind);
    if (!op) {
        free(staged);
        return rc ? rc : BASERT_ERR_FATAL;
    }
    op->staged = staged;
    op->dst = dst.ptr;
    op->bytes_total = required;
    op->dem.start = r.start;
    op->dem.end = r.end;
    op->dem.encoding = encoding;
    return issued(op, op_out);
}

/* Starts a LOSSLESS export of tokens [0, boundary_pos) (paged) or of the state at boundary_pos
 * (blob kinds) into dst, exactly export_size bytes (rule 95). Refusals (no handle, no byte
 * written): UNKNOWN_HANDLE, OP_UNSUPPORTED (rules 92, 93), EBUSY (pair claimed, rule 98),
 * STALE_SIZING (rule 96), BOUNDS (beyond the valid length or over a demoted range, rule 94),
 * BUFFER_TOO_SMALL (dst shorter than required or NULL, rule 97), OUT_OF_BOUNDARY (blob position
 * not a recorded boundary, rule 110), BAD_STRUCT (NULL op). */
baseRT_status baseRT_space_snapshot(baseRT_sequence_t seq, uint32_t space_id, uint64_t boundary_pos, BaseRTBuf dst,
                                    uint64_t sizing_gen, baseRT_op_t *op) {
    ref_bundle *b;
    ref_seq *s;
    uint32_t space;
    baseRT_status rc = gate(seq, space_id, &b, &s, &space);
    if (rc)
        return rc;
    BaseRTTokenRange r = {0, boundary_pos};
    rc = export_submit(b, s, space, r, BASERT_ENCODING_LOSSLESS, dst, sizing_gen, op, OP_SNAPSHOT);
    ref_unlock(b);
    return rc;
}

/* Starts moving `range` to host memory in `encoding` (sealed into dst as a snapshot is). When the
 * op completes the range is demoted: paged blocks wholly inside it go back to the pool (rule 108)
 * and the sequence stays claimed until promote. Refusals as baseRT_space_snapshot, plus
 * OP_UNSUPPORTED for a lossy blob demote (rule 93), BOUNDS for an empty paged range or one
 * overlapping a demoted range (rule 106), EBUSY for a sequence held by an adopt lease, and
 * OUT_OF_BOUNDARY for a blob range not ending at the current length. */
baseRT_status baseRT_space_demote(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range, uint8_t encoding,
                                  BaseRTBuf dst, uint64_t sizing_gen, baseRT_op_t *op) {
    ref_bundle *b;
    ref_seq *s;
    uint32_t space;
    baseRT_status rc = gate(seq, space_id, &b, &s, &space);
    if (rc)
        return rc;
    rc = export_submit(b, s, space, range, encoding, dst, sizing_gen, op, OP_DEMOTE);
    ref_unlock(b);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Imports: restore, promote                                                                */
/* ---------------------------------------------------------------------------------------- */

/* Takes n fresh pool blocks into *out (NEEDS_REPLAN when the pool has fewer free). */
static baseRT_status take_blocks(ref_bundle *b, uint32_t n, uint32_t **out) {
    *out = NULL;
    if (!n)
        return BASERT_STATUS_OK;
    if (b->pool.n_free < n)
        return BASERT_NEEDS_REPLAN;
    uint32_t *v = malloc((size_t)n * sizeof *v);
    if (!v)
        return BASERT_ERR_FATAL;
    for (uint32_t i = 0; i < n; i++)
        v[i] = ref_pool_alloc(&b->pool);
    *out = v;
    return BASERT_STATUS_OK;
}

/* Returns blocks taken by take_blocks (none when it failed: blocks is NULL then). */
static void give_back(ref_bundle *b, uint32_t *blocks, uint32_t n) {
    for (uint32_t i = 0; blocks && i < n; i++)
        ref_pool_unref(&b->pool, blocks[i]);
    free(blocks);
}

/* The paged payload's tokens (ENVELOPE_MISMATCH for an id outside the vocabulary). */
static baseRT_status read_tokens(const ref_bundle *b, const uint8_t *payload, uint64_t n, uint64_t unit,
                                 uint32_t *out) {
    for (uint64_t p = 0; p < n; p++) {
        out[p] = ref_env_le32(payload + p * unit);
        if (out[p] >= b->cfg.vocab_size)
            return BASERT_ERR_ENVELOPE_MISMATCH;
    }
    return BASERT_STATUS_OK;
}

static baseRT_status restore_submit(ref_bundle *b, ref_seq *s, uint32_t space, BaseRTBuf src, baseRT_op_t *op_out) {
    ref_space_state *sp = &s->sp[space];
    BaseRTStateEnvelope e;
    baseRT_status rc;
    if (!op_out)
        return BASERT_REJECT_BAD_STRUCT;
    if (s->owner)
        return BASERT_ERR_UNKNOWN_HANDLE; /* a lane's state changes through plans only */
    if (claimed(sp) || n_demoted(sp) || s->leased)
        return BASERT_EBUSY; /* rule 98 */
    if ((rc = ref_env_open(b, space, src, &e)))
        return rc; /* rules 101-103 */
    const uint8_t *payload = (const uint8_t *)src.ptr + REF_ENVELOPE_BYTES;
    uint64_t unit = ref_env_unit_bytes(b, space, e.encoding);
    uint64_t q = e.range.end;
    uint32_t *tokens = NULL, *blocks = NULL, n_blocks = 0;
    uint64_t key = 0;
    if (ref_space_is_paged(b, space)) {
        if (!unit || e.range.start != 0 || q > 0xFFFFFFFFull || e.payload_len != q * unit)
            return BASERT_ERR_ENVELOPE_MISMATCH; /* not a whole state from position 0 */
        if (!(tokens = malloc((size_t)(q ? q : 1) * sizeof *tokens)))
            return BASERT_ERR_FATAL;
        uint8_t prov[32];
        if (!(rc = read_tokens(b, payload, q, unit, tokens))) {
            ref_provenance(b, space, tokens, (uint32_t)q, e.taint_bits, 0, prov);
            if (memcmp(prov, e.provenance_digest, 32))
                rc = BASERT_ERR_IDENTITY_MISMATCH; /* the digest is not this content's */
        }
        n_blocks = ref_pool_blocks_for(&b->pool, q);
        if (!rc && ref_reserve((void **)&s->blocks, &s->cap_blocks, n_blocks ? n_blocks : 1, sizeof *s->blocks))
            rc = BASERT_ERR_FATAL;
        if (!rc)
            rc = take_blocks(b, n_blocks, &blocks);
    } else {
        if (!unit || e.range.start != q || e.payload_len != unit)
            return BASERT_ERR_ENVELOPE_MISMATCH;
        key = ref_env_le64(payload);
        if (b->paged_space >= 0 && !s->tokens_unknown && q <= s->len && ref_env_history(b, s->tokens, q) != key)
            rc = BASERT_ERR_ENVELOPE_MISMATCH; /* the target's tokens say another history */
    }
    ref_op *op = rc ? NULL : op_new(b, s, space, OP_RESTORE);
    if (!op) {
        free(tokens);
        give_back(b, blocks, n_blocks);
        return rc ? rc : BASERT_ERR_FATAL;
    }
    op->env = e;
    op->tokens = tokens;
    op->blocks = blocks;
    op->n_blocks = n_blocks;
    op->key = key;
    op->bytes_total = src.len;
    return issued(op, op_out);
}

/* Starts restoring sealed bytes (a snapshot's, or a demote's that starts at 0) into a caller-owned
 * sequence; when it completes the space holds exactly the exported state: its length, tokens
 * (paged), boundary (blob) and taint bits, plus QUANTIZED_DEMOTION for a lossy payload (rule 107).
 * Refusals, all before anything changes (rule 104): UNKNOWN_HANDLE (unknown or lane-owned
 * sequence, unknown space), OP_UNSUPPORTED (rules 92-93), EBUSY (pair claimed or holding a
 * demoted range, adopt lease), ENVELOPE_MISMATCH / IDENTITY_MISMATCH / CHECKSUM (rules 101-103;
 * also a payload that is not a whole state, a token outside the vocabulary, a provenance digest
 * other than the content's, a blob state whose history contradicts the target's tokens),
 * NEEDS_REPLAN (the pool cannot hold the state), BAD_STRUCT (NULL op). */
baseRT_status baseRT_space_restore(baseRT_sequence_t seq, uint32_t space_id, BaseRTBuf src, baseRT_op_t *op) {
    ref_bundle *b;
    ref_seq *s;
    uint32_t space;
    baseRT_status rc = gate(seq, space_id, &b, &s, &space);
    if (rc)
        return rc;
    rc = restore_submit(b, s, space, src, op);
    ref_unlock(b);
    return rc;
}

static baseRT_status promote_submit(ref_bundle *b, ref_seq *s, uint32_t space, BaseRTTokenRange r, BaseRTBuf src,
                                    baseRT_op_t *op_out) {
    ref_space_state *sp = &s->sp[space];
    ref_space_ext *x = sp->ext;
    int paged = ref_space_is_paged(b, space);
    BaseRTStateEnvelope e;
    baseRT_status rc;
    if (!op_out)
        return BASERT_REJECT_BAD_STRUCT;
    if (claimed(sp) || s->leased)
        return BASERT_EBUSY; /* rule 98 */
    const ref_demoted *d = NULL;
    for (uint32_t i = 0; x && i < x->n_demoted; i++)
        if (x->demoted[i].end == r.end && (!paged || x->demoted[i].start == r.start))
            d = &x->demoted[i];
    if (!d)
        return BASERT_REJECT_BOUNDS; /* rule 105: not a demoted range of this sequence */
    if ((rc = ref_env_open(b, space, src, &e)))
        return rc; /* rules 101-103 */
    if (e.range.start != d->start || e.range.end != d->end || e.encoding != d->encoding ||
        e.payload_len != ref_env_payload_bytes(b, space, e.range, e.encoding))
        return BASERT_ERR_ENVELOPE_MISMATCH;
    uint8_t prov[32];
    uint64_t key = 0;
    if (paged)
        ref_provenance(b, space, s->tokens, (uint32_t)d->end, sp->taint_bits, sp->prov_salt, prov);
    else if (blob_key(b, s, space, d->end, &key, prov))
        return BASERT_ERR_ENVELOPE_MISMATCH;
    if (memcmp(prov, e.provenance_digest, 32))
        return BASERT_ERR_IDENTITY_MISMATCH; /* bytes of another sequence or state */
    uint32_t *blocks = NULL;
    if (paged && ref_reserve((void **)&s->blocks, &s->cap_blocks, (uint64_t)s->n_blocks + d->n_blocks + 1,
                             sizeof *s->blocks))
        return BASERT_ERR_FATAL;
    if ((rc = take_blocks(b, paged ? d->n_blocks : 0, &blocks)))
        return rc;
    ref_demoted dem = *d;
    ref_op *op = op_new(b, s, space, OP_PROMOTE);
    if (!op) {
        give_back(b, blocks, paged ? dem.n_blocks : 0);
        return BASERT_ERR_FATAL;
    }
    op->env = e;
    op->blocks = blocks;
    op->n_blocks = paged ? dem.n_blocks : 0;
    op->dem = dem;
    op->bytes_total = src.len;
    return issued(op, op_out);
}

/* Starts bringing a demoted range back from the sealed bytes its demote wrote. `range` must be
 * a range currently demoted on this sequence and space, else BOUNDS (rule 105); the envelope is
 * checked as restore checks it (rules 101-103) and must carry that range, its encoding and this
 * sequence's provenance (ENVELOPE_MISMATCH / IDENTITY_MISMATCH). The valid length never changes;
 * a lossy range comes back tainted QUANTIZED_DEMOTION (rule 107). NEEDS_REPLAN when the pool
 * cannot give back the released blocks; EBUSY while the pair is claimed; BAD_STRUCT for NULL op. */
baseRT_status baseRT_space_promote(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range, BaseRTBuf src,
                                   baseRT_op_t *op) {
    ref_bundle *b;
    ref_seq *s;
    uint32_t space;
    baseRT_status rc = gate(seq, space_id, &b, &s, &space);
    if (rc)
        return rc;
    rc = promote_submit(b, s, space, range, src, op);
    ref_unlock(b);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Synchronous calls: trim, snapshot_boundary, poll, cancel                                 */
/* ---------------------------------------------------------------------------------------- */

/* Shortens one space of a caller-owned sequence to new_len tokens (ABI rule 109). Paged spaces
 * take any length <= the valid length and release the blocks past it; blob spaces take a
 * recorded boundary, 0 or their current length, else OUT_OF_BOUNDARY. BOUNDS for new_len above
 * the valid length; EBUSY while the pair is claimed, holds a demoted range or the sequence is
 * leased (rule 98); UNKNOWN_HANDLE for a lane-owned sequence; OP_UNSUPPORTED as export_size. */
baseRT_status baseRT_space_trim(baseRT_sequence_t seq, uint32_t space_id, uint64_t new_len) {
    ref_bundle *b;
    ref_seq *s;
    uint32_t space;
    baseRT_status rc = gate(seq, space_id, &b, &s, &space);
    if (rc)
        return rc;
    ref_space_state *sp = &s->sp[space];
    if (s->owner)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else if (claimed(sp) || n_demoted(sp) || s->leased)
        rc = BASERT_EBUSY;
    else if (new_len > sp->valid_len)
        rc = BASERT_REJECT_BOUNDS;
    else if (!ref_space_is_paged(b, space) && new_len && new_len != sp->valid_len && !is_boundary(sp, new_len))
        rc = BASERT_ERR_OUT_OF_BOUNDARY;
    if (!rc) {
        if (ref_space_is_paged(b, space)) {
            uint32_t keep = ref_pool_blocks_for(&b->pool, new_len);
            while (s->n_blocks > keep)
                ref_pool_unref(&b->pool, s->blocks[--s->n_blocks]);
        } else {
            uint32_t n = 0;
            while (n < sp->n_boundaries && sp->boundaries[n] <= new_len)
                n++;
            sp->n_boundaries = n;
            ref_space_ext *x = sp->ext;
            if (x && x->has_key && x->key_pos > new_len)
                x->has_key = 0;
        }
        if (new_len != sp->valid_len) {
            sp->valid_len = new_len;
            sp->content_gen++;
            relen(b, s);
        }
    }
    ref_unlock(b);
    return rc;
}

/* The newest durable snapshot position <= cap (ABI rule 111): for blob kinds the newest
 * recorded boundary <= min(cap, valid length), 0 when none; for paged kinds the last whole-page
 * length <= min(cap, valid length). UNKNOWN_HANDLE / OP_UNSUPPORTED as export_size; BAD_STRUCT
 * for a NULL output. */
baseRT_status baseRT_space_snapshot_boundary(baseRT_sequence_t seq, uint32_t space_id, uint64_t cap,
                                             uint64_t *boundary_out) {
    ref_bundle *b;
    ref_seq *s;
    uint32_t space;
    baseRT_status rc = gate(seq, space_id, &b, &s, &space);
    if (rc)
        return rc;
    const ref_space_state *sp = &s->sp[space];
    uint64_t lim = cap < sp->valid_len ? cap : sp->valid_len, best = 0;
    if (!boundary_out) {
        rc = BASERT_REJECT_BAD_STRUCT;
    } else if (ref_space_is_paged(b, space)) {
        best = lim / b->pool.block_tokens * b->pool.block_tokens;
    } else {
        for (uint32_t i = 0; i < sp->n_boundaries; i++)
            if (sp->boundaries[i] <= lim && sp->boundaries[i] > best)
                best = sp->boundaries[i];
    }
    if (!rc)
        *boundary_out = best;
    ref_unlock(b);
    return rc;
}

static ref_op *op_find(ref_bundle *b, baseRT_op_t op) {
    ref_ops *o = b->ops;
    return o ? ref_map_get(&o->index, op) : NULL;
}

/* The state of op `op` (ABI rule 99): UNKNOWN_HANDLE for a handle this bundle never issued;
 * BAD_STRUCT for a NULL out or out->struct_size below 24. error holds a baseRT_status as uint32
 * bits when FAILED; bytes_moved is 0 until DONE, then the bytes written or read. */
baseRT_status baseRT_op_poll(baseRT_model_t bundle, baseRT_op_t op, BaseRTOpStatus *out) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_op *o = op_find(b, op);
    if (!out || out->struct_size < sizeof *out)
        rc = BASERT_REJECT_BAD_STRUCT;
    else if (!o)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else {
        memset(out, 0, sizeof *out);
        out->struct_size = sizeof *out;
        out->state = (uint8_t)o->state;
        out->error = o->error;
        out->bytes_moved = o->bytes_moved;
    }
    ref_unlock(b);
    return rc;
}

/* Cancels op `op` (ABI rule 100): a RUNNING op becomes CANCELLED now, writes nothing, gives back
 * what it took and releases its claim; its completion is reported by the next tick. A terminal op
 * is left as it is. UNKNOWN_HANDLE for a handle this bundle never issued. */
baseRT_status baseRT_op_cancel(baseRT_model_t bundle, baseRT_op_t op) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_op *o = op_find(b, op);
    if (!o)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else if (o->state == BASERT_OP_RUNNING || o->state == BASERT_OP_PENDING)
        op_finish(b, o, BASERT_OP_CANCELLED, BASERT_STATUS_OK);
    ref_unlock(b);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Test surface (basert_ref.h)                                                              */
/* ---------------------------------------------------------------------------------------- */

baseRT_status baseRT_ref_set_export_checksum(baseRT_model_t bundle, uint32_t checksum_kind) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_ops *o = ops_make(b);
    if (checksum_kind != BASERT_CHECKSUM_FNV1A64 && checksum_kind != BASERT_CHECKSUM_XXH3_64)
        rc = BASERT_REJECT_BOUNDS;
    else if (checksum_kind == BASERT_CHECKSUM_XXH3_64 && !ref_env_xxh3_available())
        rc = BASERT_ERR_OP_UNSUPPORTED;
    else if (!o)
        rc = BASERT_ERR_FATAL;
    else
        o->checksum_kind = checksum_kind;
    ref_unlock(b);
    return rc;
}

baseRT_status baseRT_ref_space_info(baseRT_sequence_t seq, uint32_t space_id, BaseRTRefSpaceInfo *out) {
    ref_bundle *b;
    ref_seq *s;
    baseRT_status rc = ref_seq_lock(seq, &b, &s);
    if (rc)
        return rc;
    int i = ref_space_index(b, space_id);
    if (!out || out->struct_size < sizeof *out)
        rc = BASERT_REJECT_BAD_STRUCT;
    else if (i < 0)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else {
        const ref_space_state *sp = &s->sp[i];
        BaseRTRefSpaceInfo v;
        memset(&v, 0, sizeof v);
        v.struct_size = sizeof v;
        v.valid_len = sp->valid_len;
        v.content_gen = sp->content_gen;
        v.seq_len = s->len;
        v.taint_bits = sp->taint_bits;
        v.n_boundaries = sp->n_boundaries;
        v.n_demoted = n_demoted(sp);
        v.claimed = claimed(sp);
        v.ops_in_flight = s->ops_in_flight;
        v.tokens_known = !s->tokens_unknown;
        v.blocks = s->n_blocks;
        v.lane_owned = s->owner != NULL;
        v.leased = s->leased;
        *out = v;
    }
    ref_unlock(b);
    return rc;
}
