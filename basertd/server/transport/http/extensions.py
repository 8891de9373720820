"""The request fields other servers define that basertd accepts only at their no-op value: one
table for ``/v1/completions`` and ``/v1/chat/completions`` (README "Extension fields").

Routers (vllm-router, sglang-router) re-serialise every request with their own defaults
(``echo: false``, ``skip_special_tokens: true``, ...) and SDKs written for vLLM, SGLang or
llama-server send theirs. A field in ``NO_OP`` is accepted when it is absent, ``null`` or one of
the listed values, each of which means "do what basertd does anyway"; any other value is a 400
naming the field, the value sent and the value(s) served (``check``), never silently ignored.
Values compare by JSON type as well as value (``1`` is not ``true``; ``1`` and ``1.0`` are equal
numbers). Fields basertd *serves* (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``regex``, ``stream_options.continuous_usage_stats``, ...) are in the wire structs, not here.

``Extensions`` carries the table's fields so that msgspec decodes them (every other unknown field
stays a 400, ``body.decode``); ``check(req, chat=...)`` refuses a value that would change what we
do. ``CHAT_ONLY`` fields are refused on ``/v1/completions`` like any unknown field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from basertd.server.transport.http.errors import HttpError

NO_OP: dict[str, tuple[Any, ...]] = {
    # vLLM and SGLang (the routers send these on every request)
    "no_stop_trim": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "return_hidden_states": (False,),
    "include_stop_str_in_output": (False,),
    "stop_token_ids": ([],),
    "min_tokens": (0,),
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "return_tokens_as_token_ids": (False,),
    "cache_salt": (),
    "priority": (0,),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "lora_path": (),
    "session_params": (),
    "custom_logit_processor": (),
    "custom_params": (),
    "data_parallel_rank": (),
    "rid": (),
    "request_id": (),
    "suffix": ("",),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": ({},),
    # llama-server
    "cache_prompt": (True,),
    "n_probs": (0,),
    "typical_p": (1.0,),
    "tfs_z": (1.0,),
    "mirostat": (0,),
    "dynatemp_range": (0.0,),
    "dry_multiplier": (0.0,),
    "xtc_probability": (0.0,),
    "id_slot": (-1,),
    "return_tokens": (False,),
    "timings_per_token": (False,),
    "post_sampling_probs": (False,),
    "lora": ([],),
    # chat only (vLLM, SGLang)
    "echo": (False,),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
    "include_reasoning": (True,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": (),
    "reasoning_effort": (),
    "add_special_tokens": (False,),
}
"""Field -> the values that leave basertd's behaviour unchanged (besides absent and ``null``)."""

CHAT_ONLY = frozenset(
    {
        "echo",
        "continue_final_message",
        "add_generation_prompt",
        "separate_reasoning",
        "stream_reasoning",
        "include_reasoning",
        "chat_template",
        "chat_template_kwargs",
        "documents",
        "reasoning_effort",
        "add_special_tokens",
    }
)
"""Fields checked on chat requests only: on completions ``echo`` is served (``openai/echo.py``,
the completions struct's own field) and the others are unknown (``add_special_tokens`` would mean
something else there)."""

SERVED_ON_COMPLETIONS = frozenset({"echo"})
"""Table fields the completions endpoint serves itself: never checked there."""


class Extensions(msgspec.Struct, kw_only=True):
    """The fields of ``NO_OP`` as a decoded request carries them (``None`` when absent or null);
    the OpenAI request structs inherit them (``openai.wire.Common``)."""

    echo: Any = None
    no_stop_trim: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    return_hidden_states: Any = None
    include_stop_str_in_output: Any = None
    stop_token_ids: Any = None
    min_tokens: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    return_tokens_as_token_ids: Any = None
    cache_salt: Any = None
    priority: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    custom_params: Any = None
    data_parallel_rank: Any = None
    rid: Any = None
    request_id: Any = None
    suffix: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    cache_prompt: Any = None
    n_probs: Any = None
    typical_p: Any = None
    tfs_z: Any = None
    mirostat: Any = None
    dynatemp_range: Any = None
    dry_multiplier: Any = None
    xtc_probability: Any = None
    id_slot: Any = None
    return_tokens: Any = None
    timings_per_token: Any = None
    post_sampling_probs: Any = None
    lora: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    separate_reasoning: Any = None
    stream_reasoning: Any = None
    include_reasoning: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    reasoning_effort: Any = None
    add_special_tokens: Any = None


def top_k_of(value: int | None) -> int:
    """``Generate.top_k`` of a request's ``top_k``: absent, 0 and -1 (vLLM's and SGLang's "off",
    which their routers send by default) are 0, off; other values pass on to the limits check."""
    return 0 if value is None or value == -1 else value


def same(a: Any, b: Any) -> bool:
    """JSON equality that keeps types apart: booleans equal only booleans, numbers (int or float)
    equal numbers of the same value, lists and objects compare element by element."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _show(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def check(req: Extensions, *, chat: bool) -> None:
    """Refuse a table field set to a value other than its no-op ones (module docstring). Raises a
    400 ``HttpError`` (code ``unsupported_value``) naming the field, the value and what is served;
    a chat-only field on completions is refused as unknown (code ``invalid_request``)."""
    for name, accepted in NO_OP.items():
        value = getattr(req, name)
        if value is None or (not chat and name in SERVED_ON_COMPLETIONS):
            continue
        if name in CHAT_ONLY and not chat:
            raise HttpError(
                400,
                f"unsupported field {name!r}: this server does not serve it on /v1/completions",
                param=name,
                code="invalid_request",
            )
        if any(same(value, ok) for ok in accepted):
            continue
        served = " or ".join(_show(v) for v in accepted) if accepted else "null"
        raise HttpError(
            400,
            f"unsupported field {name!r} = {_show(value)}: this server serves {name} only as {served} "
            "(what it does without the field)",
            param=name,
            code="unsupported_value",
        )
