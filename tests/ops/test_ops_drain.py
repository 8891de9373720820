"""Drain: SIGTERM lets accepted requests finish within the drain timeout and exits 0
with nothing left behind; what outlives the timeout is cancelled with a typed error; basertctl
drain / resume do the same without stopping."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from daemon_harness import Daemon
from ops_harness import ref_worker
from proc_testutil import wait_until

from basertd.client import Client, ClientError, ErrorCode
from basertd.schema import control


def _wait_draining(d: Daemon) -> None:
    """Until the daemon logged that a SIGTERM drain started (``shutdown_draining``)."""
    wait_until(
        lambda: any(e.get("event") == "shutdown_draining" for e in d.log_events()),
        what="a drain after SIGTERM (shutdown_draining in the daemon log)",
    )


def _config(drain_timeout_s: float, grant: int = 2, delay_us: int = 20000, durability: str = "off") -> str:
    """A reference-engine daemon. Durability is off: these tests check the drain's cancel path; with
    ``[durability] mode = "tick"`` SIGTERM hands running requests over to the next start instead
    (tests/durability)."""
    return (
        ref_worker(lanes=4, delay_us=delay_us)
        + f"[scheduler]\ndecode_grant = {grant}\ndecode_tick_s = 0\n"
        + f"[operators]\ndrain_timeout_s = {drain_timeout_s}\n"
        + f'[durability]\nmode = "{durability}"\n'
    )


def _start(d: Daemon, n: int, max_tokens: int) -> list[tuple[Client, object]]:
    """``n`` generations, each on its own connection; returns (client, stream) pairs once each is
    Accepted."""
    out = []
    for i in range(n):
        c = d.client()
        out.append((c, c.stream(f"drain me {i}", max_tokens=max_tokens, temperature=0)))
    return out


def test_sigterm_drains_short_requests_to_the_end_and_exits_zero():
    with Daemon(_config(drain_timeout_s=20)) as d:
        streams = _start(d, 5, max_tokens=40)  # 4 lanes: the fifth is queued, and acknowledged
        first = [next(iter(s)) for _, s in streams[:4]]
        assert all(t.ids for t in first)
        d.track_children()
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        _wait_draining(d)
        with d.client() as late:  # the socket stays open while draining: a typed refusal
            with pytest.raises(ClientError) as refused:
                late.generate("too late", max_tokens=2)
            assert refused.value.code == ErrorCode.SHUTTING_DOWN
            assert late.health().status == "draining"
        for c, s in streams:
            tokens = sum(len(t.ids) for t in s)
            assert s.done is not None and s.done.finish_reason == "length", s.done
            assert s.done.usage.completion_tokens == 40
            assert tokens > 0
            c.close()
        assert d.proc.wait(20) == 0
        assert time.monotonic() - t0 < 15
        draining = next(e for e in d.log_events() if e.get("event") == "shutdown_draining")
        assert draining["in_flight"] >= 4  # the drain really had work to wait for
        drained = next(e for e in d.log_events() if e.get("event") == "shutdown_drained")
        assert drained["drained"] is True and drained["cancelled"] == 0
        d.assert_released()


def test_sigterm_cancels_what_outlives_the_drain_timeout_typed():
    with Daemon(_config(drain_timeout_s=1, grant=1)) as d:
        c = d.client()
        stream = c.stream("a very long one", max_tokens=200, temperature=0)
        it = iter(stream)
        got = len(next(it).ids)
        d.track_children()
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(ClientError) as ended:
            for t in it:
                got += len(t.ids)
        assert ended.value.code == ErrorCode.SHUTTING_DOWN and "drain timeout" in ended.value.message
        assert 0 < got < 200
        c.close()
        assert d.proc.wait(20) == 0
        assert time.monotonic() - t0 < 1 + 8  # the timeout, then the workers' stop
        drained = next(e for e in d.log_events() if e.get("event") == "shutdown_drained")
        assert drained["drained"] is False and drained["cancelled"] == 1
        d.assert_released()


def test_a_second_sigterm_stops_at_once():
    with Daemon(_config(drain_timeout_s=60, grant=1, delay_us=50000)) as d:
        c = d.client()
        stream = c.stream("long", max_tokens=200, temperature=0)
        it = iter(stream)
        next(it)
        d.track_children()
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        _wait_draining(d)  # the second SIGTERM then arrives during the drain
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(ClientError) as ended:
            for _ in it:
                pass
        assert ended.value.code == ErrorCode.SHUTTING_DOWN
        c.close()
        assert d.proc.wait(20) == 0
        assert time.monotonic() - t0 < 10
        d.assert_released()


def test_basertctl_drain_waits_refuses_new_work_and_resume_reopens():
    with Daemon(_config(drain_timeout_s=30)) as d:
        c = d.client()
        stream = c.stream("finish me", max_tokens=60, temperature=0)
        it = iter(stream)
        next(it)
        drain = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "basertd.ctl",
                "--socket",
                str(d.socket),
                "--json",
                "drain",
                "--timeout",
                "20",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with d.client() as probe:
            wait_until(lambda: probe.request(control.Status()).state == "draining", what="draining")
            with pytest.raises(ClientError) as refused:
                probe.generate("new work", max_tokens=2)
            assert refused.value.code == ErrorCode.DRAINING
        for _ in it:
            pass
        assert stream.done is not None and stream.done.usage.completion_tokens == 60
        out, err = drain.communicate(timeout=30)
        assert drain.returncode == 0, err
        result = json.loads(out)
        assert result["drained"] is True and result["lanes_active"] == 0
        # still draining until resumed
        r = d.ctl("status", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["state"] == "draining"
        r = d.ctl("resume")
        assert r.returncode == 0 and "accepting" in r.stdout
        assert c.generate("welcome back", max_tokens=3, temperature=0).usage.completion_tokens == 3
        # a drain whose timeout passes cancels the rest typed and exits 5
        s2 = c.stream("too long for the drain", max_tokens=200, temperature=0)
        it2 = iter(s2)
        next(it2)
        r = d.ctl("drain", "--timeout", "0.3")
        assert r.returncode == 5, r
        assert "1 requests cancelled" in r.stdout
        with pytest.raises(ClientError) as cancelled:
            for _ in it2:
                pass
        assert cancelled.value.code == ErrorCode.DRAINING
        assert d.ctl("resume").returncode == 0
        c.close()
