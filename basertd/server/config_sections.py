"""The tables of the daemon's configuration file, one msgspec ``Struct`` per TOML table
(``[[workers]]``, ``[scheduler]``, ``[cache]``, ...), with their keys, defaults and ranges; the
file, its root table and its loading are ``basertd.server.config``'s (whose docstring shows every
key with its default).

Sizes are in the unit their name says (``_bytes``, ``_tokens``, ``_s`` seconds, ``_mib``); a key a
table does not know, a wrong type or a value out of range fails msgspec's conversion (a
``ValueError`` of a table's ``__post_init__`` included), which ``basertd.server.config`` reports as
a ``ConfigError`` naming the key. ``parse_listen`` and ``is_loopback`` read listen addresses
(``[http] listen``, ``[operators] metrics_listen``).
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

import msgspec

from basertd.schema.client import QosClass

_Pos = Annotated[int, msgspec.Meta(ge=1)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every table (``basertd.server.config.Config`` too): unknown keys are errors (a typo
    must not be silently ignored)."""


DEFAULT_KV_LAYOUT = "per-lane"
"""A llamacpp worker's KV layout when ``[[workers]] kv_layout`` is "" (README "*KV layout*"):
llama-server's layout, which runs the agents' burst and many-lane decode faster within the same
memory; an idle lane's stream keeps the prefix it computed, so it holds as many resident prefixes as
the unified cache. "unified" shares a prefix's cells with every lane seeded from it instead of
copying its stream."""


class WorkerConfig(Section):
    """One engine worker (one process, one device).

    ``engine``: "llamacpp" (GGUF through llama-cpp-python) or "basert" (a tick-ABI library; the C
    reference engine's built-in config when ``model`` is ""). ``model``: the GGUF path for llamacpp
    ("" = the default model, ``basertd.models.default_model_path()``); for basert the bundle file
    loaded with baseRT.h's ``baseRT_load_model_ex`` (a ``.base`` bundle, or a reference bundle
    file). ``lib``: basert's library (a libbaseRT build; "" = the C reference engine);
    ``kernel_library``: its GPU kernel library ("" = the library's auto-detection). ``device``:
    "cpu", or "cuda:N" / "rocm:N" / "gpu:N", which makes GPU N the only one the worker sees.
    ``lanes``: concurrent generations; ``context_length``: tokens per lane (prompt + generated);
    ``threads``: engine CPU threads; ``engine_args``: extra ``basertd-worker`` flags passed as is.
    ``chat_template``: the chat template of the HTTP chat endpoint: a file path or the name of a
    template shipped with basertd (``basertd.server.transport.http.chat_template``); "" = the
    model's own (GGUF ``tokenizer.chat_template``), or the shipped Gemma template for the default
    model. ``draft_model``: this llamacpp worker's draft GGUF for ``[speculation]`` "draft-model"
    ("" = ``[speculation] draft_model``). ``kv_layout``: a llamacpp worker's KV cache: "per-lane"
    (llama-server's layout: a KV stream of ``context_length`` cells per lane, an idle one keeping
    the prefix it computed, and per extra resident prefix; a query attends to its own stream, a
    prefix is copied into a lane's stream) or "unified" (one cache whose cells every lane and cached
    prefix share); "" = ``DEFAULT_KV_LAYOUT`` for a llamacpp worker, nothing for others (README
    "*KV layout*")."""

    engine: Literal["llamacpp", "basert"] = "llamacpp"
    model: str = ""
    lib: str = ""
    kernel_library: str = ""
    device: str = "cpu"
    lanes: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8
    context_length: Annotated[int, msgspec.Meta(ge=16)] = 2048
    threads: _Pos = 2
    engine_args: list[str] = msgspec.field(default_factory=list)
    ref_config: dict[str, int | float | bool | str] = msgspec.field(default_factory=dict)
    chat_template: str = ""
    draft_model: str = ""
    kv_layout: Literal["", "unified", "per-lane"] = ""

    def __post_init__(self) -> None:
        if self.kv_layout and self.engine != "llamacpp":
            raise ValueError(
                f"kv_layout: {self.kv_layout!r} is for llamacpp workers only;"
                f" a {self.engine} worker has no KV layout"
            )


class SchedulerConfig(Section):
    """Per-worker scheduler knobs (DESIGN.md "Scheduling").

    ``prefill_budget``: the most prompt tokens one tick prefills (tokens); ``decode_grant``: the
    decode rounds one lane runs in one tick (a plain lane's tokens; a speculating lane's grant in
    tokens is this times its measured tokens per round; <= 65535, a u16 in LaneDecode);
    ``decode_tick_s``: when no request is queued, a tick's decode grant grows past
    ``decode_grant`` to as many rounds as fill this many seconds at the measured decode step (a
    fast engine's ticks would otherwise be a few milliseconds long, and the coordinator's turn
    between two ticks, when the worker waits, a large share of every token; 0: ``decode_grant``
    only); ``tick_target_s``: the tick length (seconds) the adaptive budget aims at while requests
    wait; ``queue_limit``:
    queued requests per QoS class and worker; ``max_queued_tokens``: queued prompt tokens per
    worker; ``partial_emits``: ask the worker for mid-tick token deltas (ABI rule 64).

    QoS (``basertd.server.sched.qos``): ``preempt``: an interactive request that finds no lane preempts
    the lowest-class lane (it resumes exactly, ABI rules 71-73); ``aging_s``: seconds after which a
    queued request competes one class higher (0: strict class order); ``lane_caps``: most live
    lanes per class (0 or absent: no cap).

    ``stall_timeout_s``: the progress watchdog's bound (seconds): a worker with work waiting that
    completes no tick for this long is reported stalled (``/health``), its worker restarted and
    its stuck work failed (``basertd.server.sched.watchdog``).

    ``max_crash_resumes``: a worker that dies is a preemption of its lanes (each resumes exactly on
    the respawned worker); a request running at this many crashes of its worker in a row, with no
    token delivered in between, fails ``worker_failed`` instead (a poison request cannot
    crash-loop its worker).

    Long ticks that yield (DESIGN.md "Scheduling"): ``long_prefill_budget``: the most prompt tokens
    one tick prefills when nothing urgent waits and no streaming lane would stall (a long tick at
    the engine's best rate; rounded to the prefill chunk of the engine's measured rate curve; an
    engine that yields ends it early when urgent work arrives); ``max_itl_s``: the inter-token
    latency bound (seconds): a decoding streaming lane never waits longer between two tokens (the
    scheduler caps the prefill of a tick, and asks a yielding engine to end the tick in time);
    ``min_prefill_chunk``: the smallest prefill chunk (tokens) taken from the measured curve.
    ``prefill_budget`` also bounds the whole-prompt prefill of short interactive prompts."""

    prefill_budget: _Pos = 512
    long_prefill_budget: _Pos = 2048
    max_itl_s: Annotated[float, msgspec.Meta(gt=0.0, le=60.0)] = 0.5
    min_prefill_chunk: _Pos = 64
    decode_grant: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8
    decode_tick_s: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 0.05
    tick_target_s: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 0.05
    queue_limit: _Pos = 256
    max_queued_tokens: _Pos = 1 << 20
    partial_emits: bool = True
    preempt: bool = True
    aging_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 10.0
    lane_caps: dict[QosClass, _NonNeg] = msgspec.field(default_factory=dict)
    stall_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] = 60.0
    max_crash_resumes: _Pos = 2


class CacheConfig(Section):
    """Prefix-cache knobs (DESIGN.md "Prefix cache policy").

    ``publish_on_retire``: retire finished lanes with ``publish_to_cache`` so later prompts sharing
    their prefix prefill less; ``evict_in_tick``: let a tick evict unpinned cache entries to fit its
    plan (the plan's ShedPolicy); ``max_evict_bytes_per_tick``: cap of that eviction (bytes, 0 = no
    cap).

    The policy (``basertd.server.cache.policy``): ``enabled``: admit requests seeded from cached
    prefixes, coalesce shared prefixes and hold pins (needs ``publish_on_retire``);
    ``coalesce_min_tokens``: queued requests sharing at least this many uncached prompt tokens with
    a prefilling lane or an earlier request wait for it and prefill them once (0: off);
    ``high_watermark`` / ``low_watermark``: pool occupancy fractions between which eviction keeps
    the pool (0: no watermark eviction); ``index_entries``: published prefixes remembered per worker;
    ``route_slack``: load difference (requests per lane) up to which a request still goes to the
    worker holding its longest prefix. ``isolate_by_api_key``: each API key's requests hash their
    pages with a salt of their own (``requester.cache_salt``), so they are seeded only from
    prefixes that key's requests published, never another tenant's, and ``cached_tokens`` tells
    nothing about other tenants' prompts (README "Tenants and the prefix cache").

    ``host_bytes``: bytes of host memory each llama.cpp worker may keep prefixes in once they are
    evicted from its KV pool, restored instead of prefilled when a prompt needs them again (0:
    off; read when a worker starts, so a change needs a restart). The default, 1 GiB per worker,
    holds about 58,000 tokens of the default model's KV (18 KiB a token), three times its pool of
    8 lanes x 2,048 tokens: what a box serving the default model can spare (llama-server's host
    prompt cache defaults to 8 GiB for a whole server) and small beside the RAM of any box that
    serves a model on the CPU; docs/operations.md "Host tier" says how to size it."""

    publish_on_retire: bool = True
    evict_in_tick: bool = True
    max_evict_bytes_per_tick: _NonNeg = 0
    enabled: bool = True
    coalesce_min_tokens: _NonNeg = 64
    high_watermark: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.9
    low_watermark: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.75
    index_entries: _Pos = 1024
    isolate_by_api_key: bool = False
    route_slack: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    host_bytes: _NonNeg = 1 << 30

    def __post_init__(self) -> None:
        if self.high_watermark and self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must not exceed high_watermark ({self.high_watermark})"
            )


LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
"""Hosts ``operators.metrics_listen`` may bind (the metrics carry no secrets, but stay local)."""


class OperatorsConfig(Section):
    """Operator-facing knobs (DESIGN.md "Operators").

    ``operator_group``: name of the group whose members may use control verbs besides root and
    the daemon's own user ("" = nobody else); ``drain_timeout_s``: seconds a SIGTERM drain lets
    in-flight requests finish before cancelling them (keep it below the unit's TimeoutStopSec);
    ``drain_grace_s``: seconds a drain (SIGTERM or ``basertctl drain``) reports not ready on
    ``/health`` while still accepting requests, before it refuses new ones, so that a router's
    health checks take the daemon out first (docs/scale-out.md; the drain timeout runs after it);
    ``metrics_listen``: ``host:port`` on a loopback address (``127.0.0.1``, ``[::1]``,
    ``localhost``) to also serve ``/metrics`` over HTTP ("" = only ``basertctl metrics``)."""

    operator_group: str = ""
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 30.0
    drain_grace_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0
    metrics_listen: str = ""

    def __post_init__(self) -> None:
        if self.metrics_listen:
            self.metrics_address()

    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of ``metrics_listen``, None when unset. Raises ValueError unless it is
        ``host:port`` with a loopback host and a port in 0..65535."""
        if not self.metrics_listen:
            return None
        m = re.fullmatch(r"\[([0-9a-fA-F:]+)\]:(\d+)|([^:\[\]]+):(\d+)", self.metrics_listen)
        if not m:
            raise ValueError(f"metrics_listen must be host:port, got {self.metrics_listen!r}")
        host = m.group(1) or m.group(3)
        port = int(m.group(2) or m.group(4))
        if host not in LOOPBACK_HOSTS and not host.startswith("127."):
            raise ValueError(f"metrics_listen must use a loopback address, got {host!r}")
        if port > 65535:
            raise ValueError(f"metrics_listen port must be within 0..65535, got {port}")
        return host, port


class DurabilityConfig(Section):
    """The write-ahead log (``basertd.server.durability.wal``; DESIGN.md "Crash = preemption; acceptance is
    durable").

    ``mode``: how the log journals accepted requests, their tokens and completions in
    ``state_dir`` (a restart resumes every unfinished request from it), with one group commit per
    tick before that tick's tokens are delivered:

    - "write" (the default): a commit is one ``write`` into the kernel's page cache, then the
      tokens are delivered; an ``fdatasync`` runs in the background at most every
      ``sync_interval_ms`` (one covers every commit before it). A SIGKILL, crash or OOM kill of
      the daemon loses nothing a client has seen. A power loss or kernel crash may lose the
      tokens delivered in about the last ``sync_interval_ms`` (the restart then generates them
      again, and a client that resumes after more tokens than survived gets ``invalid_request``).
    - "tick": a commit is one ``write`` + one ``fdatasync`` before the tokens are delivered, so
      what a client saw survives a power loss too, at a thread hop and an fsync per delivery
      (on a 2-core box about 1 ms of coordinator CPU per streamed token, taken from the engine).
    - "off": no log (a restart loses what was in flight).

    Why "write" is the default: the failure the design protects against is the death of a
    process (crash = preemption), and for that the page cache is as good as the disk. The same
    trade as PostgreSQL's ``synchronous_commit = off``, Redis's ``appendfsync everysec`` and
    MySQL's ``innodb_flush_log_at_trx_commit = 2``. Choose "tick" where a stream must survive the
    machine losing power.

    ``sync_interval_ms``: mode "write"'s least milliseconds between two background fdatasyncs
    (1-60000, default 1000, Redis's ``everysec``): the window of delivered tokens a power loss may
    take. Each background fdatasync costs the coordinator a timer, a thread hop and the fsync: at
    100 ms a single stream's coordinator spent 1.13 ms CPU and 4.5 wake-ups a token, at 1000 ms
    0.90 ms and 2.6, with no log 0.78 ms and 2.4 (``bench/bench_stream_cost.py --durability
    write,write:1000,off``, 2-core box). A stop, a drain,
    a rotation and a compaction fdatasync before they complete, in every mode. ``result_ttl_s``:
    seconds a finished request's result stays resumable (0: not after it finished; it also bounds
    how long a result stays on disk: about twice this, or a minute).
    ``min_free_bytes``: free bytes ``state_dir`` must have for the daemon to start (it refuses
    otherwise, saying so; default 64 MiB, one log segment). ``resumes_per_s`` and
    ``resume_burst``: each requester's resumes (native ``Resume``, HTTP ``Last-Event-ID``) are a
    token bucket of ``resume_burst`` refilled at ``resumes_per_s``; one over it is refused
    ``queue_full`` (HTTP 429) (``basertd.server.frontend.resume_limits``)."""

    mode: Literal["write", "tick", "off"] = "write"
    sync_interval_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)] = 1000
    result_ttl_s: Annotated[float, msgspec.Meta(ge=0.0, le=30.0 * 86400)] = 600.0
    min_free_bytes: _NonNeg = 64 << 20
    resumes_per_s: Annotated[float, msgspec.Meta(gt=0.0, le=1e6)] = 20.0
    resume_burst: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 40


class MetricsConfig(Section):
    """Metrics knobs (docs/scale-out.md). ``vllm_compat``: also export the ``vllm:*`` series the
    Gateway API Inference Extension's endpoint picker reads (``basertd.server.observe.metrics``)."""

    vllm_compat: bool = True


_ZMQ_ENDPOINT = re.compile(r"(tcp|ipc|inproc)://\S+")


class TracingConfig(Section):
    """OpenTelemetry traces (``basertd.server.observe.tracing``). ``otlp_endpoint``: the OTLP/HTTP
    traces URL of a collector ("" = no tracing, nothing recorded; needs the ``basertd[tracing]``
    extra); ``service_name``: the ``service.name`` resource attribute of the spans."""

    otlp_endpoint: str = ""
    service_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] = "basertd"

    def __post_init__(self) -> None:
        if self.otlp_endpoint and not re.fullmatch(r"https?://\S+", self.otlp_endpoint):
            raise ValueError(f"otlp_endpoint must be an http:// or https:// URL, got {self.otlp_endpoint!r}")


class KvEventsConfig(Section):
    """KV-cache events in vLLM's wire format (``basertd.server.observe.kv_events``, docs/scale-out.md).

    ``endpoint``: the ZMQ PUB address ("" = off); with ``bind = "auto"`` it binds when it holds
    ``*`` or ``::`` or is ``ipc://`` / ``inproc://``, else connects (vLLM's rule); ``bind =
    "bind"`` binds any address (one interface, e.g. ``tcp://127.0.0.1:5557``, where a router's SUB
    connects), ``"connect"`` always connects; ``layout``: each event a positional array
    (``"array"``, vLLM before 0.28 and subscribers written for it) or a map tagged by ``type``
    (``"map"``, vLLM 0.28 on; vllm-router's ``kv_aware`` decodes only this); a bound endpoint is
    per worker: worker
    ``i`` binds the TCP port plus ``i`` (``ipc``/``inproc``: the path plus ``_dp<i>``), while every
    worker connects to the same connected one. ``replay_endpoint``: a ZMQ ROUTER (bound, per worker)
    answering a start sequence number with every buffered batch from it on ("" = none).
    ``topic``: the first frame of every message, ``$VAR`` / ``${VAR}`` expanded from the
    environment at start (``replay_endpoint`` too, so a pod binds ``tcp://${POD_IP}:5600``).
    ``buffer_steps``: batches kept for replay per worker; ``hwm``: the per-subscriber high-water
    mark (messages); ``max_queue_size``: batches waiting for the publisher thread (more are
    dropped and counted). ``include_token_ids``: ``BlockStored`` carries each page's token ids
    (prompt content, readable by anyone who reaches the sockets); off (the default) its
    ``token_ids`` is empty and only the page hashes leave the process."""

    endpoint: str = ""
    bind: Literal["auto", "bind", "connect"] = "auto"
    layout: Literal["array", "map"] = "array"
    replay_endpoint: str = ""
    topic: str = ""
    include_token_ids: bool = False
    buffer_steps: _Pos = 10_000
    hwm: _Pos = 100_000
    max_queue_size: _Pos = 100_000

    def __post_init__(self) -> None:
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value and not _ZMQ_ENDPOINT.fullmatch(value):
                raise ValueError(f"{key} must be a tcp://, ipc:// or inproc:// address, got {value!r}")
        if self.replay_endpoint and not self.endpoint:
            raise ValueError("replay_endpoint needs endpoint (nothing is published without it)")

    @property
    def enabled(self) -> bool:
        """Events are published (``endpoint`` set)."""
        return bool(self.endpoint)


class LimitsConfig(Section):
    """Resource caps of the client socket (DESIGN.md "Client API"), enforced by
    ``basertd.server.transport.socket_server``.

    ``max_connections``: open client connections in all; ``max_connections_per_uid``: open
    connections of one peer uid (SO_PEERCRED); a connection over either cap gets
    ``Error(queue_full)`` and is closed. ``max_request_buffer_bytes``: bytes of request frames held
    half-received, summed over every connection (frames of at most 64 KiB are not counted); a frame
    whose length prefix would exceed it gets ``Error(queue_full)`` and its connection is closed
    before its body is read; it must be at least one frame cap (16 MiB) so a maximal request can
    ever be served. ``frame_timeout_s``: seconds a request frame may take from its first byte to
    its last; ``idle_timeout_s``: seconds a connection with no generation running may stay silent
    (0: never closed for idleness); both close with ``Error(timeout)``. ``max_reply_buffer_bytes``:
    reply bytes one connection may leave unread before it is dropped. ``listen_backlog``: the
    socket's listen queue (connects waiting for accept; the kernel caps it at
    ``net.core.somaxconn``)."""

    max_connections: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1024
    max_connections_per_uid: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 512
    max_request_buffer_bytes: Annotated[int, msgspec.Meta(ge=16 * 1024 * 1024)] = 64 * 1024 * 1024
    frame_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    idle_timeout_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0 * 7)] = 600.0
    max_reply_buffer_bytes: Annotated[int, msgspec.Meta(ge=1024 * 1024)] = 8 * 1024 * 1024
    listen_backlog: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 1024


_LISTEN_TCP = re.compile(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]/\s]+):(\d+)")


def parse_listen(entry: str) -> tuple[str, str, int]:
    """One ``[http] listen`` entry as ``("unix", path, 0)`` or ``("tcp", host, port)``. Raises
    ValueError unless it is ``unix:PATH`` (an absolute or relative path) or ``HOST:PORT``
    (``[v6]:PORT`` for IPv6) with a port in 0..65535."""
    if entry.startswith("unix:"):
        path = entry[5:]
        if not path:
            raise ValueError(f"listen entry {entry!r}: unix: needs a path")
        return "unix", path, 0
    m = _LISTEN_TCP.fullmatch(entry)
    if not m:
        raise ValueError(f"listen entry {entry!r} must be HOST:PORT, [V6]:PORT or unix:PATH")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if port > 65535:
        raise ValueError(f"listen entry {entry!r}: port must be within 0..65535")
    return "tcp", host, port


def is_loopback(host: str) -> bool:
    """True for ``localhost``, ``::1`` and 127.0.0.0/8."""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


class HttpConfig(Section):
    """The OpenAI-compatible HTTP API (``basertd.server.transport.http``).

    ``listen``: ``"HOST:PORT"`` and ``"unix:PATH"`` entries ([] = no HTTP; ``basertd serve --http``
    replaces the list); ``api_key_file``: a file of API keys, one per line (blank lines and lines
    starting with ``#`` ignored): TCP requests must carry ``Authorization: Bearer <key>``; "" = no
    keys, which only loopback addresses may use (``insecure_listeners``). Unix-socket requests
    are authorised by the socket's mode (``socket_mode``) and peer credentials instead.
    ``max_body_bytes``: largest request body (bytes), larger ones are refused 413.
    ``resume_grace_s``: seconds a streamed request keeps running after its client went away, for a
    reconnect with ``Last-Event-ID`` (``basertd.server.transport.http.resume``); 0 = cancel at once.

    Connection bounds (``basertd.server.transport.http.door``), the HTTP twins of ``[limits]``:
    ``max_connections`` open connections in all (one more is answered 503 and closed) and
    ``max_connections_per_peer`` of one peer (remote IP on TCP, uid on a Unix socket; 429);
    ``header_timeout_s``: seconds from a request head's first byte to its end, ``body_timeout_s``:
    from the head's end to the body's (both 408 and closed); ``idle_timeout_s``: seconds a
    connection with no request in progress may stay silent (closed); ``write_timeout_s``: seconds
    replies may stay over ``write_buffer_bytes`` unread (bytes queued in the daemon per connection;
    the writer waits beyond it) before the connection is closed and its requests cancelled.
    ``allowed_hosts``: host names (no port) a loopback TCP listener serves besides ``localhost``,
    127.0.0.0/8 and ``::1`` (``Host`` and ``Origin`` checks, ``basertd.server.transport.http.origin``)."""

    listen: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1:8000"])
    api_key_file: str = ""
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 8 << 20
    resume_grace_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 512
    max_connections_per_peer: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 256
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 10.0
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 60.0
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] = 60.0
    write_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    write_buffer_bytes: Annotated[int, msgspec.Meta(ge=4096, le=1 << 30)] = 256 * 1024
    allowed_hosts: list[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._\-\[\]:]{1,253}$")]] = (
        msgspec.field(default_factory=list)
    )

    def __post_init__(self) -> None:
        for i, entry in enumerate(self.listen):
            try:
                parse_listen(entry)
            except ValueError as exc:
                raise ValueError(f"listen[{i}]: {exc}") from None

    def insecure_listeners(self) -> list[str]:
        """Entries on a non-loopback TCP address while no ``api_key_file`` is set (the daemon
        refuses to start with any)."""
        if self.api_key_file:
            return []
        out = []
        for entry in self.listen:
            kind, host, _ = parse_listen(entry)
            if kind == "tcp" and not is_loopback(host):
                out.append(entry)
        return out


class CompileConfig(Section):
    """What a request brings that runs off the event loop, in child processes
    (``basertd.server.request.sandbox``): grammar specs (``frontend.spec_compiler``) and chat
    templates (``transport.http.templates``).

    ``processes``: child processes of each pool (grammar, chat template); ``grammar_timeout_s``:
    seconds one spec may take to compile (then 400); ``template_timeout_s``: seconds one chat may
    take to render (then 400); ``template_max_chars``: longest rendered chat (characters; longer
    is a 400); ``memory_mib``: address-space limit of each child (MiB); ``max_pending``: jobs one
    pool lets wait or run at once (more: 429 / QUEUE_FULL); ``max_tools``: most tools one request
    may offer; ``max_tools_bytes``: largest ``tools`` array as compact JSON (bytes);
    ``max_messages``: most messages one chat may carry (each is converted on the event loop)."""

    processes: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    grammar_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=600.0)] = 10.0
    template_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=600.0)] = 5.0
    template_max_chars: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 8 << 20
    memory_mib: Annotated[int, msgspec.Meta(ge=256, le=1 << 20)] = 2048
    max_pending: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 256
    max_tools: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 128
    max_tools_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 1 << 20
    max_messages: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 10_000


class SpeculationConfig(Section):
    """Speculative decoding (tick ABI §2; ``basertd.worker.strategies``). ``strategies``: the
    strategies every worker registers at load ([] = none: every request decodes plainly);
    "prompt-lookup" drafts from n-gram matches in the request's own prompt and output. Its
    tuning, in tokens: ``draft_min`` .. ``draft_max`` drafts per round, matches of ``ngram_min`` ..
    ``ngram_max`` tokens; ``max_batch_lanes``: a round with more decoding lanes drafts nothing
    (verification rows cost more than they save in a large batch); ``min_acceptance``: a lane whose
    recent share of accepted drafts falls below it pauses drafting for a while (0..1). A request's
    ``speculation`` field ("auto", "off", a strategy name) chooses per request; "auto" takes the
    first strategy of ``strategies`` (in this order) that covers the request.

    "draft-model" drafts with a smaller GGUF of the same vocabulary, ``draft_model`` (a path; a
    ``[[workers]]`` table's own ``draft_model`` overrides it for that llamacpp worker), with the
    same ``draft_min`` / ``draft_max`` / ``max_batch_lanes`` / ``min_acceptance``; a worker without
    a path serves without it. A ``draft_model`` without "draft-model" in ``strategies``, or
    "draft-model" with no path anywhere, is a ConfigError."""

    strategies: list[Literal["prompt-lookup", "draft-model"]] = msgspec.field(default_factory=list)
    draft_model: str = ""
    draft_min: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    draft_max: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    ngram_min: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2
    ngram_max: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    max_batch_lanes: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    min_acceptance: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.15

    def __post_init__(self) -> None:
        if self.draft_min > self.draft_max or self.ngram_min > self.ngram_max:
            raise ValueError("speculation: draft_min <= draft_max and ngram_min <= ngram_max")

    def worker_args(self, worker: WorkerConfig | None = None) -> tuple[str, ...]:
        """The ``basertd-worker`` flags registering these strategies for ``worker``
        (``--speculation``, in ``strategies`` order, and ``--draft-model`` with the worker's draft
        path; "draft-model" is left out for a worker without one, or not llamacpp)."""
        common = (
            f"draft_min={self.draft_min},draft_max={self.draft_max},max_batch_lanes={self.max_batch_lanes},"
            f"min_accept_permille={round(self.min_acceptance * 1000)}"
        )
        knobs = {"prompt-lookup": f"{common},ngram_min={self.ngram_min},ngram_max={self.ngram_max}"}
        draft = ""
        if worker is not None and worker.engine == "llamacpp":
            draft = worker.draft_model or self.draft_model
        out: list[str] = []
        for name in dict.fromkeys(self.strategies):
            if name == "draft-model" and not draft:
                continue
            out += ["--speculation", f"{name}:{knobs.get(name, common)}"]
        if draft and "draft-model" in self.strategies:
            out += ["--draft-model", os.path.expanduser(draft)]
        return tuple(out)
