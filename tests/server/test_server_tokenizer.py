"""Coordinator tokenizers, the incremental detokenizer and the stop matcher."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.server.request.tokenizer import (
    BOS_ID,
    BytesTokenizer,
    IncrementalDetokenizer,
    StopMatcher,
    TokenizerError,
    make_tokenizer,
)


def test_bytes_vocabulary_layout():
    tok = BytesTokenizer(vocab_size=1000)
    assert tok.encode("Az", add_bos=False) == [3 + 0x41, 3 + 0x7A]
    assert tok.encode("", add_bos=True) == [BOS_ID]
    assert [tok.piece(i) for i in (0, 1, 2)] == [b"", b"", b""]
    assert tok.piece(3) == b"\x00" and tok.piece(258) == b"\xff"
    assert tok.piece(259) == b"" and tok.piece(999) == b"" and tok.piece(-1) == b""
    assert make_tokenizer("bytes", vocab_size=4096).vocab_size == 4096
    with pytest.raises(TokenizerError):
        make_tokenizer("sentencepiece")


@settings(max_examples=200, deadline=None)
@given(st.text(), st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=40))
def test_detokenizer_never_splits_a_character(text, cuts):
    """Whatever the token boundaries, every delta is whole characters and the deltas add up."""
    tok = BytesTokenizer()
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = cuts[k % len(cuts)]
        delta = detok.feed(ids[i : i + n])
        assert "\ufffd" not in delta or "\ufffd" in text
        out.append(delta)
        i, k = i + n, k + 1
    out.append(detok.flush())
    assert "".join(out) == text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def test_detokenizer_holds_an_unfinished_character_and_replaces_garbage():
    tok = BytesTokenizer()
    detok = IncrementalDetokenizer(tok)
    euro = "€".encode()  # 3 bytes
    assert detok.feed([3 + euro[0], 3 + euro[1]]) == ""
    assert detok.feed([3 + euro[2], 3 + ord("x")]) == "€x"
    assert detok.feed([1, 2, 600]) == ""  # specials and ids past the bytes decode to nothing
    assert detok.feed([3 + 0xFF]) == "\ufffd"  # never valid UTF-8
    assert detok.feed([3 + euro[0]]) == ""
    assert detok.flush() == "\ufffd"  # the stream ended inside a character


def _run(stops, chunks):
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        safe, stopped = m.feed(c)
        out.append(safe)
        if stopped:
            return "".join(out), True, m
    out.append(m.flush())
    return "".join(out), False, m


def test_stop_string_split_across_deltas_never_leaks():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", False)  # "</" could begin the stop string
    assert m.feed("en") == ("", False)
    assert m.feed("d> and more") == ("", True)
    assert m.matched == "</end>"
    assert m.feed("later") == ("", True)
    assert m.flush() == ""


def test_held_tail_released_when_it_turns_out_not_to_be_a_stop():
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("x") == ("STx", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_earliest_of_several_stops_wins_and_empty_stops_are_ignored():
    assert _run(["b", "abc", ""], ["xxab", "c"])[:2] == ("xxa", True)
    assert _run(["b", "xab"], ["xxab"])[:2] == ("x", True)  # same end: the one starting first
    assert _run(["\n\n", "##"], ["one\n", "\ntwo"])[:2] == ("one", True)
    assert _run([""], ["abc"])[:2] == ("abc", False)


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="ab\n", max_size=30),
    st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=10),
)
def test_stop_matcher_matches_the_one_shot_cut(text, stops, cuts):
    """Streaming in any chunks gives exactly the text before the stop occurrence that ends first."""
    firsts = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(firsts)[1]] if firsts else text
    chunks, i, k = [], 0, 0
    while i < len(text):
        chunks.append(text[i : i + cuts[k % len(cuts)]])
        i += cuts[k % len(cuts)]
        k += 1
    got, stopped, _ = _run(stops, chunks)
    assert (got, stopped) == (expected, bool(firsts))
