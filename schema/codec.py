"""Encoders and fail-closed decoders of both links (DESIGN.md "Link W", "Client API").

- ``LinkCodec``: Link W frames, ``[envelope, msgpack body, *side frames]``. The body class comes
  from the envelope's ``msg_type``; 1-D numpy arrays with more than ``side_threshold`` elements
  travel as extra frames (zero-copy both ways), smaller ones inline as a msgpack extension.
- ``ClientCodec`` / ``FrameReader`` / ``read_message``: the client socket, each message a u32
  big-endian length then a msgpack map tagged by ``"type"`` (client and control APIs).

A decoder raises a ``FrameError`` subclass (re-exported here from ``basertd.schema.errors``) for
every input it cannot decode, and nothing else: size caps are checked before the body is read,
and every msgspec, numpy, struct or Unicode error is wrapped. Encoders raise the same family.
Codec instances reuse one msgspec Encoder/Decoder set and may be shared between threads.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Sequence
from typing import Any, Literal, Union

import msgspec
import numpy as np

from basertd.schema import client as _client
from basertd.schema import control as _control
from basertd.schema.errors import (
    BadSideBuffer,
    FrameError,
    FrameErrorCode,
    MalformedFrame,
    OversizeFrame,
    TruncatedFrame,
    UnknownMessageType,
    VersionMismatch,
)
from basertd.schema.link import (
    HANDSHAKE_TYPES,
    MESSAGE_TYPES,
    MSG_TYPE_OF,
    PROTOCOL_VERSION,
    Envelope,
)

__all__ = [
    "CLIENT_MESSAGES",
    "MAX_FRAME_BYTES",
    "MAX_SIDE_BYTES",
    "MAX_SIDE_FRAMES",
    "SIDE_THRESHOLD",
    "BadSideBuffer",
    "ClientCodec",
    "FrameError",
    "FrameErrorCode",
    "FrameReader",
    "LinkCodec",
    "MalformedFrame",
    "OversizeFrame",
    "TruncatedFrame",
    "UnknownMessageType",
    "VersionMismatch",
    "read_message",
]

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Cap of one msgpack body (either link) and of a client length prefix: 16 MiB."""
MAX_SIDE_BYTES = 1024 * 1024 * 1024
"""Default cap of one Link W side frame (sealed state exports can exceed 16 MiB): 1 GiB. A link
should also set zmq ``MAXMSGSIZE`` to the largest cap it accepts."""
MAX_SIDE_FRAMES = 64
"""The most side frames one Link W message may carry."""
SIDE_THRESHOLD = 64
"""Arrays with more elements than this travel as side frames; smaller ones inline."""

_EXT_INLINE = 1  # payload: dtype code u8, then the little-endian elements
_EXT_SIDE = 2  # payload: _SIDE_REF
_SIDE_REF = struct.Struct("<BxxxII")  # dtype code, side frame index, element count
_DTYPE_CODE = {np.dtype("<u1"): 1, np.dtype("<u4"): 2, np.dtype("<f4"): 3}
_CODE_DTYPE = {code: dtype for dtype, code in _DTYPE_CODE.items()}


def _enc_hook(obj: Any) -> Any:
    """numpy scalars become Python numbers; anything else is not encodable."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _dec_hook(typ: type, obj: Any) -> Any:
    """Array fields accept only what the extension hook produced."""
    if typ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError(f"expected an array extension, got {type(obj).__name__}")


def _as_bytes_view(frame: Any, what: str) -> memoryview:
    """A flat byte view of any buffer (bytes, memoryview, bytearray, zmq.Frame)."""
    try:
        return memoryview(frame).cast("B")
    except (TypeError, ValueError) as exc:
        raise MalformedFrame(f"{what} is not a contiguous byte buffer: {exc}") from None


def _wrap_msgspec(exc: Exception, what: str) -> FrameError:
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and "truncated" in text:
        return TruncatedFrame(f"{what}: {text}")
    return MalformedFrame(f"{what}: {type(exc).__name__}: {text}")


class LinkCodec:
    """Encoder/decoder of Link W frames for one end of one link (DESIGN.md "Link W").

    ``version`` is the negotiated protocol version (None until WELCOME; before that only the
    handshake types HELLO, WELCOME and ERROR encode or decode). Caps: ``max_frame_bytes`` for the
    envelope and body frames, ``max_side_bytes`` per side frame, ``max_side_frames`` per message.
    """

    def __init__(
        self,
        version: int | None = None,
        *,
        side_threshold: int = SIDE_THRESHOLD,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_side_bytes: int = MAX_SIDE_BYTES,
        max_side_frames: int = MAX_SIDE_FRAMES,
    ) -> None:
        self._version: int | None = None
        self.version = version
        self.side_threshold = side_threshold
        self.max_frame_bytes = max_frame_bytes
        self.max_side_bytes = max_side_bytes
        self.max_side_frames = max_side_frames
        self._tls = threading.local()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._encode_hook)
        self._decoders = {
            int(code): msgspec.msgpack.Decoder(body, ext_hook=self._ext_hook, dec_hook=_dec_hook)
            for code, body in MESSAGE_TYPES.items()
        }

    @property
    def version(self) -> int | None:
        """The negotiated Link W version, or None before the handshake."""
        return self._version

    @version.setter
    def version(self, value: int | None) -> None:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 0xFFFF
        ):
            raise VersionMismatch(f"version must be an integer in 1..65535, got {value!r}")
        self._version = value

    # --- encode -----------------------------------------------------------------------------

    def _encode_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.ndim != 1:
                raise TypeError(f"only 1-D arrays travel on Link W, got shape {obj.shape}")
            code = _DTYPE_CODE.get(obj.dtype)
            if code is None:
                raise TypeError(f"arrays of dtype {obj.dtype} do not travel on Link W")
            arr = np.ascontiguousarray(obj)
            if arr.size > self.side_threshold:
                side: list = self._tls.side
                side.append(memoryview(arr).cast("B"))
                return msgspec.msgpack.Ext(_EXT_SIDE, _SIDE_REF.pack(code, len(side) - 1, arr.size))
            return msgspec.msgpack.Ext(_EXT_INLINE, bytes((code,)) + arr.tobytes())
        return _enc_hook(obj)

    def encode(self, msg: Any, seq: int, corr: int = 0) -> list[bytes | memoryview]:
        """Frames of ``msg``: ``[envelope (24 bytes), msgpack body, *side frames]``, ready for
        ``socket.send_multipart(frames, copy=False)``. Side frames are views of the message's own
        arrays (zero-copy): do not modify those arrays until the frames are sent.

        ``seq`` is the sender's next sequence number (u64), ``corr`` the seq this answers or 0.
        Raises ``UnknownMessageType`` for a class outside the catalog, ``VersionMismatch`` for a
        non-handshake message before negotiation, ``OversizeFrame`` over a cap and
        ``MalformedFrame`` for unencodable field values (e.g. an int over u64)."""
        msg_type = MSG_TYPE_OF.get(type(msg))
        if msg_type is None:
            raise UnknownMessageType(f"{type(msg).__name__} is not a Link W message")
        version = self._version
        if version is None:
            if msg_type not in HANDSHAKE_TYPES:
                raise VersionMismatch(f"cannot send {msg_type.name} before the version is negotiated")
            version = PROTOCOL_VERSION
        envelope = Envelope(version, msg_type, seq, corr).pack()
        side: list[memoryview] = []
        self._tls.side = side
        try:
            body = self._encoder.encode(msg)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            raise MalformedFrame(f"cannot encode {msg_type.name}: {exc}") from None
        finally:
            self._tls.side = None
        if len(body) > self.max_frame_bytes:
            raise OversizeFrame(f"{msg_type.name} body is {len(body)} bytes, cap {self.max_frame_bytes}")
        if len(side) > self.max_side_frames:
            raise OversizeFrame(f"{msg_type.name} needs {len(side)} side frames, cap {self.max_side_frames}")
        for view in side:
            if view.nbytes > self.max_side_bytes:
                raise OversizeFrame(f"side frame of {view.nbytes} bytes, cap {self.max_side_bytes}")
        return [envelope, body, *side]

    # --- decode -----------------------------------------------------------------------------

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_INLINE:
            if len(data) < 1 or data[0] not in _CODE_DTYPE:
                raise BadSideBuffer("inline array without a known dtype code")
            dtype = _CODE_DTYPE[data[0]]
            if (len(data) - 1) % dtype.itemsize:
                raise BadSideBuffer(f"inline array of {len(data) - 1} bytes is not a whole number of {dtype}")
            return np.frombuffer(data[1:], dtype=dtype).copy()
        if code == _EXT_SIDE:
            if len(data) != _SIDE_REF.size:
                raise BadSideBuffer(f"side reference of {len(data)} bytes")
            dcode, index, count = _SIDE_REF.unpack(data)
            dtype = _CODE_DTYPE.get(dcode)
            if dtype is None:
                raise BadSideBuffer(f"side reference with unknown dtype code {dcode}")
            frames: list[memoryview] = self._tls.frames
            if index >= len(frames):
                raise BadSideBuffer(f"side reference {index} but {len(frames)} side frames")
            if self._tls.used & (1 << index):
                raise BadSideBuffer(f"side frame {index} referenced twice")
            self._tls.used |= 1 << index
            view = frames[index]
            if view.nbytes != count * dtype.itemsize:
                raise BadSideBuffer(f"side frame {index} is {view.nbytes} bytes, expected {count} x {dtype}")
            return np.frombuffer(view, dtype=dtype)
        raise MalformedFrame(f"unknown msgpack extension {code}")

    def decode(self, frames: Sequence[Any]) -> tuple[Envelope, Any]:
        """``(envelope, body)`` of one multipart message. ``frames`` items may be bytes,
        bytearray, memoryview or zmq.Frame (any buffer). Arrays from side frames are read-only
        zero-copy views of those frames.

        Raises only ``FrameError``: TruncatedFrame (fewer than 2 frames, short envelope, cut
        body), OversizeFrame (a frame over its cap, too many side frames), UnknownMessageType,
        VersionMismatch (not the negotiated version; non-handshake type before negotiation),
        MalformedFrame (bad magic, bad msgpack, ill-typed field), BadSideBuffer (a side frame
        missing, unused, referenced twice or of the wrong size)."""
        envelope = None
        try:
            frames = list(frames)
            if len(frames) < 2:
                raise TruncatedFrame(f"{len(frames)} frames, a message needs an envelope and a body")
            if len(frames) - 2 > self.max_side_frames:
                raise OversizeFrame(f"{len(frames) - 2} side frames, cap {self.max_side_frames}")
            envelope = Envelope.unpack(frames[0])
            decoder = self._decoders.get(envelope.msg_type)
            if decoder is None:
                raise UnknownMessageType(f"message type {envelope.msg_type}")
            if envelope.msg_type in HANDSHAKE_TYPES:
                if envelope.version < 1:
                    raise VersionMismatch("version 0 in a handshake frame")
            elif self._version is None:
                raise VersionMismatch(f"{envelope.msg_type.name} before the version is negotiated")
            elif envelope.version != self._version:
                raise VersionMismatch(f"frame at version {envelope.version}, link at {self._version}")
            body = _as_bytes_view(frames[1], "body frame")
            if body.nbytes > self.max_frame_bytes:
                raise OversizeFrame(f"body of {body.nbytes} bytes, cap {self.max_frame_bytes}")
            side = [_as_bytes_view(f, "side frame") for f in frames[2:]]
            for view in side:
                if view.nbytes > self.max_side_bytes:
                    raise OversizeFrame(f"side frame of {view.nbytes} bytes, cap {self.max_side_bytes}")
            self._tls.frames = side
            self._tls.used = 0
            try:
                msg = decoder.decode(body)
                used = self._tls.used
            finally:
                self._tls.frames = None
            if used != (1 << len(side)) - 1:
                raise BadSideBuffer(f"{len(side) - used.bit_count()} side frames not referenced by the body")
            return envelope, msg
        except FrameError as exc:
            if exc.envelope is None:
                exc.envelope = envelope
            raise
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _wrap_msgspec(exc, "Link W body") from None
        except Exception as exc:  # numpy, struct, Unicode, memory: never escape a decoder
            raise MalformedFrame(f"Link W frame: {type(exc).__name__}: {exc}", envelope=envelope) from None


# --- client socket ------------------------------------------------------------------------------

CLIENT_MESSAGES: tuple[type, ...] = (
    *_client.REQUESTS,
    *_control.REQUESTS,
    *_client.REPLIES,
    *_control.REPLIES,
)
"""Every message of the client socket (client and control APIs, both directions)."""
_CLIENT_REQUESTS = (*_client.REQUESTS, *_control.REQUESTS)
_CLIENT_REPLIES = (*_client.REPLIES, *_control.REPLIES)
_PREFIX = struct.Struct(">I")


class ClientCodec:
    """Length-prefixed msgpack frames of the client socket (DESIGN.md "Client API").

    ``side`` picks what ``decode`` accepts: "server" decodes requests (client + control), "client"
    decodes replies, "any" both. ``encode`` takes any client-socket message. ``max_frame_bytes``
    caps one body (default 16 MiB)."""

    def __init__(
        self, side: Literal["server", "client", "any"] = "any", *, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        accepted = {"server": _CLIENT_REQUESTS, "client": _CLIENT_REPLIES, "any": CLIENT_MESSAGES}
        if side not in accepted:
            raise ValueError(f"side must be 'server', 'client' or 'any', got {side!r}")
        self.side = side
        self.max_frame_bytes = max_frame_bytes
        self._encodable = frozenset(CLIENT_MESSAGES)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(Union[accepted[side]])  # noqa: UP007 - a runtime tuple

    def encode_body(self, msg: Any) -> bytes:
        """The msgpack body of ``msg`` without the length prefix. Raises ``UnknownMessageType``
        (not a client-socket message), ``OversizeFrame``, ``MalformedFrame``."""
        if type(msg) not in self._encodable:
            raise UnknownMessageType(f"{type(msg).__name__} is not a client-socket message")
        try:
            body = self._encoder.encode(msg)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            raise MalformedFrame(f"cannot encode {type(msg).__name__}: {exc}") from None
        if len(body) > self.max_frame_bytes:
            raise OversizeFrame(f"{type(msg).__name__} body is {len(body)} bytes, cap {self.max_frame_bytes}")
        return body

    def encode(self, msg: Any) -> bytes:
        """One whole frame: u32 big-endian body length, then the body. Errors as ``encode_body``."""
        body = self.encode_body(msg)
        return _PREFIX.pack(len(body)) + body

    def decode(self, body: Any) -> Any:
        """The message in one body (any buffer, without the prefix). Raises only ``FrameError``:
        OversizeFrame, TruncatedFrame, UnknownMessageType (unknown or wrong-side ``type`` tag),
        MalformedFrame (bad msgpack, missing or ill-typed fields)."""
        try:
            view = _as_bytes_view(body, "client frame")
            if view.nbytes > self.max_frame_bytes:
                raise OversizeFrame(f"body of {view.nbytes} bytes, cap {self.max_frame_bytes}")
            if view.nbytes == 0:
                raise TruncatedFrame("empty body")
            return self._decoder.decode(view)
        except FrameError:
            raise
        except msgspec.ValidationError as exc:
            if str(exc).endswith("at `$.type`"):
                raise UnknownMessageType(f"client frame: {exc}") from None
            raise _wrap_msgspec(exc, "client frame") from None
        except msgspec.DecodeError as exc:
            raise _wrap_msgspec(exc, "client frame") from None
        except Exception as exc:
            raise MalformedFrame(f"client frame: {type(exc).__name__}: {exc}") from None


class FrameReader:
    """Incremental reader of client-socket frames for a byte stream (sans-IO: usable from an
    asyncio ``Protocol.data_received`` or a blocking loop).

    ``feed_data(data)`` buffers bytes; ``next_message()`` returns the next whole message, or None
    until more bytes arrive. A length prefix over the cap raises ``OversizeFrame`` as soon as its
    4 bytes are in, before any body is buffered for it. After any ``FrameError`` the reader is
    dead: the stream has lost framing, so every later call raises the same error (close the
    connection). ``feed(data)`` does both and returns every whole message."""

    def __init__(self, codec: ClientCodec) -> None:
        self._codec = codec
        self._buf = bytearray()
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a message."""
        return len(self._buf)

    def feed_data(self, data: Any) -> None:
        """Append ``data`` (any buffer). Raises the reader's error if it is dead, and
        ``OversizeFrame`` at once when the pending frame's length prefix is over the cap."""
        if self._error is not None:
            raise self._error
        try:
            self._buf += data
        except TypeError as exc:
            self._fail(MalformedFrame(f"stream data is not bytes: {exc}"))
        self._check_prefix()

    def _fail(self, error: FrameError) -> None:
        self._error = error
        self._buf = bytearray()
        raise error

    def _check_prefix(self) -> int | None:
        if len(self._buf) < 4:
            return None
        (length,) = _PREFIX.unpack_from(self._buf)
        if length > self._codec.max_frame_bytes:
            self._fail(OversizeFrame(f"length prefix {length} over the cap {self._codec.max_frame_bytes}"))
        if length == 0:
            self._fail(TruncatedFrame("zero-length frame"))
        return length

    def next_message(self) -> Any | None:
        """The next whole message, or None when its bytes are not all in. Raises ``FrameError``
        for a bad frame (and forever after)."""
        if self._error is not None:
            raise self._error
        length = self._check_prefix()
        if length is None or len(self._buf) < 4 + length:
            return None
        body = bytes(self._buf[4 : 4 + length])
        del self._buf[: 4 + length]
        try:
            return self._codec.decode(body)
        except FrameError as exc:
            self._fail(exc)
            raise  # _fail raised already; this keeps the flow explicit

    def feed(self, data: Any) -> list[Any]:
        """``feed_data(data)`` then every whole message. A bad frame raises ``FrameError`` and the
        messages before it in this call are dropped; use ``next_message`` to handle each one."""
        self.feed_data(data)
        out = []
        while (msg := self.next_message()) is not None:
            out.append(msg)
        return out


async def read_message(stream: asyncio.StreamReader, codec: ClientCodec) -> Any | None:
    """Read one client-socket message from an asyncio stream; None on a clean end of stream
    between frames. Raises ``OversizeFrame`` from the prefix alone (the body is never read),
    ``TruncatedFrame`` when the stream ends inside a frame, and ``codec.decode``'s errors."""
    try:
        prefix = await stream.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise TruncatedFrame(f"stream ended after {len(exc.partial)} bytes of a length prefix") from None
    (length,) = _PREFIX.unpack(prefix)
    if length > codec.max_frame_bytes:
        raise OversizeFrame(f"length prefix {length} over the cap {codec.max_frame_bytes}")
    if length == 0:
        raise TruncatedFrame("zero-length frame")
    try:
        body = await stream.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrame(f"stream ended after {len(exc.partial)} of {length} body bytes") from None
    return codec.decode(body)
