"""``echo: true`` on ``/v1/completions``: each choice starts with its prompt, and with ``logprobs``
the prompt's tokens come with their log-probabilities (the first token's ``null``), as vLLM
answers — what evaluation harnesses' loglikelihood tasks read (lm-eval's ``local-completions``
sends ``echo: true, logprobs: 1, max_tokens: 1`` and scores the prompt's continuation tokens).

The prompt's tokens are the ones the generation runs on (a text prompt is tokenized once, here,
and the ids are sent), scored by the model's worker between ticks (``FrontendPort.score``: the raw
model distribution, before any sampling parameter). ``max_tokens: 0`` with ``echo`` generates
nothing and answers the prompt alone (``finish_reason: "length"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from basertd.server.transport.http.openai import wire
from basertd.server.transport.http.port import FrontendPort


@dataclass(frozen=True)
class Echo:
    """One prompt's echo: ``tokens`` (its ids), ``text`` (as the client gave it, or its ids
    detokenized), ``logprobs`` (the completions logprobs object of its tokens, or None)."""

    tokens: list[int]
    text: str
    logprobs: dict[str, Any] | None


async def echo_of(frontend: FrontendPort, model: str, prompt: str | list[int], top_k: int | None) -> Echo:
    """The echo of ``prompt`` (``top_k``: the request's ``logprobs``, None for none). Raises
    ``AdmissionError`` (the tokenizer's and the scoring's)."""
    if isinstance(prompt, str):
        tokens, text = await frontend.tokenize(model, prompt), prompt
    else:
        tokens, text = list(prompt), await frontend.detokenize(model, list(prompt))
    if top_k is None:
        return Echo(tokens, text, None)
    scores = await frontend.score(model, tokens, top_k)
    pieces = dict(zip(tokens, frontend.pieces(model, tokens), strict=True))
    pieces.update(zip(ids := scores.top_ids.reshape(-1).tolist(), frontend.pieces(model, ids), strict=True))
    lp = wire.Logprobs(False, pieces.__getitem__)
    obj = lp.prompt_object(
        tokens, scores.logprobs.tolist(), scores.top_ids.tolist(), scores.top_logprobs.tolist()
    )
    return Echo(tokens, text, obj)


def join(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects one after the other (either may be None)."""
    if first is None or then is None:
        return first if then is None else then
    return {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
