"""Pooled embeddings of the engine's model (the EMBED request of Link W; ``base.Capability.EMBEDDINGS``).

The generation context holds the lanes; embeddings take a second, small ``llama_context`` on the
same weights with ``embeddings`` on and mean pooling: an input's vector is the mean of the last
layer's hidden states over its tokens, L2-normalised (OpenAI's embeddings are unit vectors). A
decoder model has no trained pooling head; mean pooling is what llama.cpp's server and
llama-cpp-python apply to such a model. The context is made on first use (a worker that never
embeds pays nothing) with ``max_tokens`` cells (the lane context length: an input that fits a
lane fits here) and ``max_inputs`` sequences, on the engine's batch threads.

Inputs are packed, in order, into ``llama_decode`` calls of at most ``max_tokens`` tokens and
``max_inputs`` sequences, every token an output (llama.cpp pools a sequence's outputs within one
call); the memory is cleared before each call, so no input sees another.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp as L
import numpy as np

from basertd.schema.abi import Status
from basertd.worker.engines.base import EngineError
from basertd.worker.engines.llamacpp.batch import BatchDecodeError, TokenBatch
from basertd.worker.engines.llamacpp.model import LlamaModel

EMBED_INPUTS = 16
"""Most inputs pooled in one ``llama_decode`` (sequences of the embeddings context)."""


class Embedder:
    """Mean-pooled, L2-normalised embeddings of ``model`` (module docstring). ``dim`` is the
    model's hidden size. ``embed`` raises EngineError(REJECT_BOUNDS) for an empty input or one
    over ``max_tokens`` tokens or an id outside the vocabulary, EngineError(ERR_FATAL) when
    llama.cpp cannot make the context or decode."""

    def __init__(self, model: LlamaModel, *, max_tokens: int, max_inputs: int, n_threads: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.max_inputs = max_inputs
        self.n_threads = n_threads
        self.dim = int(L.llama_model_n_embd(model.ptr))
        self._ctx: L.llama_context_p | None = None
        self._batch: TokenBatch | None = None

    def _open(self) -> L.llama_context_p:
        if self._ctx is None:
            cp = L.llama_context_default_params()
            cp.n_ctx = -(-self.max_tokens // 256) * 256
            cp.n_batch = cp.n_ubatch = self.max_tokens
            cp.n_seq_max = self.max_inputs
            cp.n_threads = cp.n_threads_batch = self.n_threads
            cp.embeddings = True
            cp.pooling_type = L.LLAMA_POOLING_TYPE_MEAN
            cp.kv_unified = True
            cp.no_perf = True
            ctx = L.llama_init_from_model(self.model.ptr, cp)
            if not ctx:
                raise EngineError(Status.ERR_FATAL, "llama.cpp cannot create the embeddings context")
            self._ctx = ctx
            self._batch = TokenBatch(self.max_tokens, self.max_tokens)
        return self._ctx

    def embed(self, inputs: Sequence[np.ndarray]) -> np.ndarray:
        """The embeddings of ``inputs`` (token-id arrays) as an ``(len(inputs), dim)`` float32
        array, row i of input i (class docstring for the errors)."""
        for i, toks in enumerate(inputs):
            if toks.shape[0] == 0 or toks.shape[0] > self.max_tokens:
                raise EngineError(
                    Status.REJECT_BOUNDS, f"input {i}: {toks.shape[0]} tokens (1 .. {self.max_tokens})"
                )
            if int(toks.max()) >= self.model.n_vocab:
                raise EngineError(Status.REJECT_BOUNDS, f"input {i}: a token id outside the vocabulary")
        ctx = self._open()
        out = np.empty((len(inputs), self.dim), np.float32)
        group: list[int] = []
        used = 0
        for i, toks in enumerate(inputs):
            if group and (used + toks.shape[0] > self.max_tokens or len(group) == self.max_inputs):
                self._decode(ctx, inputs, group, out)
                group, used = [], 0
            group.append(i)
            used += toks.shape[0]
        if group:
            self._decode(ctx, inputs, group, out)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        np.divide(out, norms, out=out, where=norms > 0)
        return out

    def _decode(
        self, ctx: L.llama_context_p, inputs: Sequence[np.ndarray], group: list[int], out: np.ndarray
    ) -> None:
        batch = self._batch
        assert batch is not None
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        batch.clear()
        for seq, i in enumerate(group):
            batch.add(inputs[i].astype(np.int32, copy=False), 0, seq, want_last=True)
        batch.logits[: batch.n] = 1  # every token an output: llama.cpp pools a sequence's outputs
        try:
            batch.decode(ctx, lambda start, end: None)
        except BatchDecodeError as exc:
            raise EngineError(Status.ERR_FATAL, f"embeddings: {exc}") from None
        for seq, i in enumerate(group):
            ptr = L.llama_get_embeddings_seq(ctx, seq)
            if not ptr:
                raise EngineError(Status.ERR_FATAL, "llama.cpp returned no pooled embedding")
            out[i] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.dim,))

    def close(self) -> None:
        """Free the embeddings context (idempotent; the model belongs to the engine)."""
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
            self._batch = None
