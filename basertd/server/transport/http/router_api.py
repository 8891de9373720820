"""The endpoints routers poll on each worker they spread traffic over (docs/scale-out.md): what
SGLang's gateway (sglang-router, ``smg``) and vllm-router read to register a worker and weigh its
load. All are read from the worker snapshots the daemon already keeps (``FrontendPort
.worker_snapshots``): a dictionary built on the event loop, no tick, no tokenizing.

- ``GET /server_info`` (and the older ``/get_server_info``): ``served_model_name`` and
  ``model_id`` (the model a request without ``model`` goes to: SGLang's gateway registers the
  worker under it; without it every worker is model ``unknown``), ``version``, ``dp_size`` 1,
  ``max_running_requests`` / ``max_num_reqs`` / ``max_batch_size`` (lanes, summed over the
  workers serving it), ``max_total_tokens`` (KV capacity, tokens), ``context_length`` and
  ``kv_block_size`` / ``page_size`` (the engine's page, tokens: the block size of the KV events).
  No ``model_path``: a router would try to load a Hugging Face tokenizer from it.
- ``GET /model_info`` (and ``/get_model_info``): ``model_path`` (the served name),
  ``tokenizer_path`` null, ``is_generation`` true.
- ``GET /get_load``: one object both routers parse: ``load`` (requests running and queued: the
  number vllm-router's ``power_of_two`` adds to its own in-flight count) and SGLang's
  ``num_reqs``, ``num_waiting_reqs``, ``num_tokens`` (KV tokens reserved by live lanes) and
  ``dp_rank`` 0.

``served_model(frontend, name)`` maps the ``"model": "unknown"`` SGLang's gateway writes into a
body that named no model to "" (any), unless a worker serves a model of that name.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

import basertd
from basertd.server.transport.http.body import json_response
from basertd.server.transport.http.port import FrontendPort

UNNAMED_MODEL = "unknown"
"""The model id SGLang's gateway gives a worker it learnt no name for, and writes into a request
body without ``model``."""


def served_model(frontend: FrontendPort, name: str) -> str:
    """``name``, or "" (any model) for ``UNNAMED_MODEL`` when no worker serves a model so named."""
    if name == UNNAMED_MODEL and all(m.id != UNNAMED_MODEL for m in frontend.models()):
        return ""
    return name


class RouterApi:
    """The polled endpoints over ``frontend`` (module docstring)."""

    def __init__(self, frontend: FrontendPort) -> None:
        self.frontend = frontend

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/server_info", self.server_info),
            web.get("/get_server_info", self.server_info),
            web.get("/model_info", self.model_info),
            web.get("/get_model_info", self.model_info),
            web.get("/get_load", self.load),
        ]

    def _default(self) -> tuple[str, list[Any]]:
        """The default model's name and the snapshots of the workers serving it."""
        worker = self.frontend.route("")
        name = self.frontend.model_name(worker)
        snaps = [s for s in self.frontend.worker_snapshots() if self.frontend.model_name(s.worker_id) == name]
        return name, snaps

    async def server_info(self, request: web.Request) -> web.Response:
        name, snaps = self._default()
        lanes = sum(s.limits.max_lanes for s in snaps)
        page = next((s.limits.page_tokens for s in snaps if s.ready), snaps[0].limits.page_tokens)
        return json_response(
            {
                "served_model_name": name,
                "model_id": name,
                "version": basertd.__version__,
                "dp_size": 1,
                "tp_size": 1,
                "max_running_requests": lanes,
                "max_num_reqs": lanes,
                "max_batch_size": lanes,
                "max_total_tokens": sum(s.limits.kv_tokens for s in snaps),
                "context_length": max(s.limits.context_length for s in snaps),
                "kv_block_size": page,
                "page_size": page,
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        name, snaps = self._default()
        return json_response(
            {
                "model_path": name,
                "tokenizer_path": None,
                "is_generation": True,
                "context_length": max(s.limits.context_length for s in snaps),
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        snaps = self.frontend.worker_snapshots()
        running = sum(s.lanes_busy for s in snaps)
        waiting = sum(s.queued for s in snaps)
        return json_response(
            {
                "load": running + waiting,
                "num_reqs": running + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": sum(s.kv_reserved_tokens for s in snaps),
                "dp_rank": 0,
            }
        )
