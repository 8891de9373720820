/* envelope.c: the bytes of a state export: synthetic payloads, the BRTSTATE envelope, checksums
 * (FNV-1a-64 and XXH3-64) and the checks restore / promote run on bytes they are handed
 * (tick ABI §3; RULES.md rules 95, 101-103). Layouts are described in ops_internal.h. */

#define _XOPEN_SOURCE 700 /* dlopen/dlsym declarations under -std=c11 */

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ops_internal.h"

#define KEY_STREAM_STEP 0x9E3779B97F4A7C15ull
#define DOMAIN_PAGED 0x5041474544ull /* "PAGED" */
#define DOMAIN_BLOB 0x424C4F42ull    /* "BLOB" */

uint32_t ref_env_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint64_t ref_env_le64(const uint8_t *p) { return (uint64_t)ref_env_le32(p) | (uint64_t)ref_env_le32(p + 4) << 32; }

static void put_le(uint8_t *p, uint64_t v, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* n bytes of the key stream seeded by `seed`. */
static void key_stream(uint8_t *out, size_t n, uint64_t seed) {
    for (size_t i = 0; i < n; i += 8) {
        uint64_t w = ref_mix64(seed + (uint64_t)(i / 8 + 1) * KEY_STREAM_STEP);
        put_le(out + i, w, n - i < 8 ? n - i : 8);
    }
}

/* ---- sizes ---- */

uint64_t ref_env_unit_bytes(const ref_bundle *b, uint32_t space, uint32_t encoding) {
    const BaseRTRefSpace *c = &b->space_cfg[space];
    if (encoding > BASERT_ENCODING_Q4 || c->kind == BASERT_SPACE_KIND_ENCODER_CACHE)
        return 0;
    if (ref_space_is_paged(b, space)) {
        uint64_t bpt = b->cfg.bytes_per_token;
        uint64_t r = encoding == BASERT_ENCODING_Q8 ? (bpt + 1) / 2 : encoding == BASERT_ENCODING_Q4 ? (bpt + 3) / 4 : bpt;
        return r >= 4 ? r : 0; /* a record carries its token id */
    }
    if (ref_space_is_blob(b, space))
        return encoding == BASERT_ENCODING_LOSSLESS && c->blob_bytes >= 8 ? c->blob_bytes : 0;
    return 0;
}

uint64_t ref_env_payload_bytes(const ref_bundle *b, uint32_t space, BaseRTTokenRange range, uint32_t encoding) {
    uint64_t unit = ref_env_unit_bytes(b, space, encoding);
    return ref_space_is_paged(b, space) ? (range.end - range.start) * unit : unit;
}

/* ---- payloads ---- */

uint64_t ref_env_history(const ref_bundle *b, const uint32_t *tokens, uint64_t n) {
    uint64_t h = b->model_seed;
    for (uint64_t i = 0; i < n; i++)
        h = ref_token_step(h, tokens[i]);
    return h;
}

static uint64_t space_domain(const ref_bundle *b, uint32_t space, uint64_t domain, uint32_t encoding) {
    return ref_mix64(domain ^ ((uint64_t)b->spaces[space].space_id << 8) ^ encoding);
}

void ref_env_paged_payload(const ref_bundle *b, uint32_t space, const uint32_t *tokens, uint64_t start,
                           uint64_t end, uint32_t encoding, uint8_t *out) {
    uint64_t unit = ref_env_unit_bytes(b, space, encoding);
    uint64_t dom = space_domain(b, space, DOMAIN_PAGED, encoding);
    uint64_t h = ref_env_history(b, tokens, start);
    for (uint64_t p = start; p < end; p++, out += unit) {
        h = ref_token_step(h, tokens[p]);
        put_le(out, tokens[p], 4);
        key_stream(out + 4, unit - 4, h ^ dom);
    }
}

void ref_env_blob_payload(const ref_bundle *b, uint32_t space, uint64_t key, uint8_t *out) {
    uint64_t n = b->space_cfg[space].blob_bytes;
    put_le(out, key, 8);
    key_stream(out + 8, n - 8, key ^ space_domain(b, space, DOMAIN_BLOB, 0));
}

/* ---- checksums ---- */

typedef uint64_t (*xxh3_fn)(const void *, size_t);

static pthread_once_t xxh3_once = PTHREAD_ONCE_INIT;
static xxh3_fn xxh3;
static void *xxh3_lib; /* kept open for the life of the process */

static void xxh3_load(void) {
    const char *name = getenv("BASERT_REF_XXHASH_LIB");
    xxh3_lib = dlopen(name && *name ? name : "libxxhash.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!xxh3_lib)
        return;
    void *sym = dlsym(xxh3_lib, "XXH3_64bits");
    memcpy(&xxh3, &sym, sizeof xxh3); /* object pointer to function pointer, as POSIX allows */
}

int ref_env_xxh3_available(void) {
    pthread_once(&xxh3_once, xxh3_load);
    return xxh3 != NULL;
}

baseRT_status ref_env_checksum(uint32_t kind, const void *data, size_t len, uint64_t *out) {
    static const uint8_t empty[1];
    if (!len)
        data = empty; /* XXH3 reads nothing, but takes no NULL */
    if (kind == BASERT_CHECKSUM_FNV1A64) {
        *out = ref_fnv1a64(data, len);
        return BASERT_STATUS_OK;
    }
    if (kind == BASERT_CHECKSUM_XXH3_64) {
        if (!ref_env_xxh3_available())
            return BASERT_ERR_OP_UNSUPPORTED;
        *out = xxh3(data, len);
        return BASERT_STATUS_OK;
    }
    return BASERT_ERR_CHECKSUM; /* 0 is reserved-invalid; unknown kinds are never skipped */
}

/* ---- sealing and opening ---- */

baseRT_status ref_env_seal(const ref_bundle *b, uint32_t space, BaseRTTokenRange range, uint32_t encoding,
                           const uint8_t provenance[32], uint32_t taint_bits, uint32_t checksum_kind,
                           uint8_t *dst, uint64_t payload_len) {
    BaseRTStateEnvelope e;
    memset(&e, 0, sizeof e);
    e.magic = BASERT_STATE_ENVELOPE_MAGIC;
    e.envelope_version = REF_ENVELOPE_VERSION;
    e.space_kind = b->space_cfg[space].kind;
    ref_space_identity(b, space, e.compat_identity);
    e.version_tag = b->space_cfg[space].version_tag;
    memcpy(e.provenance_digest, provenance, 32);
    e.taint_bits = taint_bits;
    e.range = range;
    e.encoding = (uint8_t)encoding;
    e.checksum_kind = checksum_kind;
    e.payload_len = payload_len;
    baseRT_status rc = ref_env_checksum(checksum_kind, dst + REF_ENVELOPE_BYTES, payload_len, &e.content_checksum);
    if (rc)
        return rc;
    memcpy(dst, &e, sizeof e);
    return BASERT_STATUS_OK;
}

baseRT_status ref_env_open(const ref_bundle *b, uint32_t space, BaseRTBuf src, BaseRTStateEnvelope *env) {
    if (!src.ptr || src.len < REF_ENVELOPE_BYTES)
        return BASERT_ERR_ENVELOPE_MISMATCH;
    BaseRTStateEnvelope e;
    memcpy(&e, src.ptr, sizeof e);
    if (e.magic != BASERT_STATE_ENVELOPE_MAGIC || e.envelope_version != REF_ENVELOPE_VERSION ||
        e.space_kind != b->space_cfg[space].kind || e.payload_len != src.len - REF_ENVELOPE_BYTES ||
        e.encoding > BASERT_ENCODING_Q4 || e.range.start > e.range.end)
        return BASERT_ERR_ENVELOPE_MISMATCH; /* rule 101 */
    uint8_t compat[32];
    ref_space_identity(b, space, compat);
    if (memcmp(compat, e.compat_identity, 32) || e.version_tag != b->space_cfg[space].version_tag)
        return BASERT_ERR_IDENTITY_MISMATCH; /* rule 102 */
    uint64_t sum = 0;
    baseRT_status rc = ref_env_checksum(e.checksum_kind, (const uint8_t *)src.ptr + REF_ENVELOPE_BYTES,
                                        (size_t)e.payload_len, &sum);
    if (rc)
        return rc; /* rule 103: kind 0 / unknown is CHECKSUM, never a skipped check */
    if (sum != e.content_checksum)
        return BASERT_ERR_CHECKSUM; /* rule 103 */
    *env = e;
    return BASERT_STATUS_OK;
}
