"""The child process that validates grammar specs for the coordinator (``python -m
basertd.server.request.spec_check``, run by a ``sandbox.SandboxPool``; see
``basertd.server.request.grammar``).

A job is a list of candidate specs ``[[kind, text], ...]``; the reply is the index of the first
that compiles with ``basertd.grammar_compile.compile_spec`` (the worker's compiler), or the
handler raises ``GrammarSpecError`` with the last candidate's message. Each compile runs on a
thread with ``VALIDATE_STACK_BYTES`` of stack (half the worker's), so a spec that validates here
cannot overflow the worker's; a spec that overflows it kills only this process.
"""

from __future__ import annotations

import threading
from typing import Any

from basertd.grammar_compile import VALIDATE_STACK_BYTES, GrammarSpecError, compile_spec
from basertd.server.request.sandbox_child import harden, serve


def _on_small_stack(kind: str, text: str) -> BaseException | None:
    """``compile_spec(kind, text)`` on a thread of ``VALIDATE_STACK_BYTES``; its exception, if any."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            compile_spec(kind, text)
        except BaseException as exc:  # handed back to the caller's thread
            out[0] = exc

    threading.stack_size(VALIDATE_STACK_BYTES)
    t = threading.Thread(target=run, name="validate")
    t.start()
    t.join()
    return out[0]


def check(job: Any) -> int:
    """The index of the first candidate of ``job`` that compiles (module docstring). Raises
    ``GrammarSpecError`` with the last one's message."""
    error: BaseException | None = GrammarSpecError("no grammar given")
    for i, (kind, text) in enumerate(job):
        error = _on_small_stack(kind, text)
        if error is None:
            return i
    assert error is not None
    if isinstance(error, RecursionError):
        raise GrammarSpecError("the spec is nested too deeply")
    raise error


if __name__ == "__main__":
    harden()  # first: the import below runs at the child's lowered priority
    # llguidance now, before the child says it is ready, so the first spec compiles as fast as the
    # next (``compile_spec`` imports it on first use, which is for the coordinator's sake).
    import llguidance  # noqa: F401

    serve(check)
