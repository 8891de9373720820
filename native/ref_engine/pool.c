/* pool.c: the paged KV pool as reference-counted blocks, and the simulation a plan is tried on.
 *
 * A block holds block_tokens tokens of the bundle's paged space (block_bytes bytes). rc[b] counts
 * the holders of block b (sequences and cache entries); 0 means free. The simulation (ref_sim_*)
 * keeps its own counts for blocks it touched (stamped per simulation, so starting one is O(1))
 * and a signed count of free blocks: validation runs a whole plan through it, and the plan fits
 * when no deficit is left (ABI rules 50-52). */

#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"

int ref_pool_init(ref_pool *p, uint32_t block_tokens, uint64_t block_bytes, uint64_t pool_bytes) {
    memset(p, 0, sizeof *p);
    p->block_tokens = block_tokens ? block_tokens : 1;
    p->block_bytes = block_bytes;
    uint64_t n = block_bytes ? pool_bytes / block_bytes : 0;
    if (n > 0x7FFFFFFFull)
        n = 0x7FFFFFFFull;
    p->n_blocks = (uint32_t)n;
    if (!n)
        return 0;
    p->rc = calloc(n, sizeof *p->rc);
    p->free_ids = malloc(n * sizeof *p->free_ids);
    p->sim_rc = calloc(n, sizeof *p->sim_rc);
    p->sim_stamp = calloc(n, sizeof *p->sim_stamp);
    if (!p->rc || !p->free_ids || !p->sim_rc || !p->sim_stamp) {
        ref_pool_destroy(p);
        return -1;
    }
    /* Lowest ids are handed out first. */
    for (uint32_t i = 0; i < n; i++)
        p->free_ids[i] = (uint32_t)(n - 1 - i);
    p->n_free = (uint32_t)n;
    return 0;
}

void ref_pool_destroy(ref_pool *p) {
    free(p->rc);
    free(p->free_ids);
    free(p->sim_rc);
    free(p->sim_stamp);
    memset(p, 0, sizeof *p);
}

uint32_t ref_pool_alloc(ref_pool *p) {
    if (!p->n_free)
        return REF_NO_BLOCK;
    uint32_t b = p->free_ids[--p->n_free];
    p->rc[b] = 1;
    p->used++;
    return b;
}

void ref_pool_ref(ref_pool *p, uint32_t block) { p->rc[block]++; }

void ref_pool_unref(ref_pool *p, uint32_t block) {
    if (--p->rc[block] == 0) {
        p->free_ids[p->n_free++] = block;
        p->used--;
    }
}

uint32_t ref_pool_blocks_for(const ref_pool *p, uint64_t n_tokens) {
    if (!p->block_bytes)
        return 0;
    return (uint32_t)((n_tokens + p->block_tokens - 1) / p->block_tokens);
}

void ref_sim_begin(ref_pool *p) {
    if (++p->stamp == 0) { /* wrapped: forget every stamp */
        if (p->n_blocks)
            memset(p->sim_stamp, 0, p->n_blocks * sizeof *p->sim_stamp);
        p->stamp = 1;
    }
    p->sim_free = p->n_free;
}

uint32_t ref_sim_rc(const ref_pool *p, uint32_t block) {
    return p->sim_stamp[block] == p->stamp ? p->sim_rc[block] : p->rc[block];
}

static void sim_set(ref_pool *p, uint32_t block, uint32_t rc) {
    p->sim_stamp[block] = p->stamp;
    p->sim_rc[block] = rc;
}

void ref_sim_ref(ref_pool *p, uint32_t block) { sim_set(p, block, ref_sim_rc(p, block) + 1); }

void ref_sim_unref(ref_pool *p, uint32_t block) {
    uint32_t rc = ref_sim_rc(p, block);
    if (!rc)
        return;
    sim_set(p, block, rc - 1);
    if (rc == 1)
        p->sim_free++;
}

void ref_sim_alloc(ref_pool *p, uint64_t n_blocks) { p->sim_free -= (int64_t)n_blocks; }

void ref_sim_append(ref_pool *p, const uint32_t *blocks, uint32_t n_blocks, uint64_t len, uint64_t n) {
    if (!p->block_bytes || !n)
        return;
    uint64_t have = (uint64_t)n_blocks;
    uint64_t need = (len + n + p->block_tokens - 1) / p->block_tokens;
    /* A partial last block that someone else also holds is copied before it is written. */
    if (len % p->block_tokens && n_blocks && ref_sim_rc(p, blocks[n_blocks - 1]) > 1) {
        ref_sim_unref(p, blocks[n_blocks - 1]);
        ref_sim_alloc(p, 1);
    }
    if (need > have)
        ref_sim_alloc(p, need - have);
}
