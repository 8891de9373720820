"""Chat templates: a list of chat messages rendered to the prompt text a model was trained on.

Templates are Hugging Face's Jinja dialect (the GGUF key ``tokenizer.chat_template`` holds one),
rendered in jinja2's ``ImmutableSandboxedEnvironment`` (a template cannot reach Python objects or
change its inputs) with what HF templates use: ``trim_blocks`` / ``lstrip_blocks``, the
``loopcontrols`` extension, the globals ``raise_exception(message)`` and ``strftime_now(format)``,
the ``tojson`` filter (``ensure_ascii=False``), and the variables ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` and ``tools`` (OpenAI's ``tools`` array,
or undefined when a request has none; ``ChatTemplate.uses_tools`` says whether a template reads it).

Where a worker's template comes from (``template_source``): the worker key ``chat_template`` (a
file path, or the name of a template shipped in ``basertd/server/transport/http/chat_templates/``: ``gemma``,
``chatml``); else the GGUF's own; else, for the default model (base Gemma 3 270M, which carries
none), the shipped ``gemma`` turn template. No template: ``ChatTemplateError`` (the chat endpoint
answers 400, never a silent fallback).

BOS: a rendered prompt that already starts with the BOS text is tokenized without adding another
(``needs_bos``). Generation ends at the template's end-of-turn token because llama.cpp counts the
usual end-of-turn tokens (``<end_of_turn>``, ``<|im_end|>``, ``<|eot_id|>``, ...) as
end-of-generation for the vocabularies that define them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

SHIPPED_PACKAGE = "basertd.server.transport.http.chat_templates"
DEFAULT_MODEL_TEMPLATE = "gemma"
"""The shipped template used for the default model (it carries none of its own)."""


class ChatTemplateError(ValueError):
    """A template cannot be found, compiled or rendered; also what a template's
    ``raise_exception`` raises. The message is safe to show to a client."""


class ChatTemplateRefused(ChatTemplateError):
    """The template did not render these messages (its ``raise_exception``, or an error of its
    own code such as an index past the messages), as opposed to a limit or a crash of the render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


def shipped_templates() -> list[str]:
    """Names of the templates shipped with basertd."""
    root = resources.files(SHIPPED_PACKAGE)
    return sorted(p.name.removesuffix(".jinja") for p in root.iterdir() if p.name.endswith(".jinja"))


def load_template_text(name_or_path: str) -> str:
    """The source of a shipped template (by name) or of a file. Raises ``ChatTemplateError``."""
    if name_or_path in shipped_templates():
        return resources.files(SHIPPED_PACKAGE).joinpath(f"{name_or_path}.jinja").read_text("utf-8")
    path = Path(name_or_path).expanduser()
    try:
        return path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(
            f"chat_template {name_or_path!r} is neither a shipped template "
            f"({', '.join(shipped_templates())}) nor a readable file: {exc}"
        ) from None


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template with the BOS/EOS texts of its vocabulary (``""`` when it has none)."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "_compiled", _ENV.from_string(self.source))
            undeclared = jinja2.meta.find_undeclared_variables(_ENV.parse(self.source))
            object.__setattr__(self, "_uses_tools", "tools" in undeclared)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None

    @property
    def uses_tools(self) -> bool:
        """Whether the template reads the ``tools`` variable (it then offers tools itself)."""
        return self._uses_tools  # type: ignore[attr-defined]

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        max_chars: int | None = None,
    ) -> str:
        """The prompt text of ``messages`` (dicts with ``role`` and ``content``; assistant turns
        may carry ``tool_calls``, tool turns ``tool_call_id``), with ``tools`` (OpenAI's array)
        defined when given. Raises ``ChatTemplateError`` when the template refuses them
        (``raise_exception``) or fails, or its text grows past ``max_chars`` characters (checked
        as it renders). Unbounded in time: the daemon renders in a child process
        (``templates.Templates.render``)."""
        extra: dict[str, Any] = {} if tools is None else {"tools": tools}
        try:
            parts = self._compiled.generate(  # type: ignore[attr-defined]
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
            if max_chars is None:
                return "".join(parts)
            out, size = [], 0
            for part in parts:
                size += len(part)
                if size > max_chars:
                    raise ChatTemplateError(
                        f"chat template: the rendered chat is longer than {max_chars} characters"
                    )
                out.append(part)
            return "".join(out)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        except RecursionError:
            raise ChatTemplateError("chat template failed: recursion too deep") from None
        except (MemoryError, OverflowError):
            raise ChatTemplateError("chat template failed: out of memory") from None

    def needs_bos(self, rendered: str) -> bool:
        """False when ``rendered`` already starts with the BOS text (tokenize without adding one)."""
        return not (self.bos_token and rendered.startswith(self.bos_token))


def template_source(configured: str, gguf_template: str | None, *, default_model: bool) -> str:
    """The template source a worker uses (module docstring). Raises ``ChatTemplateError`` when
    there is none, or the configured one cannot be read."""
    if configured:
        return load_template_text(configured)
    if gguf_template:
        return gguf_template
    if default_model:
        return load_template_text(DEFAULT_MODEL_TEMPLATE)
    raise ChatTemplateError(
        "this model has no chat template (no tokenizer.chat_template in the model and no worker "
        "key chat_template): use /v1/completions, or configure chat_template"
    )
