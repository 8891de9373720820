"""RULES.md section J: the BRTRING1 rings as the engine reads and writes them, rules 123-130.

The ring code itself (native/brt_ring.c) has its own tests in tests/shm; these check the engine:
that it reads prompts and writes emits and logits rows at the documented offsets, refuses bad
descriptors all-or-nothing, and follows the generation rules.
"""

from __future__ import annotations

import struct
import threading

import pytest
from lanekit import EMIT_RING, PROMPT_RING, D, P

from basertd.native.abi import AbiError, RingSpec
from basertd.schema.abi import RING_MAGIC, RingKind, RingRole, Status
from basertd.schema.tick import TokenRef
from basertd.shm.errors import StaleRef
from basertd.shm.ring import RingWriter, ring_bytes, slot_bytes_for
from basertd.shm.segment import Segment

TOKENS = RingKind.TOKENS
WRITES = RingRole.ENGINE_WRITES


def _raw(seg: Segment, off: int, n: int) -> bytes:
    return bytes(seg.buffer[off : off + n])


def _fresh(rig, ring_id: int, slots: int = 8, elems: int = 8, kind=TOKENS, header_id: int | None = None):
    """A formatted ring segment (owned by the rig) and a descriptor of it."""
    sb = slot_bytes_for(elems)
    seg = Segment.create(ring_bytes(slots, sb), name="conformance")
    rig.segments.append(seg)
    RingWriter.create(seg, ring_id if header_id is None else header_id, kind, slots, sb).close()
    return seg, RingSpec(ring_id, kind, WRITES, slots, sb, seg.address, seg.length)


# ABI rule 123
def test_rule_123_ring_header_layout(rig):
    seg = rig.segments[1]  # the emit ring the engine attached
    head = _raw(seg, 0, 64)
    assert head[:8] == bytes.fromhex("31474E4952545242")
    assert struct.unpack_from("<QIII", head) == (RING_MAGIC, EMIT_RING, rig.emit.slot_bytes, rig.emit.slots)
    assert head[20:] == bytes(44)
    # The engine's first emit lands in slot 0, which starts right after the header.
    events = rig.start(1, [5, 6, 7], decode=3)
    assert rig.emit_of(events, 1).token_ref.index == 0
    gen, n = struct.unpack_from("<QI", _raw(seg, 64, 12))
    assert (gen, n) == (1, 12)


# ABI rule 124
def test_rule_124_slot_layout(make_rig):
    rig = make_rig(rig_kw=dict(token_slot_elems=4, emit_slots=8))
    seg, sb = rig.segments[1], rig.emit.slot_bytes
    assert sb == 16 + 4 * 4
    events = rig.start(1, [5, 6, 7], decode=6)  # two slots: 4 tokens, then 2
    tokens = rig.emitted(events, 1)
    for i, chunk in enumerate((tokens[:4], tokens[4:])):
        base = 64 + i * sb
        gen, length, pad = struct.unpack_from("<QII", _raw(seg, base, 16))
        assert (gen, length, pad) == (1 + i, 4 * len(chunk), 0)
        assert list(struct.unpack_from(f"<{len(chunk)}I", _raw(seg, base + 16, 4 * len(chunk)))) == chunk


@pytest.mark.parametrize(
    "bad", ["magic", "ring_id", "slot_bytes", "slots", "short len", "misaligned", "struct_size"]
)
# ABI rule 125
def test_rule_125_bad_descriptor_attaches_nothing(rig, bad):
    rig.start(1, [5, 6, 7], decode=1)
    replacement, good = _fresh(rig, EMIT_RING)  # would replace the emit ring
    seg, spec = _fresh(rig, 7, header_id=8 if bad == "ring_id" else None)
    ffi = rig.bundle.ffi
    if bad == "magic":
        seg.buffer[0] ^= 0xFF
    elif bad == "slot_bytes":
        spec = spec._replace(slot_bytes=spec.slot_bytes + 8, length=spec.length + 64)
    elif bad == "slots":
        spec = spec._replace(slots=spec.slots - 1)
    elif bad == "short len":
        spec = spec._replace(length=ring_bytes(spec.slots, spec.slot_bytes) - 1)
    elif bad == "misaligned":
        spec = spec._replace(address=spec.address + 4)
    if bad == "struct_size":
        descs = ffi.new("BaseRTRingDesc[2]")
        for d, s in zip(descs, (good, spec), strict=True):
            d.struct_size, d.ring_id, d.kind, d.role = 48, s.ring_id, s.kind, s.role
            d.slots, d.slot_bytes, d.base, d.len = (
                s.slots,
                s.slot_bytes,
                ffi.cast("void *", s.address),
                s.length,
            )
        descs[1].struct_size = 40
        status = rig.bundle.lib.baseRT_rings_attach(rig.bundle.handle, descs, 2)
    else:
        with pytest.raises(AbiError) as info:
            rig.bundle.rings_attach([good, spec])
        status = info.value.status
    assert status == Status.ERR_RING_LAYOUT
    # All or nothing: the emit ring was not replaced.
    events = rig.tick(decodes=[D(1, 2)])
    assert len(rig.emitted(events, 1)) == 2
    assert _raw(replacement, 64, 8) == bytes(8)


# ABI rule 126
def test_rule_126_generations_count_up_and_indices_wrap(make_rig):
    rig = make_rig(rig_kw=dict(token_slot_elems=2, emit_slots=4))
    rig.start(1, [5, 6, 7])
    refs = []
    for _ in range(10):
        emit = rig.emit_of(rig.tick(decodes=[D(1, 1)]), 1)
        refs.append((emit.token_ref.index, emit.token_ref.generation))
    assert refs == [((g - 1) % 4, g) for g in range(1, 11)]


@pytest.mark.parametrize("where", ["admit", "space_match", "seed_acquire"])
# ABI rule 127
def test_rule_127_generation_zero_never_resolves(rig, where):
    # Slot 5 of the prompt ring was never written: its stored generation is 0 as well.
    ghost = TokenRef(ring_id=PROMPT_RING, index=5, count=1, generation=0)
    assert rig.prompt.slot_generation(5) == 0
    if where == "admit":
        rig.rejects(Status.REJECT_BAD_REF_GENERATION, [rig.admit(1, ghost)], prefills=[P(1, 0, 1)])
        return
    with pytest.raises(AbiError) as info:
        if where == "space_match":
            rig.bundle.space_match(0, ghost)
        else:
            rig.bundle.seed_acquire(ghost, 1, 0)
    assert info.value.status == Status.REJECT_BAD_REF_GENERATION


# ABI rule 128
def test_rule_128_ref_is_stale_after_slots_writes(rig):
    span = rig.put([5, 6, 7])
    for _ in range(rig.prompt.slots - 1):
        rig.put([1])
    # slots - 1 later writes: still current.
    events = rig.tick([rig.admit(1, span)], prefills=[P(1, 0, 3)])
    assert events.admit_results[0].status == 1
    rig.put([1])  # the slots-th write recycles it
    rig.rejects(Status.REJECT_BAD_REF_GENERATION, [rig.admit(2, span)], prefills=[P(2, 0, 3)])


# ABI rule 129
def test_rule_129_concurrent_reader_sees_whole_payloads(make_rig):
    spans, most, width = 300, 500, 8
    script = [3 + (j % 200) for j in range(most) for _ in range(width)]  # each span: 8 equal ids
    rig = make_rig(
        scripted_tokens=script, context_length=4096, rig_kw=dict(token_slot_elems=width, emit_slots=2)
    )
    reader, stop = rig.emit, threading.Event()
    whole, stale, torn = [0], [0], []

    running = threading.Event()

    def read_loop():
        running.set()
        while not stop.is_set():
            for index in (0, 1):
                gen = reader.slot_generation(index)
                if not gen:
                    continue
                try:
                    got = reader.read(TokenRef(ring_id=EMIT_RING, index=index, count=width, generation=gen))
                except StaleRef:
                    stale[0] += 1
                    continue
                whole[0] += 1
                if len(set(got.tolist())) != 1:
                    torn.append(got.tolist())

    thread = threading.Thread(target=read_loop)
    rig.start(1, [5, 6, 7])
    thread.start()
    running.wait(10)
    try:
        for _ in range(spans):
            rig.tick(decodes=[D(1, width)])
        # On a loaded box the reader thread may not have been scheduled during those ticks: keep
        # writing until it has read whole payloads (within the script and the context).
        for _ in range(most - spans):
            if whole[0] >= 10:
                break
            rig.tick(decodes=[D(1, width)])
    finally:
        stop.set()
        thread.join()
    assert not torn, f"torn payloads: {torn[:3]}"
    assert whole[0] > 0


@pytest.mark.parametrize("memory", ["fresh ring", "same ring"])
# ABI rule 130
def test_rule_130_reattach_restarts_generations(rig, memory):
    rig.start(1, [5, 6, 7])
    for _ in range(3):
        rig.tick(decodes=[D(1, 1)])
    if memory == "fresh ring":
        seg, spec = _fresh(rig, EMIT_RING, slots=rig.emit.slots, elems=(rig.emit.slot_bytes - 16) // 4)
    else:
        spec = rig.specs[1]
    rig.bundle.rings_attach([spec])
    emit = rig.emit_of(rig.tick(decodes=[D(1, 2)]), 1)
    assert (emit.token_ref.index, emit.token_ref.generation) == (0, 1)
    if memory == "fresh ring":
        gen, n = struct.unpack_from("<QI", _raw(seg, 64, 12))
        assert (gen, n) == (1, 8)
