"""Random plan streams against the llama.cpp engine on the tiny model: whatever the plan, the
engine either runs it or rejects it with a plan-rejection status and no state change, never
crashes, and its bookkeeping always matches what llama.cpp holds (RULES.md
preamble)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from lc_harness import Coordinator, admit, ignore_eos, make_prompt
from test_llamacpp_validate import fingerprint

from basertd.schema.tick import LaneCommit, LaneDecode, LanePrefill, LaneRetire, ShedPolicy
from basertd.worker.engines.base import EngineError, PlanRejected
from basertd.worker.engines.llamacpp import LlamaCppEngine

TAGS = [1, 2, 3, 4, 5]
U64 = (1 << 64) - 1

record = st.one_of(
    st.tuples(
        st.just("admit"),
        st.sampled_from(TAGS),
        st.integers(1, 40),
        st.sampled_from([0, 0, 2]),
        st.integers(0, 3),
        st.booleans(),
    ),
    st.tuples(st.just("prefill"), st.sampled_from(TAGS), st.integers(-2, 2), st.integers(0, 30)),
    st.tuples(st.just("decode"), st.sampled_from(TAGS), st.integers(0, 6)),
    st.tuples(st.just("retire"), st.sampled_from(TAGS), st.booleans()),
    st.tuples(st.just("commit"), st.sampled_from(TAGS), st.integers(0, 300), st.booleans()),
)
plan_strategy = st.lists(st.lists(record, max_size=5), min_size=1, max_size=14)


def check_bookkeeping(eng):
    """Every lane's KV as llama.cpp reports it equals the engine's cursors and ledger."""
    for lane in eng.lanes.values():
        pmin, pmax = eng.cells.pos_range(lane.seq)
        assert pmax == lane.kv_len - 1
        assert pmin == (0 if lane.kv_len else -1)
        assert eng.ledger.length(lane.seq) == lane.kv_len
        assert lane.kv_len <= lane.n_tokens <= eng.context_length
    for e in eng.cache.entries.values():
        assert eng.cells.pos_range(e.seq) == (0, e.length - 1) and eng.ledger.length(e.seq) == e.length
    charged = sum(ln.pending_tokens for ln in eng.lanes.values())
    assert eng.ledger.used + charged <= eng.n_cells


@pytest.fixture(scope="module")
def fuzz_engine(tiny_gguf):
    eng = LlamaCppEngine(
        tiny_gguf, lanes=4, context_length=64, pool_tokens=160, cache_sequences=2, n_threads=1
    )
    coord = Coordinator(eng, emit_slots=64)
    yield eng, coord
    eng.close()
    coord.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=plan_strategy)
def test_random_plans_never_crash_or_corrupt(fuzz_engine, plans):
    eng, coord = fuzz_engine
    for t in list(eng.lanes) + list(eng.faulted):  # start from no lanes
        coord.tick(retires=[LaneRetire(lane_tag=t)])
    for records in plans:
        kw: dict = {"admits": [], "prefills": [], "decodes": [], "retires": [], "commits": []}
        used: set[tuple[str, int]] = set()
        for r in records:
            kind, tag = r[0], r[1]
            live = sorted(eng.lanes)
            if kind != "admit" and live and tag != TAGS[-1]:
                tag = live[tag % len(live)]  # mostly records about lanes that exist
            if (kind, tag) in used:
                continue  # duplicates are covered by test_llamacpp_validate; keep plans plausible
            used.add((kind, tag))
            lane = eng.lanes.get(tag)
            if kind == "admit":
                _, _, n, sampling, replay, seeded = r
                seed = 0
                prompt = make_prompt(tag, n)
                if seeded and n >= 16 and eng.cache.entries:
                    try:
                        seed = eng.seed_acquire(coord.prompt(prompt), 16, 0)
                    except EngineError:
                        seed = 0
                kw["admits"].append(
                    admit(
                        tag,
                        coord.prompt(prompt),
                        seed_handle=seed,
                        sampling=sampling,
                        decode_replay=replay,
                        params=ignore_eos(temperature=0.7),
                        rng_counter_base=tag << 32,
                    )
                )
            elif kind == "prefill":
                base = lane.prefilled if lane else 0
                kw["prefills"].append(
                    LanePrefill(lane_tag=tag, token_offset=max(0, base + r[2]), token_count=r[3])
                )
            elif kind == "decode":
                kw["decodes"].append(LaneDecode(lane_tag=tag, max_new_tokens=r[2]))
            elif kind == "retire":
                kw["retires"].append(LaneRetire(lane_tag=tag, publish_to_cache=int(r[2])))
            else:
                nonce = lane.pending_nonce if lane is not None and r[3] else 12345
                kw["commits"].append(LaneCommit(lane_tag=tag, token_id=r[2], logits_nonce=nonce))
        shed = ShedPolicy(evictable_cache_classes=1, max_evict_bytes=U64)
        before = fingerprint(eng)
        try:
            ev = coord.tick(prefill_token_budget=24, shed_policy=shed, **kw)
        except PlanRejected as exc:
            assert -114 <= int(exc.status) <= -100
            assert fingerprint(eng) == before
            event(f"rejected {exc.status.name}")
        else:
            event("accepted")
            assert ev.plan_seq == coord.plan_seq
            for e in ev.emits:
                toks = coord.read(e.token_ref)
                assert len(toks) == e.n_tokens and all(0 <= t < eng.n_vocab for t in toks)
        check_bookkeeping(eng)
