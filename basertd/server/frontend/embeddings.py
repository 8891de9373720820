"""Embedding requests: inputs checked and tokenized here, pooled by the model's worker between its
ticks (Link W EMBED; the pooling is the engine's, ``worker/engines/llamacpp/embed.py``).

An input is a text (tokenized with the worker's vocabulary, BOS as for a prompt) or a list of
token ids. At most ``MAX_EMBED_INPUTS`` inputs a request, each non-empty and at most the worker's
context length. Inputs go to the worker in parts of at most ``EMBED_PART_TOKENS`` tokens, one
EMBED per part, so a large request costs the generation lanes on that worker one short pause
between two ticks per part rather than one long one. An input longer than a part goes alone, in
chunks of ``EMBED_PART_TOKENS`` (``Fleet.embed_chunked``: the worker keeps the input's KV between
the chunks and pools across them, ``schema.link.Embed``), so it too costs the lanes one part's
pause at a time, and its vector is the one-pass one up to float noise. An engine serves chunks if
it serves embeddings at all (``Capability.EMBEDDINGS``); the reference engine serves neither.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from basertd.schema.client import ErrorCode
from basertd.server.frontend.limits import check_prompt_bytes, check_prompt_tokens
from basertd.server.request.record import AdmissionError

MAX_EMBED_INPUTS = 256
"""Most inputs one embedding request may carry."""
EMBED_PART_TOKENS = 128
"""Tokens sent to the worker in one EMBED (a longer input goes alone). Each part pauses the worker's
generation lanes for its whole forward pass, and a pooled embedding costs about twice a prefill's
work per token: llama.cpp computes the output layer for every token of an embeddings context, and
on the default model (262,144-entry vocabulary) that layer outweighs the rest. Measured on the
default model, one thread: 64 tokens in 0.29 s as a prefill, 0.62 s as an embedding. 128 tokens
keeps a part's pause near one decode tick; 2,048 stalled the lanes for tens of seconds (now a
long input comes in chunks of this size)."""


@dataclass(frozen=True)
class Embeddings:
    """``vectors``: ``(n, dim)`` float32, unit length, row i of input i; ``prompt_tokens``: the
    tokens embedded, all inputs together; ``worker_id``: the worker that pooled them."""

    vectors: np.ndarray
    prompt_tokens: int
    worker_id: int


class EmbedFleet(Protocol):
    """What embedding needs of the fleet (``basertd.server.fleet.Fleet``)."""

    def route(self, model: str) -> int: ...

    def context_length(self, worker_id: int) -> int: ...

    async def embed(self, worker_id: int, inputs: list[list[int]]) -> np.ndarray: ...

    async def embed_chunked(self, worker_id: int, tokens: list[int], chunk_tokens: int) -> np.ndarray: ...

    def embedding_dim(self, worker_id: int) -> int | None: ...


async def embed(
    fleet: EmbedFleet,
    encode: Callable[[int, str], Awaitable[list[int]]],
    vocab_size: Callable[[int], int],
    tokenizer: Callable[[int], object],
    model: str,
    inputs: list[str] | list[list[int]],
    *,
    truncate: bool = False,
    dimensions: int | None = None,
) -> Embeddings:
    """The embeddings of ``inputs`` with ``model`` ("" = any). Raises ``AdmissionError``:
    NOT_FOUND (no worker serves the model), INVALID_REQUEST (no input, over ``MAX_EMBED_INPUTS``,
    an empty input, ids outside the vocabulary, an engine without embeddings),
    CONTEXT_LENGTH_EXCEEDED (an input over the context length, unless ``truncate``: then only its
    first context-length tokens are embedded; ``dimensions`` other than the model's, checked before
    any input is embedded when the engine reports its size), WORKER_FAILED (its worker died
    ``max_crash_resumes`` times, or none serves), TIMEOUT (one part or chunk took over
    ``between_ticks.EMBED_TIMEOUT_S``)."""
    if not inputs:
        raise AdmissionError(
            ErrorCode.INVALID_REQUEST, "input must hold at least one text or token list", "input"
        )
    if len(inputs) > MAX_EMBED_INPUTS:
        raise AdmissionError(
            ErrorCode.INVALID_REQUEST, f"input holds {len(inputs)} items, at most {MAX_EMBED_INPUTS}", "input"
        )
    wid = fleet.route(model)
    if dimensions is not None:
        _check_dimensions(dimensions, fleet.embedding_dim(wid))
    ctx = fleet.context_length(wid)
    lists: list[list[int]] = []
    for i, item in enumerate(inputs):
        what = f"input[{i}]"
        if isinstance(item, str):
            if not item:  # tokenizing "" gives BOS alone: an embedding of nothing
                raise AdmissionError(ErrorCode.INVALID_REQUEST, f"{what} is empty", "input")
            if not truncate:
                check_prompt_bytes(item, ctx, tokenizer(wid), what=what, param="input")
            toks = await encode(wid, item)
        else:
            toks = list(item)
        if truncate:
            toks = toks[:ctx]
        if not toks:
            raise AdmissionError(ErrorCode.INVALID_REQUEST, f"{what} is empty", "input")
        if len(toks) > ctx:
            raise AdmissionError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"{what} holds {len(toks)} tokens, over the context length ({ctx})",
                "input",
            )
        check_prompt_tokens(toks, vocab_size(wid), ctx, what=what, param="input")
        lists.append(toks)
    parts: list[np.ndarray] = []
    start = 0
    while start < len(lists):
        if len(lists[start]) > EMBED_PART_TOKENS:
            vector = await fleet.embed_chunked(wid, lists[start], EMBED_PART_TOKENS)
            parts.append(vector.reshape(1, -1))
            start += 1
            continue
        end, used = start + 1, len(lists[start])
        while end < len(lists) and used + len(lists[end]) <= EMBED_PART_TOKENS:
            used += len(lists[end])
            end += 1
        parts.append(await fleet.embed(wid, lists[start:end]))
        start = end
    vectors = np.concatenate(parts)
    if dimensions is not None:  # an engine that does not report its size: known now
        _check_dimensions(dimensions, vectors.shape[1])
    return Embeddings(vectors, sum(len(t) for t in lists), wid)


def _check_dimensions(asked: int, dim: int | None) -> None:
    """INVALID_REQUEST (param ``dimensions``) unless ``asked`` is the model's ``dim`` (None:
    not known yet, nothing checked): the model is not trained for shorter vectors."""
    if dim is not None and asked != dim:
        raise AdmissionError(
            ErrorCode.INVALID_REQUEST,
            f"dimensions must be {dim}: this model's embeddings have {dim} dimensions and it is not "
            "trained for shorter ones",
            "dimensions",
        )
