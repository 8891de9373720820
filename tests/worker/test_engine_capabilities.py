"""The engine protocol's core and optional capabilities (``basertd.worker.engines.base``): what an
engine does not define answers ERR_OP_UNSUPPORTED from one place, ``capabilities()`` says what it
serves, partial capabilities are refused at class creation, and test hooks load only on request."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from basertd.schema.abi import Status
from basertd.schema.tick import ShedPolicy, TickEvents, TokenRange, TokenRef
from basertd.worker.engines import EngineOptionError, EngineOptions, open_engine
from basertd.worker.engines.base import (
    CAPABILITY_METHODS,
    Capability,
    Engine,
    EngineError,
    EngineInfo,
    ServedBy,
)


class CoreOnly(Engine):
    """An engine with the core alone."""

    def info(self) -> EngineInfo:
        raise AssertionError("not called")

    def attach_rings(self, rings) -> None:
        pass

    def tick(self, plan, on_partial_emit=None) -> TickEvents:
        return TickEvents(plan_seq=plan.plan_seq)

    def state_spaces(self):
        return []

    def stats(self):
        return {"ticks": 0}

    def tokenize(self, text, add_special):
        return list(text)

    def detokenize(self, tokens):
        return bytes(tokens)

    def close(self) -> None:
        pass


OPTIONAL_CALLS = {
    "space_match": (0, TokenRef()),
    "seed_acquire": (TokenRef(), 16, 0),
    "seed_release": (1,),
    "seed_lease_ticks": (),
    "seed_adopt": (1, TokenRef()),
    "cache_evict": (ShedPolicy(), 1),
    "cache_evict_entries": ([],),
    "lane_sequence": (1,),
    "sequence_create": (),
    "sequence_free": (1,),
    "sequence_publish": (1, []),
    "seq_fork": (1, 0),
    "export_size": (1, 0, TokenRange(start=0, end=16), 0),
    "snapshot": (1, 0, 16, 1, 64),
    "restore": (1, 0, b""),
    "snapshot_boundary": (1, 0, 16),
    "trim": (1, 0, 8),
    "op_poll": (1,),
    "op_cancel": (1,),
    "op_output": (1,),
    "demote": (1, 0, TokenRange(start=0, end=16), 0, 1, 64),
    "promote": (1, 0, TokenRange(start=0, end=16), b""),
    "grammar_create": ("{}",),
    "grammar_free": (1,),
    "logit_bias_create": ([1], [1.0]),
    "logit_bias_free": (1,),
    "attach_control": (object(),),
    "embed": ([],),
    "embed_chunk": (1, 0, np.array([1], np.uint32), True),
    "embed_cancel": (1,),
    "score": (np.zeros(2, np.uint32), 0),
    "strategy_register": (object(),),
}


def test_every_capability_method_is_exercised_here():
    assert sorted(OPTIONAL_CALLS) == sorted(n for names in CAPABILITY_METHODS.values() for n in names)


def test_a_core_only_engine_serves_nothing_optional_and_says_so():
    eng = CoreOnly()
    assert eng.capabilities() == frozenset()
    assert not any(eng.supports(c) for c in Capability)
    for cap, names in CAPABILITY_METHODS.items():
        for name in names:
            with pytest.raises(EngineError) as ex:
                getattr(eng, name)(*OPTIONAL_CALLS[name])
            assert ex.value.status == Status.ERR_OP_UNSUPPORTED
            assert f"CoreOnly does not serve {name} (no {cap.value} capability)" in str(ex.value)


def test_the_core_is_abstract():
    class NoTick(Engine):
        def info(self):
            raise AssertionError

    with pytest.raises(TypeError, match="abstract"):
        NoTick()


def test_a_capability_is_served_whole_or_not_at_all():
    class Grammars(CoreOnly):
        def grammar_create(self, json_schema, kind="json_schema"):
            return 7

        def grammar_free(self, handle):
            pass

    assert Grammars().capabilities() == {Capability.GRAMMAR}
    assert Grammars().grammar_create("{}") == 7
    with pytest.raises(TypeError, match="serves part of logit_bias: it lacks logit_bias_free"):

        class HalfBias(CoreOnly):
            def logit_bias_create(self, tokens, values):
                return 1


def test_a_capability_served_by_a_part_counts_and_each_call_reaches_the_part():
    class Grammars:
        def __init__(self) -> None:
            self.freed: list[int] = []

        def grammar_create(self, json_schema, kind="json_schema"):
            return 11 if kind == "regex" else 0

        def grammar_free(self, handle):
            self.freed.append(handle)

    class Composed(CoreOnly):
        grammar_create = ServedBy("grammars")
        grammar_free = ServedBy("grammars")

        def __init__(self) -> None:
            self.grammars = Grammars()

    eng = Composed()
    assert eng.capabilities() == {Capability.GRAMMAR}
    assert eng.grammar_create("a+", kind="regex") == 11 and eng.grammar_create("{}") == 0
    eng.grammar_free(11)
    assert eng.grammars.freed == [11]
    doc = Composed.grammar_free.__doc__
    assert doc.startswith("``grammars.grammar_free``: ") and "rule 113" in doc  # the protocol's contract
    with pytest.raises(TypeError, match="serves part of grammar: it lacks grammar_free"):

        class Half(CoreOnly):
            grammar_create = ServedBy("grammars")


def test_unserved_host_tier_ops_check_their_target_first():
    seen = []

    class Checked(CoreOnly):
        def check_op_target(self, seq, space_id):
            seen.append((seq, space_id))
            if seq == 99:
                raise EngineError(Status.ERR_UNKNOWN_HANDLE, "no sequence 99")

    eng = Checked()
    with pytest.raises(EngineError) as ex:
        eng.demote(99, 0, TokenRange(start=0, end=16), 0, 1, 64)
    assert ex.value.status == Status.ERR_UNKNOWN_HANDLE
    with pytest.raises(EngineError) as ex:
        eng.promote(3, 0, TokenRange(start=0, end=16), b"")
    assert ex.value.status == Status.ERR_OP_UNSUPPORTED
    assert seen == [(99, 0), (3, 0)]


def test_engines_state_what_they_serve(tiny_gguf):
    from basertd.worker.engines.llamacpp import LlamaCppEngine

    with LlamaCppEngine(tiny_gguf, lanes=1, context_length=32, n_threads=1) as eng:
        assert eng.capabilities() == set(Capability) - {Capability.HOST_TIER}
        assert eng.hooks is None  # no test hooks unless a test installs them
        with pytest.raises(EngineError) as ex:
            eng.demote(12345, 0, TokenRange(start=0, end=16), 0, 1, 64)
        assert ex.value.status == Status.ERR_UNKNOWN_HANDLE  # the op's own checks come first
    ref = open_engine("basert", EngineOptions())
    try:
        # the reference engine reads a yield word; it has no hidden states to pool
        assert ref.capabilities() == set(Capability) - {Capability.EMBEDDINGS, Capability.SCORING}
    finally:
        ref.close()


def test_reference_test_hooks_load_only_when_asked():
    code = (
        "import sys\n"
        "from basertd.worker.engines import EngineOptions, open_engine\n"
        "e = open_engine('basert', EngineOptions())\n"
        "print(type(e).__name__, 'basertd.worker.engines.ref_hooks' in sys.modules)\n"
        "e.close()\n"
        "e = open_engine('basert', EngineOptions(ref_config={'test_reject_top_k': 7}))\n"
        "print(type(e).__name__, e.hooks)\n"
        "e.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["BasertEngine False", "HookedEngine {'test_reject_top_k': 7}"]


@pytest.mark.parametrize(
    ("ref_config", "message"),
    [
        ({"test_nonsense": 1}, "unknown test hook(s) test_nonsense"),
        ({"test_stall_top_k": "x"}, "test_stall_top_k must be a number"),
    ],
)
def test_bad_test_hooks_are_option_errors(ref_config, message):
    with pytest.raises(EngineOptionError) as ex:
        open_engine("basert", EngineOptions(ref_config=ref_config))
    assert ex.value.flag == "--ref-config" and message in str(ex.value)
