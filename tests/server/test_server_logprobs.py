"""Logprobs and logit bias in the coordinator: Generate fields to the lane's sampler, engine rows to
the client's ``TokenLogprob`` records riding with their tokens, the limits, and the OpenAI
``logprobs`` objects built from them (no daemon: the end-to-end tests are in tests/http)."""

from __future__ import annotations

import math

import msgspec
import pytest
from sink_testutil import Sink

from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.schema.tick import LaneLogprob
from basertd.server.frontend.limits import check_generate, check_logit_bias
from basertd.server.request.record import AdmissionError, GenerationRequest, sampler_for, token_logprobs
from basertd.server.request.tokenizer import BytesTokenizer
from basertd.server.transport.http import body as http_body
from basertd.server.transport.http.errors import HttpError
from basertd.server.transport.http.openai import translate as oa_translate
from basertd.server.transport.http.openai import wire as oa_wire

TOK = BytesTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def make(logprobs=2, stream=True, stop=(), max_tokens=10) -> tuple[GenerationRequest, Sink]:
    gen = api.Generate(request_id="r", prompt="hi", max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    sink = Sink()
    req = GenerationRequest(
        request_id="r",
        prompt=ids("hi"),
        max_tokens=max_tokens,
        sampler=sampler_for(gen),
        sink=sink,
        tokenizer=TOK,
        stop=stop,
        stream=stream,
    )
    return req, sink


def rows_for(tokens: list[int], n_top: int = 2) -> list[LaneLogprob]:
    return [
        LaneLogprob(
            lane_tag=1,
            logprob=-0.25 * (k + 1),
            n_top=n_top,
            top_ids=[t, t + 1][:n_top],
            top_logprobs=[-0.25 * (k + 1), -3.0][:n_top],
        )
        for k, t in enumerate(tokens)
    ]


def test_sampler_carries_logprobs_and_bias_in_abi_terms():
    base = {"request_id": "g", "prompt": "x", "seed": 1}
    assert sampler_for(api.Generate(**base)).want_logprobs == 0
    assert not sampler_for(api.Generate(**base)).logprobs
    assert sampler_for(api.Generate(**base, logprobs=0)).want_logprobs == 1  # the token only
    assert sampler_for(api.Generate(**base, logprobs=20, temperature=0.5)).want_logprobs == 21
    s = sampler_for(api.Generate(**base, logit_bias={9: -100.0, 3: 2}))
    assert s.logit_bias == ((3, 2.0), (9, -100.0))
    assert sampler_for(api.Generate(**base)).logit_bias == ()


def test_token_logprobs_from_rows_and_count_mismatch():
    toks = ids("ab")
    out = token_logprobs(toks, rows_for(toks))
    assert [e.id for e in out] == toks and out[0].logprob == -0.25
    assert [(t.id, t.logprob) for t in out[1].top] == [(toks[1], -0.5), (toks[1] + 1, -3.0)]
    with pytest.raises(ValueError, match="1 logprob rows for 2 tokens"):
        token_logprobs(toks, rows_for(toks[:1]))


def test_logprobs_ride_with_the_tokens_they_belong_to():
    req, sink = make(max_tokens=3)
    toks = ids("abcd")
    lps = token_logprobs(toks, rows_for(toks))
    assert req.deliver(toks[:2], logprobs=lps[:2]) is None
    assert req.deliver(toks[2:], logprobs=lps[2:]) == "length"  # only "c" fits max_tokens
    req.finish("length")
    tokens = [m for m in sink.sent if isinstance(m, api.Tokens)]
    assert [len(m.ids) for m in tokens] == [2, 1]
    assert all(len(m.logprobs) == len(m.ids) for m in tokens)
    assert [e.id for m in tokens for e in m.logprobs] == toks[:3]


def test_non_streamed_and_failed_requests_send_their_logprobs_once():
    req, sink = make(stream=False)
    toks = ids("xyz")
    req.deliver(toks, logprobs=token_logprobs(toks, rows_for(toks)))
    req.finish("eos")
    (tokens, done) = sink.sent
    assert [e.id for e in tokens.logprobs] == toks and isinstance(done, api.Done)
    req, sink = make(stream=False)
    req.deliver(toks[:1], logprobs=token_logprobs(toks[:1], rows_for(toks[:1])))
    req.fail(ErrorCode.INTERNAL, "boom")
    tokens, err = sink.sent
    assert len(tokens.logprobs) == 1 and isinstance(err, api.Error)


def test_without_logprobs_tokens_carry_none():
    req, sink = make(logprobs=None)
    req.deliver(ids("ab"))
    assert sink.sent[0].logprobs is None


@pytest.mark.parametrize(
    "bias",
    [
        {5: 100.01},
        {5: -101.0},
        {5: math.nan},
        {5: math.inf},
        {-3: 1.0},
        {1 << 32: 1.0},
        dict.fromkeys(range(301), 1.0),
    ],
)
def test_logit_bias_limits(bias):
    with pytest.raises(AdmissionError) as info:
        check_generate(api.Generate(request_id="r", prompt="x", logit_bias=bias))
    assert info.value.code == ErrorCode.INVALID_REQUEST and "logit_bias" in info.value.message


def test_logit_bias_in_range_passes_and_ids_are_checked_against_the_vocabulary():
    gen = api.Generate(
        request_id="r", prompt="x", logit_bias={0: -100.0, 9: 100.0, **dict.fromkeys(range(10, 308), 0.5)}
    )
    check_generate(gen)
    assert len(gen.logit_bias) == 300
    check_logit_bias(gen, 308)
    bad = api.Generate(request_id="r", prompt="x", logit_bias={TOK.vocab_size: 1.0})
    check_generate(bad)
    with pytest.raises(AdmissionError, match="outside the vocabulary"):
        check_logit_bias(bad, TOK.vocab_size)


def test_openai_field_forms():
    def comp(**kw):
        return http_body.decode(msgspec.json.encode({"prompt": "x", **kw}), oa_wire.CompletionRequest)

    def chat(**kw):
        return http_body.decode(msgspec.json.encode({"messages": [], **kw}), oa_wire.ChatRequest)

    assert oa_translate.logprobs_of(comp()) is None and oa_translate.logprobs_of(comp(logprobs=0)) == 0
    assert (
        oa_translate.logprobs_of(chat(logprobs=True)) == 0
        and oa_translate.logprobs_of(chat(logprobs=True, top_logprobs=5)) == 5
    )
    assert oa_translate.logprobs_of(chat(logprobs=False)) is None
    for bad, field in [
        (comp(logprobs=21), "logprobs"),
        (comp(logprobs=-1), "logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(top_logprobs=2), "top_logprobs"),
        (comp(logit_bias={"abc": 1}), "logit_bias"),
        (comp(logit_bias={"-5": 1}), "logit_bias"),
    ]:
        with pytest.raises(HttpError) as info:
            oa_translate.check_fields(bad)
        assert info.value.status == 400 and info.value.param == field
    assert oa_translate.logit_bias_of(comp(logit_bias={"17": -100, " 3": 5.5})) == {17: -100.0, 3: 5.5}


def entries(text_ids: list[int]) -> list[api.TokenLogprob]:
    return [
        api.TokenLogprob(
            id=t, logprob=-1.0, top=[api.TopLogprob(id=t, logprob=-1.0), api.TopLogprob(id=5, logprob=-2.0)]
        )
        for t in text_ids
    ]


def test_completion_logprobs_object_keeps_offsets_across_a_split_character():
    lp = oa_wire.Logprobs(False, TOK.piece)
    euro = ids("€")
    lp.add(entries(ids("a") + euro[:1]))
    first = lp.take()
    assert first["tokens"] == ["a", "bytes:\\xe2"] and first["text_offset"] == [0, 1]
    assert first["token_logprobs"] == [-1.0, -1.0] and first["top_logprobs"][0] == {"a": -1.0, "\x02": -2.0}
    assert lp.take() is None
    lp.add(entries(euro[1:] + ids("b")))
    second = lp.take()
    assert second["text_offset"] == [1, 1, 2]  # the euro sign is one character, from offset 1


def test_chat_logprobs_object_gives_each_token_its_own_bytes():
    lp = oa_wire.Logprobs(True, TOK.piece)
    euro = ids("€")
    lp.add(entries(euro))
    obj = lp.take()
    assert obj["refusal"] is None
    assert [c["bytes"] for c in obj["content"]] == [[0xE2], [0x82], [0xAC]]
    assert [len(c["top_logprobs"]) for c in obj["content"]] == [2, 2, 2]
    assert obj["content"][0]["top_logprobs"][1] == {"token": "\x02", "logprob": -2.0, "bytes": [2]}
