"""The two event layouts vLLM has used, read back as plain msgpack (no basertd types): ``layout =
"array"`` (vLLM before 0.28), each event ``[tag, block_hashes, parent, token_ids, block_size,
lora_id, medium, lora_name, extra_keys]`` (vllm-router's array decoder skips a ``BlockStored`` of
fewer than 8 elements as malformed); ``layout = "map"`` (vLLM 0.28 on, what vllm-router's
``kv_aware`` decodes), each event a map tagged by ``type``; and ``bind = "bind"`` binding one
interface (``tcp://127.0.0.1:PORT``) where a router's SUB connects."""

from __future__ import annotations

import socket

import msgspec
import numpy as np
import pytest
import zmq
from proc_testutil import wait_until

from basertd.server.cache.prefix_index import PrefixIndex, page_hashes
from basertd.server.config_sections import KvEventsConfig
from basertd.server.observe.kv_events import start_kv_events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout", ["array", "map"])
def test_each_layout_on_a_bound_loopback_address(layout):
    port = free_port()
    cfg = KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{port}", bind="bind", layout=layout, include_token_ids=True
    )
    hub = start_kv_events(cfg, ["cpu"])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")  # as a router's subscriber does: the publisher bound
    try:
        wait_until(lambda: hub.publishers[0].subscribers == 1, 10, what="the subscription")
        idx = PrefixIndex(4, observer=hub.publishers[0])
        toks = np.arange(8, dtype=np.uint32)
        entry = idx.insert(toks, page_hashes(toks, 4), 0.0)
        idx.remove(entry)
        events = []
        while len(events) < 2:
            assert sub.poll(10_000), "no batch arrived"
            _topic, _seq, payload = sub.recv_multipart()
            ts, evs, rank = msgspec.msgpack.decode(payload)
            assert isinstance(ts, float) and rank == 0
            events += evs
        stored, removed = events[0], events[1]
        hashes = [int(h) for h in page_hashes(toks, 4)]
        if layout == "array":
            # lora_name, then extra_keys (null): msgspec writes array-like trailing defaults
            assert stored == ["BlockStored", hashes, None, list(range(8)), 4, None, "CPU", None, None]
            assert removed == ["BlockRemoved", hashes, "CPU"]
        else:
            assert stored == {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": list(range(8)),
                "block_size": 4,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            }
            assert removed == {"type": "BlockRemoved", "block_hashes": hashes, "medium": "CPU"}
    finally:
        hub.close()
        sub.close()
        ctx.term()
