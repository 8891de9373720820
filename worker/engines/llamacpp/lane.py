"""One lane of the llama.cpp engine: its tokens, how far its KV and its stream have got.

Positions and counts are tokens. ``tokens[:n_tokens]`` is everything the lane knows: the admitted
prompt (whose last ``decode_replay`` tokens were generated before a preemption) followed by the
tokens this admission committed. Three cursors move through it:

- ``prefilled``: prompt tokens covered by prefill, as the coordinator counts them (a seed counts);
  prefills must continue exactly there (ABI rule 45) and end by ``prefill_end`` (rule 46);
- ``kv_len``: positions whose KV is in the lane's llama.cpp sequence;
- ``produced``: index of the next token the stream produces. From ``prefill_end`` up to
  ``n_tokens`` production replays known tokens (no emit, rule 72); beyond, it samples (or, on a
  HOST lane, hands a logits row out and waits for the commit).

A decode unit needs the logits for ``produced``: either ``kv_len == produced - 1`` and the unit
forwards ``tokens[produced - 1]``, or ``kv_len == produced`` and a logits row is held (from the
forward that completed the prefill, or kept across ticks in ``held_row``).

A seed of ``p`` tokens starts the cursors at: ``p`` < prefill_end: kv_len = prefilled = p (prefill
continues at p); prefill_end <= ``p`` < prompt length (the seed covers replayed tokens): kv_len =
produced = p, so the units take replay tokens p, p + 1, ... (the first needs no logits, each next
one forwards its predecessor), one unit per replay token not in the seed, as the reference engine
counts them; ``p`` = prompt length: kv_len = p - 1, produced = p (the last position is decoded
again, since its logits are not cached).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from basertd.schema.abi import Finish, Sampling
from basertd.worker.engines.llamacpp.grammar import LaneGrammar
from basertd.worker.engines.llamacpp.sampling import SamplerConfig
from basertd.worker.engines.llamacpp.speculation import LaneSpec


@dataclass(eq=False)
class Lane:
    """A live lane. ``seq`` is its llama.cpp sequence id, ``handle`` the sequence handle the
    Engine protocol exposes (``lane_sequence``); ``rng_base`` is the admit's rng_counter_base and
    ``generated`` the tokens committed since (the RNG counter offset, ABI rule 67)."""

    tag: int
    seq: int
    handle: int
    tokens: np.ndarray  # int32, capacity = the engine's context_length
    n_tokens: int
    prompt_len: int
    prefill_end: int
    prefilled: int
    kv_len: int
    produced: int
    sampling: Sampling
    cfg: SamplerConfig
    rng_base: int
    determinism_class: int
    taint: int = 0
    generated: int = 0
    finish: Finish = Finish.NONE
    held_row: np.ndarray | None = None
    pending_nonce: int = 0
    content_gen: int = 0
    seeded_tokens: int = 0
    grammar: LaneGrammar | None = None  # the lane's matcher when admitted with a grammar handle
    spec: LaneSpec | None = None  # prompt-lookup state when admitted on a certified slot (``speculation``)
    # where its prompt is snapshotted into the host tier once prefilled past (``Seeds.prompt_mark``)
    mark: int = 0

    @property
    def is_host(self) -> bool:
        """True for a HOST-sampled lane (logits rows out, commits in)."""
        return self.sampling == Sampling.HOST

    @property
    def pending_tokens(self) -> int:
        """Committed tokens (sampled, committed, replayed, or a cached prompt's re-decoded end)
        whose KV the next decode unit computes: cells the pool keeps reserved for this lane."""
        if self.prefilled < self.prefill_end:
            return 0
        return max(0, self.produced - self.kv_len)

    @property
    def finished(self) -> bool:
        """True once the lane stopped with EOS or LENGTH (it then waits for its retire)."""
        return self.finish != Finish.NONE

    def append(self, token: int) -> None:
        """Commit ``token`` at ``produced`` (which must equal ``n_tokens``)."""
        self.tokens[self.n_tokens] = token
        self.n_tokens += 1
        self.produced += 1
        self.generated += 1
