"""``model.token_mask``: llama.cpp's per-token vocabulary predicates evaluated by one C loop
(``native/brt_scan.c``) give what one ctypes call per token gives (the end-of-generation set the
engine stops on, ``LlamaModel.eog_mask`` / ``eog_ids``)."""

from __future__ import annotations

import llama_cpp as L
import numpy as np

from basertd.worker.engines.llamacpp.model import LlamaModel, token_mask


def _per_token(pred, vocab: int, n: int) -> np.ndarray:
    return np.array([bool(pred(vocab, t)) for t in range(n)], dtype=bool)


def test_the_c_scan_matches_one_call_per_token(tiny_gguf):
    m = LlamaModel(tiny_gguf)
    try:
        want = _per_token(L.llama_vocab_is_eog, m.vocab, m.n_vocab)
        assert m.eog_mask.dtype == bool and m.eog_mask.shape == (m.n_vocab,)
        assert np.array_equal(m.eog_mask, want)
        assert m.eog_ids == tuple(int(t) for t in np.flatnonzero(want)) and 2 in m.eog_ids
        control = token_mask(L.llama_vocab_is_control, m.vocab, m.n_vocab)
        assert np.array_equal(control, _per_token(L.llama_vocab_is_control, m.vocab, m.n_vocab))
        assert control.any() and not control.all()
        assert token_mask(L.llama_vocab_is_eog, m.vocab, 0).shape == (0,)
    finally:
        m.close()
