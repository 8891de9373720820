"""Grammar-constrained lanes for the llama.cpp engine, with llguidance (DESIGN.md "Engines").

A grammar handle (``grammar_create``) holds one compiled llguidance matcher built from a spec of a
``kind``: ``json_schema`` (JSON-Schema text), ``lark`` (a Lark grammar in llguidance's dialect) or
``regex``, compiled by ``basertd.grammar_compile.compile_spec``, the compiler the coordinator
validates with (JSON schemas compact, their typed numbers bounded by ``json_bounds``: at most 16
integer and 9 fraction digits, so a sampled number cannot run on). A lane admitted with
``grammar_handle`` gets its own copy of the handle's matcher (freeing the handle later leaves live
lanes constrained, as logit biases do).

Per decode round, ``fill`` computes the next-token bitmask (one bit per token id, int32 words) of
every constrained lane that samples in the round, all in one llguidance call; ``mask_row`` applies
a lane's bitmask to its logits row (disallowed tokens to -inf) before logit bias, penalties and
top-k, for greedy, sampled and HOST lanes alike; ``consume`` feeds the matcher each committed
token (sampled, or HOST-committed). A lane whose matcher accepts and can go no further finishes
with ``Finish.GRAMMAR``; a token the grammar refuses (only a HOST commit can be one) faults the
lane with ``FaultCode.GRAMMAR_OVERFLOW``.

Replay (ABI rules 72-74): a lane admitted with ``grammar_replay = g`` starts from a reset matcher
that consumes the prompt's last ``g`` tokens, so a resumed lane's masks are the masks the
uninterrupted lane saw.

The llguidance tokenizer (every token's bytes, ~1 s on a 256k vocabulary) is built once per loaded
model, on its first grammar. Compiled matchers are kept by spec (``COMPILED_SPECS``, least recently
used first out): the n choices and many prompts of one HTTP request carry the same spec, and each
handle after the first is a copy of the compiled matcher (microseconds) instead of a compile (up to
seconds for a large schema) on the worker's only thread. Each handle is still its own (rule 113).

llguidance itself (about 0.1 s to import) is imported on the first grammar (``_llg``), not with
this module, so a worker that never sees one does not pay it at start; the first grammar pays it
beside the tokenizer's build, about ten times as long.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from basertd.grammar_compile import GrammarSpecError, compile_spec
from basertd.schema.abi import Finish, Status
from basertd.worker.engines.base import EngineError

if TYPE_CHECKING:
    import llguidance

COMPILED_SPECS = 32
"""Distinct specs whose compiled matcher ``GrammarSet`` keeps for later handles."""

_BYTE_ADD = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
    np.float32(0.0),
    np.float32(-np.inf),
).astype(np.float32)
"""(256, 8) float32: the additive mask (0 allowed, -inf refused) of each bitmask byte's 8 tokens."""

_TOKENIZERS: weakref.WeakKeyDictionary[object, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()


def _llg() -> ModuleType:
    """llguidance, with its ``llamacpp`` and ``numpy`` helpers, imported on first use (module
    docstring)."""
    import llguidance
    import llguidance.llamacpp
    import llguidance.numpy

    return llguidance


def tokenizer_for(model: object) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a loaded ``LlamaModel`` (its ``vocab``, ``n_vocab`` and
    ``eog_ids``), built on first use and cached for the model's lifetime (it reads the model's
    vocabulary pointer, so it must not outlive the model)."""
    tok = _TOKENIZERS.get(model)
    if tok is None:
        with warnings.catch_warnings():  # it calls llama-cpp-python's deprecated llama_token_get_attr
            warnings.simplefilter("ignore", DeprecationWarning)
            tok = _llg().llamacpp.lltokenizer_from_vocab(
                model.vocab,  # type: ignore[attr-defined]
                n_vocab=model.n_vocab,  # type: ignore[attr-defined]
                eos_token=list(model.eog_ids),  # type: ignore[attr-defined]
            )
        _TOKENIZERS[model] = tok
    return tok


@dataclass(eq=False)
class LaneGrammar:
    """One lane's matcher and the row of its bitmask in the current round (-1: none filled)."""

    handle: int
    matcher: llguidance.LLMatcher
    mask_index: int = -1


class GrammarSet:
    """The engine's grammar handles and the per-round bitmask of its constrained lanes.

    ``model`` is the engine's ``LlamaModel``; ``n_vocab`` the logits row width; ``threads`` the
    llguidance executor's threads for mask fills. Handles start at 1 and are never reused."""

    def __init__(self, model: object, n_vocab: int, threads: int = 1) -> None:
        self._model = model
        self.n_vocab = n_vocab
        self._threads = max(1, threads)
        self._executor: llguidance.LLExecutor | None = None
        self._templates: dict[int, llguidance.LLMatcher] = {}
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.compiles = 0
        """Specs compiled (not copied from ``_compiled``), for tests."""
        self._next = 1
        self._bitmask = np.empty((0, 0), np.int32)  # rows allocated by the first ``fill``

    # -- handles

    def grammar_create(self, json_schema: str, kind: str = "json_schema") -> int:
        """A handle for a spec of ``kind`` ("json_schema", "lark" or "regex"; ``compile_spec``),
        or 0 when it does not compile (the Engine protocol's failure value). Lanes admitted with it
        sample only what it allows and finish with Finish.GRAMMAR when it is complete. A spec
        compiled before is copied (module docstring)."""
        text = json_schema
        key = (kind, text)
        base = self._compiled.get(key)
        if base is None:
            try:
                grammar = compile_spec(kind, text)
            except GrammarSpecError:
                return 0
            self.compiles += 1
            base = _llg().LLMatcher(tokenizer_for(self._model), grammar, log_level=0)
            if base.is_error():
                return 0
            self._compiled[key] = base
            while len(self._compiled) > COMPILED_SPECS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        m = base.deep_copy()
        h = self._next
        self._next += 1
        self._templates[h] = m
        return h

    def grammar_free(self, handle: int) -> None:
        """Drop a handle (live lanes keep their matchers). EngineError(ERR_UNKNOWN_HANDLE) when absent
        (ABI rule 113)."""
        if self._templates.pop(handle, None) is None:
            raise EngineError(Status.ERR_UNKNOWN_HANDLE, f"no grammar {handle}")

    def known(self, handle: int) -> bool:
        """True when ``handle`` names a live grammar."""
        return handle in self._templates

    def __len__(self) -> int:
        return len(self._templates)

    def lane_grammar(self, handle: int, replay: np.ndarray) -> LaneGrammar | None:
        """A fresh matcher of ``handle`` that has consumed ``replay`` (the prompt's last
        ``grammar_replay`` tokens, ABI rule 74); None when ``handle`` is 0. A replay the grammar
        refuses leaves the matcher in its error state, so the lane's first sampling unit faults."""
        if handle == 0:
            return None
        m = self._templates[handle].deep_copy()
        if replay.size:
            m.consume_tokens([int(t) for t in replay])
        return LaneGrammar(handle, m)

    # -- per round

    def fill(self, grammars: list[LaneGrammar]) -> None:
        """Compute the next-token bitmask of every lane in ``grammars`` in one llguidance call
        (its executor), one bitmask row each; each gets its ``mask_index``."""
        if not grammars:
            return
        llguidance = _llg()
        if self._bitmask.shape[0] < len(grammars):
            self._bitmask = llguidance.numpy.allocate_token_bitmask(len(grammars), self.n_vocab)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self._threads)
        pairs = []
        for i, g in enumerate(grammars):
            g.mask_index = i
            pairs.append((g.matcher, i))
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, self._bitmask)

    def mask_row(self, g: LaneGrammar, row: np.ndarray) -> np.ndarray | None:
        """A float32 copy of ``row`` with the tokens the grammar refuses at -inf, or None when it
        allows none (the matcher is in its error state). One table gather per bitmask byte and
        one add: about 0.5 ms on a 262k vocabulary (a boolean ``where`` costs ten times that)."""
        if g.mask_index < 0:
            self.fill([g])
        words = self._bitmask[g.mask_index]
        g.mask_index = -1
        if not words.any():
            return None
        out = np.take(_BYTE_ADD, words.view(np.uint8), axis=0).reshape(-1)[: self.n_vocab]
        out += row
        return out

    def consume(self, g: LaneGrammar, token: int) -> int:
        """Feed a committed token to the lane's matcher. Returns Finish.NONE to go on,
        Finish.GRAMMAR when the grammar is complete and can go no further, or -1 when the grammar
        refuses the token (the caller faults the lane with GRAMMAR_OVERFLOW)."""
        g.mask_index = -1
        m = g.matcher
        if not m.consume_token(int(token)) or m.is_error():
            return -1
        return Finish.GRAMMAR if m.is_stopped() else Finish.NONE

    def refuses(self, g: LaneGrammar, token: int) -> bool:
        """True when the matcher cannot take ``token`` now (no state change)."""
        return g.matcher.validate_tokens([int(token)]) != 1
