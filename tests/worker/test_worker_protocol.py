"""Link W as the worker plays it, against a hand-driven coordinator socket:
HELLO content, a refused handshake, and malformed or out-of-place frames, each of which ends the
link with exit 76 and one JSON log line carrying the frame error code, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from proc_testutil import log_lines

from basertd.schema import link
from basertd.schema.abi import Status
from basertd.schema.codec import FrameErrorCode, LinkCodec
from basertd.schema.link import MsgType
from basertd.schema.tick import TickEvents

RECV_TIMEOUT_MS = 10_000


class RawCoordinator:
    """A bound PAIR socket and a worker process (no rings) connected to it."""

    def __init__(self, rundir: Path, log: Path, worker_id: int = 5) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.path = rundir / "raw.sock"
        self.sock.bind(f"ipc://{self.path}")
        self.codec = LinkCodec()
        self.seq = 0
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "basertd.worker.main",
                    "--worker-id",
                    str(worker_id),
                    "--link",
                    f"ipc://{self.path}",
                    "--parent-pid",
                    str(os.getpid()),
                ],
                stderr=err,
                stdin=subprocess.DEVNULL,
            )

    def recv(self) -> tuple[link.Envelope, object]:
        return self.codec.decode(self.sock.recv_multipart())

    def send(self, msg: object, corr: int = 0) -> int:
        self.seq += 1
        self.sock.send_multipart(self.codec.encode(msg, self.seq, corr))
        return self.seq

    def welcome(self) -> link.Capabilities:
        env, _ = self.recv()
        assert env.msg_type == MsgType.HELLO
        self.codec.version = 1
        seq = self.send(link.Welcome(version=1))
        env, caps = self.recv()
        assert env.msg_type == MsgType.CAPABILITIES and env.corr == seq
        return caps

    def wait(self) -> int:
        return self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.sock.close()
        self.ctx.term()
        self.path.unlink(missing_ok=True)


@contextmanager
def raw_coordinator(rundir: Path, log: Path) -> Iterator[RawCoordinator]:
    rc = RawCoordinator(rundir, log)
    try:
        yield rc
    finally:
        rc.close()


def test_hello_then_capabilities(rundir, worker_log, no_leaks):
    with raw_coordinator(rundir, worker_log) as rc:
        env, hello = rc.recv()
        assert env.msg_type == MsgType.HELLO and env.seq == 1 and env.corr == 0
        assert (hello.min_version, hello.max_version) == (link.MIN_PROTOCOL_VERSION, link.PROTOCOL_VERSION)
        assert hello.worker_id == 5 and hello.pid == rc.proc.pid
        rc.codec.version = 1
        seq = rc.send(link.Welcome(version=1))
        env, caps = rc.recv()
        assert env.msg_type == MsgType.CAPABILITIES and env.corr == seq
        assert caps.engine == "basert" and caps.vocab_size == 512 and caps.rings == []
        # Requests are answered in order with corr = their seq.
        s1 = rc.send(link.Tokenize(text=b"hi", add_special=False))
        s2 = rc.send(link.Ping())
        (e1, b1), (e2, _) = rc.recv(), rc.recv()
        assert (e1.corr, e1.msg_type, b1.tokens.tolist()) == (s1, MsgType.TOKENIZE_RESULT, [3 + 104, 3 + 105])
        assert (e2.corr, e2.msg_type) == (s2, MsgType.PONG)
        rc.send(link.Shutdown(reason="test"))
        assert rc.wait() == 0


def test_refused_handshake_exits_76(rundir, worker_log, no_leaks):
    with raw_coordinator(rundir, worker_log) as rc:
        rc.recv()
        rc.send(link.Error(status=Status.ERR_FATAL, message="no common version"))
        assert rc.wait() == 76
    events = [line["event"] for line in log_lines(worker_log)]
    assert events[-1] == "handshake_refused"


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"garbage"], FrameErrorCode.TRUNCATED),
        ([b"BRTW" + bytes(20), b"\x90"], FrameErrorCode.UNKNOWN_TYPE),
        ([b"XXXX" + bytes(20), b"\x90"], FrameErrorCode.MALFORMED),
        (None, FrameErrorCode.BAD_VERSION),
        (None, FrameErrorCode.MALFORMED),
    ],
)
def test_malformed_frame_ends_the_link_with_one_log_line(frames, code, rundir, worker_log, no_leaks):
    with raw_coordinator(rundir, worker_log) as rc:
        rc.welcome()
        if frames is None and code == FrameErrorCode.BAD_VERSION:
            frames = [link.Envelope(2, MsgType.PING, 9).pack(), b"\x90"]
        elif frames is None:
            frames = [link.Envelope(1, MsgType.MATCH, 9).pack(), b"\x93\x01\x02"]  # wrong field types
        rc.sock.send_multipart(frames)
        assert rc.wait() == 76
    lines = log_lines(worker_log)  # every line is JSON: no traceback anywhere
    errors = [line for line in lines if line["level"] == "error"]
    assert len(errors) == 1
    assert errors[0]["event"] == "link_frame_error"
    assert errors[0]["code"] == int(code) and errors[0]["code_name"] == code.name
    assert errors[0]["exit_code"] == 76


def test_message_of_the_wrong_direction_ends_the_link(rundir, worker_log, no_leaks):
    with raw_coordinator(rundir, worker_log) as rc:
        rc.welcome()
        rc.send(TickEvents(plan_seq=1))  # a TICK_RESULT is the worker's to send
        assert rc.wait() == 76
    assert log_lines(worker_log)[-1]["event"] == "link_unexpected_message"


def test_frame_before_welcome_ends_the_link(rundir, worker_log, no_leaks):
    with raw_coordinator(rundir, worker_log) as rc:
        rc.recv()
        rc.sock.send_multipart([link.Envelope(1, MsgType.PING, 1).pack(), b"\x90"])
        assert rc.wait() == 76
    assert log_lines(worker_log)[-1]["event"] == "link_frame_error"
