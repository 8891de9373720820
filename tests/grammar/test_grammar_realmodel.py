"""The 100 test schemas (tests/grammar/schemas.py) on the default model, Gemma 3 270M Q4_K_M (marked
``realmodel``): the llama.cpp engine, one thread, 8 lanes kept busy (a finished lane's slot takes the
next schema), even schemas greedy and odd ones sampled with fixed seeds. Every output finishes by
the grammar (or EOS where the grammar could go on) well inside its token cap, parses, and validates
against its schema with ``jsonschema``: a base model happily writes long numbers and arrays, and
the bounded JSON grammars (worker/engines/llamacpp/json_bounds.py) keep every output finite."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from lc_harness import Coordinator, admit
from schemas import schemas

from basertd.schema.abi import Finish, Sampling
from basertd.schema.tick import LaneDecode, LanePrefill, LaneRetire, SamplingParams
from basertd.worker.engines.llamacpp import LlamaCppEngine

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

CAP = 512
"""Token cap of each output; the longest output measured is about half of it."""
LANES = 8
PROMPT = b"A short JSON value:\n"
SAMPLED = SamplingParams(temperature=0.9, top_k=50)


def run_all(
    eng: LlamaCppEngine, coord: Coordinator, all_schemas: list[dict]
) -> dict[int, tuple[list[int], int]]:
    """Every schema's output as (tokens, finish), ``LANES`` lanes at a time; finish NONE means the
    output reached ``CAP`` tokens unfinished. Each grammar handle is freed once its lane retires."""
    prompt = eng.tokenize(PROMPT, True)
    pending = list(enumerate(all_schemas))
    live: dict[int, tuple[int, int, list[int]]] = {}  # tag -> (schema index, handle, tokens)
    results: dict[int, tuple[list[int], int]] = {}
    while pending or live:
        admits, prefills = [], []
        while pending and len(live) < LANES:
            i, schema = pending.pop(0)
            h = eng.grammar_create(json.dumps(schema))
            assert h, schema
            kw: dict = {"grammar_handle": h}
            if i % 2:
                kw |= {"sampling": Sampling.GPU_GUMBEL, "params": SAMPLED, "rng_counter_base": (i + 1) << 32}
            admits.append(admit(i + 1, coord.prompt(prompt), **kw))
            prefills.append(LanePrefill(lane_tag=i + 1, token_offset=0, token_count=len(prompt)))
            live[i + 1] = (i, h, [])
        decodes = [LaneDecode(lane_tag=t, max_new_tokens=min(16, CAP - len(v[2]))) for t, v in live.items()]
        ev = coord.tick(admits=admits, prefills=prefills, decodes=decodes)
        assert not ev.faults, ev.faults
        done = []
        for e in ev.emits:
            i, h, toks = live[e.lane_tag]
            if e.n_tokens:
                toks += coord.read(e.token_ref)
            if e.finish or len(toks) >= CAP:
                results[i] = (toks, e.finish)
                done.append(e.lane_tag)
        if done:
            coord.tick(retires=[LaneRetire(lane_tag=t) for t in done])
            for t in done:
                eng.grammar_free(live.pop(t)[1])
    return results


def test_hundred_schemas_on_the_default_model_parse_and_validate(default_model, record_property):
    eng = LlamaCppEngine(default_model, lanes=LANES, context_length=CAP + 64, n_threads=1)
    coord = Coordinator(eng)
    try:
        all_schemas = schemas(100)
        t0 = time.monotonic()
        results = run_all(eng, coord, all_schemas)
        seconds = time.monotonic() - t0
        assert len(eng.grammars) == 0 and eng.stats()["live_lanes"] == 0
        bad = []
        for i, schema in enumerate(all_schemas):
            toks, finish = results[i]
            if finish not in (Finish.GRAMMAR, Finish.EOS):
                bad.append(f"schema {i} ended by length after {len(toks)} tokens: {schema}")
                continue
            if finish == Finish.EOS:  # a grammar that could go on (a top-level number) allows EOS
                toks = toks[:-1]
            text = eng.detokenize(toks).decode()
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                bad.append(f"schema {i}: {text!r} does not validate: {exc}")
        assert not bad, "\n".join(bad)
        lengths = [len(t) for t, _ in results.values()]
        record_property("grammar_realmodel_seconds", round(seconds, 1))
        record_property("grammar_realmodel_max_tokens", max(lengths))
        record_property("grammar_realmodel_total_tokens", sum(lengths))
        print(f"100 schemas: {seconds:.1f} s, {sum(lengths)} tokens, longest {max(lengths)}")
    finally:
        eng.close()
        coord.close()
