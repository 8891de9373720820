/*
 * ops_internal.h: what the state-op files of the reference engine share (ops.c, envelope.c).
 *
 * envelope.c owns the bytes: the synthetic payload of an export, the 136-byte BRTSTATE envelope
 * in front of it, the two checksums and the checks a restore / promote runs on incoming bytes.
 * ops.c owns the lifecycle: op records, (sequence, space) claims, demoted ranges, and the ABI
 * entry points of tick ABI §3 (RULES.md section H).
 *
 * Payload (deterministic in the sequence's tokens, so a restore into a fresh sequence rebuilds
 * the very state it was taken from):
 *  - paged kinds: one record per token of the range, record_bytes each (bytes_per_token for
 *    LOSSLESS, ceil(bytes_per_token / 2) for Q8, ceil(bytes_per_token / 4) for Q4). A record is
 *    the token id (u32 LE) followed by a key stream of the history hash through that token, so a
 *    restore recovers the tokens, and a record under 4 bytes is not served (OP_UNSUPPORTED);
 *  - blob kinds (RECURRENT_BLOB, RING_KV): blob_bytes bytes at one position q: the history hash
 *    through q (u64 LE) followed by its key stream; a blob under 8 bytes is not served.
 */

#ifndef REF_OPS_INTERNAL_H
#define REF_OPS_INTERNAL_H

#include "ref_internal.h"

#define REF_ENVELOPE_BYTES ((uint64_t)sizeof(BaseRTStateEnvelope)) /* 136, ABI rule 10 */
#define REF_ENVELOPE_VERSION 1u

/* Bytes of one payload unit of `space` under `encoding`: a paged token record or a whole blob.
 * 0 when the reference engine does not serve that export (ENCODER_CACHE, a lossy blob, an
 * unknown encoding, a record under 4 bytes or a blob under 8). */
uint64_t ref_env_unit_bytes(const ref_bundle *b, uint32_t space, uint32_t encoding);

/* Payload bytes of an export of `range` (paged: (end - start) records; blob: one blob). */
uint64_t ref_env_payload_bytes(const ref_bundle *b, uint32_t space, BaseRTTokenRange range, uint32_t encoding);

/* The history hash after tokens[0..n) (the synthetic model's state at position n). */
uint64_t ref_env_history(const ref_bundle *b, const uint32_t *tokens, uint64_t n);

/* Writes the paged payload of tokens[start..end) (tokens from position 0, so the history of each
 * position is known) into out (ref_env_payload_bytes bytes). */
void ref_env_paged_payload(const ref_bundle *b, uint32_t space, const uint32_t *tokens, uint64_t start,
                           uint64_t end, uint32_t encoding, uint8_t *out);

/* Writes the blob payload of the state whose history hash is `key` into out (blob_bytes). */
void ref_env_blob_payload(const ref_bundle *b, uint32_t space, uint64_t key, uint8_t *out);

/* Checksum of `len` bytes under `kind` (BASERT_CHECKSUM_*): OK; CHECKSUM for kind 0 or unknown
 * (never a skipped check, ABI rule 103); OP_UNSUPPORTED for XXH3 when libxxhash cannot be loaded. */
baseRT_status ref_env_checksum(uint32_t kind, const void *data, size_t len, uint64_t *out);

/* 1 when XXH3-64 is available (libxxhash.so.0, or $BASERT_REF_XXHASH_LIB, dlopen'ed once). */
int ref_env_xxh3_available(void);

/* Writes the envelope for a payload already at dst + 136 (payload_len bytes) and checksums it. */
baseRT_status ref_env_seal(const ref_bundle *b, uint32_t space, BaseRTTokenRange range, uint32_t encoding,
                           const uint8_t provenance[32], uint32_t taint_bits, uint32_t checksum_kind,
                           uint8_t *dst, uint64_t payload_len);

/* Checks `src` as sealed bytes for space `space` of this bundle, in this order, and copies the
 * envelope into *env on OK (ABI rules 101-103):
 *  ENVELOPE_MISMATCH: NULL pointer, fewer than 136 bytes, bad magic or version, a space kind other
 *    than the target's, payload_len other than src.len - 136, an unknown encoding, start > end;
 *  IDENTITY_MISMATCH: compat_identity (ref_space_identity) or version_tag other than the target
 *    space's;
 *  CHECKSUM: checksum_kind 0 or unknown, or a payload whose checksum differs;
 *  OP_UNSUPPORTED: an XXH3 envelope while libxxhash is missing. */
baseRT_status ref_env_open(const ref_bundle *b, uint32_t space, BaseRTBuf src, BaseRTStateEnvelope *env);

/* Reads the u32 / u64 little-endian value at p. */
uint32_t ref_env_le32(const uint8_t *p);
uint64_t ref_env_le64(const uint8_t *p);

#endif /* REF_OPS_INTERNAL_H */
