"""Grammar-constrained lanes in the llama.cpp engine on the tiny GGUF (a real llama.cpp context,
real rings): JSON-schema, Lark and regex grammars, batching beside free lanes, HOST lanes,
preemption and resume with grammar_replay, handle errors."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from lc_harness import admit, ignore_eos, make_prompt
from schemas import schemas

from basertd.schema.abi import FaultCode, Finish, Sampling, Status
from basertd.schema.tick import LaneCommit, LaneDecode, LanePrefill, LaneRetire, SamplingParams
from basertd.worker.engines.base import EngineError, PlanRejected

SAMPLED = {"sampling": Sampling.GPU_GUMBEL, "params": SamplingParams(temperature=0.9, top_k=50)}


def run_lanes(coord, lanes: dict[int, dict], n_new: int, per_tick: int = 8) -> tuple[dict, dict]:
    """Admit ``lanes`` (tag -> admit keywords), prefill, decode up to ``n_new`` tokens each;
    returns (tokens per lane, finish per lane) and retires them."""
    prompts = {t: make_prompt(t, 6) for t in lanes}
    out: dict[int, list[int]] = {t: [] for t in lanes}
    finish: dict[int, int] = {}
    admits = [admit(t, coord.prompt(prompts[t]), **kw) for t, kw in lanes.items()]
    prefills = [LanePrefill(lane_tag=t, token_offset=0, token_count=6) for t in lanes]
    first = True
    while len(finish) < len(lanes):
        decodes = [
            LaneDecode(lane_tag=t, max_new_tokens=min(per_tick, n_new - len(out[t])))
            for t in lanes
            if t not in finish
        ]
        ev = coord.tick(admits=admits if first else [], prefills=prefills if first else [], decodes=decodes)
        first = False
        assert not ev.faults, ev.faults
        for e in ev.emits:
            if e.n_tokens:
                out[e.lane_tag] += coord.read(e.token_ref)
            if e.finish or len(out[e.lane_tag]) >= n_new:
                finish[e.lane_tag] = e.finish
    coord.tick(retires=[LaneRetire(lane_tag=t) for t in lanes])
    return out, finish


def test_json_schema_lane_finishes_with_grammar_and_validates(make_engine):
    eng, coord = make_engine()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"enum": ["a", "b"]}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    h = eng.grammar_create(json.dumps(schema))
    assert h > 0
    out, finish = run_lanes(coord, {1: {"grammar_handle": h}, 2: {"grammar_handle": h, **SAMPLED}}, 200)
    for tag in (1, 2):
        assert finish[tag] == Finish.GRAMMAR
        value = json.loads(eng.detokenize(out[tag]))
        jsonschema.validate(value, schema)
    eng.grammar_free(h)


def test_lark_and_regex_grammars(make_engine):
    eng, coord = make_engine()
    lark = eng.grammar_create('start: "id=" NUM ";"\nNUM: /[0-9]{1,4}/', "lark")
    rx = eng.grammar_create(r"(yes|no)-[a-c]{2}", "regex")
    assert lark > 0 and rx > 0 and lark != rx
    out, finish = run_lanes(coord, {1: {"grammar_handle": lark}, 2: {"grammar_handle": rx, **SAMPLED}}, 64)
    assert finish == {1: Finish.GRAMMAR, 2: Finish.GRAMMAR}
    assert re.fullmatch(r"id=[0-9]{1,4};", eng.detokenize(out[1]).decode())
    assert re.fullmatch(r"(yes|no)-[a-c]{2}", eng.detokenize(out[2]).decode())


def test_bad_specs_give_handle_zero_and_unknown_handles_are_typed_errors(make_engine):
    eng, coord = make_engine()
    assert eng.grammar_create('{"type": "strin"}') == 0
    assert eng.grammar_create("not json") == 0
    assert eng.grammar_create("start: missing_rule", "lark") == 0
    assert eng.grammar_create("a(b", "regex") == 0
    assert eng.grammar_create("{}", "gbnf") == 0
    with pytest.raises(EngineError) as ex:  # ABI rule 113
        eng.grammar_free(12345)
    assert ex.value.status == Status.ERR_UNKNOWN_HANDLE
    h = eng.grammar_create('{"type": "boolean"}')
    eng.grammar_free(h)
    with pytest.raises(EngineError):
        eng.grammar_free(h)
    ref = coord.prompt(make_prompt(1, 6))
    for kw in ({"grammar_handle": h}, {"grammar_replay": 1}):  # ABI rule 74
        with pytest.raises(PlanRejected) as ex:
            coord.tick(admits=[admit(1, ref, **kw)])
        assert ex.value.status == Status.REJECT_ILLEGAL_COMBINATION
    h2 = eng.grammar_create('{"type": "boolean"}')
    with pytest.raises(PlanRejected) as ex:
        coord.tick(admits=[admit(1, ref, grammar_handle=h2, grammar_replay=7)])
    assert ex.value.status == Status.REJECT_ILLEGAL_COMBINATION
    assert eng.stats()["live_lanes"] == 0


def test_free_lanes_beside_a_constrained_lane_are_unchanged(make_engine):
    eng, coord = make_engine()
    # A grammar that never completes within the run keeps the batch composition equal.
    rx = eng.grammar_create(r"[a-z]+( [a-z]+)*", "regex")
    free = {2: {}, 3: SAMPLED, 4: {"params": ignore_eos()}}
    base, _ = run_lanes(coord, {1: {"params": ignore_eos()}, **free}, 24, per_tick=4)
    got, fin = run_lanes(coord, {1: {"grammar_handle": rx, "params": ignore_eos()}, **free}, 24, per_tick=4)
    assert len(got[1]) == 24 and fin[1] == Finish.NONE  # the constrained lane ran throughout
    assert re.fullmatch(r"[a-z]+( [a-z]+)*", eng.detokenize(got[1]).decode())
    assert got[1] != base[1]
    for tag in free:
        assert got[tag] == base[tag]


def test_host_lane_rows_are_masked_and_refused_commits_fault(make_engine):
    eng, coord = make_engine()
    rx = eng.grammar_create(r"[0-9]{3}", "regex")
    allowed = {eng.tokenize(str(d).encode(), False)[-1] for d in range(10)}
    ref = coord.prompt(make_prompt(5, 6))
    host = {"sampling": Sampling.HOST, "grammar_handle": rx}
    ev = coord.tick(
        admits=[admit(1, ref, **host), admit(2, ref, **host)],
        prefills=[LanePrefill(lane_tag=t, token_offset=0, token_count=6) for t in (1, 2)],
        decodes=[LaneDecode(lane_tag=t, max_new_tokens=1) for t in (1, 2)],
    )
    rows = {e.lane_tag: e.logits_row for e in ev.emits}
    row = coord.row(rows[1])
    finite = set(np.flatnonzero(np.isfinite(row)).tolist())
    assert finite and finite <= allowed
    tok = max(finite, key=lambda t: row[t])
    bad = eng.tokenize(b"x", False)[-1]
    ev = coord.tick(
        commits=[
            LaneCommit(lane_tag=1, token_id=tok, logits_nonce=rows[1].generation),
            LaneCommit(lane_tag=2, token_id=bad, logits_nonce=rows[2].generation),
        ],
        decodes=[LaneDecode(lane_tag=1, max_new_tokens=1)],
    )
    assert [(f.lane_tag, f.code) for f in ev.faults] == [(2, FaultCode.GRAMMAR_OVERFLOW)]
    e1 = next(e for e in ev.emits if e.lane_tag == 1)
    assert np.isfinite(coord.row(e1.logits_row)).sum() >= 1
    coord.tick(retires=[LaneRetire(lane_tag=1), LaneRetire(lane_tag=2)])


def constrained_run(coord, tag, prompt, n, h, base, preempt_at=None):
    """Sampled grammar lane for up to n tokens (or its GRAMMAR finish); with ``preempt_at`` = k,
    retire after k tokens and resume with decode_replay = grammar_replay = k, rng base + k."""
    params = SamplingParams(temperature=0.9, top_k=40)
    kw = {"sampling": Sampling.GPU_GUMBEL, "params": params, "grammar_handle": h}
    out: list[int] = []
    ev = coord.tick(
        admits=[admit(tag, coord.prompt(prompt), rng_counter_base=base, **kw)],
        prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))],
        decodes=[LaneDecode(lane_tag=tag, max_new_tokens=1)],
    )
    while True:
        (e,) = [e for e in ev.emits if e.lane_tag == tag]
        out += coord.read(e.token_ref) if e.n_tokens else []
        if e.finish or len(out) >= n:
            break
        if preempt_at is not None and len(out) == preempt_at:
            coord.tick(retires=[LaneRetire(lane_tag=tag)])
            k = len(out)
            ev = coord.tick(
                admits=[
                    admit(
                        tag,
                        coord.prompt(prompt + out),
                        rng_counter_base=base + k,
                        decode_replay=k,
                        grammar_replay=k,
                        **kw,
                    )
                ],
                prefills=[LanePrefill(lane_tag=tag, token_offset=0, token_count=len(prompt))],
                decodes=[LaneDecode(lane_tag=tag, max_new_tokens=k + 1)],
            )
            preempt_at = None
            continue
        ev = coord.tick(decodes=[LaneDecode(lane_tag=tag, max_new_tokens=1)])
    coord.tick(retires=[LaneRetire(lane_tag=tag)])
    return out, e.finish


def test_a_preempted_constrained_lane_resumes_token_exact(make_engine):
    # ABI rules 72-74
    eng, coord = make_engine()
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 6},
            "b": {"type": "array", "maxItems": 3, "items": {"type": "boolean"}},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    h = eng.grammar_create(json.dumps(schema))
    prompt = make_prompt(21, 10)
    whole, fin = constrained_run(coord, 1, prompt, 120, h, base=5 << 32)
    assert fin == Finish.GRAMMAR
    jsonschema.validate(json.loads(eng.detokenize(whole)), schema)
    for k in (1, 4, len(whole) // 2):
        resumed, fin2 = constrained_run(coord, 2, prompt, 120, h, base=5 << 32, preempt_at=k)
        assert (resumed, fin2) == (whole, fin)


def test_hundred_schemas_on_the_tiny_model_parse_and_validate(make_engine):
    eng, coord = make_engine(lanes=8, context_length=768)
    all_schemas = schemas(100)
    for start in range(0, len(all_schemas), 8):
        chunk = all_schemas[start : start + 8]
        handles = [eng.grammar_create(json.dumps(s)) for s in chunk]
        assert all(handles), [s for s, h in zip(chunk, handles, strict=True) if not h]
        lanes = {}
        for i, h in enumerate(handles):
            kw = {"grammar_handle": h}
            if i % 2:
                kw |= SAMPLED
            lanes[start + i + 1] = kw
        out, finish = run_lanes(coord, lanes, 700, per_tick=16)
        for (tag, toks), schema in zip(out.items(), chunk, strict=True):
            # A grammar that could go on (a top-level number) allows EOS once it accepts.
            assert finish[tag] in (Finish.GRAMMAR, Finish.EOS), (schema, toks)
            if finish[tag] == Finish.EOS:
                toks = toks[:-1]
            text = eng.detokenize(toks).decode()
            jsonschema.validate(json.loads(text), schema)
        for h in handles:
            eng.grammar_free(h)


def test_one_spec_compiles_once_for_all_its_handles_and_each_handle_is_its_own(make_engine):
    eng, coord = make_engine()
    spec = r"(yes|no)-[a-c]{2}"
    handles = [eng.grammar_create(spec, "regex") for _ in range(3)]
    assert len(set(handles)) == 3 and all(handles)
    assert eng.grammars.compiles == 1  # the later handles copy the compiled matcher
    eng.grammar_free(handles[0])  # freeing one leaves the others (and the compiled spec) usable
    out, finish = run_lanes(
        coord, {1: {"grammar_handle": handles[1]}, 2: {"grammar_handle": handles[2], **SAMPLED}}, 64
    )
    assert finish == {1: Finish.GRAMMAR, 2: Finish.GRAMMAR}
    for tag in (1, 2):
        assert re.fullmatch(spec, eng.detokenize(out[tag]).decode())
    assert eng.grammar_create(spec, "regex") > 0 and eng.grammars.compiles == 1
    assert eng.grammar_create("(unclosed", "regex") == 0
