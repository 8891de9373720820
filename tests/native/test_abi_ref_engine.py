"""basertd.native.abi against the C reference engine: a tick round trip and every wrapper at
least once, each through the exact dlopen path a real libbaseRT takes."""

from __future__ import annotations

import numpy as np
import pytest
from ring_rig import RingRig, geometry

from basertd.native.abi import (
    AbiError,
    ArgumentError,
    CapabilityReq,
    PartialEmitCallbackError,
    PlanRejected,
    StrategyRegistration,
)
from basertd.native.ref import create_ref_bundle
from basertd.schema.abi import ALL_SPACES, AdmitStatus, Finish, SpaceKind, Status
from basertd.schema.tick import (
    CacheKey,
    LaneAdmit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    ShedPolicy,
    TickPlan,
    TokenRange,
    TokenRef,
)

PROMPT = list(range(10, 42))  # 32 tokens: two 16-token pages


def attached_rings(bundle, vocab: int = 512) -> RingRig:
    """Prompt (1, engine reads), emit (2) and logits (3) rings of one bundle, attached."""
    rig = RingRig(geometry(prompt_slots=64, emit_slots=256, logits_slots=8, vocab=vocab), name="abi-test")
    bundle.rings_attach(rig.specs)
    return rig


@pytest.fixture
def engine():
    """``(bundle, rings)`` of a default reference bundle; freed (bundle first) at teardown."""
    made = []

    def make(**config):
        b = create_ref_bundle(**config)
        r = attached_rings(b)
        made.append((b, r))
        return b, r

    yield make
    for b, r in made:
        b.close()
        r.close()


def _start(bundle, rings, tag: int, seq: int, decode: int = 4, tokens=PROMPT) -> tuple[TokenRef, object]:
    span = rings.prompt.write(np.asarray(tokens, np.uint32))
    plan = TickPlan(
        plan_seq=seq,
        prefill_token_budget=1 << 16,
        max_decode_lanes=1 if decode else 0,
        admits=[LaneAdmit(lane_tag=tag, prompt=span)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(tokens))],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=decode)] if decode else [],
    )
    return span, bundle.tick(plan)


def test_tick_round_trip_is_deterministic(engine):
    outs = []
    for _ in range(2):
        b, r = engine()
        _, ev = _start(b, r, tag=7, seq=1)
        assert ev.plan_seq == 1
        assert [(a.lane_tag, a.status) for a in ev.admit_results] == [(7, AdmitStatus.ADMITTED)]
        (emit,) = ev.emits
        assert (emit.lane_tag, emit.n_tokens, emit.finish) == (7, 4, Finish.NONE)
        assert emit.logits_row.generation == 0  # a GPU lane has no row (rule 65)
        outs.append(r.emit.read(emit.token_ref).tolist())
        assert ev.mem.pool_blocks_used > 0
    assert outs[0] == outs[1] and len(outs[0]) == 4  # rule 63 through the binding


def test_partial_emits_and_callback_errors(engine):
    b, r = engine()
    got: list[int] = []
    span = r.prompt.write(np.asarray(PROMPT, np.uint32))
    plan = TickPlan(
        plan_seq=1,
        prefill_token_budget=64,
        max_decode_lanes=1,
        admits=[LaneAdmit(lane_tag=1, prompt=span)],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=32)],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=3)],
    )
    ev = b.tick(plan, on_partial_emit=lambda tag, toks: got.extend(toks.tolist()))
    assert got == r.emit.read(ev.emits[0].token_ref).tolist()  # rule 64
    decode = TickPlan(plan_seq=2, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=1, max_new_tokens=2)])

    def boom(tag, toks):
        raise ValueError("callback failed")

    with pytest.raises(PartialEmitCallbackError) as info:
        b.tick(decode, on_partial_emit=boom)
    assert info.value.events.emits[0].n_tokens == 2  # the tick itself completed
    assert b.stats()["decode_tokens_total"] == 5
    b.tick(TickPlan(plan_seq=3, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=1)]))


def test_tick_raw_runs_a_hand_edited_plan(engine):
    b, r = engine()
    span = r.prompt.write(np.asarray(PROMPT, np.uint32))
    ptr = b.encode_plan(TickPlan(plan_seq=1, admits=[LaneAdmit(lane_tag=1, prompt=span)]))
    ptr.admits.elem_size = 128  # below the 136-byte v1 prefix (rule 17)
    status, _ = b.tick_raw(ptr)
    assert status == Status.REJECT_BAD_STRIDE
    assert b.stats()["ticks"] == 0
    ptr.admits.elem_size = 144
    status, address = b.tick_raw(ptr)
    assert status == Status.OK
    ev = b.read_events(address)
    assert ev.plan_seq == 1 and ev.admit_results[0].lane_tag == 1


def test_rejections_are_typed(engine):
    b, _ = engine()
    with pytest.raises(PlanRejected) as info:
        b.tick(TickPlan(plan_seq=1, max_decode_lanes=1, decodes=[LaneDecode(lane_tag=9)]))
    assert info.value.status is Status.REJECT_UNKNOWN_LANE
    with pytest.raises(ArgumentError):
        b.tick(TickPlan(plan_seq=1, max_decode_lanes=-1))
    assert b.stats()["ticks"] == 0


def test_rings_attach_layout_error(engine):
    b, r = engine()
    bad = [r.specs[0]._replace(slots=r.specs[0].slots + 1), *r.specs[1:]]
    with pytest.raises(AbiError) as info:
        b.rings_attach(bad)
    assert info.value.status is Status.ERR_RING_LAYOUT
    b.rings_attach(r.specs)  # still attachable afterwards


def test_state_spaces(engine):
    b, _ = engine()
    (space,) = b.state_spaces()
    assert (space.space_id, space.kind, space.name) == (0, SpaceKind.PAGED_TOKEN_KV, "kv")
    assert (space.page_size_tokens, space.bytes_per_token) == (16, 64)


def test_sequences_cache_and_seeds(engine):
    b, r = engine()
    span, _ = _start(b, r, tag=1, seq=1, decode=0)
    lane_seq = b.lane_sequence(1)
    assert lane_seq is not None and b.lane_sequence(1) == lane_seq  # stable id
    assert b.lane_sequence(99) is None
    with pytest.raises(AbiError) as info:
        b.sequence_free(lane_seq)  # lane-owned (rule 112)
    assert info.value.status is Status.ERR_UNKNOWN_HANDLE
    with pytest.raises(AbiError) as info:
        b.seed_adopt(lane_seq, span)  # lane-owned (rule 86)
    assert info.value.status is Status.ERR_UNKNOWN_HANDLE

    child = b.seq_fork(lane_seq, 0)
    assert child != lane_seq
    adopt = b.seed_adopt(child, span)
    assert adopt > 0
    b.seed_release(adopt)  # hands the sequence back
    b.sequence_publish(child, PROMPT)  # consumes it (rule 91)
    with pytest.raises(AbiError):
        b.sequence_free(child)

    match = b.space_match(ALL_SPACES, span)
    (space,) = match.spaces
    lens = [c.prefix_len for c in space.candidates]
    assert max(lens) == 32 and all(n % 16 == 0 for n in lens)  # rule 88
    assert b.seed_lease_ticks() == 8
    seed = b.seed_acquire(span, 32, 0)
    b.seed_release(seed)
    with pytest.raises(AbiError) as info:
        b.seed_release(seed)
    assert info.value.status is Status.ERR_UNKNOWN_HANDLE

    bare = b.sequence_create()
    b.sequence_free(bare)
    freed = b.cache_evict(ShedPolicy(evictable_cache_classes=1, max_evict_bytes=1 << 30), 1 << 30)
    assert freed == 32 * 64
    assert b.space_match(ALL_SPACES, span).spaces[0].candidates == []
    b.cache_evict_entries([CacheKey()])  # an absent key drops nothing
    b.tick(TickPlan(plan_seq=2, retires=[LaneRetire(lane_tag=1)]))
    assert b.lane_sequence(1) is None


def test_grammar_and_logit_bias(engine):
    b, _ = engine()
    g = b.grammar_create('{"type": "object"}')
    s = b.grammar_create_structural('{"begin": "<f>"}')
    assert g and s and g != s
    assert b.grammar_create("not json") == 0
    b.grammar_free(g)
    b.grammar_free(s)
    with pytest.raises(AbiError) as info:
        b.grammar_free(g)
    assert info.value.status is Status.ERR_UNKNOWN_HANDLE
    h = b.logit_bias_create([3, 4], [1.5, -2.0])
    assert h
    assert b.logit_bias_create([], []) == 0  # rule 113
    b.logit_bias_free(h)
    with pytest.raises(AbiError):
        b.logit_bias_free(h)


def test_media_strategy_and_ops_refusals(engine):
    b, _ = engine()
    for call in (
        lambda: b.media_probe("/tmp/none.png"),
        lambda: b.media_encode("/tmp/none.png"),
    ):
        with pytest.raises(AbiError) as info:
            call()
        assert info.value.status is Status.ERR_OP_UNSUPPORTED  # no vision tower (basert_ref.h)
    with pytest.raises(AbiError):
        b.media_release(1)
    with pytest.raises(AbiError):
        b.media_bind(1, 1, 0)
    with pytest.raises(AbiError) as info:
        b.strategy_register(StrategyRegistration("x", capabilities=[CapabilityReq(kind_id=999)]))
    assert info.value.status is Status.ERR_REGISTRATION_REFUSED  # unknown kind (rule 114)
    with pytest.raises(AbiError) as info:
        b.op_poll(12345)
    assert info.value.status is Status.ERR_UNKNOWN_HANDLE  # rule 99


def test_state_op_wrappers(engine):
    b, r = engine()
    _start(b, r, tag=1, seq=1, decode=0)
    seq = b.seq_fork(b.lane_sequence(1), 0)
    try:
        need, gen = b.export_size(seq, 0, TokenRange(start=0, end=32), 0)
    except AbiError as e:
        if e.status is Status.ERR_OP_UNSUPPORTED:
            pytest.skip(
                "the reference engine does not implement state ops yet (ops.c answers OP_UNSUPPORTED)"
            )
        raise
    assert need > 136
    op = b.snapshot(seq, 0, 32, gen, need)
    while b.op_poll(op).state not in (2, 3, 4):
        b.tick(TickPlan(plan_seq=2))
    data = b.op_output(op)
    assert len(data) == need and data[:8] == b"BRTSTATE"  # rule 95
    target = b.sequence_create()
    op2 = b.restore(target, 0, data)
    assert b.op_poll(op2).state in (0, 1, 2)
    assert b.snapshot_boundary(seq, 0, 32) == 32
    b.trim(seq, 0, 16)
    need, gen = b.export_size(seq, 0, TokenRange(start=0, end=16), 0)
    op3 = b.demote(seq, 0, TokenRange(start=0, end=16), 0, gen, need)
    b.op_cancel(op3)
    with pytest.raises(AbiError):
        b.promote(seq, 0, TokenRange(start=16, end=32), data)


def test_empty_key_and_media_arrays_are_the_rule_21_empty_array():
    """An empty ``cache_evict_entries`` list is marshalled as (NULL, 0, 0), which every engine
    must accept (ABI rule 21), not as a zero-count array with a stride (BAD_STRIDE, rule 24)."""
    from basertd.native.ref import RefConfig, create_ref_bundle

    bundle = create_ref_bundle(RefConfig())
    try:
        bundle.cache_evict_entries([])
    finally:
        bundle.close()
