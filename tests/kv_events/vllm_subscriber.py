"""A KV-events subscriber written only from vLLM's documented event types
(``vllm/distributed/kv_events.py``, ``examples/online_serving/kv_events_subscriber.py``): it
imports nothing of basertd. ``Subscriber`` reads ``[topic, seq, payload]`` messages from a SUB
socket, asks the replay ROUTER for the batches it missed, and ``PageSet`` applies the events to
the set of pages a router would believe a worker holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

END_SEQ = -1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


@dataclass
class PageSet:
    """Pages (hash -> (parent hash, tokens)) a router believes one worker holds."""

    pages: dict[Any, tuple[Any, tuple[int, ...]]] = field(default_factory=dict)
    block_size: int = 0

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.block_size = ev.block_size
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes), ev
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    toks = tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                    self.pages[h] = (parent, toks)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.pages.pop(h, None)
            else:
                self.pages.clear()

    def prefix(self, h: Any) -> list[int]:
        """The whole token prefix ending with page ``h`` (its chain back to the first page)."""
        out: list[tuple[int, ...]] = []
        while h is not None:
            parent, toks = self.pages[h]
            out.append(toks)
            h = parent
        return [t for toks in reversed(out) for t in toks]

    def leaves(self) -> list[Any]:
        """Pages no other page follows."""
        parents = {p for p, _ in self.pages.values()}
        return [h for h in self.pages if h not in parents]


class Subscriber:
    """SUB on ``endpoint`` (``bind``: the subscriber binds and the publisher connects, as llm-d
    does), DEALER on ``replay`` (or None). ``batches``: (seq, KVEventBatch) in sequence order."""

    def __init__(self, endpoint: str, replay: str | None, topic: bytes = b"", *, bind: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.replay_endpoint = replay
        self.batches: list[tuple[int, KVEventBatch]] = []
        self.topics: set[bytes] = set()
        self.next_seq = 0

    def _take(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already have it
        if seq > self.next_seq and self.replay_endpoint:
            self.replay(self.next_seq)
        if seq < self.next_seq:
            return
        self.batches.append((seq, DECODER.decode(payload)))
        self.next_seq = seq + 1

    def replay(self, start: int) -> list[int]:
        """Ask the replay socket for every batch from ``start``; returns the sequence numbers got."""
        got = []
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000), "replay did not answer"
                _, seq_b, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    return got
                got.append(seq)
                if seq >= self.next_seq:
                    assert seq == self.next_seq, (seq, self.next_seq)
                    self.batches.append((seq, DECODER.decode(payload)))
                    self.next_seq = seq + 1
        finally:
            dealer.close()

    def drain(self, quiet_s: float = 0.5, timeout: float = 20.0) -> int:
        """Read until nothing arrives for ``quiet_s`` seconds; returns messages read."""
        n = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.sub.poll(int(quiet_s * 1000)):
            topic, seq_b, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            self._take(int.from_bytes(seq_b, "big"), payload)
            n += 1
        return n

    def pages(self) -> PageSet:
        ps = PageSet()
        for _, b in self.batches:
            ps.apply(b)
        return ps

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()
