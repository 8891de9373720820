/* A C process on the other side of a ring, built by the tests from this file and native/brt_ring.c
 * (the code the reference engine links). It maps a segment inherited as a descriptor, as an engine
 * maps the worker's rings, and writes or reads spans of u32 tokens.
 *
 *   shm_ring_peer FD LEN RING_ID SLOTS SLOT_BYTES attach
 *       prints "ok" or "layout RC"
 *   shm_ring_peer FD LEN RING_ID SLOTS SLOT_BYTES write N SEED [N SEED ...]
 *       writes, per pair, N tokens SEED + i * 2654435761 (mod 2^32); prints "ref INDEX COUNT GEN"
 *   shm_ring_peer FD LEN RING_ID SLOTS SLOT_BYTES read INDEX COUNT GEN [INDEX COUNT GEN ...]
 *       prints "ok V0 V1 ..." or "stale RC" per span
 *   shm_ring_peer FD LEN RING_ID SLOTS SLOT_BYTES hammer-write MILLIS
 *       publishes spans of 1.5 slots' worth of tokens (two slots each) for MILLIS ms, each token a
 *       function of the span's first generation; prints "spans N"
 *   shm_ring_peer FD LEN RING_ID SLOTS SLOT_BYTES hammer-read MILLIS
 *       reads the span covering a pseudo-random slot, over and over for MILLIS ms, and checks every
 *       successful read against the pattern; prints "ok N stale M torn T empty E"
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "brt_ring.h"

static uint64_t arg_u64(const char *s) { return strtoull(s, NULL, 10); }

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Token j of the span whose first slot has generation g. */
static uint32_t hammer_value(uint64_t g, uint32_t j) { return (uint32_t)(g * 2654435761u) ^ (j * 0x85EBCA77u); }

static int hammer_write(brt_ring *ring, double millis) {
    uint32_t cap = brt_ring_capacity(ring, 4);
    uint32_t n = cap + cap / 2;
    uint32_t *vals = malloc((size_t)n * sizeof *vals);
    if (vals == NULL) {
        return 2;
    }
    double end = now_ms() + millis;
    uint64_t spans = 0;
    for (;;) {
        uint64_t g = ring->next_generation;
        for (uint32_t j = 0; j < n; j++) {
            vals[j] = hammer_value(g, j);
        }
        brt_span span;
        if (brt_ring_write(ring, vals, n, 4, &span) != BRT_RING_OK || span.generation != g) {
            free(vals);
            return 2;
        }
        if (++spans % 1024 == 0 && now_ms() > end) {
            break;
        }
    }
    free(vals);
    printf("spans %" PRIu64 "\n", spans);
    return 0;
}

static int hammer_read(brt_ring *ring, double millis) {
    uint32_t cap = brt_ring_capacity(ring, 4);
    uint32_t n = cap + cap / 2;
    uint32_t *vals = malloc((size_t)n * sizeof *vals);
    if (vals == NULL) {
        return 2;
    }
    double end = now_ms() + millis;
    uint64_t ok = 0, stale = 0, torn = 0, empty = 0, iter = 0;
    uint32_t x = 12345;
    for (;;) {
        x = x * 1664525u + 1013904223u;
        uint32_t index = (x >> 8) % ring->slots;
        uint64_t g = brt_ring_slot_generation(ring, index);
        if (g == 0) {
            empty++;
        } else {
            uint64_t first = (g % 2 == 1) ? g : g - 1; /* spans take two slots: odd generations start */
            uint32_t at = (uint32_t)((first - 1) % ring->slots);
            if (brt_ring_read(ring, at, first, n, 4, vals) != BRT_RING_OK) {
                stale++;
            } else {
                uint32_t j = 0;
                while (j < n && vals[j] == hammer_value(first, j)) {
                    j++;
                }
                if (j == n) {
                    ok++;
                } else {
                    torn++;
                }
            }
        }
        if (++iter % 1024 == 0 && now_ms() > end) {
            break;
        }
    }
    free(vals);
    printf("ok %" PRIu64 " stale %" PRIu64 " torn %" PRIu64 " empty %" PRIu64 "\n", ok, stale, torn, empty);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s FD LEN RING_ID SLOTS SLOT_BYTES CMD ...\n", argv[0]);
        return 2;
    }
    int fd = (int)arg_u64(argv[1]);
    uint64_t len = arg_u64(argv[2]);
    uint32_t ring_id = (uint32_t)arg_u64(argv[3]);
    uint32_t slots = (uint32_t)arg_u64(argv[4]);
    uint32_t slot_bytes = (uint32_t)arg_u64(argv[5]);
    const char *cmd = argv[6];
    void *base = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        perror("mmap");
        return 2;
    }
    brt_ring ring;
    memset(&ring, 0, sizeof ring);
    int rc = brt_ring_attach(&ring, base, len, ring_id, slot_bytes, slots);
    if (rc != BRT_RING_OK) {
        printf("layout %d\n", rc);
        return 0;
    }
    int exit_code = 0;
    if (strcmp(cmd, "attach") == 0) {
        printf("ok\n");
    } else if (strcmp(cmd, "write") == 0) {
        for (int a = 7; a + 1 < argc; a += 2) {
            uint32_t n = (uint32_t)arg_u64(argv[a]);
            uint32_t seed = (uint32_t)arg_u64(argv[a + 1]);
            uint32_t *vals = malloc(((size_t)n + 1) * sizeof *vals);
            if (vals == NULL) {
                return 2;
            }
            for (uint32_t i = 0; i < n; i++) {
                vals[i] = seed + i * 2654435761u;
            }
            brt_span span;
            rc = brt_ring_write(&ring, vals, n, 4, &span);
            free(vals);
            if (rc != BRT_RING_OK) {
                printf("error %d\n", rc);
            } else {
                printf("ref %" PRIu32 " %" PRIu32 " %" PRIu64 "\n", span.index, span.count, span.generation);
            }
        }
    } else if (strcmp(cmd, "read") == 0) {
        for (int a = 7; a + 2 < argc; a += 3) {
            uint32_t index = (uint32_t)arg_u64(argv[a]);
            uint32_t count = (uint32_t)arg_u64(argv[a + 1]);
            uint64_t gen = arg_u64(argv[a + 2]);
            uint32_t *vals = malloc(((size_t)count + 1) * sizeof *vals);
            if (vals == NULL) {
                return 2;
            }
            rc = brt_ring_read(&ring, index, gen, count, 4, vals);
            if (rc != BRT_RING_OK) {
                printf("stale %d\n", rc);
            } else {
                printf("ok");
                for (uint32_t i = 0; i < count; i++) {
                    printf(" %" PRIu32, vals[i]);
                }
                printf("\n");
            }
            free(vals);
        }
    } else if (strcmp(cmd, "hammer-write") == 0 && argc > 7) {
        exit_code = hammer_write(&ring, (double)arg_u64(argv[7]));
    } else if (strcmp(cmd, "hammer-read") == 0 && argc > 7) {
        exit_code = hammer_read(&ring, (double)arg_u64(argv[7]));
    } else {
        fprintf(stderr, "unknown command %s\n", cmd);
        return 2;
    }
    munmap(base, (size_t)len);
    return exit_code;
}
