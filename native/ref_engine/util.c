/* util.c: growable arrays, the u64 -> pointer map, hashes and digests, the clock. */

#define _XOPEN_SOURCE 700 /* pthread_mutexattr_settype, clock_gettime, nanosleep under -std=c11 */

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref_internal.h"

int ref_reserve(void **ptr, uint32_t *cap, uint64_t need, size_t elem) {
    if (need <= *cap)
        return 0;
    if (need > 0xFFFFFFFFull)
        return -1;
    uint64_t n = *cap ? *cap : 8;
    while (n < need)
        n *= 2;
    if (n > 0xFFFFFFFFull)
        n = 0xFFFFFFFFull;
    void *p = realloc(*ptr, (size_t)n * elem);
    if (!p)
        return -1;
    *ptr = p;
    *cap = (uint32_t)n;
    return 0;
}

/* ---- map: linear probing, backward-shift deletion, no tombstones ---- */

static uint32_t slot_of(uint64_t key, uint32_t cap) { return (uint32_t)(ref_mix64(key) & (cap - 1)); }

void *ref_map_get(const ref_map *m, uint64_t key) {
    if (!m->cap)
        return NULL;
    for (uint32_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (!m->vals[i])
            return NULL;
        if (m->keys[i] == key)
            return m->vals[i];
    }
}

static int map_grow(ref_map *m) {
    uint32_t ncap = m->cap ? m->cap * 2 : 16;
    uint64_t *keys = calloc(ncap, sizeof *keys);
    void **vals = calloc(ncap, sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    for (uint32_t i = 0; i < m->cap; i++) {
        if (!m->vals[i])
            continue;
        uint32_t j = slot_of(m->keys[i], ncap);
        while (vals[j])
            j = (j + 1) & (ncap - 1);
        keys[j] = m->keys[i];
        vals[j] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = ncap;
    return 0;
}

int ref_map_put(ref_map *m, uint64_t key, void *val) {
    if ((m->len + 1) * 4 >= m->cap * 3 && map_grow(m))
        return -1;
    uint32_t i = slot_of(key, m->cap);
    while (m->vals[i] && m->keys[i] != key)
        i = (i + 1) & (m->cap - 1);
    if (!m->vals[i])
        m->len++;
    m->keys[i] = key;
    m->vals[i] = val;
    return 0;
}

void ref_map_del(ref_map *m, uint64_t key) {
    if (!m->cap)
        return;
    uint32_t mask = m->cap - 1, i = slot_of(key, m->cap);
    while (m->vals[i] && m->keys[i] != key)
        i = (i + 1) & mask;
    if (!m->vals[i])
        return;
    m->vals[i] = NULL;
    m->len--;
    /* Shift later members of the probe run back so lookups never stop early. */
    for (uint32_t j = (i + 1) & mask; m->vals[j]; j = (j + 1) & mask) {
        uint32_t home = slot_of(m->keys[j], m->cap);
        /* j may move to i when i lies cyclically in [home, j). */
        int movable = (i <= j) ? (home <= i || home > j) : (home <= i && home > j);
        if (movable) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            m->vals[j] = NULL;
            i = j;
        }
    }
}

void ref_map_clear(ref_map *m) {
    if (m->cap)
        memset(m->vals, 0, m->cap * sizeof *m->vals);
    m->len = 0;
}

void ref_map_free(ref_map *m) {
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

/* ---- hashes ---- */

uint64_t ref_mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

#define FNV_OFFSET 0xCBF29CE484222325ull
#define FNV_PRIME 0x100000001B3ull

uint64_t ref_fnv1a64(const void *data, size_t len) {
    const uint8_t *p = data;
    uint64_t h = FNV_OFFSET;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= FNV_PRIME;
    }
    return h;
}

uint64_t ref_token_step(uint64_t h, uint32_t token) {
    return ref_mix64(h ^ (((uint64_t)token << 1 | 1) * 0xD6E8FEB86659FD93ull));
}

void ref_digest_init(ref_digest *d, uint64_t domain) {
    for (int i = 0; i < 4; i++)
        d->s[i] = FNV_OFFSET ^ ref_mix64(domain + (uint64_t)i * 0x632BE59BD9B4E019ull);
}

void ref_digest_update(ref_digest *d, const void *data, size_t len) {
    const uint8_t *p = data;
    for (size_t k = 0; k < len; k++)
        for (int i = 0; i < 4; i++) {
            d->s[i] ^= p[k];
            d->s[i] *= FNV_PRIME;
        }
}

void ref_digest_u64(ref_digest *d, uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    ref_digest_update(d, b, 8);
}

void ref_digest_final(const ref_digest *d, uint8_t out[32]) {
    for (int i = 0; i < 4; i++) {
        uint64_t v = ref_mix64(d->s[i] ^ ref_mix64(d->s[(i + 1) & 3]));
        for (int k = 0; k < 8; k++)
            out[8 * i + k] = (uint8_t)(v >> (8 * k));
    }
}

uint64_t ref_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
