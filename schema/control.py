"""The control API used by ``basertctl`` on the client socket (DESIGN.md "Operators").

Verbs: Status, Workers, Lanes, Queue, CacheStats, CacheList, CachePin, CacheUnpin, CacheEvict,
Drain, Resume, RestartWorker, Metrics, Shutdown, ConfigCheck, Overview; each answered with its result (or
``ControlOk``), or with ``basertd.schema.client.Error`` (PERMISSION_DENIED when the peer is not
root, the daemon's user or the operator group). Same framing as the client API (msgpack maps
tagged by ``"type"``, ``basertd.schema.codec.ClientCodec``); every message carries an optional
``request_id`` echoed in its reply. Rows are meant to grow: append fields with defaults.

``Status`` here is the verb; the ABI status enum is ``basertd.schema.abi.Status``. Import the
module (``from basertd.schema import control``) to keep the names apart.
"""

from __future__ import annotations

import msgspec

from basertd.schema.client import Qos, QosClass


class _Msg(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of every control message: a map tagged by ``"type"``."""


class _Rec(msgspec.Struct, kw_only=True):
    """Base of untagged rows nested inside results."""


# --- requests ---------------------------------------------------------------------------------


class Status(_Msg, tag="status"):
    """Daemon summary; answered with StatusResult."""

    request_id: str = ""


class Workers(_Msg, tag="workers"):
    """One row per configured worker; WorkersResult."""

    request_id: str = ""


class Lanes(_Msg, tag="lanes"):
    """One row per live lane, of ``worker_id`` or of every worker (None); LanesResult."""

    request_id: str = ""
    worker_id: int | None = None


class Queue(_Msg, tag="queue"):
    """Queued requests per QoS class; QueueResult."""

    request_id: str = ""


class CacheStats(_Msg, tag="cache_stats"):
    """Prefix-cache counters per worker; CacheStatsResult."""

    request_id: str = ""


class CacheList(_Msg, tag="cache_list"):
    """Cached prefixes, most recently used first, at most ``limit``; CacheListResult."""

    request_id: str = ""
    worker_id: int | None = None
    limit: int = 100


class CachePin(_Msg, tag="cache_pin"):
    """Pin a prefix (protected cache class) given as ``tokens`` or as ``text`` (tokenized with
    the model's vocabulary, BOS included); exactly one is given. ``worker_id`` None pins on every
    worker. Answered with CachePinResult."""

    request_id: str = ""
    tokens: list[int] | None = None
    text: str | None = None
    worker_id: int | None = None


class CacheUnpin(_Msg, tag="cache_unpin"):
    """Drop pin ``pin_id``; the prefix becomes evictable. ControlOk, or Error(NOT_FOUND)."""

    pin_id: int
    request_id: str = ""


class CacheEvict(_Msg, tag="cache_evict"):
    """Evict unpinned prefixes: up to ``bytes_target`` bytes (0: all unpinned) on ``worker_id``
    (None: every worker). CacheEvictResult."""

    request_id: str = ""
    worker_id: int | None = None
    bytes_target: int = 0


class Drain(_Msg, tag="drain"):
    """Stop admitting; wait up to ``timeout_s`` seconds for live lanes to finish. DrainResult."""

    request_id: str = ""
    timeout_s: float = 30.0


class Resume(_Msg, tag="resume"):
    """Admit again after a Drain. ControlOk."""

    request_id: str = ""


class RestartWorker(_Msg, tag="restart_worker"):
    """Restart worker ``worker_id`` (its lanes get a clean continuation or a typed error).
    RestartWorkerResult, or Error(NOT_FOUND)."""

    worker_id: int
    request_id: str = ""


class Metrics(_Msg, tag="metrics"):
    """The Prometheus exposition text; MetricsResult."""

    request_id: str = ""


class Shutdown(_Msg, tag="shutdown"):
    """Stop the daemon: drain first for up to ``timeout_s`` seconds when ``drain``. ControlOk
    (sent before the daemon stops)."""

    request_id: str = ""
    drain: bool = True
    timeout_s: float = 30.0


class ConfigCheck(_Msg, tag="config_check"):
    """Validate a configuration file at ``path`` or given as ``text`` (exactly one) without
    applying it; ConfigCheckResult."""

    request_id: str = ""
    path: str | None = None
    text: str | None = None


class Overview(_Msg, tag="overview"):
    """Everything ``basertctl top`` and the page at ``/`` show, in one reply; OverviewResult.
    ``history_s``: seconds of per-second series to include (0: none; at most 600)."""

    request_id: str = ""
    history_s: int = 0


# --- rows and results -------------------------------------------------------------------------


class SpeculationRow(_Rec):
    """Speculative decoding of one strategy over every worker since start: tokens drafted,
    drafts accepted, and the acceptance rate (accepted / drafted, 0 with no drafts)."""

    strategy: str
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0


class StatusResult(_Msg, tag="status_result"):
    """``state`` "starting", "ready", "draining" or "stopping"; uptime in seconds; workers
    handshaken / configured; lanes busy / total; queued requests; requests served since start;
    ``problems``: one line per worker an operator must look at ("worker 0: <why>");
    ``speculation``: one row per speculation strategy that drafted."""

    request_id: str = ""
    version: str = ""
    state: str = "ready"
    uptime_s: float = 0.0
    workers_ready: int = 0
    workers_total: int = 0
    lanes_busy: int = 0
    lanes_max: int = 0
    queued: int = 0
    requests_total: int = 0  # generations accepted and embedding requests answered since the start
    problems: list[str] = msgspec.field(default_factory=list)
    speculation: list[SpeculationRow] = msgspec.field(default_factory=list)


class WorkerRow(_Rec):
    """One worker: ``state`` "starting", "ready", "draining", "restarting" or "dead"; pid (0 when
    none); lanes busy / max; requests queued for it; respawn count; KV pool bytes used / total;
    ticks run; lanes and unconsumed seed leases the engine itself reports (its ``stats``; with
    the coordinator idle both are 0 but for one lease per held ``cache pin``, anything else is a
    leak); ``engine_stats``: every counter the engine reports (PONG stats: prefill_tokens_total,
    decode_tokens_total, cache_entries, ...); ``last_error``: why its last incarnation failed
    (set while it respawns or after it gave up; "" when it serves); ``kv_layout``: a llama.cpp
    worker's KV layout ("unified" or "per-lane"; "" for other engines)."""

    worker_id: int
    engine: str = ""
    model: str = ""
    state: str = ""
    pid: int = 0
    lanes_busy: int = 0
    lanes_max: int = 0
    queue_depth: int = 0
    respawns: int = 0
    pool_used_bytes: int = 0
    pool_total_bytes: int = 0
    ticks_run: int = 0
    engine_lanes: int = 0
    seed_leases: int = 0
    engine_stats: dict[str, int] = msgspec.field(default_factory=dict)
    last_error: str = ""
    kv_layout: str = ""


class WorkersResult(_Msg, tag="workers_result"):
    """Answer to Workers."""

    request_id: str = ""
    workers: list[WorkerRow] = msgspec.field(default_factory=list)


class LaneRow(_Rec):
    """One live lane: its worker and lane tag, the request it serves, QoS class, ``state``
    "prefill", "decode" or "retiring", prompt / generated / cached tokens, seconds since admit."""

    worker_id: int
    lane_tag: int
    request_id: str = ""
    qos: Qos = QosClass.INTERACTIVE
    state: str = ""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    age_s: float = 0.0


class LanesResult(_Msg, tag="lanes_result"):
    """Answer to Lanes."""

    request_id: str = ""
    lanes: list[LaneRow] = msgspec.field(default_factory=list)


class QueueRow(_Rec):
    """One QoS class: requests waiting and the oldest one's wait in seconds."""

    qos: Qos
    depth: int = 0
    oldest_wait_s: float = 0.0


class QueueResult(_Msg, tag="queue_result"):
    """Answer to Queue: one row per class, highest first."""

    request_id: str = ""
    classes: list[QueueRow] = msgspec.field(default_factory=list)


class CacheStatsRow(_Rec):
    """Prefix-cache counters of one worker: entries and bytes (pinned among them), lookups that
    hit / missed, prompt tokens served from cache, evictions and evicted bytes; the host tier of
    evicted prefixes (llama.cpp workers): entries and bytes held, its capacity, restores into the
    pool and their total wall time (seconds), snapshots refused at restore (corrupt, another model
    or layout, another length). Host counters count since the worker incarnation started."""

    worker_id: int
    entries: int = 0
    bytes: int = 0
    pinned_entries: int = 0
    pinned_bytes: int = 0
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    host_entries: int = 0
    host_bytes: int = 0
    host_capacity_bytes: int = 0
    host_restores: int = 0
    host_restore_s: float = 0.0
    host_refused: int = 0


class CacheStatsResult(_Msg, tag="cache_stats_result"):
    """Answer to CacheStats."""

    request_id: str = ""
    workers: list[CacheStatsRow] = msgspec.field(default_factory=list)


class CacheEntryRow(_Rec):
    """One cached prefix: its worker, length in tokens, bytes, pin id (0: not pinned), hit count,
    seconds since last use, the first tokens (a short preview of ids, never text) and ``tier``:
    "pool" (in the engine's KV pool) or "host" (only in its host-memory tier, restored on use)."""

    worker_id: int
    prefix_tokens: int = 0
    bytes: int = 0
    pin_id: int = 0
    hits: int = 0
    idle_s: float = 0.0
    head: list[int] = msgspec.field(default_factory=list)
    tier: str = "pool"


class CacheListResult(_Msg, tag="cache_list_result"):
    """Answer to CacheList."""

    request_id: str = ""
    entries: list[CacheEntryRow] = msgspec.field(default_factory=list)


class CachePinResult(_Msg, tag="cache_pin_result"):
    """A pin was recorded: its id (for CacheUnpin) and the pinned prefix length in tokens."""

    pin_id: int
    request_id: str = ""
    tokens: int = 0


class CacheEvictResult(_Msg, tag="cache_evict_result"):
    """Bytes freed and entries dropped by a CacheEvict."""

    request_id: str = ""
    bytes_freed: int = 0
    entries: int = 0


class DrainResult(_Msg, tag="drain_result"):
    """``drained`` True when no lane was left within the timeout; live lanes left; seconds waited."""

    request_id: str = ""
    drained: bool = True
    lanes_active: int = 0
    waited_s: float = 0.0


class RestartWorkerResult(_Msg, tag="restart_worker_result"):
    """The worker was restarted: its id and new pid."""

    worker_id: int
    request_id: str = ""
    pid: int = 0


class MetricsResult(_Msg, tag="metrics_result"):
    """Prometheus text exposition format (version 0.0.4)."""

    request_id: str = ""
    text: str = ""


class ConfigCheckResult(_Msg, tag="config_check_result"):
    """``ok`` when the configuration is valid; one line per error and per warning."""

    request_id: str = ""
    ok: bool = True
    errors: list[str] = msgspec.field(default_factory=list)
    warnings: list[str] = msgspec.field(default_factory=list)


class Quantiles(_Rec):
    """Quantiles of the samples of a rolling window: ``count`` samples, ``p50_s`` and ``p95_s``
    in seconds (0.0 when there were none)."""

    count: int = 0
    p50_s: float = 0.0
    p95_s: float = 0.0


class OverviewWorker(_Rec):
    """One worker in an Overview: the ``WorkerRow`` basics (``state``, ``pid``, lanes busy / max,
    requests queued), KV tokens reserved by live lanes of the pool's capacity, the engine's pool
    blocks used / total after its last tick (prefix-cache entries included; 0 before the first
    tick), and counters since start: ticks, prompt tokens prefilled and tokens decoded by the
    engine, lanes preempted, running requests requeued after a crash (``crash_resumes``),
    respawns; ``problem``: why it does not serve or is stalled ("" when fine)."""

    worker_id: int
    model: str = ""
    engine: str = ""
    state: str = ""
    pid: int = 0
    lanes_busy: int = 0
    lanes_max: int = 0
    queue_depth: int = 0
    kv_reserved_tokens: int = 0
    kv_capacity_tokens: int = 0
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0
    ticks_run: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    crash_resumes: int = 0
    respawns: int = 0
    problem: str = ""


class OverviewHistory(_Rec):
    """Per-second series of the last ``len(...)`` seconds, oldest first, the last point the second
    still filling: ``tokens_in`` (prompt tokens prefilled at first admission) and ``tokens_out``
    (tokens delivered), ``ttft_s`` (mean TTFT of the requests whose first token came in that
    second; 0.0 when none), ``cache_hit_ratio`` (cached over looked-up prompt tokens; 0.0 when
    none was looked up)."""

    step_s: float = 1.0
    tokens_in: list[float] = msgspec.field(default_factory=list)
    tokens_out: list[float] = msgspec.field(default_factory=list)
    ttft_s: list[float] = msgspec.field(default_factory=list)
    cache_hit_ratio: list[float] = msgspec.field(default_factory=list)


class OverviewResult(_Msg, tag="overview_result"):
    """The live picture (answer to Overview): the ``StatusResult`` summary (version, state,
    uptime, requests since start, ``in_flight`` accepted and not ended, problems), one row per
    worker, every live lane, the queue per QoS class (highest first), tokens/s in and out over the
    last ``rate_window_s`` seconds, TTFT / inter-token latency / WAL fsync quantiles over the last
    ``window_s`` seconds, the prefix-cache hit ratio (cached over looked-up prompt tokens) over
    the same window, KV reserved over capacity of every worker (``pool_usage_ratio``, 0..1), and
    ``history`` when asked for (``Overview.history_s``)."""

    request_id: str = ""
    version: str = ""
    state: str = ""
    uptime_s: float = 0.0
    requests_total: int = 0
    in_flight: int = 0
    problems: list[str] = msgspec.field(default_factory=list)
    workers: list[OverviewWorker] = msgspec.field(default_factory=list)
    lanes: list[LaneRow] = msgspec.field(default_factory=list)
    queue: list[QueueRow] = msgspec.field(default_factory=list)
    rate_window_s: float = 10.0
    tokens_in_per_s: float = 0.0
    tokens_out_per_s: float = 0.0
    window_s: float = 60.0
    ttft: Quantiles = msgspec.field(default_factory=Quantiles)
    itl: Quantiles = msgspec.field(default_factory=Quantiles)
    wal_fsync: Quantiles = msgspec.field(default_factory=Quantiles)
    cache_hit_ratio: float = 0.0
    pool_usage_ratio: float = 0.0
    history: OverviewHistory | None = None


class ControlOk(_Msg, tag="control_ok"):
    """A control verb with nothing to return succeeded (Resume, Shutdown, CacheUnpin)."""

    request_id: str = ""
    message: str = ""


REQUESTS: tuple[type, ...] = (
    Status,
    Workers,
    Lanes,
    Queue,
    CacheStats,
    CacheList,
    CachePin,
    CacheUnpin,
    CacheEvict,
    Drain,
    Resume,
    RestartWorker,
    Metrics,
    Shutdown,
    ConfigCheck,
    Overview,
)
"""Control verbs (basertctl -> daemon)."""
REPLIES: tuple[type, ...] = (
    StatusResult,
    WorkersResult,
    LanesResult,
    QueueResult,
    CacheStatsResult,
    CacheListResult,
    CachePinResult,
    CacheEvictResult,
    DrainResult,
    RestartWorkerResult,
    MetricsResult,
    ConfigCheckResult,
    OverviewResult,
    ControlOk,
)
"""Control results (daemon -> basertctl); failures are ``basertd.schema.client.Error``."""
