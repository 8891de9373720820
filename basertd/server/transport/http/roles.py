"""A chat's messages in the shape strict chat templates accept, for a second render when the
template refused the first (``templates.Templates.render_chat``).

Many templates (Gemma's, the default model's; Llama 2's, Mistral's) take one leading system
message and then strictly alternating user and assistant turns, and raise "Conversation roles must
alternate" otherwise. Clients send other shapes as a matter of course: pydantic-ai sends its
``instructions`` and its ``system_prompt`` as two system messages, OpenAI's newer clients send
``developer`` for ``system``, LangChain sends two human messages in a row. ``alternating`` keeps
every word and its order and changes only the roles' layout: ``developer`` is ``system``; the
system messages before the first other turn stay system, a later one becomes user text (there is
no system slot after the start); consecutive turns of one role merge into one, their contents
joined by a blank line. Messages with more than a role and a string content (tool calls, tool
results, names) are left as they are, never merged.
"""

from __future__ import annotations

from typing import Any


def _plain(m: dict[str, Any]) -> bool:
    return set(m) <= {"role", "content"} and isinstance(m.get("content"), str)


def alternating(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` laid out for a template that wants alternating roles (module docstring); a
    new list, the input unchanged."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role == "system" and any(o["role"] != "system" for o in out):
            role = "user"
        if out and out[-1]["role"] == role and _plain(m) and _plain(out[-1]):
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append({**m, "role": role})
    return out
