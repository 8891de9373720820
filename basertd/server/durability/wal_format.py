"""The write-ahead log's records, frames and replay (DESIGN.md "Front ends, durability, ...":
"Crash = preemption; acceptance is durable").

On disk (``<state_dir>/wal/``) the log is a series of segments ``<seq:020d>.wal``; ``seq`` never
repeats. A segment is a series of frames::

    magic b"BRW1" | length u32 LE | xxh3_64(magic | length | body, seed=seq) u64 LE | body

and every body is one msgpack ``Batch`` (epoch, batch sequence number, records): one frame per
group commit, so a crash tears at most the last frame. Seeding the checksum with the segment's
``seq`` keeps a frame from another segment (stale blocks after a crash) from ever validating.

Every segment starts with a checkpoint: a ``Start`` record, the full live state (``Live`` for each
unfinished request with its durable tokens, ``Result`` for each finished request still within
``result_ttl_s``) and an ``End`` record carrying the counts. Replay therefore reads one segment, the
newest whose checkpoint is complete (the *base*); older segments are obsolete, and a newer one can
only be a checkpoint torn by a crash during rotation.

Fail closed: a bad frame (short, zero, wrong magic, wrong checksum) with no valid frame after it
is a torn tail: recovery drops it and warns. A bad frame followed by a valid frame or by non-zero
bytes past its declared end (a later write happened, so it had been durable), a valid frame
whose body does not decode, or records that contradict the log (tokens of an unknown request, a gap
in the token positions, a batch number that is not contiguous, a decreasing epoch) is corruption:
``WalCorrupt``, which says what to do; nothing is guessed.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from basertd.schema.client import QosClass, Timings, Usage

FORMAT_VERSION = 1
"""Version of the record layout, written in every segment's Start record."""
MAGIC = b"BRW1"
"""First four bytes of every frame."""
HEADER = struct.Struct("<4sIQ")
"""Frame header: magic, body length (bytes), xxh3_64 checksum."""
MAX_FRAME_BYTES = 1 << 28
"""Largest frame body (bytes); a longer length field marks a bad frame."""
FRAME_BYTES = 16 << 20
"""A writer cuts a frame (a checkpoint's, or a large group commit's) once its records pass this
many encoded bytes (``batches_of``); one record larger than this goes alone in its frame."""
SEGMENT_SUFFIX = ".wal"
WAL_DIR = "wal"
"""Sub-directory of ``state_dir`` holding the segments."""
_SEGMENT_NAME = re.compile(r"(\d{20})\.wal")

WHAT_TO_DO = (
    "Inspect it with `basertctl wal check {state_dir}`; to start anyway, dropping the log from the "
    "corrupt record on (those requests are lost), run `basertd serve --wal-recover=truncate`."
)


class WalError(Exception):
    """Base of the journal's errors."""


class WalCorrupt(WalError):
    """The log is corrupt in a way a crash cannot explain (a bad record followed by valid data,
    an undecodable or contradictory record). ``path`` is the segment, ``offset`` the byte offset of
    the bad frame, ``reason`` what is wrong; the message ends with what to do (``WHAT_TO_DO``)."""

    def __init__(self, state_dir: Path, path: Path | None, offset: int, reason: str) -> None:
        where = f"{path} at byte {offset}" if path is not None else str(state_dir)
        super().__init__(
            f"write-ahead log corrupt: {where}: {reason}. " + WHAT_TO_DO.format(state_dir=state_dir)
        )
        self.path = path
        self.offset = offset
        self.reason = reason


class _Inconsistent(Exception):
    """A valid frame whose records contradict the log (raised by ``LogState.apply``)."""


# --- records -------------------------------------------------------------------------------------


class RequestRecord(msgspec.Struct, kw_only=True):
    """An accepted request as the journal keeps it: everything needed to run it again.

    ``prompt``: prompt token ids; ``max_tokens``: tokens to generate; ``seed``: the resolved
    sampling seed (``rng_counter_base = seed << 32``, ABI rule 73); the sampling knobs as in the
    client's Generate; ``qos`` the class; ``speculation`` the client's choice ("auto", "off" or a
    strategy name; records written before the field existed read as "auto", the default then and
    now); ``t_accepted`` wall-clock seconds (``time.time()``);
    ``extra``: front-end fields the journal keeps opaquely (msgpack-able values); ``client``: who
    sent it and how to answer a resume (small msgpack-able values), kept with its result too."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = msgspec.field(default_factory=list)
    qos: QosClass = QosClass.INTERACTIVE
    logprobs: int | None = None
    ignore_eos: bool = False
    speculation: str = "auto"
    stream: bool = True
    model: str = ""
    t_accepted: float = 0.0
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    client: dict[str, Any] = msgspec.field(default_factory=dict)

    @classmethod
    def from_generate(
        cls, gen: Any, prompt: list[int], seed: int, *, t_accepted: float, extra: dict | None = None
    ) -> RequestRecord:
        """The record of a validated ``basertd.schema.client.Generate`` whose prompt tokenized to
        ``prompt`` and whose seed resolved to ``seed``."""
        names = [
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repeat_penalty",
            "frequency_penalty",
            "presence_penalty",
            "qos",
            "logprobs",
            "ignore_eos",
            "speculation",
            "stream",
            "model",
            "max_tokens",
        ]
        return cls(
            request_id=gen.request_id,
            prompt=list(prompt),
            seed=seed,
            stop=list(gen.stop),
            t_accepted=t_accepted,
            extra=dict(extra or {}),
            **{n: getattr(gen, n) for n in names},
        )


class FinishedResult(msgspec.Struct, kw_only=True):
    """A finished request that ``Resume`` can still answer: its generated ``tokens``,
    ``finish_reason`` (stop, length, eos, cancelled, error), usage and timings, the client
    ``ErrorCode`` value and message when it ended with an Error ("" otherwise), and ``t_finished``
    (wall-clock seconds), and its record's ``client``. Dropped ``result_ttl_s`` after
    ``t_finished``."""

    request_id: str
    tokens: list[int]
    finish_reason: str
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)
    error_code: str = ""
    error_message: str = ""
    t_finished: float = 0.0
    client: dict[str, Any] = msgspec.field(default_factory=dict)


class UnfinishedRequest(msgspec.Struct, kw_only=True):
    """A request to run again after a restart: its ``record`` and its durable ``tokens`` (the
    tokens already delivered, or about to be, before the crash)."""

    record: RequestRecord
    tokens: list[int]


class Start(msgspec.Struct, tag="S", array_like=True):
    segment: int
    epoch: int
    version: int
    t: float


class Accept(msgspec.Struct, tag="A", array_like=True):
    record: RequestRecord


class Toks(msgspec.Struct, tag="T", array_like=True):
    request_id: str
    start: int
    ids: list[int]


class Finish(msgspec.Struct, tag="F", array_like=True):
    request_id: str
    finish_reason: str
    usage: Usage
    timings: Timings
    error_code: str
    error_message: str
    t_finished: float


class Live(msgspec.Struct, tag="L", array_like=True):
    record: RequestRecord
    tokens: list[int]


class Result(msgspec.Struct, tag="R", array_like=True):
    result: FinishedResult


class End(msgspec.Struct, tag="E", array_like=True):
    live: int
    results: int


Record = Start | Accept | Toks | Finish | Live | Result | End


class Batch(msgspec.Struct, array_like=True):
    """One frame's body: the ``epoch`` of the daemon that wrote it, ``seq`` (contiguous over the
    whole log) and its records."""

    epoch: int
    seq: int
    records: list[Record]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)


def encode_frame(batch: Batch, segment: int) -> bytes:
    """The bytes of one frame holding ``batch`` in segment ``segment``."""
    body = _encoder.encode(batch)
    head = MAGIC + struct.pack("<I", len(body))
    return head + struct.pack("<Q", _checksum(head, body, segment)) + body


def _checksum(head: bytes, body: bytes | memoryview, segment: int) -> int:
    h = xxhash.xxh3_64(seed=segment)
    h.update(head)
    h.update(body)
    return h.intdigest()


def _frame_at(data: bytes, pos: int, segment: int) -> int | None:
    """End offset of a valid frame (magic, bounds, checksum) at ``pos``, else None."""
    if pos + HEADER.size > len(data):
        return None
    magic, length, checksum = HEADER.unpack_from(data, pos)
    end = pos + HEADER.size + length
    if magic != MAGIC or length == 0 or length > MAX_FRAME_BYTES or end > len(data):
        return None
    body = memoryview(data)[pos + HEADER.size : end]
    return end if _checksum(data[pos : pos + 8], body, segment) == checksum else None


def _next_valid_frame(data: bytes, pos: int, segment: int) -> int | None:
    """Offset of the first valid frame starting after ``pos``, else None."""
    while True:
        pos = data.find(MAGIC, pos + 1)
        if pos < 0:
            return None
        if _frame_at(data, pos, segment) is not None:
            return pos


def _written_past(data: bytes, pos: int) -> bool:
    """True when the bad frame at ``pos`` has a whole header whose declared end lies before the
    end of the file with non-zero bytes after it: only a later write puts data there, and a later
    write happens only after this frame's fsync, so it is damage, not a torn write (zeros there
    may be preallocation and are not evidence)."""
    if pos + HEADER.size > len(data):
        return False
    magic, length, _ = HEADER.unpack_from(data, pos)
    end = pos + HEADER.size + length
    if magic != MAGIC or not 0 < length <= MAX_FRAME_BYTES or end >= len(data):
        return False
    return data.count(0, end) != len(data) - end


def _length_flipped(data: bytes, pos: int, segment: int) -> bool:
    """True when the bad frame at ``pos`` is the segment's last frame whole but for one flipped
    bit of its length field (the checksum validates with that bit restored and the frame then
    ends the file): the bytes after its declared end are its own, not a later write."""
    magic, length, checksum = HEADER.unpack_from(data, pos)
    for bit in range(32):
        alt = length ^ (1 << bit)
        end = pos + HEADER.size + alt
        if 0 < alt <= MAX_FRAME_BYTES and end == len(data):
            head = magic + struct.pack("<I", alt)
            return _checksum(head, memoryview(data)[pos + HEADER.size : end], segment) == checksum
    return False


@dataclass
class SegmentScan:
    """One segment read: ``batches`` with their end offsets, ``good_end`` (bytes of valid frames),
    the first bad frame's offset (None: none) and whether a valid frame follows it (corruption
    rather than a torn tail)."""

    path: Path
    seq: int
    size: int
    batches: list[tuple[Batch, int]] = field(default_factory=list)
    good_end: int = 0
    bad_offset: int | None = None
    valid_after_bad: bool = False
    undecodable: bool = False

    def checkpoint_frames(self) -> int | None:
        """Number of leading frames that make a complete checkpoint (Start ... End), else None."""
        for i, (batch, _) in enumerate(self.batches):
            if batch.records and isinstance(batch.records[-1], End):
                return i + 1
        return None


def read_segment(path: Path, seq: int) -> SegmentScan:
    """Parse every frame of the segment at ``path``; stops at the first bad frame and looks
    whether any valid frame follows it. Raises OSError when the file cannot be read."""
    data = path.read_bytes()
    scan = SegmentScan(path=path, seq=seq, size=len(data))
    pos = 0
    while pos < len(data):
        end = _frame_at(data, pos, seq)
        if end is None:
            scan.bad_offset = pos
            written = _written_past(data, pos) and not _length_flipped(data, pos, seq)
            scan.valid_after_bad = written or _next_valid_frame(data, pos, seq) is not None
            break
        try:
            batch = _decoder.decode(memoryview(data)[pos + HEADER.size : end])
        except msgspec.DecodeError:
            scan.bad_offset, scan.undecodable = pos, True
            break
        scan.batches.append((batch, end))
        scan.good_end = pos = end
    return scan


def list_segments(wal_dir: Path) -> list[tuple[int, Path]]:
    """(seq, path) of every segment in ``wal_dir``, oldest first (other files are ignored)."""
    if not wal_dir.is_dir():
        return []
    found = []
    for entry in os.scandir(wal_dir):
        m = _SEGMENT_NAME.fullmatch(entry.name)
        if m and entry.is_file(follow_symlinks=False):
            found.append((int(m.group(1)), Path(entry.path)))
    return sorted(found)


def batches_of(epoch: int, first_seq: int, records: list[Record]) -> list[Batch]:
    """``records`` as batches numbered from ``first_seq``, each about ``FRAME_BYTES`` encoded bytes
    at most (a record larger than that alone), so no frame nears ``MAX_FRAME_BYTES``."""
    parts: list[list[Record]] = []
    part: list[Record] = []
    size = 0
    for rec in records:
        n = len(_size_encoder.encode(rec))
        if part and size + n > FRAME_BYTES:
            parts.append(part)
            part, size = [], 0
        part.append(rec)
        size += n
    if part:
        parts.append(part)
    return [Batch(epoch, first_seq + i, p) for i, p in enumerate(parts)]


def encode_frames(
    epoch: int, first_seq: int, records: list[Record], segment: int
) -> tuple[list[Batch], bytes]:
    """The batches of one group commit and their frames' bytes: one frame when it fits in
    ``FRAME_BYTES`` (the usual case, encoded once), else ``batches_of``."""
    whole = Batch(epoch, first_seq, records)
    data = encode_frame(whole, segment)
    if len(data) <= FRAME_BYTES:
        return [whole], data
    batches = batches_of(epoch, first_seq, records)
    return batches, b"".join(encode_frame(b, segment) for b in batches)


_size_encoder = msgspec.msgpack.Encoder()


def segment_name(seq: int) -> str:
    """File name of segment ``seq``."""
    return f"{seq:020d}{SEGMENT_SUFFIX}"


# --- state ---------------------------------------------------------------------------------------


class LogState:
    """What the log says: ``live`` unfinished requests (id -> UnfinishedRequest, in acceptance
    order), ``results`` finished ones (id -> FinishedResult, in finishing order), the last batch
    ``seq`` and ``epoch``. ``apply_batch`` is the one place records change it (replay and the
    running journal's durable mirror both use it)."""

    def __init__(self) -> None:
        self.live: dict[str, UnfinishedRequest] = {}
        self.results: dict[str, FinishedResult] = {}
        self.seq = 0
        self.epoch = 0
        self.segment = 0
        self.frames = 0
        self.records = 0
        self._in_checkpoint = False
        self._checkpoint_counts = [0, 0]

    def apply_batch(self, batch: Batch, *, first: bool = False) -> None:
        """Apply one batch. ``first``: the first batch of a replay (its seq starts the count).
        Raises ``_Inconsistent`` when the batch contradicts the state."""
        if not first and batch.seq != self.seq + 1:
            raise _Inconsistent(f"batch {batch.seq} follows batch {self.seq}")
        if batch.epoch < self.epoch:
            raise _Inconsistent(f"epoch goes back from {self.epoch} to {batch.epoch}")
        self.seq, self.epoch = batch.seq, batch.epoch
        for record in batch.records:
            self.apply(record)

    def apply(self, rec: Record) -> None:
        """Apply one record (see the module docstring). Raises ``_Inconsistent``."""
        if isinstance(rec, Toks):
            req = self.live.get(rec.request_id)
            if req is None:
                raise _Inconsistent(f"tokens for request {rec.request_id!r}, which is not running")
            if not 0 <= rec.start <= len(req.tokens):
                raise _Inconsistent(
                    f"tokens of {rec.request_id!r} start at {rec.start}, it has {len(req.tokens)}"
                )
            del req.tokens[rec.start :]
            req.tokens.extend(rec.ids)
        elif isinstance(rec, Accept):
            rid = rec.record.request_id
            if rid in self.live:
                raise _Inconsistent(f"request {rid!r} accepted twice")
            self.results.pop(rid, None)
            self.live[rid] = UnfinishedRequest(record=rec.record, tokens=[])
        elif isinstance(rec, Finish):
            req = self.live.pop(rec.request_id, None)
            if req is None:
                raise _Inconsistent(f"finish of request {rec.request_id!r}, which is not running")
            fields = msgspec.structs.asdict(rec)
            client = req.record.client
            self.results[rec.request_id] = FinishedResult(tokens=req.tokens, client=client, **fields)
        else:
            self._apply_checkpoint(rec)

    def _apply_checkpoint(self, rec: Record) -> None:
        if isinstance(rec, Start):
            if self.live or self.results or self._in_checkpoint:
                raise _Inconsistent("a checkpoint starts inside a replay")
            if rec.version != FORMAT_VERSION:
                raise _Inconsistent(f"format version {rec.version}, this daemon reads {FORMAT_VERSION}")
            self._in_checkpoint, self.segment = True, rec.segment
            return
        if not self._in_checkpoint:
            raise _Inconsistent(f"checkpoint record {type(rec).__name__} outside a checkpoint")
        if isinstance(rec, Live):
            if rec.record.request_id in self.live:
                raise _Inconsistent(f"request {rec.record.request_id!r} twice in a checkpoint")
            self.live[rec.record.request_id] = UnfinishedRequest(record=rec.record, tokens=rec.tokens)
            self._checkpoint_counts[0] += 1
        elif isinstance(rec, Result):
            self.results[rec.result.request_id] = rec.result
            self._checkpoint_counts[1] += 1
        elif isinstance(rec, End):
            if [rec.live, rec.results] != self._checkpoint_counts:
                raise _Inconsistent("checkpoint counts do not match its records")
            self._in_checkpoint = False

    def expire(self, now: float, ttl_s: float) -> int:
        """Drop results finished more than ``ttl_s`` seconds before ``now``; returns how many."""
        old = [rid for rid, r in self.results.items() if now - r.t_finished > ttl_s]
        for rid in old:
            del self.results[rid]
        return len(old)

    def checkpoint_records(self, segment: int, epoch: int, now: float) -> list[Record]:
        """The records of a checkpoint of this state (Start, Live..., Result..., End)."""
        out: list[Record] = [Start(segment, epoch, FORMAT_VERSION, now)]
        out += [Live(r.record, list(r.tokens)) for r in self.live.values()]
        out += [Result(r) for r in self.results.values()]
        out.append(End(len(self.live), len(self.results)))
        return out
