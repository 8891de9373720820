"""Errors of the tick-ABI binding (re-exported by ``basertd.native.abi``).

Two families: ``AbiError`` carries a ``baseRT_status`` the library returned (the call changed
nothing, RULES.md preamble), except that a plan ``baseRT_tick`` refuses raises the schema's
``PlanRejected``, the one exception for it in every layer; ``BindingError`` is raised by the
binding itself, before or after a call: a library that cannot be opened, arguments that do not
fit the ABI, or engine output that breaks the array rules of RULES.md section C.
"""

from __future__ import annotations

from basertd.schema.abi import Status, status_name
from basertd.schema.rejection import PLAN_REJECTION_RANGE, PlanRejected


class AbiError(Exception):
    """A library call returned a nonzero ``baseRT_status``; nothing changed.

    ``status`` is a ``basertd.schema.abi.Status`` when the code is known, else the raw int;
    ``call`` names the C function."""

    def __init__(self, status: Status | int, call: str = "", message: str = "") -> None:
        status = Status.of(status)
        self.status = status
        self.call = call
        name = status_name(status)
        text = f"{call}: {name}" if call else name
        super().__init__(f"{text} ({message})" if message else text)


class EngineFatal(AbiError):
    """The library returned BASERT_ERR_FATAL (-1): the engine is presumed dead (ABI rule 16)."""


def error_for(status: int, call: str, message: str = "") -> AbiError | PlanRejected:
    """The exception for a nonzero status returned by ``call``: ``PlanRejected`` (the schema's,
    shared by every layer) for -100..-114 from ``baseRT_tick``, else an ``AbiError`` subclass."""
    if status == Status.ERR_FATAL:
        return EngineFatal(status, call, message)
    if call == "baseRT_tick" and status in PLAN_REJECTION_RANGE:
        return PlanRejected(status, f"{call}: {message}" if message else call)
    return AbiError(status, call, message)


class BindingError(Exception):
    """Raised by the binding itself (no status came back from the library)."""


class LibraryError(BindingError):
    """The library could not be opened or does not export the tick ABI."""


class LibraryNotFound(LibraryError, FileNotFoundError):
    """No file at the library path."""


class MissingSymbols(LibraryError):
    """The library lacks functions of the ABI; ``missing`` lists their names."""

    def __init__(self, path: str, missing: list[str]) -> None:
        self.missing = missing
        super().__init__(f"{path} does not export {len(missing)} tick-ABI function(s): {', '.join(missing)}")


class ArgumentError(BindingError, ValueError):
    """An argument does not fit the ABI (a value out of its C integer range, a wrong length, an
    unknown sequence id); raised before any C call, so nothing changed."""


class EventsMalformed(BindingError):
    """Engine output (tick events, descriptor lists, match results, grants) breaks the record
    array rules of RULES.md section C; ``where`` names the array, e.g. ``events.emits``.

    The library is not trusted: a malformed structure from a foreign libbaseRT gives this error,
    never a crash or a silently shortened read."""

    def __init__(self, where: str, reason: str) -> None:
        self.where = where
        self.reason = reason
        super().__init__(f"{where}: {reason}")


class HandleCreateFailed(BindingError):
    """A create call that reports failure only by a NULL result (baseRT_tick_sequence_create)."""


class PartialEmitCallbackError(BindingError):
    """The caller's partial-emit callback raised during ``tick``. The tick itself completed; its
    events are in ``events`` and the callback's exception is the ``__cause__`` (ABI rule 64)."""

    def __init__(self, events: object) -> None:
        self.events = events
        super().__init__("the on_partial_emit callback raised during the tick; the tick completed")
