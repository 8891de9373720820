"""``basertctl workers`` / ``status`` while a worker's tick outlasts the PONG timeout: the engine's
figures are the last PONG's, marked with their age, not zeros (``Fleet.worker_stats``). The C
reference engine ticks for 2 s, past the 1 s a status call waits for a PONG, and a worker answers
a PING between ticks, so about half the calls made during a tick get no PONG in time."""

from __future__ import annotations

import subprocess
import sys
import time

from daemon_harness import Daemon
from ops_harness import ref_worker

CONFIG = ref_worker(lanes=1, delay_us=2_000_000) + "[scheduler]\ndecode_grant = 1\ndecode_tick_s = 0\n"


def test_a_late_pong_answers_with_the_last_counters_and_their_age():
    with Daemon(CONFIG) as d:
        gen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "basertd.ctl",
                "--socket",
                str(d.socket),
                "generate",
                "--max-tokens",
                "200",
                "x",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            fresh = stale = 0
            deadline = time.monotonic() + 90
            while not (fresh and stale) and time.monotonic() < deadline:
                (row,) = d.workers()
                if row.lanes_busy != 1:
                    continue
                stats = row.engine_stats
                if "stats_age_ms" in stats:  # the PONG was late: the last one's figures, with their age
                    assert stats["stats_age_ms"] > 0 and row.engine_lanes == stats["live_lanes"]
                    stale += row.engine_lanes == 1
                else:
                    fresh += row.engine_lanes == 1
            assert fresh and stale, (fresh, stale)
        finally:
            d.ctl("drain", "--timeout", "0.1")  # cancels the generation
            gen.wait(30)
