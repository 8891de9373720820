/* A per-token predicate of an engine library evaluated over a whole vocabulary in C: one foreign
 * call from Python instead of one per token (llama.cpp's llama_vocab_is_eog over a 262,144-token
 * vocabulary is about 0.1-0.4 s of ctypes calls, a few milliseconds here). */
#ifndef BRT_SCAN_H
#define BRT_SCAN_H

#include <stdbool.h>
#include <stdint.h>

/* The shape of llama.cpp's per-token vocabulary predicates (llama_vocab_is_eog,
 * llama_vocab_is_control): bool f(const struct llama_vocab *, llama_token). */
typedef bool (*brt_token_pred)(const void *vocab, int32_t token);

/* out[t] = pred(vocab, t) (1 or 0) for every t in [0, n); returns how many are 1. */
int32_t brt_token_mask(void *pred, const void *vocab, int32_t n, uint8_t *out);

#endif
