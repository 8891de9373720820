"""Aborting a ``llama_decode`` mid-step when the coordinator asks for an urgent yield.

llama.cpp checks an abort callback between the graph nodes of a ``llama_decode``; when it returns
true the call returns 2 and the ubatch in flight is dropped from the KV cache (the ubatches
before it stay). ``AbortWatch`` installs the C check ``brt_abort_check`` (``native/brt_control.c``)
over the control segment's yield word (``basertd.shm.control``): it runs on llama.cpp's compute
thread with no Python and no GIL, one relaxed 8-byte load per node. The engine arms it per step
(``rounds.Rounds.arm_abort`` says when a step may be cut), so an interactive arrival ends a long
prefill step at once instead of at its end.
"""

from __future__ import annotations

import ctypes

import llama_cpp as L

from basertd.native._ringc import ffi as _ffi
from basertd.native._ringc import lib as _ringc
from basertd.shm import YieldReason


class AbortWatch:
    """llama.cpp's abort callback over the control segment's yield word: the C check
    ``brt_abort_check`` (``native/brt_control.c``) reads the word on llama.cpp's compute thread
    between graph nodes, with no Python and no GIL, and ends the ``llama_decode`` in flight when
    the word holds a reason of the armed set (``URGENT_ADMIT``, ``CANCEL``, ``DRAIN``)."""

    REASONS = (1 << YieldReason.URGENT_ADMIT) | (1 << YieldReason.CANCEL) | (1 << YieldReason.DRAIN)

    def __init__(self, watch: object) -> None:
        self._watch = watch
        self._fn: object = None

    @classmethod
    def attach(cls, ctx: object, control: object) -> AbortWatch | None:
        """Install the callback on ``ctx`` watching ``control.yield_word_address``; None when the
        control block has no address (a stand-in without shared memory)."""
        address = getattr(control, "yield_word_address", None)
        if not isinstance(address, int):
            return None
        watch = _ffi.new("brt_abort_watch *")
        watch.word = _ffi.cast("uint64_t *", address)
        watch.reasons = 0
        fn = L.ggml_abort_callback(int(_ffi.cast("uintptr_t", _ffi.addressof(_ringc, "brt_abort_check"))))
        L.llama_set_abort_callback(ctx, fn, ctypes.c_void_p(int(_ffi.cast("uintptr_t", watch))))
        out = cls(watch)
        out._fn = fn  # keeps the ctypes function object alive while llama.cpp holds it
        return out

    def arm(self) -> None:
        """Let the armed reasons abort the next ``llama_decode``."""
        self._watch.reasons = self.REASONS

    def disarm(self) -> None:
        """Let every ``llama_decode`` run to its end."""
        self._watch.reasons = 0
