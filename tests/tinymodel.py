"""Tiny random-weight GGUF models for fast tests of anything that loads a model through llama.cpp.

``write_tiny_gguf(path)`` writes a complete, loadable ``llama`` or ``gemma3`` model of a few
hundred kilobytes with the ``gguf`` package: an SPM ("llama") vocabulary with byte fallback, so any
UTF-8 text tokenizes, and deterministic random F32 weights drawn from ``seed``. llama.cpp loads it
in milliseconds and decodes a tick of 8 lanes in well under a millisecond with one thread
(``../shared/reference/llamacpp-notes.md`` section 5), which is what lets the engine, worker and
coordinator tests run a real llama.cpp context instead of a stand-in.

The ``gemma3`` variant has a sliding window (``n_swa`` tokens) on layer 0 and a global layer 1
(pattern 2), so the sliding-window pitfalls of prefix sharing show up at test sizes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# Vocabulary: 3 specials, 256 byte tokens, then word pieces. Ids are stable: tests may rely on them.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_BYTE_BASE = 3
_PIECES = [
    "\u2581",
    "\u2581the",
    "\u2581a",
    "\u2581hello",
    "\u2581world",
    "\u2581is",
    "\u2581of",
    "\u2581and",
]
_LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]

ARCHES = ("llama", "gemma3")


BASE_VOCAB = 3 + 256 + len(_PIECES) + len(_LETTERS)
"""Size of the tiny vocabulary without padding (293)."""


def tiny_vocab(n_vocab: int | None = None) -> tuple[list[str], list[float], list[int]]:
    """The tiny model's vocabulary as (tokens, scores, token types).

    ``<unk>`` 0, ``<s>`` 1 (BOS), ``</s>`` 2 (EOS, the only end-of-generation token), the 256
    byte tokens ``<0x00>``..``<0xFF>`` at 3..258, then "▁"-pieces and the letters a-z (293 tokens in
    all); ``n_vocab`` > 293 pads with ordinary pieces ``▁w0``, ``▁w1``, ... Raises ValueError below 293."""
    n_vocab = BASE_VOCAB if n_vocab is None else n_vocab
    if n_vocab < BASE_VOCAB:
        raise ValueError(f"the tiny vocabulary has at least {BASE_VOCAB} tokens")
    extra = [f"\u2581w{i}" for i in range(n_vocab - BASE_VOCAB)]
    words = _PIECES + _LETTERS + extra
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL] * len(words)
    )
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(words))]
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_layer: int = 2,
    context_length: int = 4096,
    n_swa: int = 32,
    n_vocab: int | None = None,
    quiet_eos: bool = False,
) -> Path:
    """Write a tiny random-weight model to ``path`` and return it as a ``Path``.

    ``arch`` is ``"llama"`` or ``"gemma3"``; sizes are in elements (``n_embd`` model width,
    ``n_ff`` feed-forward width), heads in heads, ``context_length`` and ``n_swa`` (gemma3's
    sliding window, layer 0 only) in tokens. Weights are F32 from ``numpy.random.default_rng(seed)``
    with standard deviations 1.0 (embedding), 0.5 (output) and 0.2 (everything else), so the logits
    are spread out and different contexts give different tokens. ``n_vocab`` pads the vocabulary
    (``tiny_vocab``); ``quiet_eos`` zeroes EOS's output row, so its logit is always 0 among logits
    of spread about 4: greedy decoding never ends and sampling at temperature 1 almost never does
    (like the reference engine's default, which never draws EOS). The same arguments always write
    the same bytes. Raises ValueError for an
    unknown ``arch``, a width not divisible by ``n_head`` or a vocabulary under 293 tokens.
    """
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be a multiple of n_head, and n_head a multiple of n_head_kv")
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, scores, types = tiny_vocab(n_vocab)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(n_swa)
        w.add_sliding_window_pattern(2)  # layer 0 windowed, layer 1 global
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))  # every tensor is F32, as converters record it
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return (1.0 + normal((n,), 0.05)).astype(np.float32)

    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    w.add_tensor(names[T.TOKEN_EMBD] + ".weight", normal((n_vocab, n_embd), 1.0))
    w.add_tensor(names[T.OUTPUT_NORM] + ".weight", ones(n_embd))
    output = normal((n_vocab, n_embd), 0.5)
    if quiet_eos:
        output[EOS_ID] = 0.0
    w.add_tensor(names[T.OUTPUT] + ".weight", output)
    for i in range(n_layer):

        def blk(t: gguf.MODEL_TENSOR, i: int = i) -> str:
            return names[t].format(bid=i) + ".weight"

        w.add_tensor(blk(T.ATTN_NORM), ones(n_embd))
        w.add_tensor(blk(T.ATTN_Q), normal((n_head * head_dim, n_embd), 0.2))
        w.add_tensor(blk(T.ATTN_K), normal((n_head_kv * head_dim, n_embd), 0.2))
        w.add_tensor(blk(T.ATTN_V), normal((n_head_kv * head_dim, n_embd), 0.2))
        w.add_tensor(blk(T.ATTN_OUT), normal((n_embd, n_head * head_dim), 0.2))
        w.add_tensor(blk(T.FFN_NORM), ones(n_embd))
        w.add_tensor(blk(T.FFN_GATE), normal((n_ff, n_embd), 0.2))
        w.add_tensor(blk(T.FFN_UP), normal((n_ff, n_embd), 0.2))
        w.add_tensor(blk(T.FFN_DOWN), normal((n_embd, n_ff), 0.2))
        if arch == "gemma3":
            w.add_tensor(blk(T.ATTN_POST_NORM), ones(n_embd))
            w.add_tensor(blk(T.FFN_POST_NORM), ones(n_embd))
            w.add_tensor(blk(T.ATTN_Q_NORM), ones(head_dim))
            w.add_tensor(blk(T.ATTN_K_NORM), ones(head_dim))

    path.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
