"""``VerifyCost``: what verifying drafts costs on this engine, measured live, in plain decode steps
(the ``pays`` rule of ``speculation``).

A round that verifies ``m >= 1`` draft rows costs about ``base + per_draft * m`` plain decode
steps. Both numbers depend on the machine: on a CPU each row carries its share of every matrix
product and a vocabulary-wide output row (``VERIFY_BASE`` / ``VERIFY_PER_DRAFT``, measured once on
a 2-core CPU, ``bench/bench_verify_cost.py``), while on a GPU rows cost far less (an H200, the
default model, every layer offloaded, each call synchronized with the device: 1.09-1.22,
1.23-1.25, 1.51-1.56 and 2.55-2.57 steps of 1.1 ms for m = 1, 3, 7, 15). So the engine times its
own calls.

What is measured: the decode-only ``llama_decode`` of each round (``rounds``): one row per
forwarding lane (``lanes``, n) and the draft rows of its speculative lanes (``drafts``, m, summed
over lanes), nothing else. A round whose decode rows share a ``llama_decode`` with prefill rows
(fewer than ``rounds.SPLIT_MIN_PREFILL_ROWS`` of them) is not noted: a chunk's rows would be
counted as the round's cost; a split round's decode part is noted. The clock includes the
device's work (``batch.TokenBatch.decode`` synchronizes a part with logits rows before stopping
it: on a GPU ``llama_decode`` returns once the work is queued).

The model, per engine: a plain call (m = 0) of n lanes takes ``plain(n)``, the median of the last
``PLAIN_WINDOW`` plain calls of n lanes. A verify call of n lanes and m drafts taking ``t`` is the
sample ``(m, t / plain(n))``: its cost in plain steps of its own batch, so rounds of different
batch sizes fit one line. ``base`` and ``per_draft`` are the Theil-Sen line of the last
``FIT_WINDOW`` samples, fitted again every ``REFIT_EVERY`` samples (the median of the slopes
between every two samples of different m, and the median of ``y - per_draft * m`` as the
intercept). ``base`` keeps the intercept: on the CPU a
2-row call costs about 1.3 steps of a 1-row call (the step from a matrix-vector to a
matrix-matrix product), which a line through (0, 1) would spread over every draft. ``base`` is at
least 1 and ``per_draft`` at least 0 (a verify round is never cheaper than the plain step it
replaces; a noisy fit below that would make drafting look free): below 1, the line goes through
(0, 1) with the median slope of ``(y - 1) / m``. When every sample has the same m the slope keeps
its last value (the default's before a first fit).

Why medians of windows rather than means: the box is shared (the coordinator, its clients, other
processes), and a step preempted half-way takes several times its time; a mean moves with every
such step, a median only when most of its window is slow, which is then a load change the
estimate should follow. The windows are the decay: a sample weighs nothing after ``PLAIN_WINDOW``
plain calls of its batch size or ``FIT_WINDOW`` verify calls, so after a change of load (another
process taking a core, a longer context) the estimate is the new regime's within half a window.

Until ``MIN_VERIFY`` samples exist (each needing ``MIN_PLAIN`` plain calls of its batch size
before it), ``current()`` is the default (``VERIFY_BASE``, ``VERIFY_PER_DRAFT``): a median of
fewer plain calls, or a line through fewer verify samples, lets one preempted step decide whether
every lane drafts. ``MIN_VERIFY`` = 8 samples keep the line's breakdown point (about 29 % for
Theil-Sen) above one outlier in a window of that size; with one lane drafting they are about 8
rounds, a fraction of a second.

This is the engine's cost of a round, not the coordinator's: the rule that a round of more than
``max_batch_lanes`` decoding lanes drafts nothing stays where it is (``Speculator.plan``).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

VERIFY_BASE = 1.27
VERIFY_PER_DRAFT = 0.375
"""The default cost: a round verifying ``m >= 1`` drafts costs about ``VERIFY_BASE +
VERIFY_PER_DRAFT * m`` plain decode steps: a bare ``llama_decode`` of 1 + m tokens of one sequence
at position 1,000, each with logits, default model, 2 CPU threads, m = 3 .. 47
(``bench/bench_verify_cost.py``; rows past the first are not free on a CPU: each carries its share
of every matrix product and a 262,144-wide output row)."""

PLAIN_WINDOW = 15
"""Plain calls per batch size whose median is that size's plain step (module docstring)."""
MIN_PLAIN = 5
"""Plain calls of a batch size before its verify calls are samples: a median of 5 ignores 2
preempted steps."""
FIT_WINDOW = 32
"""Verify samples the line is fitted to, the most recent."""
MIN_VERIFY = 8
"""Verify samples before the line replaces the default (module docstring)."""
REFIT_EVERY = 4
"""Verify samples between two fits of the line once it exists: a fit of ``FIT_WINDOW`` samples
is about 0.2 ms of numpy on a CPU, a tenth of a GPU decode round, and a window moves little in
four samples."""


@dataclass(frozen=True, slots=True)
class Cost:
    """A verify round's cost in plain decode steps of the same batch: ``base + per_draft * m``
    for ``m >= 1`` drafts (a plain round costs 1)."""

    base: float
    per_draft: float

    def round(self, m: int) -> float:
        """Plain steps a round verifying ``m >= 1`` drafts costs."""
        return self.base + self.per_draft * m


DEFAULT_COST = Cost(VERIFY_BASE, VERIFY_PER_DRAFT)


class VerifyCost:
    """The live verify cost of one engine (module docstring): ``note`` each decode-only
    ``llama_decode``, read ``current()``. ``default`` is the cost until enough samples exist."""

    def __init__(self, default: Cost = DEFAULT_COST) -> None:
        self.default = default
        self._plain: dict[int, deque[int]] = {}  # lanes -> ns of its last plain calls
        self._m: deque[int] = deque(maxlen=FIT_WINDOW)
        self._y: deque[float] = deque(maxlen=FIT_WINDOW)
        self._fit: Cost | None = None
        self._unfitted = 0  # verify samples since the last fit

    def note(self, lanes: int, drafts: int, ns: int) -> None:
        """One decode-only ``llama_decode`` of ``lanes`` plain rows (one per forwarding lane) and
        ``drafts`` draft rows took ``ns`` nanoseconds. Ignored when ``lanes`` or ``ns`` is <= 0 or
        ``drafts`` < 0, and a verify call (``drafts`` > 0) until its batch size has ``MIN_PLAIN``
        plain calls."""
        if lanes <= 0 or drafts < 0 or ns <= 0:
            return
        if drafts == 0:
            window = self._plain.get(lanes)
            if window is None:
                window = self._plain[lanes] = deque(maxlen=PLAIN_WINDOW)
            window.append(ns)
            return
        plain = self.plain_ns(lanes)
        if plain is None:
            return
        self._m.append(drafts)
        self._y.append(ns / plain)
        self._unfitted += 1
        if len(self._m) >= MIN_VERIFY and (self._fit is None or self._unfitted >= REFIT_EVERY):
            self._fit = self._line()
            self._unfitted = 0

    def plain_ns(self, lanes: int) -> float | None:
        """The plain step of ``lanes`` lanes in nanoseconds (the median of its window), None
        before ``MIN_PLAIN`` plain calls of that size."""
        window = self._plain.get(lanes)
        if window is None or len(window) < MIN_PLAIN:
            return None
        return float(statistics.median(window))

    @property
    def measured(self) -> bool:
        """``current()`` is the measured line, not the default."""
        return self._fit is not None

    def current(self) -> Cost:
        """The measured cost, or the default before ``MIN_VERIFY`` samples (module docstring)."""
        return self._fit if self._fit is not None else self.default

    def _line(self) -> Cost:
        m = np.fromiter(self._m, np.float64)
        y = np.fromiter(self._y, np.float64)
        i, j = np.triu_indices(m.size, 1)
        dm = m[j] - m[i]
        apart = dm != 0
        if apart.any():
            slope = float(np.median((y[j] - y[i])[apart] / dm[apart]))
        else:  # every sample drafted the same m: the level moves, the slope stays
            slope = self.current().per_draft
        slope = max(slope, 0.0)
        base = float(np.median(y - slope * m))
        if base < 1.0:
            base = 1.0
            slope = max(0.0, float(np.median((y - 1.0) / m)))
        return Cost(base, slope)

    def stats(self) -> dict[str, int]:
        """For ``Engine.stats``: ``spec_verify_base_permille`` and
        ``spec_verify_per_draft_permille`` (``current()`` in thousandths of a plain step),
        ``spec_verify_measured`` (1 once measured, 0 while the default) and
        ``spec_verify_samples`` (verify samples in the window, 0 .. ``FIT_WINDOW``)."""
        c = self.current()
        return {
            "spec_verify_base_permille": round(c.base * 1000),
            "spec_verify_per_draft_permille": round(c.per_draft * 1000),
            "spec_verify_measured": int(self.measured),
            "spec_verify_samples": len(self._m),
        }
