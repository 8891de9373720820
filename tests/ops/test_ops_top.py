"""``basertctl top`` against a real daemon (the C reference engine, slow ticks), driven through a
pseudo-terminal like an operator's: the live frame lists the lane of a running request (its id,
class, phase and tokens), the latency and throughput lines fill in, ``q`` quits with status 0 and
the terminal's mode is restored; ``--once`` prints one frame to a pipe and ``--json`` one
document."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from daemon_harness import Daemon
from ops_harness import ref_worker
from proc_testutil import wait_until
from serving_harness import end_cancelled

from basertd.client import ClientError, ErrorCode
from basertd.schema import control

CONFIG = ref_worker(lanes=2, delay_us=20000).replace("context_length = 256", "context_length = 1024") + (
    "[scheduler]\ndecode_grant = 1\ndecode_tick_s = 0\n"
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


@pytest.fixture(scope="module")
def daemon():
    with Daemon(CONFIG) as d:
        yield d


class Pty:
    """``basertctl top`` on a pseudo-terminal of 170 x 60 cells; ``screen`` is what it printed so
    far, escape sequences removed."""

    def __init__(self, socket_path: str, *args: str) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 170, 0, 0))
        self.mode_before = termios.tcgetattr(slave)
        self.slave = slave
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "170", "LINES": "60"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "basertd.ctl", "--socket", socket_path, "top", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        self.raw = b""

    @property
    def screen(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))

    def pump(self) -> str:
        while select.select([self.master], [], [], 0.05)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.raw += chunk
        return self.screen

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)
        os.close(self.slave)


def test_top_shows_the_lanes_of_a_running_request_and_q_quits(daemon):
    with daemon.client() as c:
        stream = c.stream("a request to watch", max_tokens=900, temperature=0, request_id="top-lane")
        it = iter(stream)
        next(it)
        top = Pty(str(daemon.socket))
        try:
            # a frame with the lane: worker 0, the request id, its class and phase
            wait_until(
                lambda: re.search(r"top-lane\s+interactive\s+decode", top.pump()),
                timeout=60,
                what="a frame listing the lane of top-lane",
            )
            # a later frame has measured the stream: tokens/s out and the inter-token latency
            wait_until(
                lambda: re.search(r"out [1-9][0-9.]*", top.pump()) and "ITL p50" in top.screen,
                timeout=30,
                what="tokens/s out and ITL quantiles",
            )
            assert "workers" in top.screen and "queue  interactive" in top.screen
            assert "TTFT p50" in top.screen, top.screen[-3000:]
            assert top.proc.poll() is None, top.screen[-2000:]
            os.write(top.master, b"q")
            assert top.proc.wait(20) == 0, top.pump()[-2000:]
            # cbreak mode undone: the terminal is as it was before
            assert termios.tcgetattr(top.slave) == top.mode_before
        finally:
            top.close()
        end_cancelled(stream, it, 900)


def test_top_once_prints_one_frame_and_json_one_document(daemon):
    with daemon.client() as c:
        stream = c.stream(
            "another request", max_tokens=900, temperature=0, request_id="top-once", qos="batch"
        )
        it = iter(stream)
        next(it)
        t0 = time.monotonic()
        r = daemon.ctl("top", "--once", timeout=60)
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - t0 < 30  # one frame, not a live loop
        assert re.search(r"top-once\s+batch\s+(prefill|decode)", r.stdout), r.stdout
        assert "\x1b[" not in r.stdout  # a pipe gets plain text
        r = daemon.ctl("--json", "top", timeout=60)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        lane = next(row for row in doc["lanes"] if row["request_id"] == "top-once")
        assert lane["qos"] == "batch" and lane["generated_tokens"] >= 1 and lane["age_s"] >= 0
        assert [w["worker_id"] for w in doc["workers"]] == [0] and doc["workers"][0]["state"] == "ready"
        assert doc["ttft"]["count"] >= 1 and doc["ttft"]["p95_s"] >= doc["ttft"]["p50_s"] > 0
        assert doc["history"] is None
        with daemon.client() as c2:
            hist = c2.request(control.Overview(history_s=30)).history
            assert len(hist.tokens_out) == 30 and sum(hist.tokens_out) >= 1
            for bad in (-1, 601):
                with pytest.raises(ClientError) as err:
                    c2.request(control.Overview(history_s=bad))
                assert err.value.code == ErrorCode.INVALID_REQUEST and "history_s" in err.value.message
        end_cancelled(stream, it, 900)


def test_top_against_no_daemon_is_one_line_and_exit_3(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "basertd.ctl", "--socket", str(tmp_path / "none.sock"), "top", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and "not running" in r.stderr, r


def test_the_live_view_to_a_pipe_says_it_needs_a_terminal(tmp_path):
    """Without ``--once`` or ``--json`` and with stdout not a terminal, ``top`` exits 2 at once
    naming ``--once`` (it used to wait forever, printing nothing)."""
    r = subprocess.run(
        [sys.executable, "-m", "basertd.ctl", "--socket", str(tmp_path / "none.sock"), "top"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "needs a terminal" in r.stderr and "--once" in r.stderr, r
    assert r.stdout == ""


QOS_CLASSES = ("interactive", "batch", "background")


@pytest.mark.parametrize(
    ("workers", "rid"),
    [(1, "chatcmpl-{:032x}-0"), (2, "{:032x}")],  # an OpenAI chat id is 43 characters, a native one 32
)
def test_a_frame_at_100_columns_keeps_every_number_and_request_id_whole(workers, rid):
    """``render`` drawn at 100 terminal columns (the width of a split pane): every line fits, and
    the lanes' request ids, a worker's pid and counters, the latency lines and every header come
    out whole, nothing cut with an ellipsis; counters past six digits are shortened to three
    figures. One worker's lanes have no worker column."""
    from rich.console import Console

    from basertd.ctl_top import render

    worker = control.OverviewWorker(
        worker_id=0, model="gemma-3-270m-q4_k_m", engine="llamacpp", state="ready", pid=4187321,
        lanes_busy=3, lanes_max=16, queue_depth=2, kv_reserved_tokens=5000, kv_capacity_tokens=32768,
        pool_blocks_used=310, pool_blocks_total=2048, ticks_run=902331, prefill_tokens=12_345_678,
        decode_tokens=2_345_678, preemptions=12, crash_resumes=1, respawns=3,
    )  # fmt: skip
    ids = [rid.format(i * 0x1111_1111_1111_1111) for i in range(10, 13)]
    lanes = [
        control.LaneRow(
            worker_id=0,
            lane_tag=1000 + i,
            request_id=x,
            qos="interactive",
            state="retiring",
            prompt_tokens=17400,
            generated_tokens=1000,
            cached_tokens=10240,
            age_s=123.4,
        )
        for i, x in enumerate(ids)
    ]
    slow = control.Quantiles(p50_s=12.345, p95_s=123.456, count=123456)
    overview = control.OverviewResult(
        version="0.1.0", state="ready", uptime_s=1_234_567, requests_total=12_345_678, in_flight=123,
        workers=[worker] * workers, lanes=lanes, ttft=slow, itl=slow, wal_fsync=slow,
        tokens_in_per_s=12345.6, tokens_out_per_s=1234.5,
        queue=[control.QueueRow(qos=q, depth=1234, oldest_wait_s=123.4) for q in QOS_CLASSES],
    )  # fmt: skip
    console = Console(width=100, force_terminal=False, record=True)
    console.print(render(overview))
    text = console.export_text()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 100, text
    worker_col = r"0\s+" if workers > 1 else ""
    for x in ids:
        assert re.search(
            rf"\n{worker_col}\d+\s+{x}\s+interactive\s+retiring\s+17400\s+1000\s+10240\s+123\.4s", text
        ), text
    assert re.search(r"gemma-3-270m-q4_k_m\s+ready\s+4187321\s+3/16\s+2\s+15%\s+310/2048", text), text
    assert re.search(r"\b0\s+902331\s+12\.3M\s+2\.35M\s+12\s+1\s+3\n", text), text
    assert text.count("p50 12.3 s p95 123.5 s (n=123456)") == 3  # TTFT, ITL, WAL fsync
    for header in ("prefilled", "decoded", "preempted", "crash resumes", "respawns", "output", "cached"):
        assert header in text
