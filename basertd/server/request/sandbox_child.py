"""The child's side of a ``sandbox.SandboxPool``: ``serve(handler)``, the loop of ``python -m
<module> <parent pid> <memory bytes>``, and the frame format both sides share.

Kept apart from the pool (``basertd.server.request.sandbox``, asyncio and structlog) so that a
child imports only what its handler needs: each pool's children start while the daemon starts
(``SandboxPool.start``), on the same cores as the coordinator and the workers, and asyncio and
structlog were about 0.1 s of each child's start. ``harden`` runs first in ``serve``; an entry
module with heavy imports of its own may call it before them, so they already run at the lowered
priority.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import struct
import sys
from collections.abc import Callable
from typing import Any

import msgspec

LEN = struct.Struct("<I")
"""A frame's length prefix (little-endian u32), before its msgpack body."""
MAX_FRAME_BYTES = 256 << 20
"""Largest frame either side accepts (bytes)."""
CHILD_NICE = 10
"""Added to each child's nice value."""
_PR_SET_PDEATHSIG = 1
_hardened = False


def harden() -> None:
    """Die with the parent (PR_SET_PDEATHSIG, then a check that it has not already gone), cap the
    address space, lower the priority; from the command line (``<parent pid> <memory bytes>``).
    Once per process."""
    global _hardened
    if _hardened:
        return
    _hardened = True
    parent, memory_bytes = int(sys.argv[1]), int(sys.argv[2])
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICE)


def serve(handler: Callable[[Any], Any]) -> None:
    """The child's loop: ``harden``, say ready, then read a job, answer ``[True, handler(job)]``
    or ``[False, message]`` when it raised; return at end of input."""
    harden()
    rd, wr = sys.stdin.buffer, sys.stdout.buffer
    encode, decode = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    ready = encode.encode([True, None])
    wr.write(LEN.pack(len(ready)) + ready)
    wr.flush()
    while True:
        head = rd.read(LEN.size)
        if len(head) < LEN.size:
            return
        (n,) = LEN.unpack(head)
        job = decode.decode(rd.read(n))
        try:
            reply = encode.encode([True, handler(job)])
        except MemoryError:
            reply = encode.encode([False, "out of memory"])
        except Exception as exc:
            reply = encode.encode([False, str(exc) or type(exc).__name__])
        wr.write(LEN.pack(len(reply)) + reply)
        wr.flush()
