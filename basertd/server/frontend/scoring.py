"""Prompt log-probabilities for ``echo`` with ``logprobs``: each prompt token after the first,
scored by the model's worker given the tokens before it (Link W SCORE, between ticks; the
engine's ``score``), with ``top_k`` alternatives per position (DESIGN.md "Client API")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from basertd.schema.client import ErrorCode
from basertd.server.frontend.limits import check_prompt_tokens
from basertd.server.request.record import AdmissionError

MAX_TOP_K = 20
"""The most alternatives per position (OpenAI's ``logprobs`` bound)."""


@dataclass(frozen=True)
class PromptScores:
    """``logprobs[i]``: natural-log probability of prompt token i+1 given tokens 0..i (float32,
    n-1 values; none for the first token); ``top_ids`` / ``top_logprobs``: ``(n-1, top_k)``, the
    likeliest tokens at each of those positions, likeliest first."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class ScoreFleet(Protocol):
    """What scoring needs of the fleet (``basertd.server.fleet.Fleet``)."""

    def route(self, model: str) -> int: ...

    def context_length(self, worker_id: int) -> int: ...

    async def score(self, worker_id: int, tokens: list[int], top_k: int) -> Any: ...


async def score(
    fleet: ScoreFleet, vocab_size: int, model: str, tokens: list[int], top_k: int
) -> PromptScores:
    """The scores of ``tokens`` with ``model`` ("" = any). A one-token prompt has nothing to
    score (empty arrays, no worker asked). Raises ``AdmissionError``: NOT_FOUND, INVALID_REQUEST
    (ids outside the vocabulary, ``top_k`` outside 0..``MAX_TOP_K``, an engine that scores
    nothing), CONTEXT_LENGTH_EXCEEDED, WORKER_FAILED, TIMEOUT."""
    if not 0 <= top_k <= MAX_TOP_K:
        raise AdmissionError(ErrorCode.INVALID_REQUEST, f"logprobs must be 0 .. {MAX_TOP_K}, got {top_k}")
    wid = fleet.route(model)
    check_prompt_tokens(tokens, vocab_size, fleet.context_length(wid), what="prompt")
    if len(tokens) < 2:
        empty = np.empty((0, top_k))
        return PromptScores(np.empty(0, np.float32), empty.astype(np.uint32), empty.astype(np.float32))
    r = await fleet.score(wid, tokens, top_k)
    n = len(tokens) - 1
    return PromptScores(r.logprobs, r.top_ids.reshape(n, top_k), r.top_logprobs.reshape(n, top_k))
