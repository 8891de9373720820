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

A long input may instead come in chunks, one ``embed_chunk`` call each, so that the worker's
generation ticks run between them (Link W EMBED with ``input_id``): chunk 0 clears the memory and
opens the input on sequence 0, each chunk decodes at the positions after the previous one and
attends to their KV (kept in this context between calls; causal attention needs nothing later),
and the last one returns the vector. llama.cpp's MEAN pooling of one call averages only that
call's outputs of the sequence while attending to its earlier KV, so the input's mean is
``sum(len_i * mean_i) / sum(len_i)`` over the chunks' pooled outputs ``mean_i`` (accumulated in
float64), then normalised: the one-pass vector up to float noise of the batch shape (measured on
the tiny model and on the default model, cosine 1 - 1e-6 or closer). At most one input is open
at a time; a new chunk 0 is refused (EBUSY) while it is.

``embed`` runs beside an open input, so short inputs are not held up by a long one: their
sequences are 1 .. ``max_inputs - 1`` (the open input keeps sequence 0 and its cells), each
group's cells are removed after its call (``llama_memory_seq_rm``), and an input sees only its
own sequence's KV, as without the open one. Only the cells the open input leaves are theirs:
inputs that do not fit beside it are refused (EBUSY) until it finishes.
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
    over ``max_tokens`` tokens or an id outside the vocabulary, EngineError(EBUSY) for an input
    that does not fit beside the chunked input open now, EngineError(ERR_FATAL) when llama.cpp
    cannot make the context or decode (which also drops an open input). ``embed_chunk`` and
    ``embed_cancel``: the chunked input (module docstring), errors in their docstrings; every
    refusal changes nothing."""

    def __init__(self, model: LlamaModel, *, max_tokens: int, max_inputs: int, n_threads: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.max_inputs = max_inputs
        self.n_threads = n_threads
        self.dim = int(L.llama_model_n_embd(model.ptr))
        self._ctx: L.llama_context_p | None = None
        self._batch: TokenBatch | None = None
        self._input: _OpenInput | None = None

    @property
    def open_input(self) -> int:
        """The id of the chunked input open now, 0 when none."""
        return 0 if self._input is None else self._input.input_id

    def _open(self) -> L.llama_context_p:
        if self._ctx is None:
            cp = L.llama_context_default_params()
            # n_batch = n_ubatch = n_ctx: llama.cpp pads n_ctx to 256 cells, and a mean-pooling
            # graph reserved with a smaller ubatch fails ggml_can_mul_mat (aborting the worker)
            # for a context length that is not a multiple of 256.
            cp.n_ctx = cp.n_batch = cp.n_ubatch = -(-self.max_tokens // 256) * 256
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
            self._check_vocab(toks, f"input {i}")
        held = 0 if self._input is None else self._input.tokens  # cells of the open input
        room, first_seq = self.max_tokens - held, 0 if self._input is None else 1
        longest = max(int(t.shape[0]) for t in inputs)
        if longest > room:
            assert self._input is not None
            raise EngineError(
                Status.EBUSY,
                f"embed: an input of {longest} tokens does not fit beside chunked input "
                f"{self._input.input_id} ({room} of {self.max_tokens} cells free)",
            )
        ctx = self._open()
        out = np.empty((len(inputs), self.dim), np.float32)
        group: list[int] = []
        used = 0
        for i, toks in enumerate(inputs):
            if group and (used + toks.shape[0] > room or first_seq + len(group) == self.max_inputs):
                self._decode(ctx, inputs, group, out, first_seq)
                group, used = [], 0
            group.append(i)
            used += toks.shape[0]
        if group:
            self._decode(ctx, inputs, group, out, first_seq)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        np.divide(out, norms, out=out, where=norms > 0)
        return out

    def _decode(
        self,
        ctx: L.llama_context_p,
        inputs: Sequence[np.ndarray],
        group: list[int],
        out: np.ndarray,
        first_seq: int,
    ) -> None:
        """Pool ``group``'s inputs in one call on sequences ``first_seq`` .. on: with 0 the memory
        is cleared first; with 1 (an input is open on sequence 0) only those sequences' cells go,
        after the call too, so the open input keeps its KV and the room for its next chunk."""
        batch = self._batch
        assert batch is not None
        mem = L.llama_get_memory(ctx)
        seqs = range(first_seq, first_seq + len(group))
        if first_seq == 0:
            L.llama_memory_clear(mem, True)
        batch.clear()
        for seq, i in zip(seqs, group, strict=True):
            batch.add(inputs[i].astype(np.int32, copy=False), 0, seq, want_last=True)
        batch.logits[: batch.n] = 1  # every token an output: llama.cpp pools a sequence's outputs
        try:
            batch.decode(ctx, lambda start, end: None)
            for seq, i in zip(seqs, group, strict=True):
                out[i] = _pooled(ctx, seq, self.dim)
        except (BatchDecodeError, EngineError) as exc:
            self._input = None  # its KV may be gone with the failed call
            raise EngineError(Status.ERR_FATAL, f"embeddings: {exc}") from None
        finally:
            if first_seq:
                for seq in seqs:
                    L.llama_memory_seq_rm(mem, seq, -1, -1)

    def embed_chunk(self, input_id: int, chunk: int, tokens: np.ndarray, last: bool) -> np.ndarray | None:
        """Chunk ``chunk`` (0, 1, ... in order) of the chunked input ``input_id`` (non-zero, the
        caller's name for it), ``tokens`` (token ids, at least one) at the positions after the
        chunks before; returns the input's ``(dim,)`` float32 unit vector when ``last`` (the input
        is then closed), else None (module docstring). Raises EngineError: EBUSY for chunk 0 while
        an input is open (``embed_cancel`` it first); ERR_UNKNOWN_HANDLE for a later chunk of an
        input that is not open (never opened, finished, cancelled, or lost with the worker);
        REJECT_BOUNDS for input id 0, a chunk out of order, no tokens, an id outside the
        vocabulary or the input growing past ``max_tokens``; ERR_FATAL when llama.cpp cannot make
        the context or decode (the input is dropped). A refusal changes nothing: an open input
        stays open for its next chunk."""
        if input_id == 0:
            raise EngineError(Status.REJECT_BOUNDS, "input id 0 names no chunked input")
        cur = self._input
        if chunk == 0:
            self._refuse_while_open(f"chunk 0 of input {input_id}")
            pos = 0
        elif cur is None or cur.input_id != input_id:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"input {input_id} is not open (chunk {chunk} came)")
        elif chunk != cur.next_chunk:
            raise EngineError(
                Status.REJECT_BOUNDS, f"input {input_id}: chunk {chunk} came, chunk {cur.next_chunk} expected"
            )
        else:
            pos = cur.tokens
        n = int(tokens.shape[0])
        if n == 0 or pos + n > self.max_tokens:
            raise EngineError(
                Status.REJECT_BOUNDS,
                f"input {input_id}: chunk {chunk} of {n} tokens after {pos} (1 .. {self.max_tokens} in all)",
            )
        self._check_vocab(tokens, f"input {input_id}")
        ctx = self._open()
        batch = self._batch
        assert batch is not None
        if chunk == 0:
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            cur = self._input = _OpenInput(input_id, self.dim)
        assert cur is not None
        batch.clear()
        batch.add(tokens.astype(np.int32, copy=False), pos, 0, want_last=True)
        batch.logits[: batch.n] = 1  # every token an output: the pooled mean of this call's tokens
        try:
            batch.decode(ctx, lambda start, end: None)
            mean = _pooled(ctx, 0, self.dim)
        except (BatchDecodeError, EngineError) as exc:
            self._input = None
            raise EngineError(Status.ERR_FATAL, f"embeddings: {exc}") from None
        cur.total += n * mean.astype(np.float64)
        cur.tokens += n
        cur.next_chunk += 1
        if not last:
            return None
        self._input = None
        vec = (cur.total / cur.tokens).astype(np.float32)
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    def embed_cancel(self, input_id: int) -> None:
        """Drop the chunked input ``input_id`` (its KV goes with the next chunk 0 or ``embed``).
        Raises EngineError(ERR_UNKNOWN_HANDLE) when it is not the one open."""
        if self._input is None or self._input.input_id != input_id:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"input {input_id} is not open")
        self._input = None

    def _refuse_while_open(self, what: str) -> None:
        if self._input is not None:
            raise EngineError(
                Status.EBUSY, f"{what}: chunked input {self._input.input_id} is open (one at a time)"
            )

    def _check_vocab(self, toks: np.ndarray, what: str) -> None:
        if int(toks.max()) >= self.model.n_vocab:
            raise EngineError(Status.REJECT_BOUNDS, f"{what}: a token id outside the vocabulary")

    def close(self) -> None:
        """Free the embeddings context (idempotent; the model belongs to the engine)."""
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
            self._batch = None
        self._input = None


class _OpenInput:
    """The chunked input open in an ``Embedder``: its id, the next chunk's index, the tokens
    decoded so far and ``total``, the ``(dim,)`` float64 sum of ``len_i * mean_i`` over them."""

    def __init__(self, input_id: int, dim: int) -> None:
        self.input_id = input_id
        self.next_chunk = 0
        self.tokens = 0
        self.total = np.zeros(dim, np.float64)


def _pooled(ctx: L.llama_context_p, seq: int, dim: int) -> np.ndarray:
    """Sequence ``seq``'s pooled output of the last ``llama_decode``, ``(dim,)`` float32, a view
    of llama.cpp's buffer (valid until the next decode). EngineError(ERR_FATAL) when none."""
    ptr = L.llama_get_embeddings_seq(ctx, seq)
    if not ptr:
        raise EngineError(Status.ERR_FATAL, "llama.cpp returned no pooled embedding")
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (dim,))
