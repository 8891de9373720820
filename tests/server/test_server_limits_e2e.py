"""The limits table and the event loop under hostile input, on real daemons (both engines).

Every numeric field of a Generate is driven with edge values: each request is either refused
``invalid_request`` naming the field or served normally, and a normal request on another
connection is served within a second after each. A 15 MB prompt and a 15 MB Tokenize never stall a
running stream (the byte bound refuses them before tokenizing; long texts tokenize off the loop).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from daemon_harness import Daemon
from serving_harness import ref_toml, tiny_toml

from basertd.client import ClientError
from basertd.schema.client import ErrorCode

EDGES = (0, -1, 2**31, 2**32, 2**40, 2**63, 2**64 - 1, math.nan, math.inf, -math.inf, 1e-45, 1e39)
INT_FIELDS = ("max_tokens", "top_k", "seed")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty")


def _cases():
    for field in INT_FIELDS + FLOAT_FIELDS:
        for v in EDGES:
            if field in INT_FIELDS and isinstance(v, float):
                continue  # the wire type of an int field refuses floats in the codec already
            if isinstance(v, int) and not -(2**63) <= v < 2**64:
                continue
            yield field, v


@pytest.fixture(scope="module", params=["basert", "llamacpp"])
def daemon(request, tiny_gguf):
    if request.param == "basert":
        cfg = ref_toml(lanes=4, context=256, grant=4, ref={"tick_delay_us": 500, "eos_period": 0})
    else:
        cfg = tiny_toml(tiny_gguf, lanes=2, context=256)
    with Daemon(cfg) as d:
        yield d


def test_every_numeric_edge_value_is_refused_by_name_or_served(daemon):
    refused = served = 0
    with daemon.client() as c, daemon.client() as other:
        for field, value in _cases():
            kw = {"max_tokens": 2, "temperature": 1.0, "seed": 1, field: value}
            try:
                out = c.generate("edge", **kw)
            except ClientError as exc:
                assert exc.code in (ErrorCode.INVALID_REQUEST, ErrorCode.CONTEXT_LENGTH_EXCEEDED), (
                    field,
                    value,
                    exc,
                )
                if exc.code == ErrorCode.INVALID_REQUEST:
                    assert field in exc.message, (field, value, exc.message)
                assert exc.param == field, (field, value, exc.param)  # max_tokens: over the context
                refused += 1
            else:
                assert out.finish_reason in ("length", "eos", "stop"), (field, value)
                served += 1
            t0 = time.monotonic()
            probe = other.generate("probe", max_tokens=2, temperature=0)
            assert probe.usage.completion_tokens >= 1
            assert time.monotonic() - t0 < 1.0, (field, value)  # the daemon keeps serving at once
    assert refused > 20 and served > 10
    st = daemon.wait_idle()
    assert st.lanes_busy == 0 and st.queued == 0


def test_megabyte_prompt_and_tokenize_do_not_stall_a_running_stream(daemon):
    huge = "x" * 15_000_000
    gaps: list[float] = []
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            with daemon.client() as c:
                last = time.monotonic()
                for _ in c.stream("keep streaming", max_tokens=120, temperature=0, ignore_eos=True):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.2)
    with daemon.client() as c:
        t0 = time.monotonic()
        with pytest.raises(ClientError) as info:
            c.generate(huge, max_tokens=4)
        assert info.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and info.value.param == "prompt"
        with pytest.raises(ClientError) as info:
            c.tokenize(huge)
        assert info.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
        assert time.monotonic() - t0 < 5.0
    t.join(60)
    assert not errors, errors
    assert len(gaps) > 5
    assert max(gaps[1:]) < 0.2, max(gaps[1:])  # the stream never waited behind the big inputs
