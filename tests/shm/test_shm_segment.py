"""basertd.shm.Segment: anonymous memfd segments handed to children by descriptor (DESIGN.md
"Processes": nothing named in /dev/shm, no leaks on any exit path)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess

import numpy as np
import pytest
from proc_testutil import devshm_listing, memfds_of

from basertd.native._ringc import ffi
from basertd.schema.abi import Status
from basertd.shm import Segment, SegmentError


def test_create_is_zeroed_shared_and_close_on_exec(no_leaks):
    with Segment.create(10_000, name="brt-test") as seg:
        assert seg.length == 10_000
        assert len(seg.buffer) == 10_000 and not seg.buffer.readonly
        assert bytes(seg.buffer) == bytes(10_000)
        assert not os.get_inheritable(seg.fd)
        assert fcntl.fcntl(seg.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert os.readlink(f"/proc/self/fd/{seg.fd}").startswith("/memfd:brt-test")
        assert os.fstat(seg.fd).st_size == 10_000


def test_create_seals_size_so_a_child_cannot_truncate(no_leaks):
    with Segment.create(4096) as seg:
        seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 100)
        assert os.fstat(seg.fd).st_size == 4096


def test_address_is_the_mapping_base(no_leaks):
    with Segment.create(8192) as seg:
        view = ffi.from_buffer(seg.buffer)
        try:
            assert seg.address == int(ffi.cast("uintptr_t", view))
        finally:
            ffi.release(view)
        assert seg.address % os.sysconf("SC_PAGE_SIZE") == 0


def test_attach_shares_memory_both_ways(no_leaks):
    with Segment.create(4096) as seg:
        other = Segment.attach(os.dup(seg.fd), 4096)
        try:
            seg.buffer[100:104] = b"abcd"
            assert bytes(other.buffer[100:104]) == b"abcd"
            other.buffer[0:2] = b"xy"
            assert bytes(seg.buffer[0:2]) == b"xy"
        finally:
            other.close()


def test_attach_shorter_than_announced_is_refused_and_fd_left_open(no_leaks):
    with Segment.create(4096) as seg:
        fd = os.dup(seg.fd)
        try:
            with pytest.raises(SegmentError) as info:
                Segment.attach(fd, 4097)
            assert info.value.status == Status.ERR_BUFFER_TOO_SMALL
            os.fstat(fd)  # still open: a refused attach changes nothing
            ok = Segment.attach(fd, 4000)  # a shorter view is fine
            fd = -1
            assert ok.length == 4000
            ok.close()
        finally:
            if fd >= 0:
                os.close(fd)


@pytest.mark.parametrize("length", [0, -1, 1 << 41, 1.5, True, "10"])
def test_bad_lengths_are_typed_errors(length, no_leaks):
    with pytest.raises(SegmentError) as info:
        Segment.create(length)
    assert info.value.status == Status.REJECT_BOUNDS


def test_bad_descriptors_are_typed_errors(no_leaks):
    r, w = os.pipe()
    os.close(w)
    try:
        with pytest.raises(SegmentError):
            Segment.attach(r, 16)  # not a memory file
        os.fstat(r)
    finally:
        os.close(r)
    with pytest.raises(SegmentError):
        Segment.attach(r, 16)  # closed
    with pytest.raises(SegmentError):
        Segment.attach(-3, 16)
    with pytest.raises(SegmentError):
        Segment.create(16, name="bad\x00name")


def test_close_is_idempotent_and_releases_fd_and_view(no_leaks):
    seg = Segment.create(4096)
    fd = seg.fd
    seg.close()
    seg.close()
    assert seg.closed and seg.fd == -1
    with pytest.raises(OSError) as info:
        os.fstat(fd)
    assert info.value.errno == errno.EBADF
    with pytest.raises(SegmentError):
        _ = seg.buffer


def test_close_with_a_live_caller_view_still_closes_the_fd(no_leaks):
    seg = Segment.create(4096)
    arr = np.frombuffer(seg.buffer, dtype=np.uint8)
    seg.buffer[7] = 42
    seg.close()  # does not raise; the mapping goes with the last view
    assert seg.closed and arr[7] == 42
    del arr


def test_child_attaches_by_passed_fd_only(no_leaks, py_peer, tmp_path):
    """The descriptor reaches a child only through pass_fds (close-on-exec otherwise)."""
    with Segment.create(4096) as seg:
        plain = subprocess.run([*py_peer, "fd-open", str(seg.fd)], capture_output=True, timeout=60)
        assert plain.returncode == 3, plain.stderr
        passed = subprocess.run(
            [*py_peer, "fd-open", str(seg.fd)], pass_fds=[seg.fd], capture_output=True, timeout=60
        )
        assert passed.returncode == 0, passed.stderr
        assert not os.get_inheritable(seg.fd)  # pass_fds did not change the parent's descriptor


def test_killed_owner_leaves_nothing_in_dev_shm(no_leaks, py_peer):
    """A process that created a segment and a ring dies by SIGKILL: nothing named is left behind."""
    before = devshm_listing()
    proc = subprocess.Popen([*py_peer, "own-and-hang"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        memfds = json.loads(line)["memfds"]
        assert any(m.startswith("/memfd:brt-peer") for m in memfds), memfds
        assert memfds_of(proc.pid), "the child holds its segment as a memfd"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert devshm_listing() - before == set()
