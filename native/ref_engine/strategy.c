/* strategy.c: speculation-strategy registration and admission certificates (tick ABI §2;
 * RULES.md section I).
 *
 * Registration fails closed: any field the engine cannot honour refuses the whole registration
 * with BASERT_ERR_REGISTRATION_REFUSED and changes nothing (rules 114-116). A granted strategy
 * gets the next slot (1, 2, ...; never reused), reserved_bytes = est_state_bytes (rule 118; the
 * reference keeps no drafter state, so the grant lists no state spaces) and certificates only
 * when its exact (strategy_id, impl_hash, config_hash) combination was certified with
 * baseRT_ref_certify before it registered (rule 117). Each grant's certificates get fresh
 * cert_ids, unique on the bundle.
 *
 * Admission (ref_strategy_admit, called by tick.c for each admit it runs):
 *  - strategy_slot 0 decodes the target model's own path: ADMITTED, cert_id 0, granted
 *    SEED_PATH_INVARIANT, unless a required_cert_id is named (no certificate exists: REJECTED);
 *  - otherwise the best certificate of the slot that matches the lane (highest exactness, then
 *    lowest id) is granted. A certificate matches when: required_cert_id is 0 or its id; its
 *    sampling_modes hold the lane's mode; its param_domain admits the lane (NONE nothing,
 *    GREEDY_ONLY a greedy lane or temperature <= 0, PENALTY_FREE no frequency / presence penalty
 *    and repeat_penalty 0 or 1, ANY everything); grammar / logit-bias lanes need
 *    grammar_allowed / logit_bias_allowed; exactness >= minimum_exactness; and a HOST lane's
 *    host_sampler_identity is in its admissible set and not all zero (rules 119-121);
 *  - no match: ADMITTED with cert_id 0 and APPROXIMATE when allow_approximate = 1, no
 *    required_cert_id and minimum_exactness APPROXIMATE; else REJECTED with reject_code -140 as
 *    two's-complement bits (rules 14, 15, 122).
 * The reference engine never speculates: a slot changes what admission grants, not the tokens. */

#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"

typedef struct ref_certset { /* one certified combination (baseRT_ref_certify) */
    char *id;
    uint8_t impl_hash[32];
    uint8_t config_hash[32];
    BaseRTExactnessCert *certs; /* cert_id 0: ids are given per grant */
    uint32_t n_certs;
    uint32_t _pad0;
    uint8_t *idents;            /* every admissible identity, 32 bytes each */
} ref_certset;

typedef struct ref_strategy {
    uint32_t slot;
    uint32_t host_compatible;
    uint64_t reserved_bytes;
    BaseRTExactnessCert *certs;
    uint32_t n_certs;
    uint32_t _pad0;
    uint8_t *idents;
} ref_strategy;

typedef struct ref_strategies {
    ref_strategy **v;
    uint32_t n, cap;
    ref_certset **sets;
    uint32_t n_sets, cap_sets;
    uint32_t next_slot, next_cert;
    BaseRTStrategyGrant grant; /* the last grant, handed out until the next registration */
} ref_strategies;

static const uint8_t ZERO32[32];

static ref_strategies *strat_make(ref_bundle *b) {
    if (!b->strategies)
        b->strategies = calloc(1, sizeof(ref_strategies));
    return b->strategies;
}

static const ref_strategy *slot_find(const ref_bundle *b, uint32_t slot) {
    const ref_strategies *st = b->strategies;
    for (uint32_t i = 0; st && i < st->n; i++)
        if (st->v[i]->slot == slot)
            return st->v[i];
    return NULL;
}

/* Copies certificates (stride elem bytes, identity arrays checked) into fresh storage whose
 * identity arrays point into *idents_out. Ids are cleared (next_id NULL) or assigned. Returns OK,
 * a section-C array code for a bad identity array, or FATAL out of memory. */
static baseRT_status copy_certs(const void *src, uint32_t n, uint32_t elem, uint32_t *next_id,
                                BaseRTExactnessCert **certs_out, uint8_t **idents_out) {
    *certs_out = NULL;
    *idents_out = NULL;
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        BaseRTExactnessCert c;
        memcpy(&c, (const uint8_t *)src + (size_t)i * elem, sizeof c);
        baseRT_status rc = ref_check_array(&c.admissible_host_identities, 32);
        if (rc)
            return rc;
        total += c.admissible_host_identities.count;
    }
    BaseRTExactnessCert *certs = calloc(n ? n : 1, sizeof *certs);
    uint8_t *idents = malloc((size_t)(total ? total : 1) * 32);
    if (!certs || !idents) {
        free(certs);
        free(idents);
        return BASERT_ERR_FATAL;
    }
    uint64_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        BaseRTExactnessCert c;
        memcpy(&c, (const uint8_t *)src + (size_t)i * elem, sizeof c);
        const BaseRTArray *ids = &c.admissible_host_identities;
        for (uint32_t k = 0; k < ids->count; k++)
            memcpy(idents + (at + k) * 32, (const uint8_t *)ids->data + (size_t)k * ids->elem_size, 32);
        c.cert_id = next_id ? ++*next_id : 0;
        c.admissible_host_identities.data = ids->count ? idents + at * 32 : NULL;
        c.admissible_host_identities.elem_size = 32;
        at += ids->count;
        certs[i] = c;
    }
    *certs_out = certs;
    *idents_out = idents;
    return BASERT_STATUS_OK;
}

static void certset_free(ref_certset *c) {
    free(c->id);
    free(c->certs);
    free(c->idents);
    free(c);
}

void ref_strategy_free_all(ref_bundle *b) {
    ref_strategies *st = b->strategies;
    if (!st)
        return;
    for (uint32_t i = 0; i < st->n; i++) {
        free(st->v[i]->certs);
        free(st->v[i]->idents);
        free(st->v[i]);
    }
    for (uint32_t i = 0; i < st->n_sets; i++)
        certset_free(st->sets[i]);
    free(st->v);
    free(st->sets);
    free(st);
    b->strategies = NULL;
}

/* ---- admission ---- */

int ref_strategy_known(const ref_bundle *b, uint32_t slot) { return slot == 0 || slot_find(b, slot) != NULL; }

int ref_strategy_host_compatible(const ref_bundle *b, uint32_t slot) {
    const ref_strategy *s = slot ? slot_find(b, slot) : NULL;
    return slot == 0 || (s && s->host_compatible);
}

static int domain_admits(uint32_t domain, const BaseRTLaneAdmit *a) {
    const BaseRTSamplingParams *p = &a->params;
    int greedy = a->sampling == BASERT_SAMPLING_GPU_GREEDY || p->temperature <= 0.0f;
    int penalty_free = p->freq_penalty == 0.0f && p->presence_penalty == 0.0f &&
                       (p->repeat_penalty == 0.0f || p->repeat_penalty == 1.0f);
    switch (domain) {
    case BASERT_CERT_DOMAIN_GREEDY_ONLY:
        return greedy;
    case BASERT_CERT_DOMAIN_PENALTY_FREE:
        return penalty_free;
    case BASERT_CERT_DOMAIN_ANY:
        return 1;
    default:
        return 0; /* NONE and unknown domains match no lane */
    }
}

static int cert_matches(const BaseRTExactnessCert *c, const BaseRTLaneAdmit *a) {
    static const uint8_t mode_of[3] = {BASERT_CERT_MODE_GREEDY, BASERT_CERT_MODE_GUMBEL, BASERT_CERT_MODE_HOST};
    if (a->required_cert_id && c->cert_id != a->required_cert_id)
        return 0; /* rule 119 */
    if (a->sampling > BASERT_SAMPLING_HOST || !(c->sampling_modes & mode_of[a->sampling]))
        return 0;
    if (!domain_admits(c->param_domain, a)) /* rule 120 */
        return 0;
    if ((a->grammar_handle && !c->grammar_allowed) || (a->logit_bias_handle && !c->logit_bias_allowed))
        return 0;
    if (c->exactness < a->minimum_exactness)
        return 0;
    if (a->sampling != BASERT_SAMPLING_HOST)
        return 1;
    if (!memcmp(a->host_sampler_identity, ZERO32, 32))
        return 0; /* rule 121: the all-zero identity never matches */
    const BaseRTArray *ids = &c->admissible_host_identities;
    for (uint32_t k = 0; k < ids->count; k++)
        if (!memcmp((const uint8_t *)ids->data + (size_t)k * 32, a->host_sampler_identity, 32))
            return 1;
    return 0;
}

void ref_strategy_admit(const ref_bundle *b, const BaseRTLaneAdmit *a, BaseRTAdmitResult *out) {
    memset(out, 0, sizeof *out);
    out->lane_tag = a->lane_tag;
    const ref_strategy *s = a->strategy_slot ? slot_find(b, a->strategy_slot) : NULL;
    if (!a->strategy_slot && !a->required_cert_id) {
        out->status = BASERT_ADMIT_ADMITTED; /* the target model's own path */
        out->granted_class = BASERT_EXACTNESS_SEED_PATH_INVARIANT;
        return;
    }
    const BaseRTExactnessCert *best = NULL;
    for (uint32_t i = 0; s && i < s->n_certs; i++) {
        const BaseRTExactnessCert *c = &s->certs[i];
        if (cert_matches(c, a) && (!best || c->exactness > best->exactness))
            best = c;
    }
    if (best) {
        out->status = BASERT_ADMIT_ADMITTED;
        out->cert_id = best->cert_id;
        out->granted_class = best->exactness;
    } else if (a->allow_approximate == 1 && !a->required_cert_id &&
               a->minimum_exactness == BASERT_EXACTNESS_APPROXIMATE) {
        out->status = BASERT_ADMIT_ADMITTED; /* rule 122 */
        out->granted_class = BASERT_EXACTNESS_APPROXIMATE;
    } else {
        out->status = BASERT_ADMIT_REJECTED;
        out->reject_code = (uint32_t)BASERT_REJECT_CERT_UNMATCHED; /* rules 14, 15, 122 */
    }
}

/* ---- registration ---- */

/* Record i of an array already checked by ref_check_array (stride elem_size, prefix copied). */
static void record(const BaseRTArray *a, uint32_t i, void *dst, size_t size) {
    memset(dst, 0, size);
    memcpy(dst, (const uint8_t *)a->data + (size_t)i * a->elem_size, a->elem_size < size ? a->elem_size : size);
}

/* Every check of a registration (rules 114-116); *host = HOST_COMPATIBLE was asked for. */
static int registration_ok(const ref_bundle *b, const BaseRTStrategyRegistration *r, uint32_t *host) {
    *host = 0;
    if (!r->strategy_id || !*r->strategy_id || !r->impl_version ||
        r->claimed_exactness > BASERT_EXACTNESS_SEED_PATH_INVARIANT)
        return 0;
    if (ref_check_array(&r->artifacts, sizeof(BaseRTArtifact)) || ref_check_array(&r->taps, sizeof(BaseRTTapSpec)) ||
        ref_check_array(&r->capabilities, sizeof(BaseRTCapabilityReq)) ||
        ref_check_array(&r->target_archs, sizeof(const char *)))
        return 0;
    for (uint32_t i = 0; i < r->artifacts.count; i++) {
        BaseRTArtifact a;
        record(&r->artifacts, i, &a, sizeof a);
        if (a.role < BASERT_ARTIFACT_DRAFT_WEIGHTS || a.role > BASERT_ARTIFACT_DRAFT_TOKENIZER || !a.load_path ||
            !*a.load_path)
            return 0; /* rule 116 */
    }
    for (uint32_t i = 0; i < r->taps.count; i++) {
        BaseRTTapSpec t;
        record(&r->taps, i, &t, sizeof t);
        if (t.layer >= b->cfg.n_layers || t.tensor < BASERT_TAP_TENSOR_HIDDEN || t.tensor > BASERT_TAP_TENSOR_EMBED)
            return 0; /* rule 115 */
    }
    for (uint32_t i = 0; i < r->capabilities.count; i++) {
        BaseRTCapabilityReq c;
        record(&r->capabilities, i, &c, sizeof c);
        if (c.kind_id < BASERT_STRATEGY_CAP_PROPOSAL_LINEAR || c.kind_id > BASERT_STRATEGY_CAP_HOST_COMPATIBLE ||
            ref_check_array(&c.params, 1))
            return 0; /* rule 114: an unknown kind refuses */
        if (c.kind_id == BASERT_STRATEGY_CAP_HOST_COMPATIBLE)
            *host = 1;
    }
    int arch_ok = r->target_archs.count == 0;
    for (uint32_t i = 0; i < r->target_archs.count; i++) {
        const char *arch;
        record(&r->target_archs, i, (void *)&arch, sizeof arch);
        if (!arch)
            return 0; /* rule 116 */
        arch_ok |= !strcmp(arch, b->arch);
    }
    if (!arch_ok)
        return 0; /* rule 115 */
    return ((uint64_t)r->kernel_caps_required & ~b->cfg.kernel_caps) == 0; /* rule 116 */
}

static const ref_certset *certset_find(const ref_strategies *st, const char *id) {
    for (uint32_t i = 0; st && i < st->n_sets; i++)
        if (!strcmp(st->sets[i]->id, id))
            return st->sets[i];
    return NULL;
}

/* Registers a speculation strategy (ABI §2; rules 114-118). On OK *grant_out points at the
 * engine-owned grant until the next registration or baseRT_ref_free. Every refusal is
 * REGISTRATION_REFUSED and changes nothing: NULL reg or grant_out, struct_size under 176, a NULL
 * or empty strategy_id, a NULL impl_version, claimed_exactness above SEED_PATH_INVARIANT, a
 * malformed array (section C rules), an artifact of unknown role or without load_path, a tap on
 * layer >= n_layers or of unknown tensor, a capability kind other than 1..5, a NULL target arch
 * or a non-empty target list without this engine's arch, kernel_caps_required beyond the
 * bundle's kernel_caps. BASERT_ERR_FATAL out of memory. */
baseRT_status baseRT_strategy_register(baseRT_model_t bundle, const BaseRTStrategyRegistration *reg,
                                       const BaseRTStrategyGrant **grant_out) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    BaseRTStrategyRegistration r;
    uint32_t host = 0;
    if (!reg || !grant_out || reg->struct_size < sizeof r) {
        ref_unlock(b);
        return BASERT_ERR_REGISTRATION_REFUSED;
    }
    memcpy(&r, reg, sizeof r);
    ref_strategies *st = strat_make(b);
    ref_strategy *s = NULL;
    if (!registration_ok(b, &r, &host)) {
        rc = BASERT_ERR_REGISTRATION_REFUSED;
    } else if (!st || !(s = calloc(1, sizeof *s)) ||
               ref_reserve((void **)&st->v, &st->cap, (uint64_t)st->n + 1, sizeof *st->v)) {
        rc = BASERT_ERR_FATAL;
    } else {
        const ref_certset *set = certset_find(st, r.strategy_id);
        if (set && !memcmp(set->impl_hash, r.impl_hash, 32) && !memcmp(set->config_hash, r.config_hash, 32)) {
            uint32_t next = st->next_cert; /* ids are taken only when the grant is made */
            rc = copy_certs(set->certs, set->n_certs, sizeof *set->certs, &next, &s->certs, &s->idents);
            if (!rc) {
                s->n_certs = set->n_certs;
                st->next_cert = next;
            }
        }
    }
    if (rc) {
        free(s);
        ref_unlock(b);
        return rc;
    }
    s->slot = ++st->next_slot;
    s->host_compatible = host;
    s->reserved_bytes = r.est_state_bytes; /* rule 118 */
    st->v[st->n++] = s;
    BaseRTStrategyGrant *g = &st->grant;
    memset(g, 0, sizeof *g);
    g->struct_size = sizeof *g;
    g->strategy_slot = s->slot;
    g->certificates.data = s->n_certs ? s->certs : NULL;
    g->certificates.count = s->n_certs;
    g->certificates.elem_size = sizeof(BaseRTExactnessCert);
    g->state_spaces.elem_size = sizeof(BaseRTStateSpaceDesc);
    g->reserved_bytes = s->reserved_bytes;
    *grant_out = g;
    ref_unlock(b);
    return BASERT_STATUS_OK;
}

/* Certifies (strategy_id, impl_hash, config_hash) with `certs` (BaseRTExactnessCert records;
 * their cert_id is ignored): later registrations of exactly that combination get copies of them
 * with fresh ids; the same name with another hash gets none (rule 117). A second call for the
 * same name replaces the combination; an empty array removes it. Strategies already registered
 * keep what they were granted. BAD_STRUCT for a NULL or empty id or a NULL hash; the section-C
 * array codes for a malformed certs or identity array; BOUNDS for an exactness above
 * SEED_PATH_INVARIANT, sampling_modes outside the three modes, a param_domain above ANY or a
 * grammar / logit-bias flag above 1; FATAL out of memory. */
baseRT_status baseRT_ref_certify(baseRT_model_t bundle, const char *strategy_id, const uint8_t *impl_hash,
                                 const uint8_t *config_hash, BaseRTArray certs) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (!strategy_id || !*strategy_id || !impl_hash || !config_hash)
        rc = BASERT_REJECT_BAD_STRUCT;
    else
        rc = ref_check_array(&certs, sizeof(BaseRTExactnessCert));
    for (uint32_t i = 0; !rc && i < certs.count; i++) {
        BaseRTExactnessCert c;
        record(&certs, i, &c, sizeof c);
        if (c.exactness > BASERT_EXACTNESS_SEED_PATH_INVARIANT ||
            (c.sampling_modes & ~(uint32_t)(BASERT_CERT_MODE_GREEDY | BASERT_CERT_MODE_GUMBEL | BASERT_CERT_MODE_HOST)) ||
            c.param_domain > BASERT_CERT_DOMAIN_ANY || c.grammar_allowed > 1 || c.logit_bias_allowed > 1)
            rc = BASERT_REJECT_BOUNDS;
    }
    ref_strategies *st = rc ? NULL : strat_make(b);
    if (!rc && !st)
        rc = BASERT_ERR_FATAL;
    ref_certset *set = NULL;
    if (!rc && certs.count) {
        size_t len = strlen(strategy_id) + 1;
        set = calloc(1, sizeof *set);
        if (!set || !(set->id = malloc(len)) ||
            ref_reserve((void **)&st->sets, &st->cap_sets, (uint64_t)st->n_sets + 1, sizeof *st->sets)) {
            rc = BASERT_ERR_FATAL;
        } else {
            memcpy(set->id, strategy_id, len);
            memcpy(set->impl_hash, impl_hash, 32);
            memcpy(set->config_hash, config_hash, 32);
            rc = copy_certs(certs.data, certs.count, certs.elem_size, NULL, &set->certs, &set->idents);
            set->n_certs = certs.count;
        }
    }
    if (rc) {
        if (set)
            certset_free(set);
        ref_unlock(b);
        return rc;
    }
    for (uint32_t i = 0; i < st->n_sets; i++)
        if (!strcmp(st->sets[i]->id, strategy_id)) {
            certset_free(st->sets[i]);
            st->sets[i] = st->sets[--st->n_sets];
            break;
        }
    if (set)
        st->sets[st->n_sets++] = set;
    ref_unlock(b);
    return BASERT_STATUS_OK;
}
