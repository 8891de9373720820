/* brt_ring.h - the one C implementation of BRTRING1, the single-writer shared-memory ring of the
 * baseRT tick ABI (DESIGN.md "Rings"; ABI rules 123-130, section J).
 *
 * Used by the Python package through the cffi API-mode module basertd.native._ringc and linked
 * into the C reference engine, so Python and C agree on the layout and on the memory ordering by
 * construction. Plain C11 with <stdatomic.h>; no Python, no allocation, no system calls.
 *
 * Layout (all integers little-endian, offsets in bytes):
 *
 *   ring header, 64 bytes at offset 0
 *     +0   u64 magic       BRT_RING_MAGIC (the bytes "BRTRING1")
 *     +8   u32 ring_id
 *     +12  u32 slot_bytes  bytes per slot, its 16-byte header included
 *     +16  u32 slots       number of slots
 *     +20  44 reserved bytes, zero
 *   slot i at offset 64 + i * slot_bytes, for i in [0, slots)
 *     +0   u64 generation  0 = never written (or being rewritten); never matches a reference
 *     +8   u32 payload_len payload bytes held by this slot
 *     +12  u32 pad         zero
 *     +16  payload         up to slot_bytes - 16 bytes (u32 token ids or f32 logits)
 *
 * A mapping is 64 + slots * slot_bytes bytes or more (brt_ring_bytes). This implementation
 * also requires slot_bytes to be a multiple of 8, at least 24, and the base to be 8-byte aligned,
 * so that every generation is a naturally aligned, lock-free 64-bit atomic.
 *
 * Writer cursor and spans. Exactly one writer per ring. Its cursor starts at (index 0,
 * generation 1) on every attach (ABI rules 126, 130). A span of n elements of elem_size bytes
 * takes k = ceil(n / cap) consecutive slots (cap = (slot_bytes - 16) / elem_size elements per
 * slot), wrapping modulo `slots`; slot j of the span (j < k) gets generation G + j, where
 * (index, G) was the cursor. Every slot but the last is full. The span is named by
 * (first index, element count, first generation), which is what BaseRTTokenRef carries. A span
 * of k > slots slots is refused (it would overwrite itself). The empty span is (0, 0, 0): writing
 * zero elements consumes no slot, and only the exact triple (index 0, count 0, generation 0)
 * reads back as empty.
 *
 * Publication protocol (a per-slot seqlock whose "odd" state is generation 0):
 *
 *   writer, per slot                          reader, per slot (expects generation E != 0)
 *   1. store generation := 0      (relaxed)   1. g1 := load generation   (acquire)
 *   2. thread fence               (release)      g1 != E  -> stale
 *   3. write payload, payload_len, pad        2. len := load payload_len (relaxed);
 *   4. store generation := G      (release)      copy the payload out
 *                                             3. thread fence             (acquire)
 *                                             4. g2 := load generation   (relaxed)
 *                                                g2 != E or len wrong -> stale
 *
 * Why no torn read is ever accepted. If the reader's copy (2) observed any byte written by a
 * rewrite of the slot (step 3 of a later write), the release fence (writer 2) and the acquire
 * fence (reader 3) synchronise through that byte, so the reader's load 4 sees the writer's
 * store 1 (generation 0) or something later - never E again, because generations of a ring only
 * grow within one attach lifetime. If the copy observed no such byte, the copy equals the payload
 * published with E, which the acquire load 1 made visible. Store 1 must come before the payload
 * bytes and the fence keeps it there; the acquire fence keeps load 4 after the copy. Consequently a
 * reader also rejects a slot recycled after a full wrap (ABI rules 128, 129).
 *
 * Re-attaching a writer restarts generations at 1 (ABI rule 130). A reader still holding a
 * reference from the previous lifetime could then match a new write with the same generation, so a
 * ring is re-attached only when no reader holds references into it (fresh rings per worker
 * incarnation, DESIGN.md "Link W"); brt_ring_invalidate makes all old references stale at once.
 *
 * Return codes are baseRT_status values: 0, BRT_RING_ERR_BOUNDS (-102, BASERT_REJECT_BOUNDS),
 * BRT_RING_ERR_STALE (-103, BASERT_REJECT_BAD_REF_GENERATION), BRT_RING_ERR_LAYOUT (-131,
 * BASERT_ERR_RING_LAYOUT). */

#ifndef BRT_RING_H
#define BRT_RING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BRT_RING_MAGIC 0x42525452494E4731ull /* "BRTRING1" read as a little-endian u64 */
#define BRT_RING_HEADER_BYTES 64u
#define BRT_RING_SLOT_HEADER_BYTES 16u
#define BRT_RING_MIN_SLOT_BYTES 24u

#define BRT_RING_OK 0
#define BRT_RING_ERR_BOUNDS (-102)
#define BRT_RING_ERR_STALE (-103)
#define BRT_RING_ERR_LAYOUT (-131)

/* One attached ring: the mapping, its validated geometry and (for the writer) the cursor.
 * A reader leaves next_index / next_generation untouched. Not shared between processes: each
 * process holds its own brt_ring over its own mapping of the same memory. */
typedef struct brt_ring {
    uint8_t *base;            /* the ring header; 8-byte aligned */
    uint64_t len;             /* mapped bytes, >= brt_ring_bytes(slots, slot_bytes) */
    uint32_t ring_id;
    uint32_t slot_bytes;      /* includes the 16-byte slot header */
    uint32_t slots;
    uint32_t next_index;      /* writer cursor: slot of the next write, in [0, slots) */
    uint64_t next_generation; /* writer cursor: generation of the next slot written, >= 1 */
} brt_ring;

/* A published span: first slot, element count, generation of the first slot. */
typedef struct brt_span {
    uint32_t index;
    uint32_t count;
    uint64_t generation;
} brt_span;

/* Bytes a ring of `slots` slots of `slot_bytes` bytes needs: 64 + slots * slot_bytes. */
uint64_t brt_ring_bytes(uint32_t slots, uint32_t slot_bytes);

/* 0 if (slot_bytes, slots) is a geometry this implementation accepts (slots >= 1, slot_bytes >= 24
 * and a multiple of 8), else BRT_RING_ERR_LAYOUT. */
int brt_ring_check_geometry(uint32_t slot_bytes, uint32_t slots);

/* Writes a fresh header at `base` (which must map brt_ring_bytes(slots, slot_bytes) bytes) and
 * zeroes every slot header, so no slot resolves. The magic is stored last, with release. Returns
 * 0, or BRT_RING_ERR_LAYOUT (nothing written) for a NULL or misaligned base or a bad geometry. */
int brt_ring_format(void *base, uint32_t ring_id, uint32_t slot_bytes, uint32_t slots);

/* Validates the header at `base` against the expected ring_id, slot_bytes and slots and the
 * mapped length `len`: magic, the three fields, zero reserved bytes, geometry, alignment and
 * len >= brt_ring_bytes. On success fills *r and sets the writer cursor to (index 0, generation 1)
 * (ABI rule 130); on failure returns BRT_RING_ERR_LAYOUT and leaves *r unchanged (ABI rule 125).
 * Does not write to the ring memory. */
int brt_ring_attach(brt_ring *r, void *base, uint64_t len, uint32_t ring_id, uint32_t slot_bytes,
                    uint32_t slots);

/* Payload capacity of one slot, in elements of elem_size bytes (0 if elem_size is 0 or *r is not
 * attached). */
uint32_t brt_ring_capacity(const brt_ring *r, uint32_t elem_size);

/* Slots a span of n elements of elem_size bytes occupies (0 for n == 0 or elem_size == 0). */
uint32_t brt_ring_span_slots(const brt_ring *r, uint32_t n, uint32_t elem_size);

/* Writer: publishes n elements of elem_size bytes from src over consecutive slots starting at the
 * cursor and stores (first index, n, first generation) in *out; the cursor advances past the span.
 * n == 0 writes nothing and stores (0, 0, 0). Returns BRT_RING_ERR_BOUNDS, writing nothing, when
 * elem_size is 0 or larger than a slot's payload or the span needs more than `slots` slots. */
int brt_ring_write(brt_ring *r, const void *src, uint32_t n, uint32_t elem_size, brt_span *out);

/* Writer: stores generation 0 in every slot (release), so every reference to the ring is stale.
 * Leaves the cursor alone. */
void brt_ring_invalidate(brt_ring *r);

/* Reader: copies the span (index, generation, count elements of elem_size bytes) into dst (room
 * for count * elem_size bytes) and returns 0, or BRT_RING_ERR_STALE when generation is 0, index is
 * out of range, the span needs more than `slots` slots, a slot's generation is not the expected one
 * before or after its copy, or a slot's payload_len differs from the span's. After a stale return
 * dst holds unspecified bytes and must not be used. (index 0, count 0, generation 0) is the empty
 * span: returns 0 and copies nothing. The layout has no end-of-span mark, so a count that is a
 * multiple of the slot capacity and shorter than the published span reads that exact prefix of it
 * (whole slots, never torn); every other count that differs from the published one is stale. */
int brt_ring_read(const brt_ring *r, uint32_t index, uint64_t generation, uint32_t count,
                  uint32_t elem_size, void *dst);

/* Reader: copies one slot of unknown length (a logits row) into dst, which has room for
 * dst_elems elements of elem_size bytes; stores the element count in *out_count. Returns 0, or
 * BRT_RING_ERR_STALE for generation 0, an out-of-range index, a generation mismatch before or
 * after the copy, or a payload_len that is not a whole number of elements or exceeds the slot;
 * BRT_RING_ERR_BOUNDS when a valid row is longer than dst_elems. */
int brt_ring_read_slot(const brt_ring *r, uint32_t index, uint64_t generation, uint32_t elem_size,
                       void *dst, uint32_t dst_elems, uint32_t *out_count);

/* The current generation of slot `index` (acquire load); 0 for an out-of-range index. */
uint64_t brt_ring_slot_generation(const brt_ring *r, uint32_t index);

#ifdef __cplusplus
}
#endif

#endif /* BRT_RING_H */
