"""The request record: validation, exact max_tokens, stop strings, usage and timings."""

from __future__ import annotations

import pytest
from sink_testutil import Sink

from basertd.schema import client as api
from basertd.schema.abi import Sampling, SamplingFlag
from basertd.schema.client import ErrorCode
from basertd.server.frontend.limits import MAX_GRAMMAR_CHARS, check_generate
from basertd.server.request.record import AdmissionError, GenerationRequest, fold_seed, sampler_for
from basertd.server.request.tokenizer import BytesTokenizer
from basertd.server.sched.lanes import RequestQueues, candidate, reservation

TOK = BytesTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def make(
    max_tokens=10, stop=(), stream=True, qos="interactive", prompt="hi"
) -> tuple[GenerationRequest, Sink]:
    sink = Sink()
    gen = api.Generate(request_id="r1", prompt=prompt, max_tokens=max_tokens, temperature=0.0, seed=7)
    req = GenerationRequest(
        request_id="r1",
        prompt=ids(prompt),
        max_tokens=max_tokens,
        sampler=sampler_for(gen),
        sink=sink,
        tokenizer=TOK,
        stop=stop,
        stream=stream,
        qos=qos,
    )
    return req, sink


def text_of(sent) -> str:
    return "".join(m.text for m in sent if isinstance(m, api.Tokens))


def ids_of(sent) -> list[int]:
    return [i for m in sent if isinstance(m, api.Tokens) for i in m.ids]


def test_max_tokens_is_exact_even_when_the_engine_overshoots():
    req, sink = make(max_tokens=5)
    assert req.deliver(ids("abc")) is None
    assert req.deliver(ids("defgh")) == "length"  # only "de" fits
    req.finish("length")
    assert text_of(sink.sent) == "abcde" and req.generated == ids("abcde")
    done = sink.sent[-1]
    assert isinstance(done, api.Done) and done.finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (2, 5)
    assert req.deliver(ids("x")) is None and sink.sent[-1] is done  # nothing after Done
    req.finish("length")
    req.fail(ErrorCode.INTERNAL, "late")
    assert sink.sent[-1] is done


def test_stop_string_ends_the_generation_without_leaking():
    req, sink = make(max_tokens=50, stop=["\n\n"])
    assert req.deliver(ids("one\n")) is None
    assert text_of(sink.sent) == "one"  # "\n" is held back: it may begin the stop string
    assert req.deliver(ids("\ntwo")) == "stop"
    req.finish("stop")
    assert text_of(sink.sent) == "one"
    assert ids_of(sink.sent) == ids("one\n\n")  # ids end with the token that completed the stop
    assert sink.sent[-1].finish_reason == "stop"


def test_held_back_text_is_released_at_a_finish_that_is_not_a_stop():
    req, sink = make(max_tokens=4, stop=["xyz"])
    assert req.deliver(ids("abxy")) == "length"
    req.finish("length")
    assert text_of(sink.sent) == "abxy"


def test_utf8_split_across_deliveries_and_non_streaming_mode():
    req, sink = make(max_tokens=10, stream=False)
    euro = list("€".encode())
    req.deliver([3 + euro[0]])
    req.deliver([3 + euro[1], 3 + euro[2], 3 + ord("!")])
    assert sink.sent == []  # stream=False: one Tokens before Done
    req.finish("eos")
    tokens, done = sink.sent
    assert tokens.text == "€!" and len(tokens.ids) == 4 and done.finish_reason == "eos"


def test_fail_after_delivered_tokens_repeats_nothing():
    req, sink = make(max_tokens=10)
    req.deliver(ids("ab"))
    req.fail(ErrorCode.WORKER_FAILED, "worker 0 died")
    assert text_of(sink.sent) == "ab"
    err = sink.sent[-1]
    assert isinstance(err, api.Error) and err.code == ErrorCode.WORKER_FAILED
    assert req.finished and req.finish_reason == "error"


def test_timings_and_usage():
    req, sink = make(max_tokens=3)
    req.t_received = 100.0
    req.t_admitted = 100.5
    req.deliver(ids("a"), now=101.0)
    req.deliver(ids("bc"), now=102.0)
    req.finish("length", now=102.0)
    t = sink.sent[-1].timings
    assert (t.queue_s, t.ttft_s, t.total_s) == (0.5, 1.0, 2.0)
    assert t.decode_tokens_per_s == pytest.approx(2.0)


def test_sampler_greedy_and_gumbel_and_rng_stream():  # ABI rule 73
    greedy = sampler_for(api.Generate(request_id="g", prompt="x", temperature=0.0, seed=3, ignore_eos=True))
    assert greedy.mode == Sampling.GPU_GREEDY and greedy.params.flags == SamplingFlag.IGNORE_EOS
    assert greedy.rng_counter_base() == 3 << 32 and greedy.rng_counter_base(5) == (3 << 32) + 5
    g = sampler_for(api.Generate(request_id="g", prompt="x", temperature=0.7, top_p=0.9, top_k=40, seed=1))
    assert g.mode == Sampling.GPU_GUMBEL
    assert (g.params.top_p, g.params.top_k, g.params.repeat_penalty) == (pytest.approx(0.9), 40, 0.0)
    drawn = {sampler_for(api.Generate(request_id="g", prompt="x")).seed for _ in range(8)}
    assert len(drawn) > 1 and all(0 <= s < 1 << 32 for s in drawn)


INVALID = ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"prompt": ""}, ErrorCode.EMPTY_PROMPT),
        ({"prompt": None, "prompt_tokens": []}, ErrorCode.EMPTY_PROMPT),
        ({"prompt": None}, ErrorCode.INVALID_REQUEST),
        ({"prompt": "a", "prompt_tokens": [5]}, ErrorCode.INVALID_REQUEST),
        ({"max_tokens": 0}, ErrorCode.INVALID_REQUEST),
        ({"temperature": -1.0}, ErrorCode.INVALID_REQUEST),
        ({"temperature": float("nan")}, ErrorCode.INVALID_REQUEST),
        ({"top_p": 1.5}, ErrorCode.INVALID_REQUEST),
        ({"top_k": -1}, ErrorCode.INVALID_REQUEST),
        ({"repeat_penalty": 0.0}, ErrorCode.INVALID_REQUEST),
        ({"top_k": 1 << 32}, ErrorCode.INVALID_REQUEST),
        ({"presence_penalty": float("inf")}, ErrorCode.INVALID_REQUEST),
        ({"frequency_penalty": float("nan")}, ErrorCode.INVALID_REQUEST),
        ({"max_tokens": 1 << 32}, ErrorCode.INVALID_REQUEST),
        ({"seed": -1}, ErrorCode.INVALID_REQUEST),
        ({"logprobs": 21}, ErrorCode.INVALID_REQUEST),
        ({"logprobs": -1}, ErrorCode.INVALID_REQUEST),
        ({"logit_bias": {5: 100.5}}, ErrorCode.INVALID_REQUEST),
        ({"logit_bias": {5: float("nan")}}, ErrorCode.INVALID_REQUEST),
        ({"logit_bias": {5: float("-inf")}}, ErrorCode.INVALID_REQUEST),
        ({"logit_bias": {-1: 1.0}}, ErrorCode.INVALID_REQUEST),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, ErrorCode.INVALID_REQUEST),
        ({"stop": ["x"] * 17}, ErrorCode.INVALID_REQUEST),
        ({"request_id": ""}, ErrorCode.INVALID_REQUEST),
        ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, ErrorCode.INVALID_REQUEST),
        ({"grammar": "x" * (MAX_GRAMMAR_CHARS + 1)}, ErrorCode.INVALID_REQUEST),
        ({"response_format": {"type": "json_object", "x": "y" * MAX_GRAMMAR_CHARS}}, INVALID),
    ],
)
def test_invalid_generates_are_refused_typed(fields, code):
    base = {"request_id": "r", "prompt": "hello"}
    base.update(fields)
    with pytest.raises(AdmissionError) as info:
        check_generate(api.Generate(**base))
    assert info.value.code == code


def test_queues_are_fifo_per_class_in_class_order_and_skip_gone_requests():
    q = RequestQueues()
    reqs = {}
    for name, qos in [("b1", "batch"), ("i1", "interactive"), ("g1", "background"), ("i2", "interactive")]:
        reqs[name], _ = make(qos=qos, prompt=name)
        q.push(reqs[name])
    assert [r.prompt for r in q] == [ids(n) for n in ("i1", "i2", "b1", "g1")]
    reqs["i2"].fail(ErrorCode.CANCELLED, "gone")
    assert [r.prompt for r in q] == [ids(n) for n in ("i1", "b1", "g1")]
    q.pop(reqs["i1"])
    assert [r.prompt for r in q] == [ids(n) for n in ("b1", "g1")]  # the gone i2 is dropped on the way
    assert len(q) == 2 and q.tokens == 4
    assert q.remove(reqs["b1"]) and not q.remove(reqs["b1"])
    assert candidate(reqs["g1"], page_tokens=16).reserve == reservation(2 + 10, 16) == 16


def test_a_greedy_request_keeps_its_penalties():
    """Temperature 0 with a penalty is the argmax of the penalised row (as vLLM and llama.cpp's
    server): a GUMBEL lane at temperature 0 carrying the penalties; without one, plain GREEDY."""
    for field, attr in (
        ("frequency_penalty", "freq_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("repeat_penalty", "repeat_penalty"),
    ):
        s = sampler_for(api.Generate(request_id="p", prompt="x", temperature=0.0, **{field: 1.3}))
        assert s.mode == Sampling.GPU_GUMBEL and s.params.temperature == 0.0, field
        assert getattr(s.params, attr) == pytest.approx(1.3), field
    plain = sampler_for(api.Generate(request_id="p", prompt="x", temperature=0.0, repeat_penalty=1.0))
    assert plain.mode == Sampling.GPU_GREEDY


def test_u64_seeds_fold_to_a_32_bit_stream_key_and_big_top_k_is_off():
    assert fold_seed(7) == 7 and fold_seed((1 << 32) - 1) == (1 << 32) - 1
    big = (1 << 64) - 1
    check_generate(api.Generate(request_id="r", prompt="x", seed=big))  # a u64 seed is accepted
    s = sampler_for(api.Generate(request_id="r", prompt="x", seed=big, temperature=1.0))
    assert s.seed == fold_seed(big) <= (1 << 32) - 1
    assert s.rng_counter_base() == s.seed << 32 < 1 << 64
    s = sampler_for(api.Generate(request_id="r", prompt="x", top_k=1000, temperature=1.0), vocab_size=259)
    assert s.params.top_k == 0  # a top_k over the vocabulary keeps every token: off


def test_a_delivered_token_alone_does_not_end_a_crash_streak_and_specs_under_the_limit_pass():
    req, _ = make(max_tokens=5)
    req.crash_streak = 1
    req.deliver([])
    assert req.crash_streak == 1  # nothing delivered: still on the streak
    req.deliver(ids("a"))
    # a partial emit's tokens may come from a tick that then dies: only the scheduler ends the
    # streak, for a completed tick (tests/server/test_scheduler_core.py)
    assert req.crash_streak == 1
    check_generate(api.Generate(request_id="r", prompt="x", regex="a" * MAX_GRAMMAR_CHARS))
    check_generate(api.Generate(request_id="r", prompt="x", response_format={"type": "json_object"}))
