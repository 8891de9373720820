/* brt_ring.c - BRTRING1 rings: format, attach, single-writer publish, copy-and-validate read.
 * The protocol and the layout are documented in brt_ring.h. */

#include "brt_ring.h"

#include <stdatomic.h>
#include <string.h>

/* Generations live in memory shared between processes: their atomics must be lock-free and
 * exactly as wide as the plain u64 of the layout. */
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free");
_Static_assert(sizeof(_Atomic uint64_t) == 8, "atomic u64 must be 8 bytes");
_Static_assert(sizeof(_Atomic uint32_t) == 4, "atomic u32 must be 4 bytes");

#define OFF_MAGIC 0u
#define OFF_RING_ID 8u
#define OFF_SLOT_BYTES 12u
#define OFF_SLOTS 16u
#define OFF_RESERVED 20u
#define SLOT_OFF_GENERATION 0u
#define SLOT_OFF_PAYLOAD_LEN 8u
#define SLOT_OFF_PAD 12u

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void store_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, sizeof v); }

static uint8_t *slot_at(const brt_ring *r, uint32_t index) {
    return r->base + BRT_RING_HEADER_BYTES + (uint64_t)index * r->slot_bytes;
}

static _Atomic uint64_t *slot_generation(uint8_t *slot) {
    return (_Atomic uint64_t *)(void *)(slot + SLOT_OFF_GENERATION);
}

static _Atomic uint32_t *slot_payload_len(uint8_t *slot) {
    return (_Atomic uint32_t *)(void *)(slot + SLOT_OFF_PAYLOAD_LEN);
}

uint64_t brt_ring_bytes(uint32_t slots, uint32_t slot_bytes) {
    return (uint64_t)BRT_RING_HEADER_BYTES + (uint64_t)slots * (uint64_t)slot_bytes;
}

int brt_ring_check_geometry(uint32_t slot_bytes, uint32_t slots) {
    if (slots == 0 || slot_bytes < BRT_RING_MIN_SLOT_BYTES || slot_bytes % 8u != 0) {
        return BRT_RING_ERR_LAYOUT;
    }
    return BRT_RING_OK;
}

int brt_ring_format(void *base, uint32_t ring_id, uint32_t slot_bytes, uint32_t slots) {
    uint8_t *b = (uint8_t *)base;
    if (b == NULL || ((uintptr_t)b % 8u) != 0 || brt_ring_check_geometry(slot_bytes, slots) != 0) {
        return BRT_RING_ERR_LAYOUT;
    }
    _Atomic uint64_t *magic = (_Atomic uint64_t *)(void *)(b + OFF_MAGIC);
    atomic_store_explicit(magic, 0, memory_order_relaxed);
    memset(b + 8, 0, BRT_RING_HEADER_BYTES - 8);
    store_u32(b + OFF_RING_ID, ring_id);
    store_u32(b + OFF_SLOT_BYTES, slot_bytes);
    store_u32(b + OFF_SLOTS, slots);
    for (uint32_t i = 0; i < slots; i++) {
        uint8_t *s = b + BRT_RING_HEADER_BYTES + (uint64_t)i * slot_bytes;
        atomic_store_explicit(slot_generation(s), 0, memory_order_relaxed);
        atomic_store_explicit(slot_payload_len(s), 0, memory_order_relaxed);
        store_u32(s + SLOT_OFF_PAD, 0);
    }
    atomic_store_explicit(magic, BRT_RING_MAGIC, memory_order_release);
    return BRT_RING_OK;
}

int brt_ring_attach(brt_ring *r, void *base, uint64_t len, uint32_t ring_id, uint32_t slot_bytes,
                    uint32_t slots) {
    const uint8_t *b = (const uint8_t *)base;
    if (r == NULL || b == NULL || ((uintptr_t)b % 8u) != 0 || len < BRT_RING_HEADER_BYTES) {
        return BRT_RING_ERR_LAYOUT;
    }
    if (brt_ring_check_geometry(slot_bytes, slots) != 0 || len < brt_ring_bytes(slots, slot_bytes)) {
        return BRT_RING_ERR_LAYOUT;
    }
    const _Atomic uint64_t *magic = (const _Atomic uint64_t *)(const void *)(b + OFF_MAGIC);
    if (atomic_load_explicit(magic, memory_order_acquire) != BRT_RING_MAGIC) {
        return BRT_RING_ERR_LAYOUT;
    }
    if (load_u32(b + OFF_RING_ID) != ring_id || load_u32(b + OFF_SLOT_BYTES) != slot_bytes ||
        load_u32(b + OFF_SLOTS) != slots) {
        return BRT_RING_ERR_LAYOUT;
    }
    for (uint32_t off = OFF_RESERVED; off < BRT_RING_HEADER_BYTES; off += 4) {
        if (load_u32(b + off) != 0) {
            return BRT_RING_ERR_LAYOUT;
        }
    }
    r->base = (uint8_t *)base;
    r->len = len;
    r->ring_id = ring_id;
    r->slot_bytes = slot_bytes;
    r->slots = slots;
    r->next_index = 0;
    r->next_generation = 1;
    return BRT_RING_OK;
}

uint32_t brt_ring_capacity(const brt_ring *r, uint32_t elem_size) {
    if (elem_size == 0 || r->slots == 0 || r->slot_bytes < BRT_RING_MIN_SLOT_BYTES) {
        return 0;
    }
    return (r->slot_bytes - BRT_RING_SLOT_HEADER_BYTES) / elem_size;
}

uint32_t brt_ring_span_slots(const brt_ring *r, uint32_t n, uint32_t elem_size) {
    uint32_t cap = brt_ring_capacity(r, elem_size);
    if (n == 0 || cap == 0) {
        return 0;
    }
    return n / cap + (n % cap != 0);
}

int brt_ring_write(brt_ring *r, const void *src, uint32_t n, uint32_t elem_size, brt_span *out) {
    if (n == 0) {
        out->index = 0;
        out->count = 0;
        out->generation = 0;
        return BRT_RING_OK;
    }
    uint32_t cap = brt_ring_capacity(r, elem_size);
    if (cap == 0) {
        return BRT_RING_ERR_BOUNDS;
    }
    uint32_t k = brt_ring_span_slots(r, n, elem_size);
    if (k > r->slots || r->next_generation > UINT64_MAX - k) {
        return BRT_RING_ERR_BOUNDS;
    }
    const uint8_t *from = (const uint8_t *)src;
    uint32_t index = r->next_index;
    uint64_t generation = r->next_generation;
    uint32_t left = n;
    for (uint32_t j = 0; j < k; j++) {
        uint32_t take = left < cap ? left : cap;
        uint32_t bytes = take * elem_size;
        uint8_t *s = slot_at(r, index);
        _Atomic uint64_t *gen = slot_generation(s);
        /* 1-2: the slot stops resolving before any payload byte changes. */
        atomic_store_explicit(gen, 0, memory_order_relaxed);
        atomic_thread_fence(memory_order_release);
        /* 3: payload and length; the pad stays zero. */
        memcpy(s + BRT_RING_SLOT_HEADER_BYTES, from, bytes);
        atomic_store_explicit(slot_payload_len(s), bytes, memory_order_relaxed);
        store_u32(s + SLOT_OFF_PAD, 0);
        /* 4: publish. */
        atomic_store_explicit(gen, generation + j, memory_order_release);
        from += bytes;
        left -= take;
        index = index + 1 == r->slots ? 0 : index + 1;
    }
    out->index = r->next_index;
    out->count = n;
    out->generation = generation;
    r->next_index = index;
    r->next_generation = generation + k;
    return BRT_RING_OK;
}

void brt_ring_invalidate(brt_ring *r) {
    for (uint32_t i = 0; i < r->slots; i++) {
        atomic_store_explicit(slot_generation(slot_at(r, i)), 0, memory_order_release);
    }
}

/* Copies `bytes` payload bytes of slot `index` if it holds generation `expected` and exactly
 * `bytes` payload bytes before and after the copy. */
static int read_one(const brt_ring *r, uint32_t index, uint64_t expected, uint32_t bytes, uint8_t *dst) {
    uint8_t *s = slot_at(r, index);
    _Atomic uint64_t *gen = slot_generation(s);
    if (atomic_load_explicit(gen, memory_order_acquire) != expected) {
        return BRT_RING_ERR_STALE;
    }
    uint32_t len = atomic_load_explicit(slot_payload_len(s), memory_order_relaxed);
    memcpy(dst, s + BRT_RING_SLOT_HEADER_BYTES, bytes);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(gen, memory_order_relaxed) != expected || len != bytes) {
        return BRT_RING_ERR_STALE;
    }
    return BRT_RING_OK;
}

int brt_ring_read(const brt_ring *r, uint32_t index, uint64_t generation, uint32_t count,
                  uint32_t elem_size, void *dst) {
    if (count == 0) {
        return (index == 0 && generation == 0) ? BRT_RING_OK : BRT_RING_ERR_STALE;
    }
    uint32_t cap = brt_ring_capacity(r, elem_size);
    if (generation == 0 || index >= r->slots || cap == 0) {
        return BRT_RING_ERR_STALE;
    }
    uint32_t k = brt_ring_span_slots(r, count, elem_size);
    if (k > r->slots || generation > UINT64_MAX - k) {
        return BRT_RING_ERR_STALE;
    }
    uint8_t *to = (uint8_t *)dst;
    uint32_t left = count;
    for (uint32_t j = 0; j < k; j++) {
        uint32_t take = left < cap ? left : cap;
        uint32_t bytes = take * elem_size;
        int rc = read_one(r, index, generation + j, bytes, to);
        if (rc != BRT_RING_OK) {
            return rc;
        }
        to += bytes;
        left -= take;
        index = index + 1 == r->slots ? 0 : index + 1;
    }
    return BRT_RING_OK;
}

int brt_ring_read_slot(const brt_ring *r, uint32_t index, uint64_t generation, uint32_t elem_size,
                       void *dst, uint32_t dst_elems, uint32_t *out_count) {
    uint32_t cap = brt_ring_capacity(r, elem_size);
    if (generation == 0 || index >= r->slots || cap == 0) {
        return BRT_RING_ERR_STALE;
    }
    uint8_t *s = slot_at(r, index);
    _Atomic uint64_t *gen = slot_generation(s);
    if (atomic_load_explicit(gen, memory_order_acquire) != generation) {
        return BRT_RING_ERR_STALE;
    }
    uint32_t len = atomic_load_explicit(slot_payload_len(s), memory_order_relaxed);
    uint32_t room = (dst_elems < cap ? dst_elems : cap) * elem_size;
    /* A length read under a generation that later fails the check may be garbage: copy at most
     * `room` bytes, then validate. */
    uint32_t bytes = len < room ? len : room;
    memcpy(dst, s + BRT_RING_SLOT_HEADER_BYTES, bytes);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(gen, memory_order_relaxed) != generation) {
        return BRT_RING_ERR_STALE;
    }
    if (len > cap * elem_size || len % elem_size != 0) {
        return BRT_RING_ERR_STALE;
    }
    if (len > room) {
        return BRT_RING_ERR_BOUNDS;
    }
    *out_count = len / elem_size;
    return BRT_RING_OK;
}

uint64_t brt_ring_slot_generation(const brt_ring *r, uint32_t index) {
    if (index >= r->slots) {
        return 0;
    }
    return atomic_load_explicit(slot_generation(slot_at(r, index)), memory_order_acquire);
}
