/* See brt_scan.h. */
#include "brt_scan.h"

int32_t brt_token_mask(void *pred, const void *vocab, int32_t n, uint8_t *out) {
    brt_token_pred f = (brt_token_pred)pred;
    int32_t count = 0;
    for (int32_t t = 0; t < n; t++) {
        uint8_t v = f(vocab, t) ? 1u : 0u;
        out[t] = v;
        count += v;
    }
    return count;
}
