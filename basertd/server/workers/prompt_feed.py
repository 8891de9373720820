"""The one writer of a worker's prompt ring (ring 1, DESIGN.md "Rings", ABI rules 20-24).

Ring 1 has a single writer: the coordinator's per-worker scheduler loop. Every span that goes into
it (an admitted prompt, a prompt matched for a cached-prefix seed, a pinned prefix being held, an
index entry being verified) is written through one ``PromptFeed``, owned by the loop for the
worker incarnation it serves, and handed (inside a ``WorkerPort``) to the prefix-cache policy's
match / seed / hold / verify calls. Nothing else holds the ring's writer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from basertd.schema.tick import TokenRef


class PromptFeed:
    """Writes token spans into one incarnation's prompt ring (``basertd.shm.RingWriter``).
    ``spans`` counts the spans written (for operators and tests)."""

    __slots__ = ("_ring", "spans")

    def __init__(self, ring: Any) -> None:
        self._ring = ring
        self.spans = 0

    @property
    def max_tokens(self) -> int:
        """The most tokens one span may hold."""
        return int(self._ring.max_span_elems)

    def write(self, tokens: Sequence[int] | np.ndarray) -> TokenRef:
        """Write ``tokens`` (uint32 token ids) as one span; returns its ``TokenRef``. Raises
        ``basertd.shm.RingError`` when the span does not fit the ring."""
        ref = self._ring.write(np.asarray(tokens, dtype=np.uint32))
        self.spans += 1
        return ref


@dataclass(frozen=True)
class WorkerPort:
    """What the prefix-cache policy may use of a running worker incarnation: its ``link``
    (``basertd.server.workers.link.WorkerLink``), the ``feed`` that alone writes its prompt ring, and its
    capability record ``capabilities``."""

    link: Any
    feed: PromptFeed
    capabilities: Any = None

    @classmethod
    def of(cls, proc: Any) -> WorkerPort:
        """The port of a started ``basertd.server.workers.process.WorkerProcess``."""
        return cls(proc.link, PromptFeed(proc.prompt_ring), proc.capabilities)
