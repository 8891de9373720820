"""Typed refusals of the operator verbs (DESIGN.md "Operators").

``ControlError`` lives apart from the verbs themselves so the parts that serve a verb (the
prefix-cache policy's pins and evictions) can raise it without importing the control service.
"""

from __future__ import annotations

from basertd.schema.client import ErrorCode


class ControlError(Exception):
    """A control verb refused: ``code`` (an ``ErrorCode``) and a message for the operator."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
