"""Chat message text stays text: control-token text a client writes inside a message
(``<start_of_turn>``, ``<|im_end|>``, ``</s>``) is tokenized as plain text, never as the control
token, while the chat template's own markup keeps its control tokens — so a user cannot forge a
turn, a system prompt or an end of generation (llama.cpp's ``parse_special`` off for content,
on for markup).

``encode_chat`` does it for every dialect: the front end names the control texts that occur in
the messages (``FrontendPort.control_texts``: none in the common case, and then the prompt is
tokenized exactly as before); each occurrence inside any string of the messages (contents, text
parts, tool-call arguments, names) is wrapped between two markers made of private-use characters
and a per-request random nonce (``Literal``), so no client text can forge one; the template
renders (whatever it does around the contents, ``| trim`` included); the rendered text is split
at the markers into parts tokenized with special parsing on (markup, ordinary content) and off
(the client's control texts) (``FrontendPort.tokenize_parts``). A template that breaks a marker
apart is refused (``ChatTemplateError``, a 400): the prompt would otherwise be ambiguous.
"""

from __future__ import annotations

import inspect
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from basertd.server.transport.http.chat_template import ChatTemplateError
from basertd.server.transport.http.port import FrontendPort

OPEN = "\ue000"
CLOSE = "\ue001"
SKIPPED_KEYS = frozenset({"role", "type"})
"""Message keys whose values are the dialect's own words, not client text to protect."""


def strings(value: Any) -> list[str]:
    """Every string inside ``value`` (messages: dicts, lists), keys in ``SKIPPED_KEYS`` skipped."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() if k not in SKIPPED_KEYS for s in strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in strings(v)]
    return []


class Literal:
    """Markers around the control texts ``controls`` inside client text (module docstring)."""

    def __init__(self, controls: frozenset[str]) -> None:
        nonce = str(secrets.randbelow(10**18)).zfill(18)  # digits: case and trim leave them alone
        self.open, self.close = f"{OPEN}{nonce}{CLOSE}", f"{CLOSE}{nonce}{OPEN}"
        ordered = sorted(controls, key=len, reverse=True)  # the longest match first
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def protect(self, value: Any) -> Any:
        """A copy of ``value`` (messages) with every control text in its strings wrapped."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self._pattern.sub(lambda m: self.open + m.group(0) + self.close, value)
        if isinstance(value, dict):
            return {k: v if k in SKIPPED_KEYS else self.protect(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.protect(v) for v in value]
        return value

    def parts(self, rendered: str) -> list[tuple[str, bool]]:
        """``rendered`` as ``(text, special)`` parts, markers removed: the wrapped control texts
        with ``special`` False, the rest True. Raises ``ChatTemplateError`` when a marker was
        broken apart by the template."""
        if self._pattern is None:
            return [(rendered, True)]
        out: list[tuple[str, bool]] = []
        pos = 0
        while (i := rendered.find(self.open, pos)) >= 0:
            j = rendered.find(self.close, i + len(self.open))
            if j < 0:
                break
            out += [(rendered[pos:i], True), (rendered[i + len(self.open) : j], False)]
            pos = j + len(self.close)
        out.append((rendered[pos:], True))
        if any(self.open in t or self.close in t for t, _ in out):
            raise ChatTemplateError(
                "the chat template changed message text that holds control-token text; it cannot "
                "be kept apart from the template's markup"
            )
        return [(t, special) for t, special in out if t]


async def encode_chat(
    frontend: FrontendPort,
    model: str,
    messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], str | Awaitable[str]],
    needs_bos: Callable[[str], bool],
    *,
    suffix: str = "",
) -> list[int]:
    """The prompt token ids of ``messages`` rendered by ``render`` (the template, called with
    the protected messages; it may be a coroutine function, e.g. a render off the event loop)
    then ``suffix`` appended (a prefill, client text too), with the client's control texts kept
    plain (module docstring). ``needs_bos(rendered text)`` says whether BOS is added. Raises
    ``ChatTemplateError`` and ``AdmissionError``."""
    controls = await frontend.control_texts(model, [*strings(messages), suffix])
    lit = Literal(controls)
    rendered = render(lit.protect(messages))
    if inspect.isawaitable(rendered):
        rendered = await rendered
    parts = lit.parts(rendered + lit.protect(suffix))
    text = "".join(t for t, _ in parts)
    return await frontend.tokenize_parts(model, parts, add_special=needs_bos(text))
