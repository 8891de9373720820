/* ops.c: state operations on sequences (tick ABI §3; RULES.md section H).
 *
 * Not implemented yet in the reference engine: every submission is refused with
 * BASERT_ERR_OP_UNSUPPORTED after the common checks (an unknown sequence or space is
 * UNKNOWN_HANDLE), no op handle is ever issued, so op_poll / op_cancel answer UNKNOWN_HANDLE
 * (rule 99). The state-ops work fills this file in: op records in ref_bundle.ops, claims via
 * ref_seq.ops_in_flight (which already makes plans TRANSFER_LOCKED, rule 49, and fork / free /
 * publish / adopt EBUSY), per-space extras in ref_space_state.ext, sizing via content_gen, and
 * completions handed to ticks by ref_ops_pump / ref_ops_drain (rule 69). */

#include <string.h>

#include "ref_internal.h"

void ref_ops_pump(ref_bundle *b) { (void)b; }

uint32_t ref_ops_pending(const ref_bundle *b) {
    (void)b;
    return 0;
}

uint32_t ref_ops_drain(ref_bundle *b, BaseRTOpComplete *dst, uint32_t cap) {
    (void)b;
    (void)dst;
    (void)cap;
    return 0;
}

void ref_ops_space_free(ref_bundle *b, ref_space_state *sp) {
    (void)b;
    sp->ext = NULL;
}

void ref_ops_free_all(ref_bundle *b) { b->ops = NULL; }

/* Resolves (seq, space_id) and locks the bundle: UNKNOWN_HANDLE for either unknown,
 * OP_UNSUPPORTED for a space flagged OPS_UNAVAILABLE. On success the caller unlocks. */
static baseRT_status gate(baseRT_sequence_t seq, uint32_t space_id, ref_bundle **b, ref_seq **s, int *space) {
    baseRT_status rc = ref_seq_lock(seq, b, s);
    if (rc)
        return rc;
    *space = ref_space_index(*b, space_id);
    if (*space < 0)
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else if ((*b)->space_cfg[*space].flags & BASERT_SPACE_FLAG_OPS_UNAVAILABLE)
        rc = BASERT_ERR_OP_UNSUPPORTED;
    if (rc)
        ref_unlock(*b);
    return rc;
}

/* Common refusal of the not-yet-implemented ops. */
static baseRT_status unsupported(baseRT_sequence_t seq, uint32_t space_id) {
    ref_bundle *b;
    ref_seq *s;
    int space;
    baseRT_status rc = gate(seq, space_id, &b, &s, &space);
    if (rc)
        return rc;
    ref_unlock(b);
    return BASERT_ERR_OP_UNSUPPORTED;
}

baseRT_status baseRT_op_poll(baseRT_model_t bundle, baseRT_op_t op, BaseRTOpStatus *out) {
    (void)op;
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    rc = out ? BASERT_ERR_UNKNOWN_HANDLE : BASERT_REJECT_BAD_STRUCT;
    ref_unlock(b);
    return rc;
}

baseRT_status baseRT_op_cancel(baseRT_model_t bundle, baseRT_op_t op) {
    (void)op;
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_unlock(b);
    return BASERT_ERR_UNKNOWN_HANDLE;
}

baseRT_status baseRT_space_export_size(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range,
                                       uint8_t encoding, uint64_t *required_bytes, uint64_t *sizing_gen) {
    (void)range;
    (void)encoding;
    (void)required_bytes;
    (void)sizing_gen;
    return unsupported(seq, space_id);
}

baseRT_status baseRT_space_snapshot(baseRT_sequence_t seq, uint32_t space_id, uint64_t boundary_pos, BaseRTBuf dst,
                                    uint64_t sizing_gen, baseRT_op_t *op) {
    (void)boundary_pos;
    (void)dst;
    (void)sizing_gen;
    (void)op;
    return unsupported(seq, space_id);
}

baseRT_status baseRT_space_restore(baseRT_sequence_t seq, uint32_t space_id, BaseRTBuf src, baseRT_op_t *op) {
    (void)src;
    (void)op;
    return unsupported(seq, space_id);
}

baseRT_status baseRT_space_snapshot_boundary(baseRT_sequence_t seq, uint32_t space_id, uint64_t cap,
                                             uint64_t *boundary_out) {
    (void)cap;
    (void)boundary_out;
    return unsupported(seq, space_id);
}

baseRT_status baseRT_space_trim(baseRT_sequence_t seq, uint32_t space_id, uint64_t new_len) {
    (void)new_len;
    return unsupported(seq, space_id);
}

baseRT_status baseRT_space_demote(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range, uint8_t encoding,
                                  BaseRTBuf dst, uint64_t sizing_gen, baseRT_op_t *op) {
    (void)range;
    (void)encoding;
    (void)dst;
    (void)sizing_gen;
    (void)op;
    return unsupported(seq, space_id);
}

baseRT_status baseRT_space_promote(baseRT_sequence_t seq, uint32_t space_id, BaseRTTokenRange range, BaseRTBuf src,
                                   baseRT_op_t *op) {
    (void)range;
    (void)src;
    (void)op;
    return unsupported(seq, space_id);
}
