/* model.c: the synthetic model.
 *
 * State of a lane = the rolling hash of every token in its sequence (ref_seq.hist_hash).
 * - greedy token: from that hash alone (or scripted_tokens[j], j = the request's generated index);
 * - GPU_GUMBEL with temperature > 0: the hash mixed with the RNG counter rng_base + generated;
 * - EOS: with eos_period p > 0, eos_token when (hash >> 32) % p == 0, otherwise never eos_token;
 * - logits row: every token gets a value in [-4, 0) from the hash, the greedy token 4.0, so a
 *   HOST sampler's argmax reproduces the greedy lane; logprobs are log-softmax of that row.
 * Everything is a pure function of (bundle config, history, counter): same plans, same tokens
 * (ABI rule 63), and a lane resumed with its generated tokens as replay continues exactly (73). */

#include <string.h>

#include "ref_internal.h"

/* exp and log without libm (the engine links nothing but libc): range reduction to [-ln2/2,
 * ln2/2] plus a Taylor series for exp; mantissa/exponent split plus the atanh series for log.
 * Relative error below 1e-12 over the range used here. */
static double ref_exp(double x) {
    const double ln2 = 0.69314718055994530942;
    int k = (int)(x / ln2 + (x < 0 ? -0.5 : 0.5));
    double r = x - k * ln2, term = 1.0, sum = 1.0;
    for (int i = 1; i < 20; i++) {
        term *= r / i;
        sum += term;
    }
    while (k > 0) {
        sum *= 2.0;
        k--;
    }
    while (k < 0) {
        sum *= 0.5;
        k++;
    }
    return sum;
}

static double ref_log(double x) {
    const double ln2 = 0.69314718055994530942;
    int k = 0;
    while (x > 1.4142135623730951) {
        x *= 0.5;
        k++;
    }
    while (x < 0.7071067811865476) {
        x *= 2.0;
        k--;
    }
    double z = (x - 1.0) / (x + 1.0), z2 = z * z, term = z, sum = 0.0;
    for (int i = 1; i < 40; i += 2) {
        sum += term / i;
        term *= z2;
    }
    return 2.0 * sum + k * ln2;
}

static uint32_t from_hash(const ref_bundle *b, uint64_t x) {
    uint32_t vocab = b->cfg.vocab_size, eos = b->cfg.eos_token;
    if (b->cfg.eos_period && ((x >> 32) % b->cfg.eos_period) == 0)
        return eos;
    uint32_t t = (uint32_t)(ref_mix64(x) % (vocab - 1));
    return t >= eos ? t + 1 : t;
}

static int scripted(const ref_bundle *b, const ref_lane *l, uint32_t *out) {
    uint64_t j = (uint64_t)l->decode_replay + l->generated;
    if (j < b->cfg.n_scripted_tokens) {
        *out = b->script[j];
        return 1;
    }
    return 0;
}

uint32_t ref_model_greedy(const ref_bundle *b, const ref_lane *l) {
    uint32_t t;
    if (scripted(b, l, &t))
        return t;
    return from_hash(b, l->seq->hist_hash);
}

uint32_t ref_model_next(const ref_bundle *b, const ref_lane *l) {
    if (l->sampling != BASERT_SAMPLING_GPU_GUMBEL || !(l->params.temperature > 0.0f))
        return ref_model_greedy(b, l);
    uint32_t t;
    if (scripted(b, l, &t))
        return t;
    uint64_t counter = l->rng_base + l->generated;
    return from_hash(b, ref_mix64(l->seq->hist_hash ^ ref_mix64(counter ^ 0xD1B54A32D192ED03ull)));
}

static float logit_of(uint64_t h, uint32_t token) {
    uint64_t v = ref_mix64(h ^ ((uint64_t)token * 0x9FB21C651E98DF25ull));
    return -(float)((v >> 48) & 0xFFFF) / 16384.0f; /* [-4, 0) */
}

void ref_model_row(const ref_bundle *b, const ref_lane *l, float *row) {
    uint64_t h = l->seq->hist_hash;
    for (uint32_t t = 0; t < b->cfg.vocab_size; t++)
        row[t] = logit_of(h, t);
    row[ref_model_greedy(b, l)] = 4.0f;
}

void ref_model_logprob(const ref_bundle *b, const ref_lane *l, uint32_t token, uint32_t n_top,
                       BaseRTLaneLogprob *out) {
    uint32_t vocab = b->cfg.vocab_size;
    uint64_t h = l->seq->hist_hash;
    uint32_t top = ref_model_greedy(b, l);
    double sum = 0.0;
    for (uint32_t t = 0; t < vocab; t++)
        sum += ref_exp((double)(t == top ? 4.0f : logit_of(h, t)) - 4.0);
    double lse = 4.0 + ref_log(sum);
    memset(out, 0, sizeof *out);
    out->lane_tag = 0;
    out->logprob = (float)((token == top ? 4.0 : (double)logit_of(h, token)) - lse);
    if (n_top > BASERT_MAX_TOP_LOGPROBS)
        n_top = BASERT_MAX_TOP_LOGPROBS;
    if (n_top > vocab)
        n_top = vocab;
    /* Selection of the n_top largest logits, ties broken by the smaller id. */
    float vals[BASERT_MAX_TOP_LOGPROBS];
    uint32_t ids[BASERT_MAX_TOP_LOGPROBS];
    uint32_t have = 0;
    for (uint32_t t = 0; t < vocab && n_top; t++) {
        float v = t == top ? 4.0f : logit_of(h, t);
        if (have == n_top && v <= vals[have - 1])
            continue;
        uint32_t pos = have < n_top ? have++ : n_top - 1;
        while (pos > 0 && vals[pos - 1] < v) {
            vals[pos] = vals[pos - 1];
            ids[pos] = ids[pos - 1];
            pos--;
        }
        vals[pos] = v;
        ids[pos] = t;
    }
    out->n_top = have;
    for (uint32_t i = 0; i < have; i++) {
        out->top_ids[i] = ids[i];
        out->top_logprobs[i] = (float)((double)vals[i] - lse);
    }
}
