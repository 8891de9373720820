"""Fail-closed reading of engine-owned output: tick events, state-space lists, match results.

Every ``BaseRTArray`` the library hands back is read by the four array rules of RULES.md section
C (schema §1.1), in this order, before a single record byte is touched:

1. non-NULL ``data`` not 8-byte aligned -> refused, even when ``count`` is 0 (rule 20);
2. ``count`` > 0 with NULL ``data`` -> refused (rule 22);
3. ``elem_size`` below the record's minimum prefix -> refused, unless the array is the empty
   (count 0, elem_size 0) array, which is legal (rules 17, 21, 24);
4. ``count * elem_size`` above ``max_array_bytes`` -> refused (rule 23; the product of two u32
   cannot overflow the 64-bit arithmetic used here).

Accepted records are copied into zero-initialised local records, ``min(elem_size, sizeof)`` bytes
each: a longer writer's unknown tail is ignored and a shorter writer's missing fields read as 0
(rules 18-19). A refusal raises ``EventsMalformed`` naming the array; nothing is half-returned.
"""

from __future__ import annotations

import cffi
import msgspec
import numpy as np

from basertd.native._errors import EventsMalformed
from basertd.native._layout import min_prefix, record_dtype
from basertd.schema.abi import MAX_TOP_LOGPROBS
from basertd.schema.tick import (
    AdmitResult,
    LaneEmit,
    LaneFault,
    LaneLogprob,
    MatchCandidate,
    MatchResult,
    MemCounters,
    OpComplete,
    ShedEntry,
    ShedReport,
    SpaceMatch,
    StateSpaceDesc,
    TickEvents,
    TickTimings,
)

DEFAULT_MAX_ARRAY_BYTES = 64 << 20
"""Sanity cap on one engine-output array, in bytes (rule 23's "readable region" for output
whose true extent the reader cannot know)."""

EVENTS_V1_SIZE = 216
"""Minimum ``struct_size`` of BaseRTTickEvents (ABI rule 8); smaller is refused like rule 25."""

_TOLIST_MAX = 16  # below this many records ndarray.tolist() beats building columns

_ADMITS = list[AdmitResult]
_EMITS = list[LaneEmit]
_FAULTS = list[LaneFault]
_SHED = list[ShedEntry]
_OPS = list[OpComplete]
_CANDS = list[MatchCandidate]
_SPACES = list[StateSpaceDesc]


def rows(arr: np.ndarray) -> list[tuple]:
    """Records of a structured array as nested tuples in field order (sub-arrays as lists, byte
    fields as ``bytes``), built column by column: ~2.5x faster than ``ndarray.tolist()`` on nested
    records, and the shape ``msgspec.convert`` turns into array-like schema Structs."""
    return list(_columns(arr))


def _columns(arr: np.ndarray):
    cols = []
    for name in arr.dtype.names:
        col = arr[name]
        cols.append(list(_columns(col)) if col.dtype.names else col.tolist())
    return zip(*cols, strict=True)


class ArrayReader:
    """Reads ``BaseRTArray``s of records out of engine memory by the section-C rules.

    ``ffi`` is the binding's FFI (``basertd.native._layout.tick_ffi``); ``max_array_bytes`` caps
    one array (bytes). Thread-compatible: no state besides caches of dtypes."""

    def __init__(self, ffi: cffi.FFI, max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES) -> None:
        self.ffi = ffi
        self.max_array_bytes = max_array_bytes
        self._u8 = np.dtype(np.uint8)
        self._specs: dict[str, tuple[np.dtype, int]] = {}

    # -- the four rules --------------------------------------------------------------------------

    def _check(self, data: int, count: int, elem_size: int, min_size: int, where: str) -> int:
        if data % 8:
            raise EventsMalformed(where, f"data pointer 0x{data:x} is not 8-byte aligned")
        if count and not data:
            raise EventsMalformed(where, f"count {count} with a NULL data pointer")
        if elem_size < min_size and (count or elem_size):
            raise EventsMalformed(where, f"elem_size {elem_size} is below the record's {min_size} bytes")
        total = count * elem_size
        if total > self.max_array_bytes:
            raise EventsMalformed(
                where, f"{count} x {elem_size} bytes exceeds the {self.max_array_bytes}-byte cap"
            )
        return total

    def records(
        self, data: int, count: int, elem_size: int, dtype: np.dtype, min_size: int, where: str
    ) -> np.ndarray:
        """Copy ``count`` records at address ``data`` (stride ``elem_size`` bytes) into a new
        zero-initialised numpy array of ``dtype``. Raises ``EventsMalformed`` (rules 17-24)."""
        total = self._check(data, count, elem_size, min_size, where)
        local = dtype.itemsize
        if not count:
            return np.zeros(0, dtype)
        raw = np.frombuffer(self.ffi.buffer(self.ffi.cast("char *", data), total), self._u8)
        if elem_size == local:
            return raw.copy().view(dtype)
        out = np.zeros((count, local), self._u8)
        n = min(elem_size, local)
        out[:, :n] = raw.reshape(count, elem_size)[:, :n]
        return out.reshape(-1).view(dtype)

    def _spec(self, cname: str) -> tuple[np.dtype, int]:
        spec = self._specs.get(cname)
        if spec is None:
            spec = self._specs[cname] = (record_dtype(self.ffi, cname), min_prefix(self.ffi, cname))
        return spec

    def array(self, arr: tuple[int, int, int], cname: str, where: str) -> np.ndarray:
        """``records`` for a ``(data, count, elem_size)`` triple of C records ``cname``."""
        dtype, min_size = self._spec(cname)
        return self.records(*arr, dtype, min_size, where)

    def _convert(self, arr: tuple[int, int, int], cname: str, where: str, kind: type) -> list:
        """Decode an array of flat-field records into a list of schema Structs ``kind``."""
        data, count, elem_size = arr
        if not count:  # still checked: alignment and stride apply to empty arrays (rules 20, 24)
            self._check(data, count, elem_size, self._spec(cname)[1], where)
            return []
        recs = self.array(arr, cname, where)
        return msgspec.convert(recs.tolist() if count <= _TOLIST_MAX else rows(recs), kind)

    def struct_at(self, address: int, cname: str, where: str) -> tuple:
        """The fields of one top-level engine-owned struct at ``address`` (a nested tuple in C
        field order, pads left out). Checks NULL, alignment and, when the struct starts with
        ``struct_size``, that it is at least the v1 size (like ABI rule 25)."""
        if not address:
            raise EventsMalformed(where, "NULL pointer")
        if address % 8:
            raise EventsMalformed(where, f"pointer 0x{address:x} is not 8-byte aligned")
        dtype, min_size = self._spec(cname)
        buf = self.ffi.buffer(self.ffi.cast("char *", address), dtype.itemsize)
        row = np.frombuffer(buf, dtype, count=1)[0].tolist()
        if dtype.names[0] == "struct_size" and row[0] < min_size:
            raise EventsMalformed(where, f"struct_size {row[0]} is below the v1 size {dtype.itemsize}")
        return row

    # -- tick events ----------------------------------------------------------------------------

    def events(self, address: int) -> TickEvents:
        """Decode the ``BaseRTTickEvents`` at ``address`` into a schema ``TickEvents``.

        Raises ``EventsMalformed`` for a NULL, misaligned or undersized events struct (below 216
        bytes) or any array breaking the section-C rules, or a logprob record with n_top > 20."""
        ev = self.struct_at(address, "BaseRTTickEvents", "events")
        (_, plan_seq, tick_status, admits, emits, faults, shed, ops, timings, mem, logprobs) = ev
        return TickEvents(
            plan_seq=plan_seq,
            tick_status=tick_status,
            admit_results=self._convert(admits, "BaseRTAdmitResult", "events.admit_results", _ADMITS),
            emits=self._convert(emits, "BaseRTLaneEmit", "events.emits", _EMITS),
            faults=self._convert(faults, "BaseRTLaneFault", "events.faults", _FAULTS),
            shed=ShedReport(
                prefill_chunks_dropped=shed[0],
                evictions_performed=shed[1],
                bytes_evicted=shed[2],
                entries=self._convert(shed[3], "BaseRTShedEntry", "events.shed.entries", _SHED),
            ),
            op_completions=self._convert(ops, "BaseRTOpComplete", "events.op_completions", _OPS),
            timings=msgspec.convert(timings, TickTimings),
            mem=msgspec.convert(mem, MemCounters),
            logprobs=self._logprobs(logprobs),
        )

    def _logprobs(self, arr: tuple[int, int, int]) -> list[LaneLogprob]:
        out = []
        if not arr[1]:
            return self._convert(arr, "BaseRTLaneLogprob", "events.logprobs", list)
        for lane_tag, logprob, n_top, top_ids, top_logprobs in rows(
            self.array(arr, "BaseRTLaneLogprob", "events.logprobs")
        ):
            if n_top > MAX_TOP_LOGPROBS:
                raise EventsMalformed("events.logprobs", f"n_top {n_top} exceeds {MAX_TOP_LOGPROBS}")
            out.append(
                LaneLogprob(
                    lane_tag=lane_tag,
                    logprob=logprob,
                    n_top=n_top,
                    top_ids=top_ids[:n_top],
                    top_logprobs=top_logprobs[:n_top],
                )
            )
        return out

    # -- other engine-owned output --------------------------------------------------------------

    def state_spaces(self, arr: tuple[int, int, int], where: str = "state_spaces") -> list[StateSpaceDesc]:
        """Decode an array of ``BaseRTStateSpaceDesc`` (names cut at the first NUL, UTF-8)."""
        recs = rows(self.array(arr, "BaseRTStateSpaceDesc", where))
        return msgspec.convert(
            [(*r[:-1], r[-1].split(b"\0", 1)[0].decode("utf-8", "replace")) for r in recs], _SPACES
        )

    def match_result(self, address: int) -> MatchResult:
        """Decode the ``BaseRTMatchResult`` at ``address`` and its nested candidate arrays."""
        _, spaces = self.struct_at(address, "BaseRTMatchResult", "match_result")
        out = []
        for i, (space_id, cands) in enumerate(rows(self.array(spaces, "BaseRTSpaceMatch", "match.spaces"))):
            found = self._convert(cands, "BaseRTMatchCandidate", f"match.spaces[{i}].candidates", _CANDS)
            out.append(SpaceMatch(space_id=space_id, candidates=found))
        return MatchResult(spaces=out)
