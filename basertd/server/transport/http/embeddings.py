"""Embeddings over HTTP in OpenAI's and Ollama's shapes: ``POST /v1/embeddings``, Ollama's
``POST /api/embed`` and its older ``POST /api/embeddings`` (the vectors come from
``FrontendPort.embed``: mean-pooled over the input's tokens, unit length).

- ``/v1/embeddings``: ``input`` a string, a list of strings, a list of token ids or a list of
  token-id lists; ``encoding_format`` "float" (default) or "base64" (little-endian float32, what
  the openai package asks for and decodes); ``dimensions`` only the model's own size (the served
  models are not trained for shorter vectors: another value is a 400 naming the size); ``user``
  accepted and unused. Usage: ``prompt_tokens`` = ``total_tokens``.
- ``/api/embed``: ``input`` a string or a list of strings, ``truncate`` (default true: an input
  over the context length keeps its first tokens; false: a 400), ``options`` / ``keep_alive``
  accepted and unused; answers ``embeddings``, ``prompt_eval_count`` and durations.
- ``/api/embeddings``: ``prompt`` one string; answers ``embedding``.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import msgspec
from aiohttp import web

from basertd.server.transport.http import body
from basertd.server.transport.http.errors import bad_request
from basertd.server.transport.http.port import FrontendPort

NANOS = 1_000_000_000


class OpenAiEmbeddingsRequest(msgspec.Struct, forbid_unknown_fields=True):
    input: Any = None
    model: str = ""
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


class OllamaEmbedRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str = ""
    input: Any = None
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: Any = None
    dimensions: int | None = None


class OllamaEmbeddingsRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: Any = None


def _inputs(value: Any, *, tokens: bool) -> list[str] | list[list[int]]:
    """``input`` as a list of texts or of token lists. Raises a 400 naming what is wrong."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        return value
    if tokens and is_ids(value) and value:
        return [value]
    if tokens and isinstance(value, list) and value and all(is_ids(x) for x in value):
        return value
    shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
    raise bad_request(f"input must be {shapes if tokens else 'a string or a list of strings'}", "input")


class EmbeddingsApi:
    """The embedding endpoints of both dialects over ``frontend`` (module docstring)."""

    def __init__(self, frontend: FrontendPort) -> None:
        self.frontend = frontend

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/embeddings", self.openai),
            web.post("/api/embed", self.ollama_embed),
            web.post("/api/embeddings", self.ollama_embeddings),
        ]

    async def openai(self, request: web.Request) -> web.Response:
        req = body.decode(await body.read(request), OpenAiEmbeddingsRequest)
        if req.encoding_format not in ("float", "base64"):
            raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
        out = await self.frontend.embed(
            req.model, _inputs(req.input, tokens=True), dimensions=req.dimensions, api_name="openai"
        )
        data = []
        for i, v in enumerate(out.vectors):
            vec: Any = (
                base64.b64encode(v.astype("<f4").tobytes()).decode()
                if req.encoding_format == "base64"
                else v.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": vec})
        model = req.model or self.frontend.models()[0].id
        usage = {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}
        return body.json_response({"object": "list", "data": data, "model": model, "usage": usage})

    async def ollama_embed(self, request: web.Request) -> web.Response:
        t0 = time.monotonic()
        req = body.decode(await body.read(request), OllamaEmbedRequest)
        out = await self.frontend.embed(
            req.model.removesuffix(":latest"),
            _inputs(req.input, tokens=False),
            truncate=req.truncate,
            dimensions=req.dimensions,
            api_name="ollama",
        )
        took = int((time.monotonic() - t0) * NANOS)
        return body.json_response(
            {
                "model": req.model,
                "embeddings": out.vectors.tolist(),
                "total_duration": took,
                "load_duration": 0,
                "prompt_eval_count": out.prompt_tokens,
            }
        )

    async def ollama_embeddings(self, request: web.Request) -> web.Response:
        req = body.decode(await body.read(request), OllamaEmbeddingsRequest)
        if not req.prompt:
            return body.json_response({"embedding": []})  # Ollama's answer to an empty prompt
        out = await self.frontend.embed(
            req.model.removesuffix(":latest"), [req.prompt], truncate=True, api_name="ollama"
        )
        return body.json_response({"embedding": out.vectors[0].tolist()})
