"""Sequences and state ops of the llama.cpp engine (RULES.md section H, rules 69, 79, 85, 86):
sealed snapshots, restores, adoption, and a preempted lane coming back exactly in a fresh engine."""

from __future__ import annotations

import struct

import pytest
from lc_harness import admit, ignore_eos, make_prompt

from basertd.schema.abi import (
    STATE_ENVELOPE_MAGIC,
    ChecksumKind,
    DeterminismClass,
    Encoding,
    OpState,
    Sampling,
    SpaceKind,
    Status,
    Taint,
)
from basertd.schema.tick import (
    ENVELOPE_BYTES,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    StateEnvelope,
    TokenRange,
)
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.state import seal

SPACE = 0


def err(status, fn, *args):
    with pytest.raises(EngineError) as ex:
        fn(*args)
    assert ex.value.status == status, str(ex.value)


def rng(end, start=0):
    return TokenRange(start=start, end=end)


def snapshot_lane(eng, coord, tag):
    """Sealed export of a lane's whole KV (the op runs at the next tick)."""
    seq = eng.lane_sequence(tag)
    n = eng.lanes[tag].kv_len
    size, gen = eng.export_size(seq, SPACE, rng(n), Encoding.LOSSLESS)
    op = eng.snapshot(seq, SPACE, n, gen, size)
    assert eng.op_poll(op).state == OpState.RUNNING
    err(Status.EBUSY, eng.op_output, op)
    coord.tick()
    assert eng.op_poll(op).state == OpState.DONE
    data = eng.op_output(op)
    assert len(data) == size  # ABI rule 95
    return data


def run_lane(coord, tag, prompt, steps, **kw):
    """Admit + prefill + one token, then steps - 1 one-token ticks; returns the tokens."""
    ev = coord.tick(
        admits=[admit(tag, coord.prompt(prompt), **kw)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))],
        decodes=[LaneDecode(lane_tag=tag)],
    )
    out = coord.read(ev.emits[0].token_ref)
    while len(out) < steps:
        ev = coord.tick(decodes=[LaneDecode(lane_tag=tag)])
        out += coord.read(ev.emits[0].token_ref)
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_a_snapshot_restored_in_a_fresh_engine_continues_exactly(make_engine, sampled):
    """Preempt after k tokens: snapshot, restore into another engine (a respawned worker), adopt,
    re-admit with decode_replay = k: the continuation equals the uninterrupted lane's."""
    kw = {"params": ignore_eos()}
    if sampled:
        kw = {"params": ignore_eos(temperature=0.9, top_p=0.9), "sampling": Sampling.GPU_GUMBEL}
    base = 31 << 32
    prompt = make_prompt(1, 20)
    eng_a, coord_a = make_engine()
    first = run_lane(coord_a, 1, prompt, 6, rng_counter_base=base, **kw)
    data = snapshot_lane(eng_a, coord_a, 1)
    env = StateEnvelope.unpack(data)
    assert (env.magic, env.space_kind, env.range.end) == (STATE_ENVELOPE_MAGIC, SpaceKind.PAGED_TOKEN_KV, 25)
    assert env.checksum_kind == ChecksumKind.XXH3_64 and env.payload_len == len(data) - ENVELOPE_BYTES
    whole = list(first)
    while len(whole) < 16:
        ev = coord_a.tick(decodes=[LaneDecode(lane_tag=1)])
        whole = whole + coord_a.read(ev.emits[0].token_ref)

    eng_b, coord_b = make_engine()
    seq = eng_b.sequence_create()
    op = eng_b.restore(seq, SPACE, data)
    ev = coord_b.tick()  # the op runs at the next tick and is reported there [69]
    assert [(c.op, c.state) for c in ev.op_completions] == [(op, OpState.DONE)]
    assert eng_b.ledger.length(eng_b.sequences.bare[seq].seq) == 25
    lease = eng_b.seed_adopt(seq, coord_b.prompt(prompt + first[:5]))
    k = len(first)
    ev = coord_b.tick(
        admits=[
            admit(
                1,
                coord_b.prompt(prompt + first),
                seed_handle=lease,
                decode_replay=k,
                rng_counter_base=base + k,
                **kw,
            )
        ],
        decodes=[LaneDecode(lane_tag=1)],
    )
    resumed = coord_b.read(ev.emits[0].token_ref)
    while len(resumed) < 10:
        ev = coord_b.tick(decodes=[LaneDecode(lane_tag=1)])
        resumed += coord_b.read(ev.emits[0].token_ref)
    assert resumed == whole[k:]
    assert eng_b.stats()["prefill_tokens_total"] == 0  # nothing prefilled again


def test_envelope_refusals_change_nothing(lc, make_engine, tiny_gemma3_gguf):
    # ABI rules 101-104
    eng, coord = lc
    run_lane(coord, 1, make_prompt(2, 12), 1)
    data = snapshot_lane(eng, coord, 1)
    seq = eng.sequence_create()
    bad_env = Status.ERR_ENVELOPE_MISMATCH

    def patched(offset, fmt, value):
        b = bytearray(data)
        struct.pack_into(fmt, b, offset, value)
        return bytes(b)

    err(bad_env, eng.restore, seq, SPACE, data[:100])
    err(bad_env, eng.restore, seq, SPACE, patched(0, "<Q", 1))  # magic
    err(bad_env, eng.restore, seq, SPACE, patched(8, "<I", 2))  # envelope version
    err(bad_env, eng.restore, seq, SPACE, patched(12, "<I", SpaceKind.RECURRENT_BLOB))
    err(bad_env, eng.restore, seq, SPACE, data[:-1])  # payload_len != bytes supplied
    err(Status.ERR_IDENTITY_MISMATCH, eng.restore, seq, SPACE, patched(16, "<B", data[16] ^ 1))
    err(Status.ERR_IDENTITY_MISMATCH, eng.restore, seq, SPACE, patched(48, "<Q", 7))  # version_tag
    flipped = bytearray(data)
    flipped[-3] ^= 0x40
    err(Status.ERR_CHECKSUM, eng.restore, seq, SPACE, bytes(flipped))
    err(Status.ERR_CHECKSUM, eng.restore, seq, SPACE, patched(116, "<I", 0))  # checksum kind 0
    other, _ = make_engine(tiny_gemma3_gguf)
    err(Status.ERR_IDENTITY_MISMATCH, other.restore, other.sequence_create(), SPACE, data)
    assert eng.ledger.length(eng.sequences.bare[seq].seq) == 0
    # a well-sealed payload llama.cpp cannot read: the op fails, the target stays empty [104]
    junk = seal(b"\x01" * 64, identity=eng.identity, provenance=bytes(32), taint=0, n_tokens=4)
    op = eng.restore(seq, SPACE, junk)
    coord.tick()
    st = eng.op_poll(op)
    assert st.state == OpState.FAILED and st.error != 0
    assert eng.ledger.length(eng.sequences.bare[seq].seq) == 0
    assert eng.export_size(eng.lane_sequence(1), SPACE, rng(12), 0)[0] == len(data)


def test_export_sizing_and_op_lifecycle(lc):
    # ABI rules 92-100
    eng, coord = lc
    run_lane(coord, 1, make_prompt(3, 16), 1, params=ignore_eos())
    seq = eng.lane_sequence(1)
    err(Status.ERR_UNKNOWN_HANDLE, eng.export_size, seq, 3, rng(8), 0)  # [92]
    err(Status.ERR_UNKNOWN_HANDLE, eng.export_size, 999, SPACE, rng(8), 0)
    err(Status.ERR_OP_UNSUPPORTED, eng.export_size, seq, SPACE, rng(8), Encoding.Q8)
    err(Status.REJECT_BOUNDS, eng.export_size, seq, SPACE, rng(4, start=5), 0)  # [94]
    err(Status.REJECT_BOUNDS, eng.export_size, seq, SPACE, rng(17), 0)
    size, gen = eng.export_size(seq, SPACE, rng(16), 0)
    part, _ = eng.export_size(seq, SPACE, rng(8), 0)
    assert ENVELOPE_BYTES < part < size
    err(Status.ERR_BUFFER_TOO_SMALL, eng.snapshot, seq, SPACE, 16, gen, size - 1)  # [97]
    coord.tick(decodes=[LaneDecode(lane_tag=1)])
    err(Status.ERR_STALE_SIZING, eng.snapshot, seq, SPACE, 16, gen, size)  # [96]
    size, gen = eng.export_size(seq, SPACE, rng(16), 0)
    op1 = eng.snapshot(seq, SPACE, 16, gen, size)
    err(Status.EBUSY, eng.snapshot, seq, SPACE, 16, gen, size)  # [98]
    err(Status.EBUSY, eng.seq_fork, seq, 0)
    eng.op_cancel(op1)  # [100]
    assert eng.op_poll(op1).state == OpState.CANCELLED
    err(Status.ERR_UNKNOWN_HANDLE, eng.op_output, op1)
    op2 = eng.snapshot(seq, SPACE, 8, gen, size)  # the claim was released; a prefix export
    assert op2 > op1  # handles are never reused [99]
    ev = coord.tick()
    assert eng.op_poll(op2).state == OpState.DONE
    eng.op_cancel(op2)
    assert eng.op_poll(op2).state == OpState.DONE
    assert StateEnvelope.unpack(eng.op_output(op2)).range.end == 8
    err(Status.ERR_UNKNOWN_HANDLE, eng.op_output, op2)  # handed over once
    err(Status.ERR_UNKNOWN_HANDLE, eng.op_poll, 12345)
    assert [(c.op, c.state) for c in ev.op_completions] == [(op1, OpState.CANCELLED), (op2, OpState.DONE)]
    err(Status.ERR_OP_UNSUPPORTED, eng.demote, seq, SPACE, rng(8), 0, gen, size)
    err(Status.ERR_OP_UNSUPPORTED, eng.promote, seq, SPACE, rng(8), b"")


@pytest.mark.kv_layouts("unified")
def test_bare_sequences(lc):
    # ABI rules 86, 91, 109, 111, 112
    eng, coord = lc
    run_lane(coord, 1, make_prompt(4, 40), 1)
    data = snapshot_lane(eng, coord, 1)
    lane_seq = eng.lane_sequence(1)
    err(Status.ERR_UNKNOWN_HANDLE, eng.sequence_free, lane_seq)
    err(Status.ERR_UNKNOWN_HANDLE, eng.sequence_free, 4242)
    err(Status.ERR_UNKNOWN_HANDLE, eng.seed_adopt, lane_seq, coord.prompt(make_prompt(4, 40)))
    err(Status.EBUSY, eng.trim, lane_seq, SPACE, 4)
    fork = eng.seq_fork(lane_seq, 0)
    used = eng.ledger.used
    assert eng.ledger.length(eng.sequences.bare[fork].seq) == 40 and eng.ledger.used == used  # shared
    assert eng.sequences.bare[fork].pending == 1  # the lane's sampled token, KV not computed yet
    assert eng.snapshot_boundary(fork, SPACE, 1000) == 32
    assert eng.snapshot_boundary(fork, SPACE, 20) == 16
    err(Status.REJECT_BOUNDS, eng.trim, fork, SPACE, 42)
    eng.trim(fork, SPACE, 35)
    assert eng.sequences.bare[fork].pending == 0
    assert eng.ledger.length(eng.sequences.bare[fork].seq) == 35
    eng.sequence_free(fork)
    err(Status.ERR_UNKNOWN_HANDLE, eng.sequence_free, fork)
    assert eng.ledger.used == used

    seq = eng.sequence_create()
    op = eng.restore(seq, SPACE, data)
    coord.tick()
    assert eng.op_poll(op).state == OpState.DONE
    err(Status.ERR_SEED_UNSERVABLE, eng.seed_adopt, seq, coord.prompt(make_prompt(4, 39)))
    err(Status.ERR_OUT_OF_BOUNDARY, eng.sequence_publish, seq, make_prompt(4, 41))
    eng.sequence_publish(seq, make_prompt(4, 40))  # consumed; 32 tokens published
    err(Status.ERR_UNKNOWN_HANDLE, eng.sequence_free, seq)
    (entry,) = eng.cache.entries.values()
    assert entry.length == 32
    small = eng.sequence_create()
    eng.sequence_publish(small, [])  # sub-page: publishes nothing, still consumed
    err(Status.ERR_UNKNOWN_HANDLE, eng.sequence_free, small)
    assert len(eng.cache.entries) == 1
    for _ in range(eng.spare_sequences):
        eng.sequence_create()
    err(Status.EBUSY, eng.sequence_create)


def test_grammar_and_bias_handles(lc):
    # ABI rule 113
    eng, _ = lc
    g = eng.grammar_create('{"type": "object"}')
    assert g > 0
    eng.grammar_free(g)
    err(Status.ERR_UNKNOWN_HANDLE, eng.grammar_free, g)
    assert eng.logit_bias_create([], []) == 0
    assert eng.logit_bias_create([1, 2], [1.0]) == 0
    assert eng.logit_bias_create([eng.n_vocab], [1.0]) == 0
    h = eng.logit_bias_create([5], [2.0])
    assert h > 0
    eng.logit_bias_free(h)
    err(Status.ERR_UNKNOWN_HANDLE, eng.logit_bias_free, h)


def test_taint_travels_with_the_state(lc):
    # ABI rules 79, 85, 107
    eng, coord = lc
    prompt = make_prompt(5, 32)
    run_lane(coord, 1, prompt, 1)
    clean = snapshot_lane(eng, coord, 1)
    env = StateEnvelope.unpack(clean)
    tainted = seal(
        clean[ENVELOPE_BYTES:],
        identity=eng.identity,
        provenance=env.provenance_digest,
        taint=Taint.QUANTIZED_DEMOTION,
        n_tokens=32,
    )
    seq = eng.sequence_create()
    op = eng.restore(seq, SPACE, tainted)
    coord.tick()
    assert eng.op_poll(op).state == OpState.DONE
    eng.sequence_publish(seq, prompt)
    span = coord.prompt([*prompt, 7, 7])
    err(Status.ERR_SEED_UNSERVABLE, eng.seed_acquire, span, 32, DeterminismClass.DETERMINISTIC)
    h = eng.seed_acquire(span, 32, DeterminismClass.BEST_EFFORT)
    coord.tick(
        admits=[admit(2, coord.prompt([*prompt, 7, 7]), seed_handle=h)],
        prefills=[LanePrefill(lane_tag=2, token_offset=32, token_count=2)],
    )
    assert eng.lanes[2].taint == Taint.QUANTIZED_DEMOTION
    assert StateEnvelope.unpack(snapshot_lane(eng, coord, 2)).taint_bits == Taint.QUANTIZED_DEMOTION
    coord.tick(retires=[LaneRetire(lane_tag=2)])
