/* The control segment's yield word read from C (DESIGN.md "Rings"; basertd/shm/control.py holds
 * the layout and the ordering argument). An engine whose tick runs inside a C library hands
 * brt_abort_check to it as an abort callback so a step in flight can end early. */
#ifndef BRT_CONTROL_H
#define BRT_CONTROL_H

#include <stdbool.h>
#include <stdint.h>

typedef struct brt_abort_watch {
    const uint64_t *word; /* the yield word: 8-byte aligned, single writer (the coordinator) */
    uint64_t reasons;     /* bit r set: yield reason r aborts the step in flight */
} brt_abort_watch;

/* An abort callback (llama.cpp's ggml_abort_callback): true when the yield word holds one of
 * watch->reasons. One relaxed 8-byte load, no lock, no allocation: safe on any compute thread. */
bool brt_abort_check(void *watch);

#endif
