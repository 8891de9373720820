"""Prompt log-probabilities of the engine's model (the SCORE request of Link W;
``base.Capability.SCORING``): for each token of a sequence after the first, its log-probability
given the tokens before it, and the ``top_k`` likeliest tokens there, as evaluation harnesses ask
of ``echo`` with ``logprobs`` (a loglikelihood task scores a continuation after a context).

Scoring takes a second, small ``llama_context`` on the same weights (one sequence, ``max_tokens``
cells), made on first use, so lanes and their KV are untouched. The sequence is decoded in chunks
of ``SCORE_CHUNK`` rows with every row an output, and each chunk's rows are turned into
log-softmax values at once, so the logits held at a time are ``SCORE_CHUNK`` x vocabulary floats
(64 x 262,144 x 4 bytes = 64 MiB on Gemma 3) rather than the whole sequence's. The raw logits are
the model's (no sampling transforms, temperature 1), as vLLM's prompt logprobs are.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from basertd.schema.abi import Status
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.batch import BatchDecodeError, TokenBatch
from basertd.worker.engines.llamacpp.model import LlamaModel

SCORE_CHUNK = 64
"""Rows decoded, and logits rows held, at a time."""
MAX_TOP_K = 20
"""The most alternatives per position (OpenAI's ``logprobs`` bound)."""


@dataclass(frozen=True)
class Scores:
    """``logprobs[i]``: log P(token i+1 | tokens 0..i), float32, ``n - 1`` of them;
    ``top_ids`` / ``top_logprobs``: ``(n - 1, k)``, the ``k`` likeliest tokens at each of those
    positions, likeliest first."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class Scorer:
    """Prompt log-probabilities with ``model`` (module docstring). ``score`` raises
    EngineError(REJECT_BOUNDS) for fewer than 2 or more than ``max_tokens`` tokens, an id outside
    the vocabulary or ``top_k`` outside 0..``MAX_TOP_K``; EngineError(ERR_FATAL) when llama.cpp
    cannot make the context or decode."""

    def __init__(self, model: LlamaModel, *, max_tokens: int, n_threads: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.n_threads = n_threads
        self._ctx: L.llama_context_p | None = None
        self._batch = TokenBatch(SCORE_CHUNK, SCORE_CHUNK)

    def _open(self) -> L.llama_context_p:
        if self._ctx is None:
            cp = L.llama_context_default_params()
            cp.n_ctx = -(-self.max_tokens // 256) * 256
            cp.n_batch = cp.n_ubatch = SCORE_CHUNK
            cp.n_seq_max = 1
            cp.n_threads = cp.n_threads_batch = self.n_threads
            cp.no_perf = True
            ctx = L.llama_init_from_model(self.model.ptr, cp)
            if not ctx:
                raise EngineError(Status.ERR_FATAL, "llama.cpp cannot create the scoring context")
            self._ctx = ctx
        return self._ctx

    def score(self, tokens: np.ndarray, top_k: int) -> Scores:
        """The scores of ``tokens`` (a u32 id array; class docstring for the errors)."""
        n = tokens.shape[0]
        if not 2 <= n <= self.max_tokens:
            raise EngineError(Status.REJECT_BOUNDS, f"{n} tokens to score (2 .. {self.max_tokens})")
        if int(tokens.max()) >= self.model.n_vocab:
            raise EngineError(Status.REJECT_BOUNDS, "a token id outside the vocabulary")
        if not 0 <= top_k <= MAX_TOP_K:
            raise EngineError(Status.REJECT_BOUNDS, f"top_k {top_k} (0 .. {MAX_TOP_K})")
        ctx = self._open()
        vocab = self.model.n_vocab
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        ids = tokens.astype(np.int32)
        lp = np.empty(n - 1, np.float32)
        top_ids = np.empty((n - 1, top_k), np.uint32)
        top_lp = np.empty((n - 1, top_k), np.float32)
        b = self._batch
        for start in range(0, n - 1, SCORE_CHUNK):  # the last token is scored, never decoded
            end = min(n - 1, start + SCORE_CHUNK)
            b.clear()
            b.add(ids[start:end], start, 0, want_last=True)
            b.logits[: b.n] = 1
            try:
                b.decode(ctx, lambda s, e: None)
            except BatchDecodeError as exc:
                raise EngineError(Status.ERR_FATAL, f"scoring: {exc}") from None
            ptr = ctypes.cast(L.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float))
            rows = np.ctypeslib.as_array(ptr, (end - start, vocab)).astype(np.float64)
            peak = rows.max(axis=1, keepdims=True)
            lse = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
            nxt = ids[start + 1 : end + 1]
            lp[start:end] = rows[np.arange(end - start), nxt] - lse
            if top_k:
                part = np.argpartition(-rows, top_k - 1, axis=1)[:, :top_k]
                vals = np.take_along_axis(rows, part, axis=1)
                order = np.argsort(-vals, axis=1, kind="stable")
                top_ids[start:end] = np.take_along_axis(part, order, axis=1)
                top_lp[start:end] = np.take_along_axis(vals, order, axis=1) - lse[:, None]
        return Scores(lp, top_ids, top_lp)

    def close(self) -> None:
        """Free the scoring context (idempotent; the model belongs to the engine)."""
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
