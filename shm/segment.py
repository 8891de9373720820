"""Anonymous shared-memory segments: ``memfd_create`` + ``ftruncate`` + ``mmap(MAP_SHARED)``.

The coordinator creates a segment and hands its descriptor to a worker with ``subprocess``'s
``pass_fds``; the worker attaches by descriptor. Nothing is ever named in ``/dev/shm``, so no crash
can leave a segment behind: the memory lives exactly as long as some process holds the descriptor or
a mapping (DESIGN.md "Processes", "Reliability rules").
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import weakref
from typing import Any, Protocol

from basertd.schema.abi import Status
from basertd.shm.errors import SegmentError

_MAX_LENGTH = 1 << 40
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class _Closable(Protocol):
    def close(self) -> None: ...


def _base_address(mm: mmap.mmap) -> int:
    """Base address of a mapping, taken through a cffi buffer view that is released at once."""
    from basertd.native._ringc import ffi

    view = ffi.from_buffer(mm)
    try:
        return int(ffi.cast("uintptr_t", view))
    finally:
        ffi.release(view)


def _check_length(length: Any) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= _MAX_LENGTH:
        raise SegmentError(
            f"segment length must be an int in [1, 2**40] bytes, got {length!r}", Status.REJECT_BOUNDS
        )
    return length


class Segment:
    """One anonymous shared-memory segment of ``length`` bytes, mapped read-write and shared.

    Build it with :meth:`create` (a new memfd, sealed against shrinking and growing so a child can
    never truncate the memory under the parent) or :meth:`attach` (an inherited descriptor). The
    descriptor is close-on-exec; it reaches a child only through ``pass_fds``.

    ``buffer`` is a writable ``memoryview`` (bytes) of the whole mapping; ``address`` its base address
    for C code. Rings built over the segment (``basertd.shm.ring``) are registered with it and closed
    by :meth:`close`, which also unmaps (once no other view of the buffer is alive) and closes the
    descriptor. ``close`` is idempotent; the segment is also a context manager.
    """

    __slots__ = ("__weakref__", "_address", "_closed", "_fd", "_length", "_mm", "_rings", "_view")

    def __init__(self, fd: int, length: int, mm: mmap.mmap) -> None:
        """Private: use :meth:`create` or :meth:`attach`. Takes ownership of ``fd`` and ``mm``."""
        self._fd = fd
        self._length = length
        self._mm = mm
        self._view = memoryview(mm)
        self._address = _base_address(mm)
        self._rings: weakref.WeakSet[_Closable] = weakref.WeakSet()
        self._closed = False

    @classmethod
    def create(cls, length: int, name: str = "brt") -> Segment:
        """A new zero-filled segment of ``length`` bytes (1 to 2**40).

        ``name`` only labels the memfd in ``/proc/<pid>/fd`` (it never appears in ``/dev/shm``).
        Raises SegmentError (status REJECT_BOUNDS) for a bad length, or (status ERR_FATAL) when the
        kernel refuses the memfd, the size or the mapping; nothing is left open then."""
        length = _check_length(length)
        if not isinstance(name, str) or not name or "\x00" in name or len(name.encode()) > 249:
            raise SegmentError(f"bad memfd name {name!r}", Status.REJECT_BOUNDS)
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise SegmentError(f"memfd_create failed: {exc}", Status.ERR_FATAL) from exc
        try:
            os.ftruncate(fd, length)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise SegmentError(
                f"cannot size or map a {length}-byte segment: {exc}", Status.ERR_FATAL
            ) from exc
        return cls(fd, length, mm)

    @classmethod
    def attach(cls, fd: int, length: int) -> Segment:
        """Maps the first ``length`` bytes of an inherited segment descriptor ``fd``.

        On success the segment owns ``fd`` (``close`` closes it). Raises SegmentError, leaving ``fd``
        open and untouched, when ``fd`` is not an open regular file or memfd (ERR_FATAL), when
        ``fstat`` shows fewer than ``length`` bytes (ERR_BUFFER_TOO_SMALL), or for a bad length
        (REJECT_BOUNDS)."""
        length = _check_length(length)
        if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
            raise SegmentError(f"bad file descriptor {fd!r}", Status.REJECT_BOUNDS)
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise SegmentError(f"descriptor {fd} is not open: {exc}", Status.ERR_FATAL) from exc
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError(f"descriptor {fd} is not a memory file", Status.ERR_FATAL)
        if st.st_size < length:
            raise SegmentError(
                f"segment on fd {fd} holds {st.st_size} bytes, fewer than the announced {length}",
                Status.ERR_BUFFER_TOO_SMALL,
            )
        try:
            mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise SegmentError(f"cannot map fd {fd}: {exc}", Status.ERR_FATAL) from exc
        return cls(fd, length, mm)

    @property
    def fd(self) -> int:
        """The memfd descriptor (close-on-exec); -1 once closed."""
        return self._fd

    @property
    def length(self) -> int:
        """Mapped bytes."""
        return self._length

    @property
    def buffer(self) -> memoryview:
        """Writable byte view of the whole mapping. Raises SegmentError once closed."""
        if self._closed:
            raise SegmentError("segment is closed", Status.ERR_UNKNOWN_HANDLE)
        return self._view

    @property
    def address(self) -> int:
        """Base address of the mapping in this process (page-aligned), for C engines."""
        return self._address

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def _register(self, ring: _Closable) -> None:
        """Private (``basertd.shm.ring``): ``ring`` is closed before the mapping goes away."""
        if self._closed:
            raise SegmentError("segment is closed", Status.ERR_UNKNOWN_HANDLE)
        self._rings.add(ring)

    def close(self) -> None:
        """Closes every ring over the segment, unmaps it and closes the descriptor. Idempotent.

        If the caller still holds a view derived from ``buffer`` (a numpy array over it, a slice),
        the unmapping happens when that view is released; the descriptor is closed at once."""
        if self._closed:
            return
        self._closed = True
        for ring in list(self._rings):
            ring.close()
        self._rings.clear()
        try:
            self._view.release()
            self._mm.close()
        except BufferError:
            pass  # a caller's view is alive: the mapping is released with the last view
        self._mm = None  # type: ignore[assignment]
        fd, self._fd = self._fd, -1
        os.close(fd)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self._fd}"
        return f"Segment({state}, length={self._length})"
