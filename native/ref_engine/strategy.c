/* strategy.c: speculation-strategy registration and admission certificates (tick ABI §2;
 * RULES.md section I).
 *
 * Not implemented yet in the reference engine: registration fails closed with
 * BASERT_ERR_REGISTRATION_REFUSED, so no strategy slot exists; an admit naming a nonzero
 * strategy_slot is therefore ILLEGAL_COMBINATION (rule 36). Admits without a strategy are
 * ADMITTED with cert_id 0 and granted class SEED_PATH_INVARIANT: the reference decodes the target
 * model's own path, exact by construction. The registration work fills in ref_bundle.strategies,
 * the three hooks below (rules 37, 119-122) and the grant storage. */

#include <string.h>

#include "ref_internal.h"

int ref_strategy_known(const ref_bundle *b, uint32_t slot) {
    (void)b;
    return slot == 0;
}

int ref_strategy_host_compatible(const ref_bundle *b, uint32_t slot) {
    (void)b;
    return slot == 0;
}

void ref_strategy_admit(const ref_bundle *b, const BaseRTLaneAdmit *a, BaseRTAdmitResult *out) {
    (void)b;
    memset(out, 0, sizeof *out);
    out->lane_tag = a->lane_tag;
    out->status = BASERT_ADMIT_ADMITTED;
    out->cert_id = 0;
    out->granted_class = BASERT_EXACTNESS_SEED_PATH_INVARIANT;
}

void ref_strategy_free_all(ref_bundle *b) { b->strategies = NULL; }

/* Refuses every registration (not implemented yet); *grant_out is set to NULL when given. */
baseRT_status baseRT_strategy_register(baseRT_model_t bundle, const BaseRTStrategyRegistration *reg,
                                       const BaseRTStrategyGrant **grant_out) {
    (void)reg;
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (grant_out)
        *grant_out = NULL;
    ref_unlock(b);
    return BASERT_ERR_REGISTRATION_REFUSED;
}
