"""cffi API-mode build of ``basertd.native._ringc``: the BRTRING1 ring code of ``native/brt_ring.c``
compiled into an extension module, so that Python stores and loads slot generations with real C11
release/acquire atomics and reads one span with one foreign call (DESIGN.md "Rings", ABI rules
123-130); with it ``native/brt_control.c``, the control segment's yield word as an abort callback
for engines whose steps run inside a C library (``basertd.shm.control``); and ``native/brt_scan.c``,
a per-token predicate of an engine library evaluated over a whole vocabulary in one call. setup.py picks this
file up as ``cffi_modules``; ``make native`` rebuilds it in place."""

from __future__ import annotations

import os

import cffi

_HERE = os.path.dirname(os.path.abspath(__file__))

CDEF = """
typedef struct brt_ring {
    uint8_t *base;
    uint64_t len;
    uint32_t ring_id;
    uint32_t slot_bytes;
    uint32_t slots;
    uint32_t next_index;
    uint64_t next_generation;
} brt_ring;

typedef struct brt_span {
    uint32_t index;
    uint32_t count;
    uint64_t generation;
} brt_span;

#define BRT_RING_MAGIC ...
#define BRT_RING_HEADER_BYTES ...
#define BRT_RING_SLOT_HEADER_BYTES ...
#define BRT_RING_MIN_SLOT_BYTES ...
#define BRT_RING_OK ...
#define BRT_RING_ERR_BOUNDS ...
#define BRT_RING_ERR_STALE ...
#define BRT_RING_ERR_LAYOUT ...

uint64_t brt_ring_bytes(uint32_t slots, uint32_t slot_bytes);
int brt_ring_check_geometry(uint32_t slot_bytes, uint32_t slots);
int brt_ring_format(void *base, uint32_t ring_id, uint32_t slot_bytes, uint32_t slots);
int brt_ring_attach(brt_ring *r, void *base, uint64_t len, uint32_t ring_id, uint32_t slot_bytes,
                    uint32_t slots);
uint32_t brt_ring_capacity(const brt_ring *r, uint32_t elem_size);
uint32_t brt_ring_span_slots(const brt_ring *r, uint32_t n, uint32_t elem_size);
int brt_ring_write(brt_ring *r, const void *src, uint32_t n, uint32_t elem_size, brt_span *out);
void brt_ring_invalidate(brt_ring *r);
int brt_ring_read(const brt_ring *r, uint32_t index, uint64_t generation, uint32_t count,
                  uint32_t elem_size, void *dst);
int brt_ring_read_slot(const brt_ring *r, uint32_t index, uint64_t generation, uint32_t elem_size,
                       void *dst, uint32_t dst_elems, uint32_t *out_count);
uint64_t brt_ring_slot_generation(const brt_ring *r, uint32_t index);

typedef struct brt_abort_watch {
    const uint64_t *word;
    uint64_t reasons;
} brt_abort_watch;
_Bool brt_abort_check(void *watch);

int32_t brt_token_mask(void *pred, const void *vocab, int32_t n, uint8_t *out);
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "basertd.native._ringc",
    '#include "brt_ring.h"\n#include "brt_control.h"\n#include "brt_scan.h"',
    sources=[
        os.path.relpath(os.path.join(_HERE, name)) for name in ("brt_ring.c", "brt_control.c", "brt_scan.c")
    ],
    include_dirs=[os.path.relpath(_HERE)],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
