/*
 * basert_h.h: the part of baseRT's public C API (baseRT.h, baseRT 0.3.0) that basertd binds.
 *
 * basertd does not ship baseRT.h. These are our own declarations of the entry points a serving
 * daemon needs to load a bundle and its tokenizer, with the names, signatures and documented
 * semantics of baseRT.h 0.3.0 (DESIGN.md "Engines"):
 *
 *  - baseRT_load_model_ex(model_path, kernel_library_path, max_context, opts) loads a bundle;
 *    NULL on failure, with baseRT_get_error() / baseRT_get_error_code() (thread-local) saying why.
 *    opts may be NULL (defaults); otherwise opts->struct_size must be sizeof(BaseRTLoadOptions),
 *    which guards the layout, and every zero field keeps its default.
 *  - baseRT_load_tokenizer_only(model_path): a handle with only the tokenizer surface
 *    (encode, decode_token_raw, token_count, bos/eos ids and strings, chat_template_jinja,
 *    free_model), so a serving daemon tokenizes outside the process that owns the GPU state.
 *  - baseRT_free_model frees either kind of handle. A handle is single-owner: the runtime does
 *    not serialize calls on one handle.
 *  - baseRT_capabilities (BASERT_CAP_* bits, fixed at load) and baseRT_capability_descriptor
 *    (a JSON document owned by the handle, valid until baseRT_free_model).
 *  - baseRT_decode_token_raw writes a token's exact bytes (no NUL added) and returns its full
 *    length (call again with a larger buffer when it exceeds max_bytes), 0 for a token that
 *    decodes to nothing, < 0 on invalid arguments (an id outside the vocabulary included).
 *  - Strings returned as const char * belong to the runtime; copy them before the next call.
 *
 * The C reference engine implements these over its synthetic model (ref_engine/loader.c), so one
 * loading path serves a real libbaseRT and the reference engine. This file is also fed to cffi
 * through native/_cdef.py, so it keeps to plain declarations.
 */

#ifndef BASERT_H_SUBSET
#define BASERT_H_SUBSET

#include <stddef.h>
#include <stdint.h>

#include "basert_tick.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    BASERT_OK = 0,
    BASERT_ERR_UNKNOWN = 1,
    BASERT_ERR_INVALID_ARGUMENT = 2,
    BASERT_ERR_FILE_NOT_FOUND = 3,
    BASERT_ERR_INVALID_FORMAT = 4,
    BASERT_ERR_UNSUPPORTED = 5,
    BASERT_ERR_OUT_OF_MEMORY = 6,
    BASERT_ERR_GPU = 7,
    BASERT_ERR_GENERATION_FAILED = 8
} BaseRTErrorCode;

typedef struct {
    size_t struct_size;     /* sizeof(BaseRTLoadOptions): the layout guard */
    int kv_bits;            /* 0 default, or 4 / 8 / 16 / 84 */
    int paged_kv;           /* 0 off (default), 1 on */
    int max_batch_size;     /* 0 default (1), else decode lanes */
    int prefix_cache;       /* 0 off (default), 1 on (needs paged_kv) */
    int prefill_chunk;      /* 0 per-device default, else tokens per prefill pass */
    int paged_weights_mode; /* 0 auto, 1 force paged, 2 fail hard */
} BaseRTLoadOptions;

enum {
    BASERT_CAP_PAGED_KV = 1,
    BASERT_CAP_SEQUENCES = 2,
    BASERT_CAP_HOST_LOGITS = 4,
    BASERT_CAP_PREFIX_CACHE = 8,
    BASERT_CAP_GDN_SNAPSHOT = 16
};

const char *baseRT_version_string(void);
baseRT_model_t baseRT_load_model_ex(const char *model_path, const char *kernel_library_path, int max_context,
                                    const BaseRTLoadOptions *opts);
baseRT_model_t baseRT_load_tokenizer_only(const char *model_path);
void baseRT_free_model(baseRT_model_t model);
const char *baseRT_get_error(void);
BaseRTErrorCode baseRT_get_error_code(void);
uint32_t baseRT_capabilities(baseRT_model_t model);
const char *baseRT_capability_descriptor(baseRT_model_t model);
int baseRT_suggest_max_context(const char *model_path, int max_batch, int kv_bits, int paged_kv);

int baseRT_encode(baseRT_model_t model, const char *text, uint32_t *out_tokens, int max_tokens);
int baseRT_decode_token_raw(baseRT_model_t model, uint32_t token_id, char *out, int max_bytes);
int baseRT_token_count(baseRT_model_t model, const char *text);
uint32_t baseRT_bos_id(baseRT_model_t model);
uint32_t baseRT_eos_token_id(baseRT_model_t model);
const char *baseRT_bos_token(baseRT_model_t model);
const char *baseRT_eos_token(baseRT_model_t model);
const char *baseRT_chat_template_jinja(baseRT_model_t model);

#ifdef __cplusplus
}
#endif

#endif /* BASERT_H_SUBSET */
