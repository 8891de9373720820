/* grammar.c: the grammar and logit-bias handle registries.
 *
 * The reference engine validates and tracks handles (admits naming an unknown handle are refused,
 * grammar_replay needs a live grammar, ABI rule 74) but its synthetic model applies neither: a
 * grammar is accepted when its text is one balanced JSON object, a bias when its token ids are
 * in range. Handles start at 1 and are never reused on a bundle. */

#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"

static int find(const uint32_t *set, uint32_t n, uint32_t h) {
    for (uint32_t i = 0; i < n; i++)
        if (set[i] == h)
            return (int)i;
    return -1;
}

int ref_grammar_known(const ref_bundle *b, uint32_t handle) {
    return handle && find(b->grammars, b->n_grammars, handle) >= 0;
}

int ref_bias_known(const ref_bundle *b, uint32_t handle) { return handle && find(b->biases, b->n_biases, handle) >= 0; }

void ref_grammar_free_all(ref_bundle *b) {
    free(b->grammars);
    free(b->biases);
    b->grammars = b->biases = NULL;
    b->n_grammars = b->n_biases = b->cap_grammars = b->cap_biases = 0;
}

/* 1 when text (trimmed) is one JSON object with balanced braces and brackets outside strings. */
static int json_object(const char *text) {
    const char *p = text, *end = text + strlen(text);
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r'))
        p++;
    while (end > p && (end[-1] == ' ' || end[-1] == '\n' || end[-1] == '\t' || end[-1] == '\r'))
        end--;
    if (end - p < 2 || *p != '{' || end[-1] != '}')
        return 0;
    int depth = 0, in_str = 0, esc = 0;
    for (const char *c = p; c < end; c++) {
        if (esc) {
            esc = 0;
        } else if (in_str) {
            if (*c == '\\')
                esc = 1;
            else if (*c == '"')
                in_str = 0;
        } else if (*c == '"') {
            in_str = 1;
        } else if (*c == '{' || *c == '[') {
            depth++;
        } else if (*c == '}' || *c == ']') {
            if (--depth < 0)
                return 0;
            if (depth == 0 && c != end - 1)
                return 0; /* a second top-level value */
        }
    }
    return depth == 0 && !in_str;
}

static uint32_t add(uint32_t **set, uint32_t *n, uint32_t *cap, uint32_t *next) {
    if (ref_reserve((void **)set, cap, (uint64_t)*n + 1, sizeof **set))
        return 0;
    uint32_t h = ++*next;
    (*set)[(*n)++] = h;
    return h;
}

static baseRT_status drop(uint32_t *set, uint32_t *n, uint32_t h) {
    int i = h ? find(set, *n, h) : -1;
    if (i < 0)
        return BASERT_ERR_UNKNOWN_HANDLE;
    set[i] = set[--*n];
    return BASERT_STATUS_OK;
}

/* A grammar handle for a JSON schema (one balanced JSON object); 0 for NULL or anything else. */
uint32_t baseRT_tick_grammar_create(baseRT_model_t bundle, const char *json_schema) {
    baseRT_status err;
    ref_bundle *b = ref_lock(bundle, &err);
    if (!b)
        return 0;
    uint32_t h = json_schema && json_object(json_schema)
                     ? add(&b->grammars, &b->n_grammars, &b->cap_grammars, &b->next_grammar)
                     : 0;
    ref_unlock(b);
    return h;
}

/* As baseRT_tick_grammar_create, from a structural tag (also one JSON object). */
uint32_t baseRT_tick_grammar_create_structural(baseRT_model_t bundle, const char *tag_json) {
    return baseRT_tick_grammar_create(bundle, tag_json);
}

/* Frees a grammar handle; UNKNOWN_HANDLE when absent (rule 113). */
baseRT_status baseRT_tick_grammar_free(baseRT_model_t bundle, uint32_t handle) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    rc = drop(b->grammars, &b->n_grammars, handle);
    ref_unlock(b);
    return rc;
}

/* A logit-bias handle; 0 when n <= 0, an array is NULL or a token id is outside the vocabulary
 * (rule 113). */
uint32_t baseRT_tick_logit_bias_create(baseRT_model_t bundle, const int32_t *tokens, const float *values, int n) {
    baseRT_status err;
    ref_bundle *b = ref_lock(bundle, &err);
    if (!b)
        return 0;
    uint32_t h = 0;
    if (n > 0 && tokens && values) {
        int ok = 1;
        for (int i = 0; i < n && ok; i++)
            ok = tokens[i] >= 0 && (uint32_t)tokens[i] < b->cfg.vocab_size;
        if (ok)
            h = add(&b->biases, &b->n_biases, &b->cap_biases, &b->next_bias);
    }
    ref_unlock(b);
    return h;
}

/* Frees a logit-bias handle; UNKNOWN_HANDLE when absent (rule 113). */
baseRT_status baseRT_tick_logit_bias_free(baseRT_model_t bundle, uint32_t handle) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    rc = drop(b->biases, &b->n_biases, handle);
    ref_unlock(b);
    return rc;
}
