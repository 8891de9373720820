"""Plan marshalling (basertd.native._plan.PlanArena): every field lands where C reads it, pads
are zero, arrays are 8-byte aligned, and a warm arena never reallocates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.native._layout import tick_ffi
from basertd.native._plan import PlanArena
from basertd.native.abi import ArgumentError
from basertd.schema.abi import TickFlag
from basertd.schema.tick import (
    LaneAdmit,
    LaneCommit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    SamplingParams,
    ShedPolicy,
    TickPlan,
    TokenRef,
)

FFI = tick_ffi()
IDENT = bytes(range(1, 33))


def _admit(tag: int) -> LaneAdmit:
    return LaneAdmit(
        lane_tag=tag,
        prompt=TokenRef(ring_id=1, index=7, count=12, generation=3),
        seed_handle=44,
        sampling=2,
        logit_bias_handle=5,
        params=SamplingParams(
            temperature=0.75,
            top_p=0.5,
            min_p=0.25,
            top_k=40,
            freq_penalty=0.125,
            presence_penalty=1.5,
            repeat_penalty=1.25,
            flags=1,
        ),
        rng_counter_base=2**63 + 1,
        grammar_handle=6,
        strategy_slot=2,
        determinism_class=1,
        minimum_exactness=2,
        allow_approximate=1,
        want_logprobs=3,
        required_cert_id=9,
        host_sampler_identity=IDENT,
        grammar_replay=4,
        decode_replay=5,
    )


def _full_plan() -> TickPlan:
    return TickPlan(
        plan_seq=42,
        flags=TickFlag.CAPTURE_OK,
        prefill_token_budget=512,
        max_decode_lanes=8,
        admits=[_admit(1), _admit(2)],
        commits=[LaneCommit(lane_tag=3, token_id=17, logits_nonce=2**40)],
        prefills=[LanePrefill(lane_tag=1, token_offset=0, token_count=12)],
        decodes=[LaneDecode(lane_tag=4, max_new_tokens=16, overshoot=3)],
        retires=[LaneRetire(lane_tag=5, publish_to_cache=1)],
        shed_policy=ShedPolicy(
            victim_lanes=[9, 8],
            evictable_cache_classes=6,
            protected_quota_bytes=2**64 - 1,
            max_evict_bytes=1 << 20,
        ),
    )


def _records(arr, ctype: str):
    assert arr.elem_size == FFI.sizeof(ctype)
    assert int(FFI.cast("uintptr_t", arr.data)) % 8 == 0  # ABI rule 20
    return FFI.cast(ctype + " *", arr.data), arr.count


def test_every_field_lands_where_c_reads_it():
    arena = PlanArena(FFI)
    p = arena.encode(_full_plan())
    assert (p.struct_size, p.plan_seq, p.flags) == (152, 42, TickFlag.CAPTURE_OK)
    assert (p.prefill_token_budget, p.max_decode_lanes) == (512, 8)
    a, n = _records(p.admits, "BaseRTLaneAdmit")
    assert n == 2 and a[1].lane_tag == 2
    x = a[0]
    assert (x.prompt.ring_id, x.prompt.index, x.prompt.count, x.prompt.generation) == (1, 7, 12, 3)
    assert (x.seed_handle, x.sampling, x.logit_bias_handle) == (44, 2, 5)
    sp = x.params
    assert (sp.temperature, sp.top_p, sp.min_p, sp.top_k) == (0.75, 0.5, 0.25, 40)
    assert (sp.freq_penalty, sp.presence_penalty, sp.repeat_penalty, sp.flags) == (0.125, 1.5, 1.25, 1)
    assert (x.rng_counter_base, x.grammar_handle, x.strategy_slot) == (2**63 + 1, 6, 2)
    assert (x.determinism_class, x.minimum_exactness, x.allow_approximate, x.want_logprobs) == (1, 2, 1, 3)
    assert x.required_cert_id == 9 and bytes(FFI.buffer(x.host_sampler_identity)) == IDENT
    assert (x.grammar_replay, x.decode_replay) == (4, 5)
    c, _ = _records(p.commits, "BaseRTLaneCommit")
    assert (c[0].lane_tag, c[0].token_id, c[0].logits_nonce) == (3, 17, 2**40)
    f, _ = _records(p.prefills, "BaseRTLanePrefill")
    assert (f[0].lane_tag, f[0].token_offset, f[0].token_count) == (1, 0, 12)
    d, _ = _records(p.decodes, "BaseRTLaneDecode")
    assert (d[0].lane_tag, d[0].max_new_tokens, d[0].overshoot) == (4, 16, 3)
    r, _ = _records(p.retires, "BaseRTLaneRetire")
    assert (r[0].lane_tag, r[0].publish_to_cache) == (5, 1)
    pol = p.shed_policy
    v = FFI.cast("uint64_t *", pol.victim_lanes.data)
    assert (pol.victim_lanes.count, pol.victim_lanes.elem_size, v[0], v[1]) == (2, 8, 9, 8)
    assert (pol.evictable_cache_classes, pol.protected_quota_bytes, pol.max_evict_bytes) == (
        6,
        2**64 - 1,
        1 << 20,
    )
    assert p.on_partial_emit == FFI.NULL and p.partial_emit_user == FFI.NULL


def test_pads_are_zero_even_over_stale_bytes():
    arena = PlanArena(FFI)
    FFI.buffer(arena._mem)[:] = b"\xff" * arena.capacity  # what an earlier, larger plan might leave
    p = arena.encode(_full_plan())
    a, _ = _records(p.admits, "BaseRTLaneAdmit")
    assert a[0].prompt._pad0 == 0
    c, _ = _records(p.commits, "BaseRTLaneCommit")
    assert c[0]._pad0 == 0
    d, _ = _records(p.decodes, "BaseRTLaneDecode")
    assert d[0]._pad1 == 0
    r, _ = _records(p.retires, "BaseRTLaneRetire")
    assert list(r[0]._pad0) == [0] * 7
    assert p._pad0 == 0


def test_empty_arrays_and_partial_emit_tail():
    arena = PlanArena(FFI)
    p = arena.encode(TickPlan(plan_seq=1, flags=TickFlag.PARTIAL_EMITS), partial_emit=0x1234, partial_user=7)
    assert p.struct_size == 168 and p.flags == TickFlag.PARTIAL_EMITS
    assert int(FFI.cast("uintptr_t", p.on_partial_emit)) == 0x1234
    assert int(FFI.cast("uintptr_t", p.partial_emit_user)) == 7
    for name in ("admits", "commits", "prefills", "decodes", "retires"):
        arr = getattr(p, name)
        assert arr.data == FFI.NULL and arr.count == 0  # ABI rule 21
    p = arena.encode(TickPlan(plan_seq=2, flags=TickFlag.PARTIAL_EMITS | TickFlag.DRAIN))
    assert p.struct_size == 152 and p.flags == TickFlag.DRAIN


def test_growth_is_geometric_and_never_shrinks():
    arena = PlanArena(FFI)
    big = TickPlan(
        plan_seq=1,
        admits=[_admit(i) for i in range(300)],
        decodes=[LaneDecode(lane_tag=i) for i in range(300)],
    )
    arena.encode(big)
    cap, grows, address = arena.capacity, arena.grows, arena.address
    assert cap >= 168 + 300 * 144 + 300 * 16
    arena.encode(TickPlan(plan_seq=2))
    arena.encode(big)
    assert (arena.capacity, arena.grows, arena.address) == (cap, grows, address)


@pytest.mark.parametrize(
    "plan",
    [
        TickPlan(plan_seq=-1),
        TickPlan(plan_seq=1, max_decode_lanes=2**32),
        TickPlan(plan_seq=1, admits=[LaneAdmit(lane_tag=1, host_sampler_identity=b"short")]),
        TickPlan(plan_seq=1, admits=[LaneAdmit(lane_tag=1, determinism_class=256)]),
        TickPlan(plan_seq=1, commits=[LaneCommit(lane_tag="x")]),
        TickPlan(plan_seq=1, shed_policy=ShedPolicy(victim_lanes=[-3])),
        TickPlan(plan_seq=1, retires=[LaneRetire(lane_tag=1, publish_to_cache=-1)]),
    ],
)
def test_values_that_do_not_fit_raise_argument_error(plan):
    with pytest.raises(ArgumentError):
        PlanArena(FFI).encode(plan)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**16 - 1), st.integers(0, 2**16 - 1)),
        max_size=300,
    ),
    st.lists(st.integers(0, 2**64 - 1), max_size=20),
)
def test_decodes_and_victims_round_trip(decodes, victims):
    arena = PlanArena(FFI)
    plan = TickPlan(
        plan_seq=1,
        decodes=[LaneDecode(lane_tag=t, max_new_tokens=m, overshoot=o) for t, m, o in decodes],
        shed_policy=ShedPolicy(victim_lanes=victims),
    )
    p = arena.encode(plan)
    d = FFI.cast("BaseRTLaneDecode *", p.decodes.data)
    assert [(d[i].lane_tag, d[i].max_new_tokens, d[i].overshoot) for i in range(p.decodes.count)] == decodes
    v = FFI.cast("uint64_t *", p.shed_policy.victim_lanes.data)
    assert [v[i] for i in range(p.shed_policy.victim_lanes.count)] == victims
