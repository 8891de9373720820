/* See brt_control.h. */
#include "brt_control.h"

bool brt_abort_check(void *watch) {
    const brt_abort_watch *w = (const brt_abort_watch *)watch;
    uint64_t v = __atomic_load_n(w->word, __ATOMIC_RELAXED);
    return v != 0 && v < 64 && ((w->reasons >> v) & 1u) != 0;
}
