"""KV-cache events in vLLM's wire format over ZMQ, from the coordinator's prefix index
(docs/scale-out.md; DESIGN.md "Prefix cache policy").

A router that scores pods by prefix affinity (llm-d's precise-prefix scorer, NVIDIA Dynamo's
KV router) keeps its own copy of every pod's cached pages from these events. The source is each
worker's ``PrefixIndex`` (``basertd.server.cache.policy``): a page entering the index is
``BlockStored`` (its chained page hash, its parent's, its tokens), a page leaving it (evicted,
pruned after ``space_match`` served less, forgotten) is ``BlockRemoved``, and a new worker
incarnation (its cache starts empty) is ``AllBlocksCleared``. Page = the engine's page:
``block_size`` is the page size in tokens, hashes are the index's ``page_hashes``
(``h_i = xxh3_64(tokens of page i, seed=h_(i-1))``, unsigned 64-bit).

**Wire** (vLLM's ``vllm/distributed/kv_events.py``): msgspec structs with ``omit_defaults``;
the batch is ``array_like``; events are tagged unions whose tag is the class name: the first
array element (``[kv_events] layout = "array"``, vLLM before 0.28) or the ``type`` key of a map
(``layout = "map"``, vLLM 0.28 on, what vllm-router's ``kv_aware`` decodes). One publisher per
worker, ``data_parallel_rank`` = worker index. Every batch is the
multipart message ``[topic, seq (8-byte big-endian unsigned), payload]`` on a PUB-compatible
socket; ``seq`` counts batches of that worker from 0. A bound endpoint is one per worker (the TCP
port plus the worker index, ``_dp<i>`` after an ipc/inproc path, as vLLM offsets data-parallel
ranks); a connecting endpoint (llm-d's indexer binds the SUB) is shared by every worker.
The replay socket is a ROUTER: a request
``[b"", start_seq (8 bytes big-endian)]`` from a DEALER/REQ is answered with one
``[b"", seq, payload]`` per buffered batch with ``seq >= start_seq``, then ``[b"", -1 (8 bytes
big-endian signed), b""]``.

**Never slowing a tick.** The index calls the observer on the event loop; events are gathered
into one batch per loop turn, encoded (microseconds) and pushed without blocking through a
bounded inproc queue (``max_queue_size`` batches) to the publisher thread, which owns the
sockets. A full queue drops the batch. The PUB side is an XPUB with ``XPUB_NODROP`` and a
high-water mark of ``hwm`` messages per subscriber: when a subscriber that does not read has
``hwm`` messages waiting, the send is refused rather than blocking, the batch is counted as
dropped, and it stays in the replay buffer under its sequence number (a subscriber that sees a
gap asks the replay socket for it). Both drop counts are exported as
``basertd_kv_events_dropped_total{worker,where}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import structlog
import zmq
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from basertd.server.config_sections import KvEventsConfig

log = structlog.get_logger("basertd.kv_events")

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay answer."""
CLOSE_TIMEOUT_S = 2.0


# --- the wire types (vLLM's field names, order, tags and struct options) ----------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: ``ts`` (seconds since the epoch), ``events``, ``data_parallel_rank``
    (the worker index)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    """Pages entered the cache: ``block_hashes`` (a chain, parent first), the hash of the page
    before the first one (None at the start of a prompt), their ``token_ids`` (``block_size``
    per page, concatenated), ``lora_id`` (None: no adapters here), ``medium``, ``lora_name``
    (None; current vLLM sends it, and vllm-router skips a ``BlockStored`` of fewer than these 8
    array elements as malformed), ``extra_keys`` (None, omitted)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None


class BlockRemoved(KVCacheEvent):
    """Pages left the cache: ``block_hashes``, ``medium``."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every page of this publisher's worker is gone (a new worker incarnation)."""


class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events in vLLM's current layout (0.28 on): a map whose ``type`` is the class
    name (``[kv_events] layout = "map"``); the fields are those of the array-like events."""


def _map_twin(cls: type[KVCacheEvent]) -> type[MapKVCacheEvent]:
    """``cls`` as a map-layout event: the same fields, types and defaults, tagged with its name."""
    fields = [
        (f.name, f.type) if f.required else (f.name, f.type, f.default) for f in msgspec.structs.fields(cls)
    ]
    return msgspec.defstruct(
        f"Map{cls.__name__}", fields, bases=(MapKVCacheEvent,), tag=cls.__name__, module=__name__
    )


_AS_MAP: dict[type, type[MapKVCacheEvent]] = {
    cls: _map_twin(cls) for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}


def as_map(event: KVCacheEvent) -> MapKVCacheEvent:
    """``event`` in the map layout (same fields, tag ``type``)."""
    return _AS_MAP[type(event)](**msgspec.structs.asdict(event))


class KVEventBatch(EventBatch):
    """``EventBatch`` whose events decode as the three event types."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- endpoints -----------------------------------------------------------------------------------


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Worker ``rank``'s address of ``endpoint``: rank 0 keeps it; a ``tcp://`` port grows by
    ``rank``; ``ipc://`` and ``inproc://`` get the suffix ``_dp<rank>`` (vLLM's rule, extended to
    ipc). Raises ValueError for a tcp address without a numeric port."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit() or base == "tcp":
            raise ValueError(f"{endpoint!r} has no port to offset for worker {rank}")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` under ``[kv_events] bind = "auto"`` (wildcard
    host, ``::``, ipc or inproc) rather than connecting to a subscriber that bound it (vLLM's
    rule); ``bind = "bind"`` binds any address, ``"connect"`` never binds."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


IPC_MODE = 0o600
"""Permission bits of an ``ipc://`` socket file the publisher binds: the daemon's user only."""


def _bind_private(sock: zmq.Socket, endpoint: str) -> str | None:
    """Bind ``sock`` to ``endpoint``; an ``ipc://`` socket file is created with mode ``IPC_MODE``
    (a umask of 0o177 around the bind, then a chmod), never the 0o755 of the process umask.
    Returns the socket file's path (None: no file), which libzmq leaves behind when the socket
    closes. Raises ``zmq.ZMQError`` (the bind) or ``OSError`` (the chmod)."""
    if not endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        return None
    old = os.umask(0o777 & ~IPC_MODE)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    path = endpoint[len("ipc://") :]
    if not path or path.startswith("@"):  # "@name": Linux's abstract namespace, no file
        return None
    os.chmod(path, IPC_MODE)
    return path


# --- one publisher per worker ---------------------------------------------------------------------


class KvEventsPublisher:
    """The events of one worker (module docstring). As the ``PrefixIndex`` observer: ``stored``,
    ``removed``, ``cleared`` (on the event loop; never block, never raise into the index).
    ``flush()`` sends what was gathered as one batch (called once per loop turn by itself).
    Counters: ``batches`` (handed to the publisher thread), ``sent``, ``dropped_queue``,
    ``dropped_hwm``. ``close()`` stops the thread and closes its sockets."""

    def __init__(
        self,
        ctx: zmq.Context,
        rank: int,
        config: KvEventsConfig,
        *,
        medium: str = MEDIUM_GPU,
        topic: str | None = None,
    ) -> None:
        self.rank = rank
        self.medium = medium
        # a bound address is one per worker; connecting publishers share the subscriber's address
        # (ZMQ fans them in; the batches carry data_parallel_rank)
        self.binding = config.bind == "bind" or (config.bind == "auto" and binds(config.endpoint))
        self.endpoint = offset_endpoint(config.endpoint, rank) if self.binding else config.endpoint
        replay = os.path.expandvars(config.replay_endpoint)
        self.replay_endpoint = offset_endpoint(replay, rank) if replay else ""
        self.include_token_ids = config.include_token_ids
        self.topic = (os.path.expandvars(config.topic) if topic is None else topic).encode()
        self.maps = config.layout == "map"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.batches = 0
        self.sent = 0
        self.dropped_queue = 0
        self.dropped_hwm = 0
        self.subscribers = 0
        self._events: list[KVCacheEvent] = []
        self._flush_scheduled = False
        self._encoder = msgspec.msgpack.Encoder()
        self._closed = False
        inbox = f"inproc://basertd-kv-events-{id(self):x}"
        # sockets of the publisher thread, created here so that a bad address fails at start
        self._pub = ctx.socket(zmq.XPUB)
        self._pull = ctx.socket(zmq.PULL)
        self._replay: zmq.Socket | None = None
        self._push = ctx.socket(zmq.PUSH)  # the loop thread's end of the queue
        self._files: list[str] = []  # ipc socket files this publisher made (removed by close)
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._pub.setsockopt(zmq.LINGER, 0)
            if self.binding:
                self._own(_bind_private(self._pub, self.endpoint))
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._own(_bind_private(self._replay, self.replay_endpoint))
            for s in (self._pull, self._push):
                s.setsockopt(zmq.LINGER, 0)
            half = max(1, config.max_queue_size // 2)  # inproc: the two ends' marks add up
            self._pull.setsockopt(zmq.RCVHWM, half)
            self._pull.bind(inbox)
            self._push.setsockopt(zmq.SNDHWM, half)
            self._push.connect(inbox)
        except (zmq.ZMQError, OSError):
            self._close_sockets()
            self._remove_files()
            raise
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{rank}", daemon=True)
        self._thread.start()

    # --- the observer (event loop) -------------------------------------------------------------

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: np.ndarray | Sequence[int]) -> None:
        """Pages ``hashes`` (a chain following ``parent``) entered the index with ``tokens``
        (``len(hashes) * block_size`` of them; published only with ``include_token_ids``)."""
        if not hashes:
            return
        block = len(tokens) // len(hashes)
        self._add(
            BlockStored(
                block_hashes=[int(h) for h in hashes],
                parent_block_hash=None if parent is None else int(parent),
                token_ids=[int(t) for t in tokens] if self.include_token_ids else [],
                block_size=block,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
            )
        )

    def removed(self, hashes: Sequence[int]) -> None:
        """Pages ``hashes`` left the index."""
        if hashes:
            self._add(BlockRemoved(block_hashes=[int(h) for h in hashes], medium=self.medium))

    def cleared(self) -> None:
        """Every page of this worker is gone (a new incarnation starts with an empty cache)."""
        self._events.clear()  # nothing before it matters to a subscriber
        self._add(AllBlocksCleared())

    def _add(self, event: KVCacheEvent) -> None:
        if self._closed:
            return
        self._events.append(event)
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send the gathered events as one batch (no-op when none). Never blocks: a full queue
        drops the batch (``dropped_queue``)."""
        self._flush_scheduled = False
        if not self._events or self._closed:
            self._events.clear()
            return
        events: list[Any] = [as_map(e) for e in self._events] if self.maps else self._events
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        self._events = []
        payload = self._encoder.encode(batch)
        try:
            self._push.send(payload, zmq.NOBLOCK)
            self.batches += 1
        except zmq.Again:
            self.dropped_queue += 1

    # --- the publisher thread ------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)  # subscriptions
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        seq = 0
        try:
            while True:
                ready = dict(poller.poll())
                if self._pub in ready:
                    self._subscriptions()
                if self._replay in ready:
                    self._serve_replay()
                if self._pull in ready:
                    while True:
                        try:
                            payload = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if not payload:  # the close sentinel
                            return
                        seq_bytes = seq.to_bytes(8, "big")
                        self.buffer.append((seq, payload))
                        try:
                            self._pub.send_multipart((self.topic, seq_bytes, payload), zmq.NOBLOCK)
                            self.sent += 1
                        except zmq.Again:  # a subscriber holds hwm unread messages
                            self.dropped_hwm += 1
                        seq += 1
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                log.error("kv_events_thread_failed", worker_id=self.rank, error=str(exc))
        finally:
            self._close_sockets()

    def _subscriptions(self) -> None:
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self.subscribers += 1
            elif msg[:1] == b"\x00":
                self.subscribers = max(0, self.subscribers - 1)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv_events_bad_replay_request", worker_id=self.rank, frames=len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self.buffer):
                    if seq >= first:
                        frames = (client, b"", seq.to_bytes(8, "big"), payload)
                        self._replay.send_multipart(frames, zmq.NOBLOCK)
                self._replay.send_multipart((client, b"", END_SEQ, b""), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("kv_events_replay_client_slow", worker_id=self.rank)

    def _close_sockets(self) -> None:
        for s in (self._pub, self._pull, self._replay):
            if s is not None and not s.closed:
                s.close(linger=0)

    def _own(self, path: str | None) -> None:
        if path is not None:
            self._files.append(path)

    def _remove_files(self) -> None:
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._files.clear()

    def close(self) -> None:
        """Send what is gathered, stop the thread (it sends what is queued first), close every
        socket and remove the ipc socket files it bound (a reader connecting later finds no
        endpoint rather than a dead one). Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        with contextlib.suppress(zmq.ZMQError):
            self._push.send(b"", zmq.NOBLOCK)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # the sentinel did not fit: the queue is full
            log.warning("kv_events_close_timeout", worker_id=self.rank)
        self._push.close(linger=0)
        self._remove_files()


# --- all workers ---------------------------------------------------------------------------------


class KvEventsHub:
    """The publishers of every worker (``publisher(i)`` for worker ``i``) on one ZMQ context,
    and the Prometheus collector of their counters (``collector()``). A worker added at run time
    gets one (``add``), a removed worker's is closed (``remove``): a reload changes the workers
    and their endpoints with them. ``close()`` closes them all."""

    def __init__(self, config: KvEventsConfig, mediums: Sequence[str]) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.publishers: list[KvEventsPublisher] = []
        try:
            for rank, medium in enumerate(mediums):
                self.add(rank, medium)
        except BaseException:
            self.close()
            raise

    def publisher(self, rank: int) -> KvEventsPublisher | None:
        """Worker ``rank``'s publisher; None when it has none (its endpoint failed to open)."""
        return next((p for p in self.publishers if p.rank == rank), None)

    def add(self, rank: int, medium: str) -> KvEventsPublisher:
        """Open worker ``rank``'s publisher (its endpoints: the module docstring's offsets).
        Raises ``zmq.ZMQError`` when an address cannot be bound or connected (nothing is left
        open) and ValueError when ``rank`` has one already."""
        if self.publisher(rank) is not None:
            raise ValueError(f"worker {rank} already publishes KV events")
        p = KvEventsPublisher(self.ctx, rank, self.config, medium=medium)
        self.publishers.append(p)
        return p

    def remove(self, rank: int) -> None:
        """Close worker ``rank``'s publisher and release its endpoints (a bound ``ipc://`` file
        is removed), if it has one. Its counters leave the collector."""
        p = self.publisher(rank)
        if p is not None:
            self.publishers.remove(p)
            p.close()

    def collector(self) -> Collector:
        """A collector of ``basertd_kv_events_batches_total{worker}`` (batches handed to the
        publisher) and ``basertd_kv_events_dropped_total{worker,where}`` (``queue``: the publisher
        thread was behind; ``hwm``: a subscriber had ``hwm`` messages unread)."""
        return _HubCollector(self)

    def close(self) -> None:
        """Close every publisher and the context. Idempotent."""
        for p in self.publishers:
            p.close()
        self.ctx.term()


class _HubCollector(Collector):
    def __init__(self, hub: KvEventsHub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        b = CounterMetricFamily(
            "basertd_kv_events_batches", "KV-event batches handed to the publisher.", labels=["worker"]
        )
        d = CounterMetricFamily(
            "basertd_kv_events_dropped",
            "KV-event batches not sent: the publisher queue was full (queue) or a subscriber had hwm "
            "messages unread (hwm; the batch stays replayable).",
            labels=["worker", "where"],
        )
        for p in self.hub.publishers:
            b.add_metric([str(p.rank)], float(p.batches))
            d.add_metric([str(p.rank), "queue"], float(p.dropped_queue))
            d.add_metric([str(p.rank), "hwm"], float(p.dropped_hwm))
        yield b
        yield d


def medium_of(device: str) -> str:
    """The ``medium`` of a worker's events: CPU for ``device = "cpu"``, GPU for anything else."""
    return MEDIUM_CPU if device == "cpu" else MEDIUM_GPU


def start_kv_events(config: KvEventsConfig, devices: Sequence[str]) -> KvEventsHub | None:
    """The hub of one publisher per worker (``devices[i]``: worker ``i``'s device, ``medium_of``),
    or None when ``config.endpoint`` is "". Raises ``zmq.ZMQError`` when an address cannot be
    bound or connected (nothing is left open)."""
    if not config.enabled:
        return None
    hub = KvEventsHub(config, [medium_of(d) for d in devices])
    log.info(
        "kv_events_started",
        endpoints=[p.endpoint for p in hub.publishers],
        replay=[p.replay_endpoint for p in hub.publishers],
    )
    return hub
