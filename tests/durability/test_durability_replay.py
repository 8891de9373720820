"""``replay_text``: the text a resumed stream sends after the client's first ``after`` tokens is
the live stream's text from there, held-back tail included once the generation has ended."""

from __future__ import annotations

import pytest

from basertd.schema.client import ErrorCode
from basertd.server.durability.durable import replay_text
from basertd.server.durability.replay import ReplayCache, ReplayText
from basertd.server.frontend.resume_limits import ResumeLimiter
from basertd.server.request.record import AdmissionError


class ByteVocab:
    """Token ``i`` is the single byte ``i`` (so a character can span several tokens)."""

    def piece(self, token_id: int) -> bytes:
        return bytes([token_id])


def live_text(ids: list[int], stop: list[str]) -> str:
    """What a live stream sends in all: every delta, then the tail ``finish`` flushes."""
    return replay_text(ByteVocab(), stop, ids, 0, final=True)


def test_a_finished_result_replays_its_held_back_tail_as_the_live_stream_did():
    ids = [*"héllo".encode(), 0xE2, 0x82]  # ends inside a 3-byte character ("€" cut short)
    whole = live_text(ids, [])
    assert whole == "héllo\ufffd"
    for after in range(len(ids)):
        head = replay_text(ByteVocab(), [], ids[:after], 0)
        assert head + replay_text(ByteVocab(), [], ids, after, final=True) == whole, after
    # a live (unfinished) request holds the cut character back: it may still complete
    assert replay_text(ByteVocab(), [], ids, 3) == "llo"


def test_a_partial_stop_match_is_released_at_the_end_and_a_matched_stop_withholds_the_rest():
    ids = list(b"say STO")
    assert replay_text(ByteVocab(), ["STOP"], ids, 2) == "y "
    assert replay_text(ByteVocab(), ["STOP"], ids, 2, final=True) == "y STO"
    stopped = list(b"say STOP and more")
    assert replay_text(ByteVocab(), ["STOP"], stopped, 2, final=True) == "y "


def test_the_cached_replay_text_answers_every_count_as_the_one_pass_does():
    """``ReplayText`` (fed once, then sliced) answers what ``replay_text`` computes afresh, live
    (growing in chunks) and after the end, stop strings and cut characters included."""
    for stop, ids in (
        ([], [*"héllo wörld".encode(), 0xE2, 0x82]),
        (["STOP"], list(b"say STO")),
        (["wo"], list(b"a two b")),
    ):
        entry = ReplayText(ByteVocab(), stop)
        for upto in range(0, len(ids) + 1, 3):  # a live request: its tokens arrive in chunks
            entry.extend(ids[entry.fed : upto])
            for after in range(upto + 1):
                assert entry.after(after) == replay_text(ByteVocab(), stop, ids[:upto], after), (
                    stop,
                    upto,
                    after,
                )
        entry.extend(ids[entry.fed :])
        entry.finish()
        for after in range(len(ids) + 1):
            assert entry.after(after) == replay_text(ByteVocab(), stop, ids, after, final=True), (stop, after)


def test_the_replay_cache_is_bounded_in_tokens_and_keeps_the_entry_in_use():
    cache = ReplayCache(max_tokens=10)
    for rid in ("a", "b", "c"):
        entry = cache.get(rid, ByteVocab(), [])
        entry.extend(list(b"12345"))
        cache.account(rid, 5)
    assert len(cache) == 2 and cache.get("c", ByteVocab(), []).fed == 5  # "a" went first
    assert cache.get("a", ByteVocab(), []).fed == 0  # forgotten: a fresh entry


def test_resumes_are_a_token_bucket_per_requester():
    now = [0.0]
    limiter = ResumeLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    for _ in range(3):
        limiter.take("uid:1")
    with pytest.raises(AdmissionError) as exc:
        limiter.take("uid:1")
    assert exc.value.code == ErrorCode.QUEUE_FULL and "retry in 0.50 s" in exc.value.message
    limiter.take("uid:2")  # another requester has its own bucket
    now[0] = 0.5  # one resume refilled
    limiter.take("uid:1")
    with pytest.raises(AdmissionError):
        limiter.take("uid:1")
