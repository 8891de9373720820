"""``basertctl top``: a live terminal view of a running daemon (DESIGN.md "Operators").

One ``Overview`` control request per refresh (``basertd.schema.control.OverviewResult``, built by
``basertd.server.observe.overview``), drawn with rich's ``Live`` display: the daemon summary, one
row per worker (state, lanes busy/total, queue, KV and pool use) and its counters since start
(ticks, tokens, preemptions, crash resumes, respawns), every live lane (request, class, phase,
tokens, age), the queue per QoS class, tokens/s in and out, TTFT and inter-token latency p50/p95
over the last minute, the prefix-cache hit ratio and the WAL fsync time. ``q`` quits (the terminal
is put in cbreak mode while it runs and restored on every exit path); ``--once`` prints one frame
without the live display (for scripts and pipes).

``render(result)`` is pure (an ``OverviewResult`` in, a rich renderable out); ``run`` does the
I/O. Errors from the daemon surface as ``basertd.client.ClientError`` (the caller maps them to
exit statuses, as for every verb).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from basertd.schema import control

REFRESH_S = 1.0
"""Seconds between two frames of the live view."""
LANE_ROWS = 64
"""Most lanes drawn (the rest are counted in one line)."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _pct(ratio: float) -> str:
    return f"{ratio * 100:.0f}%"


def _latency(name: str, q: control.Quantiles) -> str:
    if q.count == 0:
        return f"{name} -"
    return f"{name} p50 {_ms(q.p50_s)} p95 {_ms(q.p95_s)} (n={q.count})"


def _count(n: int) -> str:
    """``n`` in at most 6 characters: 999999, then 1.23M, 12.3M, 123M, 1.23G."""
    if n < 1_000_000:
        return str(n)
    v, unit = n / 1e6, "M"
    for bigger in ("G", "T"):
        if v < 1000:
            break
        v, unit = v / 1000, bigger
    return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"


def _table(title: str, columns: tuple[str, ...], left: int) -> Table:
    """A borderless table (a rule under the header, one space between columns) whose first
    ``left`` columns are left-justified and the rest, numbers, right-justified; no cell wraps (a
    worker's model, the one free-text column, is cut with an ellipsis when the terminal is
    narrow)."""
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=0,
        pad_edge=False,
        expand=False,
    )
    for i, col in enumerate(columns):
        table.add_column(
            col,
            justify="left" if i < left else "right",
            no_wrap=col != "model",
        )
    return table


def render(o: control.OverviewResult) -> RenderableType:
    """One frame of ``top`` for the overview ``o`` (module docstring)."""
    busy = sum(w.lanes_busy for w in o.workers)
    total = sum(w.lanes_max for w in o.workers)
    head = Text.assemble(
        ("basertd ", "bold"),
        f"{o.version}  ",
        (o.state, "green" if o.state == "ready" else "yellow"),
        f"  up {o.uptime_s:.0f}s  lanes {busy}/{total}  in flight {o.in_flight}  requests {o.requests_total}",
    )
    # one line per window, each within 100 columns
    rates = Text(
        f"tokens/s in {o.tokens_in_per_s:.1f}  out {o.tokens_out_per_s:.1f} (last {o.rate_window_s:.0f}s)   "
        f"KV pool {_pct(o.pool_usage_ratio)}  preemptions {sum(w.preemptions for w in o.workers)}  "
        f"crash resumes {sum(w.crash_resumes for w in o.workers)}"
    )
    latency = Text(f"{_latency('TTFT', o.ttft)}   {_latency('ITL', o.itl)}   (last {o.window_s:.0f}s)")
    cache = Text(
        f"prefix cache hit {_pct(o.cache_hit_ratio)}   {_latency('WAL fsync', o.wal_fsync)}   "
        f"(last {o.window_s:.0f}s)"
    )
    queue = Text(
        "queue  "
        + "  ".join(f"{q.qos} {q.depth}" + (f" ({q.oldest_wait_s:.1f}s)" if q.depth else "") for q in o.queue)
    )
    workers = _table("workers", ("worker", "model", "state", "pid", "lanes", "queued", "KV", "pool"), 4)
    counters = _table(
        "since start",
        ("worker", "ticks", "prefilled", "decoded", "preempted", "crash resumes", "respawns"),
        1,
    )
    for w in o.workers:
        kv = _pct(w.kv_reserved_tokens / w.kv_capacity_tokens) if w.kv_capacity_tokens else "-"
        pool = f"{w.pool_blocks_used}/{w.pool_blocks_total}" if w.pool_blocks_total else "-"
        workers.add_row(
            str(w.worker_id),
            w.model,
            w.state if not w.problem else f"{w.state}: {w.problem}",
            str(w.pid),
            f"{w.lanes_busy}/{w.lanes_max}",
            str(w.queue_depth),
            kv,
            pool,
        )
        counters.add_row(
            str(w.worker_id),
            *(
                _count(n)
                for n in (
                    w.ticks_run,
                    w.prefill_tokens,
                    w.decode_tokens,
                    w.preemptions,
                    w.crash_resumes,
                    w.respawns,
                )
            ),
        )
    # one worker: no worker column (a chat request id is 43 characters, and the row fits 100)
    many = len(o.workers) > 1
    lane_cols = ("worker",) * many + (
        "lane",
        "request",
        "class",
        "phase",
        "prompt",
        "output",
        "cached",
        "age",
    )
    lanes = _table("lanes", lane_cols, 4 + many)
    lanes.columns[lane_cols.index("request")].min_width = max((len(x.request_id) for x in o.lanes), default=7)
    for lane in o.lanes[:LANE_ROWS]:
        lanes.add_row(
            *(str(lane.worker_id),) * many,
            str(lane.lane_tag),
            lane.request_id,
            str(lane.qos),
            lane.state,
            str(lane.prompt_tokens),
            str(lane.generated_tokens),
            str(lane.cached_tokens),
            f"{lane.age_s:.1f}s",
        )
    gap = Text("")
    parts: list[RenderableType] = [
        head,
        rates,
        latency,
        cache,
        queue,
        gap,
        workers,
        gap,
        counters,
        gap,
        lanes,
    ]
    if len(o.lanes) > LANE_ROWS:
        parts.append(Text(f"... and {len(o.lanes) - LANE_ROWS} more lanes"))
    if not o.lanes:
        parts.append(Text("(no live lanes)"))
    parts.extend(Text(f"problem: {p}", style="red") for p in o.problems)
    return Group(*parts)


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str]]:
    """A reader of single key presses: ``read(timeout_s)`` returns the keys typed within
    ``timeout_s`` ("" when none). stdin is put in cbreak mode (no echo, no line buffering) and
    restored on exit; without a terminal on stdin it only waits."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        yield lambda timeout: (time.sleep(timeout), "")[1]
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:

        def read(timeout: float) -> str:
            ready, _, _ = select.select([fd], [], [], timeout)
            return os.read(fd, 64).decode(errors="replace") if ready else ""

        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(fetch: Callable[[], control.OverviewResult], *, once: bool, interval_s: float = REFRESH_S) -> None:
    """Draw ``fetch()`` once (``once``) or every ``interval_s`` seconds until ``q`` (or Ctrl-C).
    ``fetch`` raises ``ClientError`` when the daemon fails; that ends the view."""
    if once:
        console = Console(width=None if sys.stdout.isatty() else 160)
        console.print(render(fetch()))
        return
    console = Console()
    with (
        contextlib.suppress(KeyboardInterrupt),
        _keys() as read,
        Live(render(fetch()), console=console, auto_refresh=False) as live,
    ):
        while True:
            deadline = time.monotonic() + interval_s
            while (left := deadline - time.monotonic()) > 0:
                if "q" in read(left).lower():
                    return
            live.update(render(fetch()), refresh=True)
