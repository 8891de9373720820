"""The engine's measured rate curve: tokens per second of one ``llama_decode`` by its row count.

Every ``llama_decode`` the engine runs is timed; its rows (prefill tokens plus decode tokens) and
wall time go into the bucket of the largest power of two <= rows (1, 2, 4, ... 4096), as an
exponentially weighted mean of tokens per second (weight ``alpha`` for the newest call). Prefill
on llama.cpp is far cheaper per token in large batches than in small ones (one weight pass per
ubatch), so the curve tells a scheduler how large a prefill chunk must be to run near the engine's
best rate (DESIGN.md "Scheduling": prefill budgets come from this measured curve, not a constant).
"""

from __future__ import annotations

MAX_BUCKET = 4096


def bucket(rows: int) -> int:
    """The bucket of a call of ``rows`` rows (>= 1): the largest power of two <= rows, capped."""
    return min(1 << (max(1, rows).bit_length() - 1), MAX_BUCKET)


class RateCurve:
    """Tokens per second per row-count bucket, measured online. ``alpha`` in (0, 1]."""

    def __init__(self, alpha: float = 0.25) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._rate: dict[int, float] = {}
        self._calls: dict[int, int] = {}

    def note(self, rows: int, ns: int) -> None:
        """One llama_decode of ``rows`` rows took ``ns`` nanoseconds (ignored when either is <= 0)."""
        if rows <= 0 or ns <= 0:
            return
        b = bucket(rows)
        r = rows * 1e9 / ns
        old = self._rate.get(b)
        self._rate[b] = r if old is None else old + self.alpha * (r - old)
        self._calls[b] = self._calls.get(b, 0) + 1

    def curve(self) -> list[tuple[int, float]]:
        """``[(bucket_rows, tokens_per_s)]`` for every bucket measured so far, smallest first."""
        return sorted(self._rate.items())

    def stats(self) -> dict[str, int]:
        """``rate_tok_s_b<rows>`` (whole tokens per second) and ``rate_calls_b<rows>`` per bucket,
        for ``Engine.stats`` (the coordinator sees them in every PONG)."""
        out: dict[str, int] = {}
        for b, r in sorted(self._rate.items()):
            out[f"rate_tok_s_b{b}"] = int(r)
            out[f"rate_calls_b{b}"] = self._calls[b]
        return out
