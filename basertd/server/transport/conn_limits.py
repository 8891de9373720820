"""Bounded reading of the client socket: connection caps, the request-buffer budget and timeouts.

The ``[limits]`` section (``basertd.server.config_sections.LimitsConfig``) bounds what clients can make the
coordinator hold (DESIGN.md "Client API"):

- ``ConnectionCaps`` counts open connections in all and per peer uid; ``admit(uid)`` says which cap
  a new connection would break, if any.
- ``BufferBudget`` is the byte budget for request frames being received, shared by every
  connection. ``read_frame`` reads a frame's 4-byte length prefix, reserves that many bytes (frames
  of at most ``SMALL_FRAME_BYTES`` are exempt: a StreamReader holds that much anyway), and only then
  reads the body, into an anonymous ``mmap`` that is unmapped as soon as the frame is decoded or
  dropped, so the memory goes back to the kernel rather than to the allocator's free lists.
- ``read_frame`` also applies the frame timeout (first byte of a frame to its last) and the idle
  timeout (no frame started while the connection has nothing running).

Breaking a limit raises ``ConnectionDropped``: its ``reason`` labels the
``basertd_connections_dropped_total`` metric and its ``code`` / ``message`` form the ``Error``
the client gets before the connection closes.
"""

from __future__ import annotations

import asyncio
import mmap
import struct
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from basertd.schema.client import ErrorCode
from basertd.schema.codec import ClientCodec, FrameError, OversizeFrame, TruncatedFrame

SMALL_FRAME_BYTES = 64 * 1024
"""Frames (body bytes) up to this size are read without a reservation from the budget."""
CHUNK_BYTES = 256 * 1024
"""Most bytes taken from the stream per read while a large body arrives."""
_PREFIX = struct.Struct(">I")


class ConnectionDropped(Exception):
    """A connection broke a ``[limits]`` cap. ``reason`` (the metric label): ``total_cap``,
    ``uid_cap``, ``buffer_budget``, ``frame_timeout``, ``idle_timeout``; ``code``: the
    ``ErrorCode`` sent to the client (``queue_full`` for caps, ``timeout`` for timeouts)."""

    def __init__(self, reason: str, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code
        self.message = message


class BufferBudget:
    """Bytes of request frames being received, summed over connections, capped at ``capacity``.
    ``reserve(n)`` returns False (and changes nothing) when ``n`` more would exceed the cap;
    ``release(n)`` gives bytes back. ``on_change(used)`` is called after each change."""

    def __init__(self, capacity: int, on_change: Callable[[int], None] | None = None) -> None:
        self.capacity = capacity
        self.used = 0
        self._on_change = on_change

    def reserve(self, n: int) -> bool:
        """Take ``n`` bytes; False when they do not fit."""
        if self.used + n > self.capacity:
            return False
        self.used += n
        if self._on_change is not None:
            self._on_change(self.used)
        return True

    def release(self, n: int) -> None:
        """Give back ``n`` bytes taken by ``reserve``."""
        self.used = max(0, self.used - n)
        if self._on_change is not None:
            self._on_change(self.used)


class ConnectionCaps:
    """Open connections in all (cap ``total``) and per peer uid (cap ``per_uid``)."""

    def __init__(self, total: int, per_uid: int) -> None:
        self.total = total
        self.per_uid = per_uid
        self.open = 0
        self.by_uid: Counter[int] = Counter()

    def admit(self, uid: int) -> None:
        """Count a new connection of ``uid``. Raises ``ConnectionDropped`` (``total_cap`` or
        ``uid_cap``, code ``queue_full``) and counts nothing when it would break a cap."""
        if self.open >= self.total:
            raise ConnectionDropped(
                "total_cap",
                ErrorCode.QUEUE_FULL,
                f"too many connections: {self.open} open, limits.max_connections is {self.total}",
            )
        if self.by_uid[uid] >= self.per_uid:
            raise ConnectionDropped(
                "uid_cap",
                ErrorCode.QUEUE_FULL,
                f"too many connections of uid {uid}: {self.by_uid[uid]} open, "
                f"limits.max_connections_per_uid is {self.per_uid}",
            )
        self.open += 1
        self.by_uid[uid] += 1

    def leave(self, uid: int) -> None:
        """Uncount a connection of ``uid`` that ``admit`` counted."""
        self.open -= 1
        self.by_uid[uid] -= 1
        if self.by_uid[uid] <= 0:
            del self.by_uid[uid]


async def read_frame(
    stream: asyncio.StreamReader,
    codec: ClientCodec,
    budget: BufferBudget,
    *,
    frame_timeout_s: float,
    idle_timeout_s: float,
    busy: Callable[[], bool],
) -> Any | None:
    """Read and decode one request frame; None on a clean end of stream between frames.

    Waits for a frame's first byte for ``idle_timeout_s`` seconds at a time (0: forever) and raises
    ``ConnectionDropped("idle_timeout")`` when that passes while ``busy()`` is False (a connection
    whose generations are running is never idle). The rest of the frame must arrive within
    ``frame_timeout_s`` seconds of its first byte (else ``ConnectionDropped("frame_timeout")``).
    A body over ``SMALL_FRAME_BYTES`` first reserves its length from ``budget``
    (``ConnectionDropped("buffer_budget")`` when it does not fit; the body is then never read) and
    gives it back before returning or raising. Raises ``OversizeFrame``, ``TruncatedFrame`` and
    ``codec.decode``'s ``FrameError``\\ s as ``basertd.schema.codec.read_message`` does."""
    first = await _first_byte(stream, idle_timeout_s, busy)
    if first is None:
        return None
    started = time.monotonic()
    got = 0
    length = 0
    try:
        async with asyncio.timeout_at(asyncio.get_running_loop().time() + frame_timeout_s):
            try:
                prefix = first + await stream.readexactly(3)
            except asyncio.IncompleteReadError as exc:
                raise TruncatedFrame(
                    f"stream ended after {1 + len(exc.partial)} bytes of a length prefix"
                ) from None
            (length,) = _PREFIX.unpack(prefix)
            if length > codec.max_frame_bytes:
                raise OversizeFrame(f"length prefix {length} over the cap {codec.max_frame_bytes}")
            if length == 0:
                raise TruncatedFrame("zero-length frame")
            if length <= SMALL_FRAME_BYTES:
                try:
                    body = await stream.readexactly(length)
                except asyncio.IncompleteReadError as exc:
                    got = len(exc.partial)
                    raise TruncatedFrame(f"stream ended after {got} of {length} body bytes") from None
                return codec.decode(body)
            if not budget.reserve(length):
                raise ConnectionDropped(
                    "buffer_budget",
                    ErrorCode.QUEUE_FULL,
                    f"request frame of {length} bytes refused: {budget.used} of "
                    f"limits.max_request_buffer_bytes {budget.capacity} are held by requests being "
                    "received; retry later",
                )
            try:
                return await _read_large(stream, codec, length)
            finally:
                budget.release(length)
    except TimeoutError:
        late = time.monotonic() - started
        raise ConnectionDropped(
            "frame_timeout",
            ErrorCode.TIMEOUT,
            f"request frame incomplete after {late:.1f} s (limits.frame_timeout_s is "
            f"{frame_timeout_s:g}; length prefix {length or 'unread'})",
        ) from None


async def _first_byte(
    stream: asyncio.StreamReader, idle_timeout_s: float, busy: Callable[[], bool]
) -> bytes | None:
    """The first byte of the next frame; None at end of stream. Idle rule: ``read_frame``."""
    while True:
        try:
            if idle_timeout_s > 0:
                async with asyncio.timeout(idle_timeout_s):
                    data = await stream.read(1)
            else:
                data = await stream.read(1)
        except TimeoutError:
            if busy():
                continue
            raise ConnectionDropped(
                "idle_timeout",
                ErrorCode.TIMEOUT,
                f"connection idle for {idle_timeout_s:g} s (limits.idle_timeout_s) with nothing running",
            ) from None
        return data or None


async def _read_large(stream: asyncio.StreamReader, codec: ClientCodec, length: int) -> Any:
    """Read a ``length``-byte body into an anonymous mapping and decode it; the mapping is unmapped
    before returning or raising (the decoded message owns copies of its strings and lists)."""
    buf = mmap.mmap(-1, length)
    failure: FrameError | None = None
    msg: Any = None
    try:
        got = 0
        while got < length:
            chunk = await stream.read(min(CHUNK_BYTES, length - got))
            if not chunk:
                raise TruncatedFrame(f"stream ended after {got} of {length} body bytes")
            buf.write(chunk)
            got += len(chunk)
            del chunk
        try:
            msg = codec.decode(buf)
        except FrameError as exc:  # its traceback holds the decoder's view of ``buf``: drop it
            failure = exc.with_traceback(None)
            failure.__context__ = None
    finally:
        try:
            buf.close()
        except BufferError:  # a view still alive: the mapping goes when it is collected
            pass
    if failure is not None:
        raise failure
    return msg
