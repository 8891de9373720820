"""``replay_text``: the text a resumed stream sends after the client's first ``after`` tokens is
the live stream's text from there, held-back tail included once the generation has ended."""

from __future__ import annotations

from basertd.server.durability.durable import replay_text


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
