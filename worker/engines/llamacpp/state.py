"""Sealed state exports of the llama.cpp engine: one sequence's KV in the ABI's 136-byte envelope.

The payload is exactly what ``llama_state_seq_get_data`` writes for one sequence (cells, positions,
K and V per layer) and ``llama_state_seq_set_data`` reads back. The envelope (``StateEnvelope``,
ABI "BaseRTStateEnvelope") wraps it with:

- ``compat_identity``: BLAKE2b-256 over the model id and everything that shapes the blob (KV types,
  unified cache, stream count, page size, llama-cpp-python version), so a blob only restores into an
  engine that reads it the same way (ABI rule 102);
- ``version_tag``: the state format version of this adapter (rule 102);
- ``provenance_digest`` and ``taint_bits`` of the sequence (taint is sticky, rule 107);
- ``range`` ``[0, n)``: the positions held; ``encoding`` LOSSLESS;
- ``checksum_kind`` XXH3_64 over the payload (rule 103; FNV-1a-64 is refused as unsupported here
  rather than verified slowly, with the same CHECKSUM status as a mismatch).

``open_sealed`` checks in the order the rules list them: size, magic, version, space kind, payload
length and range (ENVELOPE_MISMATCH, rule 101), identity (IDENTITY_MISMATCH, rule 102), checksum
(CHECKSUM, rule 103).
"""

from __future__ import annotations

import hashlib

import xxhash

from basertd.schema.abi import STATE_ENVELOPE_MAGIC, ChecksumKind, Encoding, SpaceKind, Status
from basertd.schema.tick import ENVELOPE_BYTES, StateEnvelope, TokenRange
from basertd.worker.engines.base import EngineError

ENVELOPE_VERSION = 1
STATE_VERSION_TAG = 0x6C63_0001
"""``version_tag`` of this adapter's KV payload format ("lc" + format 1); bump on any change."""


def compat_identity(model_id: str, *facts: object) -> bytes:
    """32-byte identity of what a KV blob can be restored into: the model id plus every fact that
    shapes the llama.cpp state format (passed by the engine as ``facts``)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(model_id.encode())
    for f in facts:
        h.update(b"\x00" + repr(f).encode())
    return h.digest()


def envelope(
    payload: bytes | bytearray | memoryview,
    *,
    identity: bytes,
    provenance: bytes,
    taint: int,
    n_tokens: int,
) -> bytes:
    """The packed ``ENVELOPE_BYTES``-byte envelope of a PAGED_TOKEN_KV export of positions
    ``[0, n_tokens)`` whose payload is ``payload`` (checksummed here, not copied)."""
    env = StateEnvelope(
        magic=STATE_ENVELOPE_MAGIC,
        envelope_version=ENVELOPE_VERSION,
        space_kind=SpaceKind.PAGED_TOKEN_KV,
        compat_identity=identity,
        version_tag=STATE_VERSION_TAG,
        provenance_digest=provenance,
        taint_bits=taint,
        range=TokenRange(start=0, end=n_tokens),
        encoding=Encoding.LOSSLESS,
        checksum_kind=ChecksumKind.XXH3_64,
        payload_len=len(payload),
        content_checksum=xxhash.xxh3_64_intdigest(payload),
    )
    return env.pack()


def seal(
    payload: bytes | bytearray | memoryview,
    *,
    identity: bytes,
    provenance: bytes,
    taint: int,
    n_tokens: int,
) -> bytes:
    """Envelope + payload for a PAGED_TOKEN_KV export of positions ``[0, n_tokens)``; exactly
    ``ENVELOPE_BYTES + len(payload)`` bytes (ABI rule 95)."""
    head = envelope(payload, identity=identity, provenance=provenance, taint=taint, n_tokens=n_tokens)
    return head + bytes(payload)


def open_sealed(data: bytes | memoryview, *, identity: bytes) -> tuple[StateEnvelope, memoryview]:
    """Check a sealed export against this engine and return (envelope, payload view).

    Raises EngineError with ERR_ENVELOPE_MISMATCH (short buffer, bad magic or version, wrong space
    kind or encoding, a range other than ``[0, n)``, payload_len != bytes supplied),
    ERR_IDENTITY_MISMATCH (compat identity or version tag), or ERR_CHECKSUM (unknown checksum kind,
    FNV-1a-64, or a payload that does not match) - ABI rules 101-103. Changes nothing."""
    view = memoryview(data).cast("B")
    if len(view) < ENVELOPE_BYTES:
        raise EngineError(Status.ERR_ENVELOPE_MISMATCH, f"{len(view)} bytes cannot hold an envelope")
    env = StateEnvelope.unpack(view)
    if env.magic != STATE_ENVELOPE_MAGIC or env.envelope_version != ENVELOPE_VERSION:
        raise EngineError(Status.ERR_ENVELOPE_MISMATCH, "bad envelope magic or version")
    if env.space_kind != SpaceKind.PAGED_TOKEN_KV or env.encoding != Encoding.LOSSLESS:
        raise EngineError(Status.ERR_ENVELOPE_MISMATCH, "not a lossless paged-KV export")
    if env.payload_len != len(view) - ENVELOPE_BYTES:
        raise EngineError(
            Status.ERR_ENVELOPE_MISMATCH,
            f"payload_len {env.payload_len} but {len(view) - ENVELOPE_BYTES} bytes follow the envelope",
        )
    if env.range.start != 0 or env.range.end < 1:
        raise EngineError(Status.ERR_ENVELOPE_MISMATCH, "a KV export covers [0, n) with n >= 1")
    if env.compat_identity != identity or env.version_tag != STATE_VERSION_TAG:
        raise EngineError(Status.ERR_IDENTITY_MISMATCH, "export is from an incompatible engine or model")
    payload = view[ENVELOPE_BYTES:]
    if env.checksum_kind != ChecksumKind.XXH3_64:
        raise EngineError(Status.ERR_CHECKSUM, f"checksum kind {env.checksum_kind} is not verifiable here")
    if xxhash.xxh3_64_intdigest(payload) != env.content_checksum:
        raise EngineError(Status.ERR_CHECKSUM, "payload checksum mismatch")
    return env, payload
