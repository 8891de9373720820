"""The daemon's configuration: one TOML file, validated with msgspec.

Every key has a working default, so ``basertd serve`` with no file serves the default model on the
llamacpp engine on CPU. Unknown keys, wrong types and values out of range are a ``ConfigError``
listing each one by its key (``workers[0].lanse``), raised before anything starts.

Example (every key shown with its default)::

    runtime_dir = ""            # "": $RUNTIME_DIRECTORY, else /run/basertd, else a per-user dir
    state_dir = ""              # "": $STATE_DIRECTORY, else /var/lib/basertd, else a per-user dir
    socket = ""                 # "": <runtime_dir>/basertd.sock
    socket_mode = "0660"        # octal string or integer
    log_level = "info"

    [[workers]]                 # one table per worker; none given = one default worker
    engine = "llamacpp"         # "llamacpp" or "basert" (libbaseRT or the C reference engine)
    model = ""                  # GGUF path ("" = the default model) or engine library path
    device = "cpu"
    lanes = 8                   # concurrent generations
    context_length = 2048       # tokens per lane (prompt + generated)
    threads = 2                 # CPU threads of the engine
    engine_args = []            # extra basertd-worker flags, verbatim
    ref_config = {}             # reference-engine settings (engine "basert" without a model)

    [scheduler]                 # DESIGN.md "Scheduling"
    prefill_budget = 512        # most prompt tokens prefilled per tick
    decode_grant = 8            # most tokens one lane decodes per tick
    tick_target_s = 0.05        # tick length aimed at while an interactive request waits
    long_prefill_budget = 2048  # most prompt tokens per tick when nothing urgent waits (a long tick)
    max_itl_s = 0.5             # a streaming lane never waits longer than this between two tokens
    min_prefill_chunk = 64      # smallest prefill chunk taken from the engine's measured rate curve
    queue_limit = 256           # queued requests per QoS class
    max_queued_tokens = 1048576 # prompt tokens queued in all, per worker
    partial_emits = true        # stream tokens mid-tick (TICK_EMIT, ABI rule 64)
    preempt = true              # a waiting interactive request preempts a lower-class lane
    aging_s = 10.0              # a queued request moves up one class per aging_s seconds (0: off)
    lane_caps = {}              # most lanes per class, e.g. {background = 2} (absent or 0: no cap)
    stall_timeout_s = 60.0      # no tick this long while work waits: stalled, worker restarted

    [cache]                     # DESIGN.md "Prefix cache policy"
    publish_on_retire = true    # finished lanes publish their KV to the engine's prefix cache
    enabled = true              # seed admits from cached prefixes, coalesce shared prefixes, pins
    coalesce_min_tokens = 64    # requests sharing this many uncached tokens prefill them once (0: off)
    evict_in_tick = true        # a tick may evict unpinned cache entries to fit its plan
    max_evict_bytes_per_tick = 0  # 0: no limit
    high_watermark = 0.9        # pool occupancy above which unpinned prefixes are evicted (0: off)
    low_watermark = 0.75        # ... down to this occupancy
    index_entries = 1024        # published prefixes the coordinator remembers per worker
    isolate_by_api_key = false  # each API key is seeded only from its own prefixes (README "Tenants ...")
    route_slack = 1.0           # route to the worker holding the longest prefix unless its load
                                # (queued + running per lane) exceeds the least loaded one's by more

    [operators]                 # DESIGN.md "Operators"
    operator_group = ""         # members may use control verbs (as root and the daemon's user always may)
    drain_timeout_s = 30.0      # SIGTERM: seconds in-flight requests get to finish before they are cancelled
    drain_grace_s = 0.0         # a drain turns /health 503 at once but refuses requests only after this long
    metrics_listen = ""         # "127.0.0.1:9464": also serve /metrics over HTTP (loopback addresses only)

    [durability]                # DESIGN.md "Crash = preemption; acceptance is durable"
    mode = "write"              # "write": write-ahead log, one write per tick before delivery, fsync in
                                # the background (a power loss may lose the last sync_interval_ms);
                                # "tick": also one fsync per tick before delivery; "off": none
    sync_interval_ms = 1000     # "write": least milliseconds between two background fsyncs
    result_ttl_s = 600.0        # seconds a finished request's result can still be resumed
    resumes_per_s = 20.0        # resumes one requester (uid or API key) may make per second ...
    resume_burst = 40           # ... with this many at once; more: queue_full (HTTP 429)

    [metrics]                   # docs/scale-out.md
    vllm_compat = true          # also export vllm:* series (what the endpoint picker reads)

    [tracing]                   # OpenTelemetry spans per request (basertd.server.observe.tracing)
    otlp_endpoint = ""          # "": off; "http://collector:4318/v1/traces": OTLP/HTTP (basertd[tracing])
    service_name = "basertd"    # the traces' service.name

    [http]                      # the OpenAI-compatible API (README "OpenAI-compatible API")
    listen = ["127.0.0.1:8000"] # "HOST:PORT" and "unix:PATH" entries; [] = off
    api_key_file = ""           # one key per line; required for a non-loopback TCP address
    max_body_bytes = 8388608    # larger request bodies are refused 413
    resume_grace_s = 0.0        # seconds a streamed request outlives its client, for Last-Event-ID
    max_connections = 512       # open HTTP connections in all (more: 503 and closed)
    max_connections_per_peer = 256  # open HTTP connections of one remote IP / Unix peer uid (more: 429)
    header_timeout_s = 10.0     # a request head must be complete this long after its first byte (408)
    body_timeout_s = 60.0       # a request body must be complete this long after its head (408)
    idle_timeout_s = 60.0       # close a connection with no request in progress that sent nothing
    write_timeout_s = 30.0      # replies unread this long: the stream is cancelled, the connection closed
    write_buffer_bytes = 262144 # reply bytes queued per connection before the writer waits
    allowed_hosts = []          # Host names served on loopback TCP besides the loopback names

    [kv_events]                 # vLLM's KV-cache events over ZMQ (docs/scale-out.md)
    endpoint = ""               # "": off; "tcp://*:5557" binds (port + worker), "tcp://host:5557" connects
    bind = "auto"               # "auto": the rule above; "bind" any address (tcp://127.0.0.1:5557); "connect"
    layout = "array"            # events as positional arrays (vLLM before 0.28); "map": tagged maps (0.28 on)
    replay_endpoint = ""        # ZMQ ROUTER answering a start sequence number with buffered batches
    topic = ""                  # first frame of every message; $VARS expanded (e.g. "kv@${POD_IP}@model")
    buffer_steps = 10000        # batches kept for replay, per worker
    hwm = 100000                # ZMQ high-water mark (messages) per subscriber
    max_queue_size = 100000     # batches waiting for the publisher thread; more are dropped (counted)
    include_token_ids = false   # BlockStored carries the pages' token ids (prompt content); off: hashes only

    [limits]                    # the client socket's resources (DESIGN.md "Client API")
    max_connections = 1024      # open client connections in all
    max_connections_per_uid = 512  # open client connections of one peer uid
    max_request_buffer_bytes = 67108864  # bytes of half-received request frames over all connections
    frame_timeout_s = 30.0      # a request frame must arrive whole within this after its first byte
    idle_timeout_s = 600.0      # close a connection with nothing running that sent nothing (0: never)
    max_reply_buffer_bytes = 8388608  # replies waiting in one connection's send buffer before it is dropped
    listen_backlog = 1024       # pending connects the kernel queues (capped by net.core.somaxconn)

The tables (``WorkerConfig``, ``SchedulerConfig``, ...) are ``basertd.server.config_sections``'s;
this module is the file: its root table ``Config``, ``parse_config``, ``load_config`` and
``ConfigError``.

Paths: ``resolve_runtime_dir`` and ``default_socket_path`` are the one place the runtime directory
rule lives; ``basertctl`` and the client library use them too.
``resolve_state_dir`` is the one place the state directory rule lives (the write-ahead log,
``basertd.server.durability.wal``).
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from typing import Annotated, Any, Literal

import msgspec

from basertd.server.config_sections import (
    CacheConfig,
    CompileConfig,
    DurabilityConfig,
    HttpConfig,
    KvEventsConfig,
    LimitsConfig,
    MetricsConfig,
    OperatorsConfig,
    SchedulerConfig,
    Section,
    SpeculationConfig,
    TracingConfig,
    WorkerConfig,
)


class ConfigError(ValueError):
    """The configuration cannot be used: unreadable file, bad TOML, unknown key, wrong type or a
    value out of range. ``errors`` lists every error found, each naming the file and the key; the
    message is those lines."""

    def __init__(self, *errors: str) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


def _default_workers() -> list[WorkerConfig]:
    return [WorkerConfig()]


class Config(Section):
    """The whole configuration. ``runtime_dir`` "" means the rule of ``resolve_runtime_dir``;
    ``state_dir`` "" the rule of ``resolve_state_dir``;
    ``socket`` "" means ``<runtime_dir>/basertd.sock``; ``socket_mode`` is the client socket's
    permission bits (an integer such as 0o660, or an octal string "0660")."""

    runtime_dir: str = ""
    state_dir: str = ""
    socket: str = ""
    socket_mode: int | str = 0o660
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    workers: Annotated[list[WorkerConfig], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=_default_workers
    )
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    operators: OperatorsConfig = msgspec.field(default_factory=OperatorsConfig)
    durability: DurabilityConfig = msgspec.field(default_factory=DurabilityConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    kv_events: KvEventsConfig = msgspec.field(default_factory=KvEventsConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    compile: CompileConfig = msgspec.field(default_factory=CompileConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    speculation: SpeculationConfig = msgspec.field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
        mode = self.socket_mode
        if isinstance(mode, str):
            if not re.fullmatch(r"0?[0-7]{3}|0o[0-7]{3}", mode):
                raise ValueError(f"socket_mode must be an octal mode such as '0660', got {mode!r}")
            mode = int(mode.removeprefix("0o"), 8)
        if not 0 <= mode <= 0o777:
            raise ValueError(f"socket_mode must be within 0..0o777, got {mode:#o}")
        self.socket_mode = mode
        spec = self.speculation
        paths = [spec.draft_model, *(w.draft_model for w in self.workers)]
        if "draft-model" in spec.strategies and not any(paths):
            raise ValueError("speculation: draft-model needs a draft_model path")
        if any(paths) and "draft-model" not in spec.strategies:
            raise ValueError("speculation: a draft_model is set but strategies does not name draft-model")


_KEY_PATH = re.compile(r"\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)")
_KEYED = re.compile(r"([a-z_]+(?:\[\d+\])*): (.*?)(?: - at `\$([^`]*)`)?", re.S)
"""A ``__post_init__`` message that starts with the key it is about (``listen[0]: ...``)."""


def _join(where: str, sub: str) -> str:
    """``workers[0]`` + ``.lanes`` -> ``workers[0].lanes``; ``workers`` + ``[1]`` -> ``workers[1]``."""
    sub = sub.lstrip(".")
    if not where or not sub:
        return where or sub
    return where + sub if sub.startswith("[") else f"{where}.{sub}"


def _readable(exc: msgspec.ValidationError, where: str = "") -> str:
    """msgspec says ``... - at `$.lanes``` of the value at ``where``; operators read
    ``workers[0].lanes``."""
    text = str(exc)
    m = re.search(r"unknown field `([^`]+)`(?: - at `\$([^`]*)`)?", text)
    if m:
        return f"unknown key {_join(_join(where, m.group(2) or ''), m.group(1))!r}"
    m = _KEYED.fullmatch(text)
    if m:  # a check across keys that names its key: "listen[0]: ... - at `$`" of the table
        return f"{m.group(2)} - at {_join(_join(where, m.group(3) or ''), m.group(1))}"
    text = text.replace("`", "")
    if _KEY_PATH.search(text) is None:
        return f"{text} - at {where}" if where else text
    return _KEY_PATH.sub(lambda k: _join(where, k.group(1)) or "(top level)", text)


def _errors(value: Any, typ: Any, where: str) -> list[str]:
    """Every error converting ``value`` to ``typ`` at key path ``where``, not only msgspec's first:
    a table's keys and a list's items are checked one by one; a table's checks across keys run
    over the keys that passed, and a list's length is checked when its items pass."""
    try:
        msgspec.convert(value, typ, strict=True)
        return []
    except msgspec.ValidationError as exc:
        whole = [_readable(exc, where)]
    inner = typing.get_args(typ)[0] if typing.get_origin(typ) is typing.Annotated else typ
    if typing.get_origin(inner) is typing.Literal:  # say what the key takes
        choices = ", ".join(repr(c) for c in typing.get_args(inner) if c != "")
        head, sep, tail = whole[0].partition(" - at ")
        return [f"{head} (one of {choices}){sep}{tail}"]
    found: list[str] = []
    if isinstance(inner, type) and issubclass(inner, msgspec.Struct) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in msgspec.structs.fields(inner)}
        good = {}
        for key, item in value.items():
            if key not in fields:
                found.append(f"unknown key {_join(where, str(key))!r}")
            elif errors := _errors(item, fields[key], _join(where, str(key))):
                found += errors
            else:
                good[key] = item
        if found:  # the checks across keys, over the keys that passed (the rest at their defaults)
            found += _errors(good, inner, where)
    elif typing.get_origin(inner) is list and isinstance(value, list):
        (item_type,) = typing.get_args(inner)
        for i, item in enumerate(value):
            found += _errors(item, item_type, f"{where}[{i}]")
    return found or whole


def config_errors(data: dict[str, Any], *, source: str = "<config>") -> list[str]:
    """Every error ``parse_config`` would refuse ``data`` for, each naming ``source`` and the key
    (``<source>: unknown key 'workers[0].lanse'``); [] when it parses."""
    return [f"{source}: {e}" for e in _errors(data, Config, "")]


def parse_config(data: dict[str, Any], *, source: str = "<config>") -> Config:
    """A ``Config`` from already-parsed TOML data. Raises ``ConfigError`` listing every error
    (``config_errors``), each naming the key."""
    try:
        return msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as exc:
        errors = config_errors(data, source=source) or [f"{source}: {_readable(exc)}"]
        raise ConfigError(*errors) from None


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate the TOML file at ``path`` (None: every default). Raises ``ConfigError``
    for an unreadable file, invalid TOML, an unknown key, a wrong type or an out-of-range value."""
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return parse_config(data, source=str(path))
