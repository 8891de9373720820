"""The text of a resumed stream, computed once per request and answered by slicing (DESIGN.md
"Front ends, durability, ...": a ``Resume`` must never cost the daemon what generating did).

A resumed client gets the tokens after its first ``after`` and the text the live stream sent for
them: the text of ``ids[after:]`` detokenized after ``ids[:after]`` (UTF-8 never split, text from
a matched stop string on withheld), plus, once the generation ended, the held-back tail the live
stream sent at its end (an incomplete UTF-8 character as U+FFFD, a partial stop match as text).

``ReplayText`` feeds a request's tokens once, one at a time, and keeps ``offsets[k]``: the
characters the stream had sent after ``k`` tokens; the answer for ``after`` is then
``text[offsets[after]:]``, O(1) however often it is asked. A live request's entry grows with its
tokens (only the new ones are fed). ``ReplayCache`` keeps the entries of the most recently
resumed requests, bounded in tokens (``max_tokens``, the oldest dropped first): a flood of resumes
of one 30,000-token result detokenizes it once. Errors: none (a tokenizer that fails on an id
is the caller's ``TokenizerError``).
"""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from basertd.server.request.tokenizer import IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from basertd.server.request.tokenizer import Tokenizer

CACHE_TOKENS = 4_000_000
"""Tokens of replay text kept over every cached request (about 4 bytes of offsets plus the text
per token)."""


def replay_text(
    tokenizer: Tokenizer, stop: list[str], ids: list[int], after: int, final: bool = False
) -> str:
    """The text delta of ``ids[after:]`` as the live stream would have produced it after the first
    ``after`` ids (module docstring); ``final``: the generation has ended (the tail follows). One
    pass over ``ids``: use ``ReplayText`` for repeated answers."""
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopMatcher(stop)
    stops.feed(detok.feed(ids[:after]))
    text = stops.feed(detok.feed(ids[after:]))[0]
    if final and not stops.stopped:
        text += stops.feed(detok.flush())[0] + stops.flush()
    return text


class ReplayText:
    """The text one request's stream sent, token by token (module docstring). ``fed``: tokens fed
    so far; ``final``: the end's tail was added."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(list(stop))
        self._parts: list[str] = []
        self._chars = 0
        self._text = ""
        self.offsets = array("Q", [0])
        self.final = False
        self.lock = asyncio.Lock()
        """Held while tokens are fed off the event loop (``Durability.resume``)."""

    @property
    def fed(self) -> int:
        return len(self.offsets) - 1

    def extend(self, ids: Sequence[int]) -> None:
        """Feed ``ids`` (the request's tokens after the ``fed`` ones), one at a time."""
        detok, stops, parts, offsets = self._detok, self._stops, self._parts, self.offsets
        chars = self._chars
        for t in ids:
            piece = stops.feed(detok.feed((t,)))[0]
            if piece:
                parts.append(piece)
                chars += len(piece)
            offsets.append(chars)
        self._chars = chars

    def finish(self) -> None:
        """The generation ended: add the tail the live stream sent with its end. Idempotent."""
        if not self.final:
            self.final = True
            if not self._stops.stopped:
                tail = self._stops.feed(self._detok.flush())[0] + self._stops.flush()
                if tail:
                    self._parts.append(tail)
                    self._chars += len(tail)

    def after(self, n: int) -> str:
        """The text sent after the first ``n`` tokens (0 <= n <= ``fed``)."""
        if self._parts:
            self._text += "".join(self._parts)
            self._parts = []
        return self._text[self.offsets[n] :]


class ReplayCache:
    """``ReplayText`` per resume id, most recently used last, at most ``max_tokens`` fed tokens
    in all (the least recently used dropped first)."""

    def __init__(self, max_tokens: int = CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, ReplayText] = OrderedDict()
        self._tokens = 0

    def get(self, resume_id: str, tokenizer: Tokenizer, stop: Sequence[str]) -> ReplayText:
        """The entry of ``resume_id`` (a new, empty one on a miss)."""
        entry = self._entries.get(resume_id)
        if entry is None:
            entry = self._entries[resume_id] = ReplayText(tokenizer, stop)
        else:
            self._entries.move_to_end(resume_id)
        return entry

    def account(self, resume_id: str, added: int) -> None:
        """``added`` tokens were fed to ``resume_id``'s entry: drop the oldest entries over the
        bound (never the one just used)."""
        self._tokens += added
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            rid, old = next(iter(self._entries.items()))
            if rid == resume_id:
                break
            del self._entries[rid]
            self._tokens -= old.fed

    def __len__(self) -> int:
        return len(self._entries)
