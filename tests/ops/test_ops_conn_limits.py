"""The client socket's resource caps (``[limits]``, DESIGN.md "Client API") on a real daemon with
the reference engine: half-sent frames are bounded by the shared request-buffer budget and their
memory goes back when they close; connection caps per uid and in total; the frame and idle
timeouts; the listen backlog and the client's EAGAIN retry under a burst of connects."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_harness import Daemon
from ops_harness import ref_worker, run_as

from basertd import ctl
from basertd.client import AsyncClient, Client, ClientError
from basertd.schema import client as api
from basertd.schema.client import ErrorCode
from basertd.schema.codec import ClientCodec, FrameReader

MiB = 1024 * 1024
NOBODY = 65534


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (bytes), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def metric(d: Daemon, name: str, labels: str = "") -> float:
    """One sample of the daemon's exposition (0 when absent)."""
    text = d.ctl("metrics").stdout
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def read_reply(sock: socket.socket, timeout: float = 10.0) -> object | None:
    """The first frame the daemon sends on ``sock`` (None when it closes first)."""
    reader = FrameReader(ClientCodec("client"))
    sock.settimeout(timeout)
    while True:
        msg = reader.next_message()
        if msg is not None:
            return msg
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return None
        if not data:
            return None
        reader.feed_data(data)


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True when the daemon closed ``sock`` within ``timeout`` (after any frames it sent)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def half_sent(path: Path, length: int, body: int) -> tuple[socket.socket, bool]:
    """Connect, send a length prefix of ``length`` and ``body`` bytes of it. Returns the socket and
    whether every byte went out (False: the daemon closed the connection first)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(path))
    try:
        s.sendall(struct.pack(">I", length))
        s.sendall(bytes(body))
    except (BrokenPipeError, ConnectionResetError):
        return s, False
    return s, True


@pytest.mark.slow
def test_half_sent_frames_are_capped_and_their_memory_returns():
    with Daemon(ref_worker(lanes=2) + "[limits]\nmax_request_buffer_bytes = 67108864\n") as d:
        with d.client() as c:
            c.generate("warm up", max_tokens=8, temperature=0)
        time.sleep(0.5)
        before = rss_bytes(d.proc.pid)

        length = 15 * MiB  # under the 16 MiB frame cap: 4 fit the 64 MiB budget, the rest do not
        held, refused = [], []
        for _ in range(20):
            s, whole = half_sent(d.socket, length, length - 1)
            (held if whole else refused).append(s)
        assert len(held) == 4 and len(refused) == 16, (len(held), len(refused))
        for s in refused:  # each refused one got a typed error before the close
            reply = read_reply(s)
            assert isinstance(reply, api.Error) and reply.code == ErrorCode.QUEUE_FULL, reply
            assert "max_request_buffer_bytes" in reply.message
            s.close()
        peak = rss_bytes(d.proc.pid)
        assert peak - before > 40 * MiB, (before, peak)  # the held frames are really in memory
        assert metric(d, "basertd_request_buffer_bytes") == 4 * length
        assert metric(d, "basertd_connections_dropped_total", '{reason="buffer_budget"}') == 16

        # a normal request is served while the budget is spent (small frames need none of it)
        with d.client() as c:
            assert c.generate("still served", max_tokens=4, temperature=0).finish_reason == "length"

        for s in held:
            s.close()
        deadline = time.monotonic() + 10
        while metric(d, "basertd_request_buffer_bytes") != 0:
            assert time.monotonic() < deadline, "the budget was not given back"
            time.sleep(0.1)
        after = rss_bytes(d.proc.pid)
        mib = [round(x / MiB) for x in (before, peak, after)]
        print("coordinator RSS (MiB) before, peak, after:", *mib)
        assert after <= before * 1.10, (before, peak, after)
        # the budget is whole again: a maximal frame can be sent and is answered
        big = api.Tokenize(request_id="big", text="a" * (15 * MiB))
        with d.client() as c:
            try:
                c.request(big)
            except ClientError as exc:  # refused for its size by the request rules, not the budget
                assert exc.code != ErrorCode.QUEUE_FULL, exc


def test_connection_caps_per_uid_and_in_total():
    limits = "[limits]\nmax_connections = 5\nmax_connections_per_uid = 3\n"
    with Daemon(ref_worker(lanes=2) + limits, open_to_all=True) as d:
        mine = [d.client(timeout=10) for _ in range(3)]
        for c in mine:
            assert c.health().status == "ok"
        with d.client(timeout=10) as c, pytest.raises(ClientError) as over:
            c.health()
        assert over.value.code == ErrorCode.QUEUE_FULL and "max_connections_per_uid" in over.value.message

        async def aio_over_the_cap() -> ClientError:
            async with await AsyncClient.connect(d.socket) as ac:
                await asyncio.sleep(0.2)  # the refusal arrives first; the send then reports it
                with pytest.raises(ClientError) as err:
                    await ac.health()
                return err.value

        aio_err = asyncio.run(aio_over_the_cap())
        assert aio_err.code == ErrorCode.QUEUE_FULL and "max_connections_per_uid" in aio_err.message

        def as_nobody() -> list[str]:
            out = []
            theirs = [Client(d.socket, timeout=10) for _ in range(3)]
            for c in theirs:
                try:
                    out.append(c.health().status)
                except ClientError as exc:
                    out.append(f"{exc.code}: {exc.message}")
            for c in theirs:
                c.close()
            return out

        got = run_as(NOBODY, NOBODY, [], as_nobody)
        assert got[:2] == ["ok", "ok"], got
        assert got[2].startswith("queue_full") and "limits.max_connections is 5" in got[2], got

        for c in mine:
            c.close()
        # the counts are given back: the uid may connect again
        deadline = time.monotonic() + 10
        while True:
            try:
                with d.client(timeout=10) as c:
                    assert c.health().status == "ok"
                break
            except ClientError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert metric(d, "basertd_connections_dropped_total", '{reason="uid_cap"}') == 2
        assert metric(d, "basertd_connections_dropped_total", '{reason="total_cap"}') == 1


def test_frame_timeout_and_idle_timeout_close_the_connection():
    cfg = (
        ref_worker(lanes=2, delay_us=50000)
        + "[scheduler]\ndecode_grant = 1\ndecode_tick_s = 0\n"
        + "[limits]\nframe_timeout_s = 1.0\nidle_timeout_s = 1.5\n"
    )
    with Daemon(cfg) as d:
        t0 = time.monotonic()
        half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        half.connect(str(d.socket))
        half.sendall(struct.pack(">I", 100)[:2])  # half a length prefix, then nothing
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.connect(str(d.socket))

        # a generation outlives the idle timeout: its connection is busy, never idle
        with d.client() as c:
            out = c.generate("busy", max_tokens=50, temperature=0)
            assert out.finish_reason == "length" and len(out.ids) == 50
            assert time.monotonic() - t0 > 2.0  # 50 ticks of 50 ms

        reply = read_reply(half)
        assert isinstance(reply, api.Error) and reply.code == ErrorCode.TIMEOUT, reply
        assert "frame_timeout_s" in reply.message
        assert closed_by_peer(half)
        reply = read_reply(idle)
        assert isinstance(reply, api.Error) and reply.code == ErrorCode.TIMEOUT, reply
        assert "idle_timeout_s" in reply.message
        assert closed_by_peer(idle)
        half.close()
        idle.close()
        assert metric(d, "basertd_connections_dropped_total", '{reason="frame_timeout"}') == 1
        assert metric(d, "basertd_connections_dropped_total", '{reason="idle_timeout"}') == 1


@pytest.mark.slow
def test_400_quick_connects_from_the_sync_client_all_succeed():
    with Daemon(ref_worker(lanes=2)) as d:
        clients: list[Client] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def burst(n: int) -> None:
            for _ in range(n):
                try:
                    c = Client(d.socket, timeout=30)  # a socket with a timeout sees EAGAIN, never waits
                except BaseException as exc:
                    with lock:
                        errors.append(exc)
                    continue
                with lock:
                    clients.append(c)

        threads = [threading.Thread(target=burst, args=(100,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        try:
            assert not errors, errors[:3]
            assert len(clients) == 400
            for c in clients:
                assert c.health().status == "ok"
        finally:
            for c in clients:
                c.close()


def test_sync_client_retries_eagain_with_a_bounded_backoff(tmp_path):
    path = tmp_path / "s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    filler = []
    try:
        while True:  # fill the listen queue: nothing accepts
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(path))
            except BlockingIOError:
                s.close()
                break
            filler.append(s)
        t0 = time.monotonic()
        with pytest.raises(BlockingIOError):
            Client(path, timeout=5)
        took = time.monotonic() - t0
        assert 1.0 < took < 3.0, took  # retried for CONNECT_RETRY_S, then the EAGAIN is raised

        # room appears while it retries: it connects
        threading.Timer(0.3, lambda: listener.accept()[0].close()).start()
        with Client(path, timeout=5):
            pass
    finally:
        for s in filler:
            s.close()
        listener.close()


def test_basertctl_exits_3_with_one_line_on_a_socket_it_cannot_open():
    with Daemon(ref_worker(lanes=1), open_to_all=True) as d:
        os.chmod(d.socket, 0o600)  # root's alone now: nobody may not connect

        def ctl_as_nobody() -> tuple[int, str]:
            r = CliRunner().invoke(ctl.cli, ["--socket", str(d.socket), "status"])
            return r.exit_code, r.stderr

        code, stderr = run_as(NOBODY, NOBODY, [], ctl_as_nobody)
        assert code == ctl.EXIT_UNREACHABLE == 3, (code, stderr)
        assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
        assert f"no access to {d.socket} (Permission denied)" in stderr, stderr
        assert d.status().state == "ready"  # root still gets through
