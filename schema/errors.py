"""The one error family every basertd decoder raises: ``FrameError`` and a subclass per code.

A decoder of Link W or of the client socket raises a ``FrameError`` subclass for any input it
cannot turn into a message (oversize, truncated, unknown type, wrong version, ill-typed, bad side
buffer) and nothing else ever escapes it (DESIGN.md "Link W": decoding is fail-closed). Encoders
raise the same family for messages they cannot put on the wire, so a caller handles one type.

This module sits apart from ``basertd.schema.codec`` only so that ``basertd.schema.link``
(``negotiate``) can raise ``VersionMismatch`` without importing the codec; ``codec`` re-exports
every name here.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class FrameErrorCode(IntEnum):
    """Why a frame was refused. Stable numbers: they appear in logs and metrics labels."""

    OVERSIZE = 1
    """A frame (or a length prefix) is over its size cap; refused before the body is read."""
    TRUNCATED = 2
    """Fewer bytes or frames than the message needs."""
    UNKNOWN_TYPE = 3
    """The envelope names a message type outside the catalog (or a class is not in it)."""
    BAD_VERSION = 4
    """Protocol version outside the negotiated one, no common version, or not negotiated yet."""
    MALFORMED = 5
    """Not valid msgpack, or a field of the wrong type, or a bad envelope."""
    BAD_BUFFER = 6
    """A side buffer reference out of range, of the wrong size or dtype, or a side frame unused."""


class FrameError(Exception):
    """A frame that cannot be decoded (or a message that cannot be encoded); the link refuses it
    and changes nothing. ``code`` is a ``FrameErrorCode``; ``envelope`` is the decoded Link W
    envelope when the failure came after it was read (else None).

    Construct a subclass; ``FrameError.for_code(code, message)`` picks the right one."""

    code: FrameErrorCode = FrameErrorCode.MALFORMED

    def __init__(self, message: str = "", *, envelope: Any = None) -> None:
        self.envelope = envelope
        super().__init__(f"{self.code.name}: {message}" if message else self.code.name)

    @staticmethod
    def for_code(code: FrameErrorCode | int, message: str = "", *, envelope: Any = None) -> FrameError:
        """The ``FrameError`` subclass instance for ``code`` (raises ValueError for an unknown code)."""
        return _BY_CODE[FrameErrorCode(code)](message, envelope=envelope)


class OversizeFrame(FrameError):
    """A frame or length prefix over the cap (``MAX_FRAME_BYTES`` unless configured)."""

    code = FrameErrorCode.OVERSIZE


class TruncatedFrame(FrameError):
    """The input ended before the message did (short envelope, missing frames, cut msgpack)."""

    code = FrameErrorCode.TRUNCATED


class UnknownMessageType(FrameError):
    """A message type code (or Python class) that is not in the catalog."""

    code = FrameErrorCode.UNKNOWN_TYPE


class VersionMismatch(FrameError):
    """No common protocol version, or a frame at a version other than the negotiated one."""

    code = FrameErrorCode.BAD_VERSION


class MalformedFrame(FrameError):
    """Undecodable or ill-typed content: bad msgpack, wrong field types, bad envelope magic."""

    code = FrameErrorCode.MALFORMED


class BadSideBuffer(FrameError):
    """A Link W side-buffer reference that does not match the frames that came with it."""

    code = FrameErrorCode.BAD_BUFFER


_BY_CODE: dict[FrameErrorCode, type[FrameError]] = {
    cls.code: cls
    for cls in (
        OversizeFrame,
        TruncatedFrame,
        UnknownMessageType,
        VersionMismatch,
        MalformedFrame,
        BadSideBuffer,
    )
}
