"""systemd integration of the daemon: READY=1 / STATUS= / WATCHDOG=1 / STOPPING=1 to
a fake NOTIFY_SOCKET, a hung scheduler loop withholding the watchdog, and the client socket taken
from LISTEN_FDS (what basertd.socket hands over)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
import structlog
from daemon_harness import Daemon
from ops_harness import NotifyListener, listening_socket, ref_worker

from basertd.client import AsyncClient, Client, ClientError, ErrorCode
from basertd.schema import control
from basertd.server.config import parse_config
from basertd.server.observe.notify import (
    Heartbeat,
    Notifier,
    SocketActivationError,
    Watchdog,
    adopt_listener,
    listen_fds,
    watchdog_interval,
)

SLOW = "[scheduler]\ndecode_grant = 1\ndecode_tick_s = 0\n"
"""One token per lane per tick: with 20 ms ticks a 200-token generation runs for seconds."""


def test_ready_after_every_worker_then_status_watchdog_and_stopping():
    with Daemon(
        ref_worker(lanes=2, delay_us=20000) + ref_worker(lanes=2, delay_us=20000) + SLOW,
        notify=NotifyListener,
        env={"WATCHDOG_USEC": "400000"},
    ) as d:
        n = d.notify
        ready = n.wait_for("READY", "1")
        assert "workers 2/2" in ready["STATUS"], ready
        events = [e.get("event") for e in d.log_events()]
        ready_at = events.index("daemon_ready")
        assert events[:ready_at].count("worker_ready") == 2, "READY=1 before every worker handshook"
        assert "worker_ready" not in events[ready_at:]
        # watchdog: a ping every half WATCHDOG_USEC while the scheduler loops beat
        before = n.count("WATCHDOG")
        n.poll(1.5)
        assert n.count("WATCHDOG") - before >= 3, n.messages
        # STATUS follows the load: a running generation shows as a busy lane
        with d.client() as c:
            stream = c.stream("status please", max_tokens=200, temperature=0)
            deadline = time.monotonic() + 10
            while not any("lanes 1/4 busy" in m.get("STATUS", "") for m in n.messages):
                assert time.monotonic() < deadline, n.messages
                n.poll(0.5)
            stream.cancel()
            with pytest.raises(ClientError) as err:
                for _ in stream:
                    pass
            assert err.value.code == ErrorCode.CANCELLED
        d.track_children()
        d.proc.send_signal(15)
        assert d.proc.wait(30) == 0
        n.poll(0.2)
        assert n.count("STOPPING") >= 1, n.messages
        d.assert_released()


def test_a_hung_scheduler_loop_stops_the_watchdog(monkeypatch):
    """In process: the scheduler of worker 0 parks in an await that never ends; the event loop and
    the API keep running, but WATCHDOG=1 stops and the stall is logged naming the loop."""
    from basertd.server.daemon import Daemon

    base = Path(tempfile.mkdtemp(prefix="brt-wd-", dir="/tmp"))
    listener = NotifyListener(base)
    monkeypatch.setenv("NOTIFY_SOCKET", str(listener.path))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    cfg = parse_config(
        {
            "runtime_dir": str(base / "rt"),
            "state_dir": str(base / "state"),
            "http": {"listen": []},
            "workers": [
                {"engine": "basert", "lanes": 2, "context_length": 128, "ref_config": {"vocab_size": 259}}
            ],
        }
    )

    async def scenario() -> tuple[int, int, list[dict]]:
        daemon = Daemon(cfg)
        await daemon.start()
        try:
            await asyncio.wait_for(daemon.slots[0].ready(), 30)
            await asyncio.to_thread(listener.poll, 1.2)
            healthy = listener.count("WATCHDOG")

            async def hang(*args, **kwargs):
                await asyncio.Event().wait()

            daemon.schedulers[0]._tick = hang  # the loop's next tick never returns
            with structlog.testing.capture_logs() as logs:
                async with await AsyncClient.connect(daemon.socket) as client:
                    await client.stream("stuck", max_tokens=4, temperature=0)
                    await asyncio.sleep(0.5)  # the ping already on its way may still arrive
                    await asyncio.to_thread(listener.poll, 0.1)
                    before = listener.count("WATCHDOG")
                    await asyncio.to_thread(listener.poll, 1.5)
                    stalled = listener.count("WATCHDOG") - before
                    health = await client.health()  # the loop itself still serves
                    assert health.status == "ok"
            return healthy, stalled, logs
        finally:
            await daemon.stop()

    try:
        healthy, stalled, logs = asyncio.run(scenario())
    finally:
        listener.close()
        shutil.rmtree(base, ignore_errors=True)
    assert healthy >= 2
    assert stalled == 0
    withheld = [e for e in logs if e["event"] == "watchdog_withheld"]
    assert withheld and withheld[0]["stalled"] == ["scheduler-0"], logs


def test_the_client_socket_comes_from_listen_fds_and_outlives_a_restart():
    base = Path(tempfile.mkdtemp(prefix="brt-sock-", dir="/tmp"))
    os.chmod(base, 0o755)
    listener = listening_socket(base)
    try:
        with Daemon(ref_worker(lanes=2), listen=listener) as d:
            assert d.socket == base / "basertd.sock"
            assert not (d.runtime_dir / "basertd.sock").exists()  # nothing bound by the daemon
            with d.client() as c:
                out = c.generate("socket activation", max_tokens=5, temperature=0)
                assert out.usage.completion_tokens == 5
            started = next(e for e in d.log_events() if e.get("event") == "daemon_started")
            assert started["socket_inherited"] is True and started["socket"] == str(d.socket)
        # systemd's socket stays: a client connecting while no daemon runs waits in the backlog ...
        assert (base / "basertd.sock").exists()
        waiting = Client(base / "basertd.sock", timeout=60)
        waiting.send(control.Status(request_id="queued-while-down"))
        # ... and the next daemon, handed the same socket, answers it.
        with Daemon(ref_worker(lanes=2), listen=listener):
            reply = waiting._recv_for("queued-while-down")
            waiting.close()
            assert isinstance(reply, control.StatusResult) and reply.workers_total == 1
    finally:
        listener.close()
        shutil.rmtree(base, ignore_errors=True)


# --- the protocol pieces -----------------------------------------------------------------------


def test_notifier_speaks_to_abstract_and_path_sockets_and_never_raises(tmp_path):
    name = f"brt-test-{os.getpid()}"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind("\0" + name)
    rx.settimeout(5)
    env = {"NOTIFY_SOCKET": "@" + name}
    n = Notifier.from_env(env)
    assert env == {} and n.enabled
    assert n.ready("up") and rx.recv(100) == b"READY=1\nSTATUS=up"
    assert n.status("a\nb") and rx.recv(100) == b"STATUS=a b"
    assert n.watchdog() and rx.recv(100) == b"WATCHDOG=1"
    assert n.reloading() and rx.recv(100).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
    n.close()
    rx.close()
    gone = Notifier(str(tmp_path / "nobody-listens"))
    assert gone.watchdog() is False  # logged once, no exception
    assert Notifier(None).ready() is False


def test_watchdog_interval_and_listen_fds_only_for_this_process():
    env = {"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(env) == 1.5 and env == {}
    assert watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({}) is None
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x"}
    assert listen_fds(env) == [] and env == {}


def test_adopt_listener_takes_a_listening_unix_socket_and_refuses_anything_else(tmp_path):
    assert adopt_listener([]) is None
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not listening
    with pytest.raises(SocketActivationError, match="not a listening"):
        adopt_listener([(bad.fileno(), "basertd.socket")])
    assert bad.fileno() >= 0  # left open: it is not ours to close
    bad.close()
    good = listening_socket(tmp_path)
    adopted = adopt_listener([(good.fileno(), "basertd.socket")])
    assert adopted is not None and adopted.fileno() == good.fileno()
    adopted.detach()
    good.close()


def test_watchdog_pings_only_when_every_heartbeat_moved():
    sent = []

    class Recorder(Notifier):
        def watchdog(self) -> bool:
            sent.append(1)
            return True

    a, b = Heartbeat("scheduler-0"), Heartbeat("scheduler-1")
    wd = Watchdog(Recorder(None), 1.0, lambda: [a, b])
    wd.check()
    a.beat()
    b.beat()
    assert wd.tick() is True and len(sent) == 1
    a.beat()  # b made no progress
    assert wd.tick() is False and len(sent) == 1
    a.beat()
    b.beat()
    assert wd.tick() is True and len(sent) == 2
