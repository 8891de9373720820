"""Ollama's wire shapes: the request bodies of ``/api/generate``, ``/api/chat`` and ``/api/show``
(msgspec structs; any unknown field is a 400 naming it), the model entries of ``/api/tags`` /
``/api/ps``, the closing fields of a generation and Ollama's error object ``{"error": "<message>"}``.

Closing fields (``done_fields``): ``done: true``, ``done_reason`` (``stop``: the end-of-generation
token or a stop string; ``length``: ``num_predict`` or the context), ``prompt_eval_count`` (prompt
tokens), ``eval_count`` (generated tokens) and ``total_duration`` / ``load_duration`` (0) /
``prompt_eval_duration`` / ``eval_duration`` in nanoseconds from the request's ``Timings``; with
speculative decoding also ``draft_tokens`` and ``accepted_draft_tokens`` (the native API's names:
an extension, present only when the request drafted).
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

import msgspec

from basertd.schema import client as api
from basertd.server.transport.http.errors import HttpError

API_VERSION = "0.9.0"
"""The Ollama API version ``/api/version`` reports (the one whose fields this module serves)."""


NDJSON = "application/x-ndjson"


NANOS = 1_000_000_000


def error_body(err: HttpError) -> dict[str, Any]:
    return {"error": err.message}


class Options(msgspec.Struct, forbid_unknown_fields=True):
    """``options``: sampling fields are served; loading fields are accepted and ignored."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    speculation: str | None = None  # our extension (``Generate.speculation``)
    # model loading: the daemon's configuration decides these
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    vocab_only: bool | None = None


class Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    stream: bool | None = None
    options: Options | None = None
    format: Any = None
    keep_alive: Any = None
    think: Any = None
    qos: str | None = None


class GenerateRequest(Common, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/generate``."""

    prompt: str = ""
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None


class ChatRequest(Common, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/chat``."""

    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None


class ShowRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str = ""
    name: str = ""
    verbose: bool | None = None


def created_at() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def done_fields(done: api.Done) -> dict[str, Any]:
    """The closing fields of a generation (module docstring)."""
    t = done.timings
    out = {
        "done": True,
        "done_reason": "length" if done.finish_reason == "length" else "stop",
        "total_duration": int(t.total_s * NANOS),
        "load_duration": 0,
        "prompt_eval_count": done.usage.prompt_tokens,
        "prompt_eval_duration": int(max(0.0, t.ttft_s - t.queue_s) * NANOS),
        "eval_count": done.usage.completion_tokens,
        "eval_duration": int(max(0.0, t.total_s - t.ttft_s) * NANOS),
    }
    if done.usage.draft_tokens:
        out["draft_tokens"] = done.usage.draft_tokens
        out["accepted_draft_tokens"] = done.usage.accepted_draft_tokens
    return out


def parameter_size(count: int) -> str:
    """Ollama's ``parameter_size``: a parameter count in K / M / B / T with up to two decimals
    (``268098176`` -> ``268.1M``, ``8030261248`` -> ``8.03B``); "" for 0 (not known)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(count) if count else ""


def model_details(m: api.ModelInfo) -> dict[str, Any]:
    """The ``details`` object of ``/api/tags``, ``/api/ps`` and ``/api/show`` for ``m``."""
    return {
        "parent_model": "",
        "format": "gguf" if m.engine == "llamacpp" else m.engine,
        "family": m.family,
        "families": [m.family] if m.family else None,
        "parameter_size": parameter_size(m.parameters),
        "quantization_level": m.quantization,
    }


def model_entries(models: list[api.ModelInfo], running: bool) -> list[dict[str, Any]]:
    """The ``models`` of ``/api/tags`` (``running`` False) or ``/api/ps`` (True): each served model
    named ``<id>:latest`` unless its id has a tag; ``size`` is the model file's bytes and
    ``digest`` the engine's model id (a hex digest of the file, not Ollama's sha256 of a blob)."""
    out = []
    for m in models:
        name = m.id if ":" in m.id else f"{m.id}:latest"
        entry: dict[str, Any] = {
            "name": name,
            "model": name,
            "size": m.file_bytes,
            "digest": m.digest,
            "details": model_details(m),
        }
        if running:
            entry.update(expires_at="9999-12-31T23:59:59Z", size_vram=0, context_length=m.context_length)
        else:
            entry["modified_at"] = created_at()
        out.append(entry)
    return out
