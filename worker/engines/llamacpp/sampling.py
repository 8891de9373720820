"""Host-side token selection for the llama.cpp engine: vectorised numpy over one logits row.

A lane's token at stream position ``p`` (the p-th token this admission commits) is a pure function
of the logits row, the lane's token history and one uniform draw ``u = draw(rng_counter_base + p)``
(ABI rules 63, 67, 73). The draw is a keyed hash of the 64-bit counter (xxh3-64 with a fixed engine
key), so there is no generator state to save: a lane re-admitted after a preemption with
``decode_replay = k`` and ``rng_counter_base`` advanced by ``k`` draws exactly what the
uninterrupted lane drew. Coordinator convention: put the request's 32-bit seed in the high half of
``rng_counter_base`` (``seed << 32``) and the resumed length in the low half, so two seeds never
share draws.

Pipeline of a sampled (GPU_GUMBEL) lane, in llama.cpp's own order: logit bias, penalties
(repetition over prompt + generated, frequency / presence over generated tokens, as vLLM does), then
temperature <= 0 means argmax; otherwise top-k, top-p, min-p, temperature, and inverse-CDF
selection with ``u`` over the surviving tokens in token-id order (the same distribution as a
Gumbel-max draw, one uniform per token). GPU_GREEDY lanes take the argmax of the row plus any logit
bias; their penalties are recorded but unused (the header: params are used by GPU_GUMBEL).

A step's rows are selected together (``select_batch``): one ``argmax`` over the 2-D array of every
greedy row; sampled rows, whose truncation differs per lane, are selected row by row.

Cost per sampled row is a few O(vocab) numpy passes (no Python loop over the vocabulary); top-p
sorts only as many candidates as it needs. Greedy rows without bias or logprobs are read in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from basertd.schema.abi import MAX_TOP_LOGPROBS, Sampling, SamplingFlag, Status
from basertd.schema.tick import SamplingParams
from basertd.worker.engines.base import EngineError

ENGINE_RNG_KEY = 0x6261736572746431
"""Fixed xxh3 seed of the counter hash (the ASCII bytes "basertd1"); part of the sampling contract."""

_U64 = (1 << 64) - 1
_INV_2_53 = 1.0 / (1 << 53)


def draw(counter: int) -> float:
    """The uniform in [0, 1) for RNG counter ``counter`` (u64, wraps modulo 2**64).

    53 bits of ``xxh3_64(counter as 8 little-endian bytes, seed=ENGINE_RNG_KEY)``. Pure: the same
    counter always gives the same value, on any host (ABI rule 73)."""
    h = xxhash.xxh3_64_intdigest((counter & _U64).to_bytes(8, "little"), seed=ENGINE_RNG_KEY)
    return (h >> 11) * _INV_2_53


@dataclass(frozen=True)
class SamplerConfig:
    """How one lane picks tokens, fixed at admit.

    ``mode`` is Sampling.GPU_GREEDY or GPU_GUMBEL (HOST lanes never sample in the engine).
    ``top_k`` 0 and ``top_p`` outside (0, 1) and ``min_p`` <= 0 disable those filters;
    ``repeat_penalty`` 0 or 1 disables it. ``n_logprobs`` is -1 when the lane wants no logprobs,
    else the number of top alternatives (0..MAX_TOP_LOGPROBS). ``bias_ids`` / ``bias_values`` are a
    logit bias (token ids, additive values) or empty."""

    mode: Sampling = Sampling.GPU_GREEDY
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    repeat_penalty: float = 0.0
    freq_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    n_logprobs: int = -1
    bias_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None

    @classmethod
    def from_admit(
        cls,
        sampling: int,
        params: SamplingParams,
        want_logprobs: int,
        bias: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SamplerConfig:
        """Build from a LaneAdmit's ``sampling``, ``params`` and ``want_logprobs`` byte (0 = off,
        else 1 + number of alternatives, at most 1 + MAX_TOP_LOGPROBS; the caller validates)."""
        return cls(
            mode=Sampling(sampling) if sampling != Sampling.HOST else Sampling.GPU_GREEDY,
            temperature=float(params.temperature),
            top_k=int(params.top_k),
            top_p=float(params.top_p),
            min_p=float(params.min_p),
            repeat_penalty=float(params.repeat_penalty),
            freq_penalty=float(params.freq_penalty),
            presence_penalty=float(params.presence_penalty),
            ignore_eos=bool(params.flags & SamplingFlag.IGNORE_EOS),
            n_logprobs=min(want_logprobs - 1, MAX_TOP_LOGPROBS) if want_logprobs else -1,
            bias_ids=None if bias is None else bias[0],
            bias_values=None if bias is None else bias[1],
        )

    @property
    def sampled(self) -> bool:
        """True when the lane draws from a distribution (GUMBEL with temperature > 0)."""
        return self.mode == Sampling.GPU_GUMBEL and self.temperature > 0.0

    @property
    def penalised(self) -> bool:
        """True when any penalty changes the row (GUMBEL lanes only)."""
        if self.mode != Sampling.GPU_GUMBEL:
            return False
        rp = self.repeat_penalty
        return (rp not in (0.0, 1.0)) or self.freq_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def reads_row_in_place(self) -> bool:
        """True when the token is a plain argmax of the unmodified row (no copy needed)."""
        return not self.sampled and not self.penalised and self.bias_ids is None


def adjusted_row(row: np.ndarray, cfg: SamplerConfig, history: np.ndarray, gen_start: int) -> np.ndarray:
    """The row after logit bias and penalties: ``row`` itself when nothing applies, else a copy.

    ``row`` is float32 of shape (vocab,); ``history`` the lane's tokens so far (int32, prompt then
    generated); tokens from ``gen_start`` on were generated by this request (including a replayed
    tail). Repetition penalty divides positive and multiplies negative logits of every token in
    ``history``; frequency / presence subtract ``count * freq + presence`` for generated tokens."""
    if cfg.bias_ids is None and not cfg.penalised:
        return row
    out = row.astype(np.float32, copy=True)
    if cfg.bias_ids is not None:
        np.add.at(out, cfg.bias_ids, cfg.bias_values)
    if cfg.penalised:
        rp = cfg.repeat_penalty
        if rp not in (0.0, 1.0) and history.size:
            seen = np.unique(history)
            vals = out[seen]
            out[seen] = np.where(vals > 0, vals / rp, vals * rp)
        if (cfg.freq_penalty or cfg.presence_penalty) and history.size > gen_start:
            toks, counts = np.unique(history[gen_start:], return_counts=True)
            out[toks] -= counts.astype(np.float32) * cfg.freq_penalty + cfg.presence_penalty
    return out


def _top_p_keep(ids: np.ndarray | None, logits: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Smallest set of highest-probability candidates whose mass reaches ``top_p`` (at least one).

    ``ids`` None means the candidates are the whole row. Sorts only the top few candidates,
    widening the window until the mass is reached."""
    m = float(logits.max())
    probs = np.exp((logits - m).astype(np.float64))
    probs /= probs.sum()
    n = probs.shape[0]
    k = min(n, 64)
    while True:
        part = np.argpartition(-probs, k - 1)[:k] if k < n else np.arange(n)
        order = part[np.lexsort((part, -probs[part]))]
        cum = np.cumsum(probs[order])
        cut = int(np.searchsorted(cum, top_p, side="left"))
        if cut < k or k == n:
            keep = order[: min(cut + 1, order.shape[0])]
            break
        k = min(n, k * 8)
    sel_ids = keep if ids is None else ids[keep]
    return sel_ids, logits[keep]


_TOP_K_STRIDE = 64
"""Stride of the sample ``top_k_ids`` takes its threshold from."""


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of ``k`` largest entries of ``row`` (1-D, ``0 < k < row.size``), in no order; among
    entries tied at the k-th value, which are kept is unspecified (as with ``np.argpartition``).

    An ``argpartition`` of a 262,144-entry row takes about 1.3 ms on a CPU core, per sampled lane
    and token. Here a threshold comes from every ``_TOP_K_STRIDE``-th entry (about ``2k`` entries of
    the row are expected at or above it), one vectorised compare keeps the candidates, and only
    they are partitioned (about 0.2 ms). When fewer than ``k`` entries reach the threshold (a row
    whose large values cluster between the sampled positions), the whole row is partitioned: the
    result is always exactly the top ``k``.

    A row mostly masked to -inf (a grammar's mask) gives a threshold of -inf; then the candidates
    are the finite entries, and when fewer than ``k`` are finite the rest of the ``k`` are the
    lowest-numbered -inf ids (tied at the k-th value; never drawn). A full partition of such a row
    takes about 20 ms."""
    n = row.shape[0]
    sample = row[::_TOP_K_STRIDE]
    j = 2 * k // _TOP_K_STRIDE + 3
    if j < sample.shape[0]:
        threshold = np.partition(sample, sample.shape[0] - j)[sample.shape[0] - j]
        if threshold == -np.inf:
            cand = np.flatnonzero(row > -np.inf)
            if cand.shape[0] < k:
                return np.concatenate((cand, np.flatnonzero(row == -np.inf)[: k - cand.shape[0]]))
        else:
            cand = np.flatnonzero(row >= threshold)
        if k <= cand.shape[0] < n:
            return cand[np.argpartition(row[cand], cand.shape[0] - k)[cand.shape[0] - k :]]
    return np.argpartition(row, n - k)[n - k :]


def select(row: np.ndarray, cfg: SamplerConfig, u: float) -> int:
    """The token id chosen from ``row`` (already through ``adjusted_row``) with uniform ``u``.

    Greedy (GPU_GREEDY, or temperature <= 0) is ``argmax`` (lowest id on ties). Sampled lanes
    apply top-k, top-p, min-p and temperature, then pick by inverse CDF over the survivors sorted by
    token id."""
    if not cfg.sampled:
        return int(np.argmax(row))
    vocab = row.shape[0]
    ids: np.ndarray | None = None
    logits = row
    if 0 < cfg.top_k < vocab:
        ids = top_k_ids(row, cfg.top_k)
        logits = row[ids]
    if 0.0 < cfg.top_p < 1.0:
        ids, logits = _top_p_keep(ids, logits, cfg.top_p)
    if cfg.min_p > 0.0:
        floor = float(logits.max()) + float(np.log(cfg.min_p))
        keep = np.flatnonzero(logits >= floor)
        ids = keep if ids is None else ids[keep]
        logits = logits[keep]
    if ids is not None:
        order = np.argsort(ids, kind="stable")
        ids, logits = ids[order], logits[order]
    m = float(logits.max())
    weights = np.exp((logits.astype(np.float64) - m) / cfg.temperature)
    cdf = np.cumsum(weights)
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    j = min(j, cdf.shape[0] - 1)
    return int(ids[j]) if ids is not None else j


def select_batch(rows: np.ndarray, cfgs: Sequence[SamplerConfig], us: Sequence[float]) -> np.ndarray:
    """The token of every row of one step: ``rows`` is float32 (n, vocab), row i already through
    ``adjusted_row`` for lane i with config ``cfgs[i]`` and uniform ``us[i]``. Returns int64 (n,).

    Token-identical to ``select`` row by row: every greedy row is resolved by one ``argmax`` over
    the 2-D array (lowest id on ties); only sampled rows (GPU_GUMBEL, temperature > 0), whose
    truncation differs per lane, go through ``select`` one by one. ValueError when the lengths of
    ``cfgs`` / ``us`` differ from the row count."""
    n = rows.shape[0]
    if len(cfgs) != n or len(us) != n:
        raise ValueError(f"{n} rows, {len(cfgs)} configs, {len(us)} draws")
    sampled = [i for i, c in enumerate(cfgs) if c.sampled]
    if not sampled:
        return np.argmax(rows, axis=1)
    out = np.empty(n, np.int64)
    greedy = [i for i, c in enumerate(cfgs) if not c.sampled]
    if greedy:
        out[greedy] = np.argmax(rows[greedy], axis=1)
    for i in sampled:
        out[i] = select(rows[i], cfgs[i], us[i])
    return out


def logprobs(row: np.ndarray, token: int, n_top: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Natural-log probability of ``token`` under softmax(``row``) and the ``n_top`` most likely
    alternatives, descending (ties: lower id first), as (logprob, ids uint32, logprobs float32).

    ``row`` is the row the token was chosen from after bias and penalties, before temperature and
    truncation. ``n_top`` is clamped to [0, MAX_TOP_LOGPROBS]."""
    m = float(row.max())
    lse = m + float(np.log(np.exp((row - m).astype(np.float64)).sum()))
    lp = float(row[token]) - lse
    n_top = max(0, min(n_top, MAX_TOP_LOGPROBS, row.shape[0]))
    if n_top == 0:
        return lp, np.zeros(0, np.uint32), np.zeros(0, np.float32)
    vocab = row.shape[0]
    part = np.argpartition(row, vocab - n_top)[vocab - n_top :] if n_top < vocab else np.arange(vocab)
    order = part[np.lexsort((part, -row[part]))]
    return lp, order.astype(np.uint32), (row[order].astype(np.float64) - lse).astype(np.float32)


class LogitBiases(dict[int, tuple[np.ndarray, np.ndarray]]):
    """Registered additive logit biases by handle: (token ids int32, values float32), copied into
    each admitted lane's ``SamplerConfig``. Handles start at 1 and are never reused."""

    def __init__(self, n_vocab: int) -> None:
        super().__init__()
        self.n_vocab = n_vocab
        self._next = 1

    def logit_bias_create(self, tokens: Sequence[int], values: Sequence[float]) -> int:
        """A handle for an additive bias, or 0 when empty, mismatched, out of the vocabulary or not
        finite (ABI rule 113)."""
        ids = np.asarray(list(tokens), dtype=np.int64)
        vals = np.asarray(list(values), dtype=np.float32)
        if ids.size == 0 or ids.shape != vals.shape or ids.min() < 0 or ids.max() >= self.n_vocab:
            return 0
        if not np.all(np.isfinite(vals)):
            return 0
        h = self._next
        self._next += 1
        self[h] = (ids.astype(np.int32), vals)
        return h

    def logit_bias_free(self, handle: int) -> None:
        """Free a bias handle (lanes keep their copy); EngineError(ERR_UNKNOWN_HANDLE) if absent
        (ABI rule 113)."""
        if self.pop(handle, None) is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no logit bias {handle}")
