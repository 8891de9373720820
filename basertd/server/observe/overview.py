"""The live picture of a running daemon, as one ``OverviewResult`` (DESIGN.md "Operators").

``overview(...)`` assembles what ``basertctl top`` and the web page at ``/`` show from the two
sources the daemon already keeps: every worker's ``WorkerSnapshot`` (``observe.snapshot``: state,
lanes, queues, engine counters) and the rolling ``Windows`` the metrics path feeds
(``observe.windows``: TTFT, inter-token latency and WAL fsync quantiles, tokens/s, prefix-cache hit
ratio). The control verb ``Overview`` (``ops.control``) and the page's JSON endpoint
(``transport.http.opsview``) both answer with it, so the terminal and the browser show the same
numbers. Pure: no I/O, no clock but the ``now`` it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from basertd.schema import control
from basertd.server.observe.snapshot import LaneSnapshot, WorkerSnapshot
from basertd.server.observe.windows import HISTORY_S, RATE_S, WINDOW_S, Quantiles, Windows


@dataclass(frozen=True, slots=True)
class ServedWorker:
    """A worker's snapshot with what the snapshot does not carry: the ``model`` it serves and its
    ``engine`` name."""

    snapshot: WorkerSnapshot
    model: str
    engine: str


@dataclass(frozen=True, slots=True)
class Header:
    """The daemon summary of an overview: version, public state, uptime (seconds), requests
    accepted since start, accepted and not ended, one line per problem."""

    version: str
    state: str
    uptime_s: float
    requests_total: int
    in_flight: int
    problems: list[str]


def lane_row(snap: WorkerSnapshot, lane: LaneSnapshot) -> control.LaneRow:
    """One live lane of ``snap`` as the control API shows it (``basertctl lanes``, ``top``);
    its age in seconds at the snapshot."""
    return control.LaneRow(
        worker_id=snap.worker_id,
        lane_tag=lane.tag,
        request_id=lane.request_id,
        qos=lane.qos,
        state=lane.phase,
        prompt_tokens=lane.prompt_tokens,
        generated_tokens=lane.generated_tokens,
        cached_tokens=lane.cached_tokens,
        age_s=max(0.0, snap.taken_at - lane.admitted_at),
    )


def _quantiles(q: Quantiles) -> control.Quantiles:
    return control.Quantiles(count=q.count, p50_s=q.p50, p95_s=q.p95)


def _worker(w: ServedWorker) -> control.OverviewWorker:
    s = w.snapshot
    mem = s.mem
    return control.OverviewWorker(
        worker_id=s.worker_id,
        model=w.model,
        engine=w.engine,
        state=str(s.state),
        pid=s.pid,
        lanes_busy=s.lanes_busy,
        lanes_max=s.limits.max_lanes,
        queue_depth=s.queued,
        kv_reserved_tokens=s.kv_reserved_tokens,
        kv_capacity_tokens=s.limits.kv_tokens,
        pool_blocks_used=mem.pool_blocks_used if mem is not None else 0,
        pool_blocks_total=mem.pool_blocks_total if mem is not None else 0,
        ticks_run=s.ticks_run,
        prefill_tokens=s.prefill_tokens,
        decode_tokens=s.decode_tokens,
        preemptions=s.preemptions,
        crash_resumes=s.crash_resumes,
        respawns=s.respawns,
        problem=s.last_error or s.stall_reason or "",
    )


def history(windows: Windows, now: float, span_s: int) -> control.OverviewHistory:
    """Per-second series of the last ``span_s`` seconds (at most ``HISTORY_S``)."""
    span_s = max(0, min(span_s, HISTORY_S))
    ttft_sum = windows.ttft_sum.series(now, span_s)
    ttft_n = windows.ttft_count.series(now, span_s)
    queried = windows.cache_query_tokens.series(now, span_s)
    hit = windows.cache_hit_tokens.series(now, span_s)
    return control.OverviewHistory(
        step_s=1.0,
        tokens_in=windows.tokens_in.series(now, span_s),
        tokens_out=windows.tokens_out.series(now, span_s),
        ttft_s=[s / n if n else 0.0 for s, n in zip(ttft_sum, ttft_n, strict=True)],
        cache_hit_ratio=[h / q if q else 0.0 for h, q in zip(hit, queried, strict=True)],
    )


def overview(
    header: Header, workers: Sequence[ServedWorker], windows: Windows, now: float, history_s: int = 0
) -> control.OverviewResult:
    """The ``OverviewResult`` of ``workers`` at ``now`` (monotonic seconds; module docstring),
    with ``history_s`` seconds of per-second series (0: none)."""
    snaps = [w.snapshot for w in workers]
    depth: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for s in snaps:
        for q in s.queues:
            depth[q.qos] = depth.get(q.qos, 0) + q.depth
            oldest[q.qos] = max(oldest.get(q.qos, 0.0), q.oldest_wait_s)
    capacity = sum(s.limits.kv_tokens for s in snaps)
    reserved = sum(s.kv_reserved_tokens for s in snaps)
    return control.OverviewResult(
        version=header.version,
        state=header.state,
        uptime_s=header.uptime_s,
        requests_total=header.requests_total,
        in_flight=header.in_flight,
        problems=list(header.problems),
        workers=[_worker(w) for w in workers],
        lanes=[lane_row(s, lane) for s in snaps for lane in s.lanes],
        queue=[control.QueueRow(qos=q, depth=d, oldest_wait_s=oldest[q]) for q, d in depth.items()],
        rate_window_s=float(RATE_S),
        tokens_in_per_s=windows.rate(windows.tokens_in, now),
        tokens_out_per_s=windows.rate(windows.tokens_out, now),
        window_s=WINDOW_S,
        ttft=_quantiles(windows.ttft.quantiles(now)),
        itl=_quantiles(windows.itl.quantiles(now)),
        wal_fsync=_quantiles(windows.wal_fsync.quantiles(now)),
        cache_hit_ratio=windows.cache_hit_ratio(now),
        pool_usage_ratio=min(1.0, reserved / capacity) if capacity else 0.0,
        history=history(windows, now, history_s) if history_s > 0 else None,
    )
