"""basertd.native.abi through a real dlopen of a scripted tick-ABI library (scripted_lib.c).

The scripted library is compiled here with the system compiler. It lets the binding be driven
against well-formed and deliberately malformed output from C, independently of the reference
engine (whose own binding tests are in test_abi_ref_engine.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from basertd.native import header_path
from basertd.native.abi import (
    TICK_FUNCTIONS,
    AbiError,
    ArgumentError,
    BasertLib,
    CapabilityReq,
    EventsMalformed,
    LibraryError,
    LibraryNotFound,
    MissingSymbols,
    PartialEmitCallbackError,
    PlanRejected,
    RingSpec,
    StrategyRegistration,
    TapSpec,
)
from basertd.schema.abi import Finish, OpState, SpaceKind, Status, TickFlag
from basertd.schema.tick import CacheKey, LaneDecode, ShedPolicy, TickPlan, TokenRange, TokenRef

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler on PATH to build the scripted library")

SCRIPTED_CDEF = """
void scripted_set_mode(int mode);
uint64_t scripted_last_plan_size(void);
uint32_t scripted_last_plan_flags(void);
uint32_t scripted_last_decodes(void);
"""
ECHO, MISALIGNED, NULL_DATA, SHORT_STRIDE, HUGE, NULL_EVENTS, BAD_SEQ, REJECT, LONG_STRIDE, SMALL_EVENTS = (
    range(10)
)


@pytest.fixture(scope="module")
def scripted_path(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("scripted") / "libscripted.so"
    src = Path(__file__).with_name("scripted_lib.c")
    cmd = [CC, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"]
    subprocess.run([*cmd, f"-I{Path(header_path()).parent}", str(src), "-o", str(out)], check=True)
    return str(out)


@pytest.fixture
def lib(scripted_path) -> BasertLib:
    lib = BasertLib(scripted_path, extra_cdef=SCRIPTED_CDEF)
    lib.lib.scripted_set_mode(ECHO)
    return lib


@pytest.fixture
def bundle(lib):
    with lib.bundle(0x1000) as b:
        yield b


def _plan(seq: int, n: int, tokens: int = 2) -> TickPlan:
    return TickPlan(
        plan_seq=seq,
        max_decode_lanes=n,
        decodes=[LaneDecode(lane_tag=100 + i, max_new_tokens=tokens) for i in range(n)],
    )


def test_tick_round_trip(bundle, lib):
    ev = bundle.tick(_plan(5, 3))
    assert ev.plan_seq == 5
    assert [e.lane_tag for e in ev.emits] == [100, 101, 102]
    assert [e.n_tokens for e in ev.emits] == [2, 2, 2]
    assert [e.token_ref.generation for e in ev.emits] == [1, 2, 3]
    assert all(e.finish == Finish.NONE for e in ev.emits)
    assert ev.mem.pool_blocks_total == 99 and ev.timings.wall_ns == 12345
    # No callback: the 152-byte legacy plan, PARTIAL_EMITS cleared even if the caller set it.
    assert lib.lib.scripted_last_plan_size() == 152
    bundle.tick(TickPlan(plan_seq=6, flags=TickFlag.PARTIAL_EMITS | TickFlag.CAPTURE_OK))
    assert lib.lib.scripted_last_plan_flags() == TickFlag.CAPTURE_OK


def test_partial_emits_reach_the_callback(bundle, lib):
    # ABI rule 64 through the binding: 168-byte plan, flag set, tokens copied out as uint32.
    got = []
    ev = bundle.tick(_plan(1, 2, tokens=3), on_partial_emit=lambda tag, toks: got.append((tag, toks)))
    assert lib.lib.scripted_last_plan_size() == 168
    assert lib.lib.scripted_last_plan_flags() & TickFlag.PARTIAL_EMITS
    assert [(t, a.tolist()) for t, a in got] == [(100, [100, 101, 102]), (101, [101, 102, 103])]
    assert all(a.dtype == np.uint32 for _, a in got)
    assert [e.n_tokens for e in ev.emits] == [3, 3]


def test_callback_exception_does_not_cross_into_c(bundle):
    calls = []

    def bad(tag, toks):
        calls.append(tag)
        raise RuntimeError("boom")

    with pytest.raises(PartialEmitCallbackError) as info:
        bundle.tick(_plan(1, 3), on_partial_emit=bad)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert calls == [100, 101, 102]  # C carried on; only the first exception is kept
    assert [e.lane_tag for e in info.value.events.emits] == [100, 101, 102]
    ev = bundle.tick(_plan(2, 1))  # the bundle is fine afterwards, with no stale error
    assert ev.plan_seq == 2


@pytest.mark.parametrize(
    ("mode", "where"),
    [
        (MISALIGNED, "events.emits"),
        (NULL_DATA, "events.emits"),
        (SHORT_STRIDE, "events.emits"),
        (HUGE, "events.emits"),
        (NULL_EVENTS, "events"),
        (SMALL_EVENTS, "events"),
        (BAD_SEQ, "events.plan_seq"),
    ],
)
def test_malformed_events_from_c_raise_typed_errors(bundle, lib, mode, where):
    lib.lib.scripted_set_mode(mode)
    with pytest.raises(EventsMalformed) as info:
        bundle.tick(_plan(3, 2))
    assert info.value.where == where


def test_longer_records_are_read_by_their_known_prefix(bundle, lib):
    # ABI rule 19 from the reader's side: an 80-byte LaneEmit with a garbage tail reads fine.
    lib.lib.scripted_set_mode(LONG_STRIDE)
    ev = bundle.tick(_plan(4, 3))
    assert [(e.lane_tag, e.n_tokens, e.token_ref.generation) for e in ev.emits] == [
        (100, 2, 1),
        (101, 2, 2),
        (102, 2, 3),
    ]


def test_plan_rejection_is_typed(bundle, lib):
    lib.lib.scripted_set_mode(REJECT)
    with pytest.raises(PlanRejected) as info:
        bundle.tick(_plan(1, 1))
    assert info.value.status is Status.REJECT_DUPLICATE_LANE


def test_bad_plan_never_reaches_c(bundle, lib):
    bundle.tick(_plan(1, 4))
    assert lib.lib.scripted_last_decodes() == 4
    with pytest.raises(ArgumentError):
        bundle.tick(TickPlan(plan_seq=2, decodes=[LaneDecode(lane_tag=-1)]))
    with pytest.raises(ArgumentError):
        bundle.tick(TickPlan(plan_seq=2, decodes=[LaneDecode(lane_tag=1, max_new_tokens=1 << 16)]))
    assert lib.lib.scripted_last_decodes() == 4


def test_no_arena_growth_once_warm(bundle):
    bundle.tick(_plan(1, 256))
    arena = bundle._arena
    grows, address = arena.grows, arena.address
    for i, n in enumerate([1, 64, 256, 8, 0, 256] * 10):
        bundle.tick(_plan(2 + i, n))
    assert (arena.grows, arena.address) == (grows, address)


def test_snapshot_output_is_owned_by_the_binding(bundle):
    seq = bundle.sequence_create()
    op = bundle.snapshot(seq, 0, 0, 0, 400)
    assert bundle.op_poll(op).state == OpState.DONE
    out = bundle.op_output(op)
    assert len(out) == 136 + 7 and out[:8] == b"BRTSTATE" and out[136:] == b"payload"
    with pytest.raises(ArgumentError):
        bundle.op_output(op)  # handed out once
    with pytest.raises(AbiError) as info:
        bundle.snapshot(seq, 0, 0, 0, 100)
    assert info.value.status is Status.ERR_BUFFER_TOO_SMALL
    assert not bundle._loans  # a refused submission keeps no buffer
    with pytest.raises(AbiError) as info:
        bundle.op_poll(999)
    assert info.value.status is Status.ERR_UNKNOWN_HANDLE


def test_sequence_ids(bundle):
    a, b = bundle.sequence_create(), bundle.sequence_create()
    assert a != b
    bundle.sequence_free(a)
    with pytest.raises(AbiError) as info:
        bundle.sequence_free(a)  # the id is gone; the binding answers without calling C
    assert info.value.status is Status.ERR_UNKNOWN_HANDLE
    assert bundle.lane_sequence(7) is None
    c = bundle.sequence_create()
    assert c not in (a, b)  # ids are never reused
    bundle.sequence_free(b)
    bundle.sequence_free(c)


def test_state_spaces_and_scalars(bundle, lib):
    (space,) = bundle.state_spaces()
    assert (space.name, space.kind, space.page_size_tokens) == ("kv", SpaceKind.PAGED_TOKEN_KV, 16)
    assert bundle.seed_lease_ticks() == 8
    with pytest.raises(AbiError) as info:
        bundle.seed_release(3)
    assert info.value.status is Status.ERR_UNKNOWN_HANDLE
    with pytest.raises(AbiError) as info:
        bundle.trim(bundle.sequence_create(), 0, 4)
    assert info.value.status is Status.ERR_OP_UNSUPPORTED
    lib.lib.scripted_set_mode(MISALIGNED)
    with pytest.raises(EventsMalformed):
        bundle.state_spaces()


def test_logit_bias_arguments(bundle):
    assert bundle.logit_bias_create([5, 7], [1.0, -2.0]) == 2
    assert bundle.logit_bias_create([], []) == 0
    with pytest.raises(ArgumentError):
        bundle.logit_bias_create([1, 2], [1.0])
    with pytest.raises(ArgumentError):
        bundle.grammar_create('{"a":\x00}')


def test_library_errors(tmp_path, scripted_path):
    with pytest.raises(LibraryNotFound):
        BasertLib(tmp_path / "absent.so")
    junk = tmp_path / "junk.so"
    junk.write_text("not an ELF file")
    with pytest.raises(LibraryError):
        BasertLib(junk)
    libc = next(
        (
            p
            for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6")
            if Path(p).exists()
        ),
        None,
    )
    if libc:
        with pytest.raises(MissingSymbols) as info:
            BasertLib(libc)
        assert sorted(info.value.missing) == sorted(TICK_FUNCTIONS)
    with pytest.raises(MissingSymbols) as info:
        BasertLib(scripted_path, extra_cdef="int scripted_not_there(void);")
    assert info.value.missing == ["scripted_not_there"]
    assert len(TICK_FUNCTIONS) == 34


def test_every_wrapper_reaches_c(bundle):
    # Each wrapper marshals its arguments (structs by value, arrays, strings, out pointers) and
    # reaches the library, which answers OP_UNSUPPORTED for everything it does not script.
    seq = bundle.sequence_create()
    span = TokenRef(ring_id=1, index=0, count=4, generation=1)
    rng = TokenRange(start=0, end=4)
    calls = {
        "rings_attach": lambda: bundle.rings_attach([RingSpec(1, 1, 1, 8, 64, 0x10000, 4096)]),
        "space_match": lambda: bundle.space_match(0xFFFFFFFF, span, [bytes(32)]),
        "seed_acquire": lambda: bundle.seed_acquire(span, 4, 0),
        "seed_adopt": lambda: bundle.seed_adopt(seq, span),
        "seq_fork": lambda: bundle.seq_fork(seq, 1),
        "export_size": lambda: bundle.export_size(seq, 0, rng, 0),
        "restore": lambda: bundle.restore(seq, 0, b"x" * 140),
        "snapshot_boundary": lambda: bundle.snapshot_boundary(seq, 0, 16),
        "demote": lambda: bundle.demote(seq, 0, rng, 1, 1, 512),
        "promote": lambda: bundle.promote(seq, 0, rng, b"y" * 140),
        "op_cancel": lambda: bundle.op_cancel(1),
        "cache_evict": lambda: bundle.cache_evict(ShedPolicy(victim_lanes=[1, 2], max_evict_bytes=10), 10),
        "cache_evict_entries": lambda: bundle.cache_evict_entries([CacheKey(), CacheKey()]),
        "sequence_publish": lambda: bundle.sequence_publish(seq, [1, 2, 3]),
        "media_probe": lambda: bundle.media_probe("/nonexistent.png"),
        "media_encode": lambda: bundle.media_encode("/nonexistent.png"),
        "media_release": lambda: bundle.media_release(1),
        "media_bind": lambda: bundle.media_bind(1, 1, 0),
        "strategy_register": lambda: bundle.strategy_register(
            StrategyRegistration(
                strategy_id="prompt-lookup",
                taps=[TapSpec(layer=0, tensor=1)],
                capabilities=[CapabilityReq(kind_id=1, params=bytes(16), param_elem_size=8)],
                target_archs=["x86", None],
            )
        ),
    }
    for name, call in calls.items():
        with pytest.raises(AbiError) as info:
            call()
        assert info.value.status is Status.ERR_OP_UNSUPPORTED, name
    assert not bundle._loans  # refused submissions hold no buffers
    assert bundle.grammar_create('{"type": "object"}') == 0
    assert bundle.grammar_create_structural("{}") == 0
    for free in (bundle.grammar_free, bundle.logit_bias_free):
        with pytest.raises(AbiError) as info:
            free(5)
        assert info.value.status is Status.ERR_UNKNOWN_HANDLE
    with pytest.raises(ArgumentError):
        bundle.sequence_publish(seq, [-1])
    with pytest.raises(ArgumentError):
        bundle.space_match(0, span, [b"short"])
