"""The child process that renders chat templates for the HTTP dialects (``python -m
basertd.server.transport.http.template_render``, run by the ``sandbox.SandboxPool`` of
``templates.Templates``).

A job is ``[source, bos_token, eos_token, messages, add_generation_prompt, tools, max_chars]``
(``tools`` None when the request has none); the reply is the rendered text. The handler raises
``ChatTemplateError`` when the template refuses the chat or fails, and when the text grows past
``max_chars`` characters (checked while it renders, so a template printing without end stops
there). Compiled templates are cached by source. Time and memory are the pool's limits: a
template that loops past the time limit is killed with its process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from basertd.server.request.sandbox_child import harden, serve

if TYPE_CHECKING:
    from basertd.server.transport.http.chat_template import ChatTemplate

CACHED_TEMPLATES = 16
"""Compiled templates kept per child."""

_templates: dict[tuple[str, str, str], ChatTemplate] = {}


def render(job: Any) -> str:
    """The text of one chat (module docstring). Raises ``ChatTemplateError``."""
    from basertd.server.transport.http.chat_template import ChatTemplate  # loaded before serve()

    source, bos, eos, messages, add_generation_prompt, tools, max_chars = job
    key = (source, bos, eos)
    template = _templates.get(key)
    if template is None:
        if len(_templates) >= CACHED_TEMPLATES:
            _templates.clear()
        template = _templates[key] = ChatTemplate(source, bos_token=bos, eos_token=eos)
    return template.render(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, max_chars=max_chars
    )


if __name__ == "__main__":
    harden()  # first: jinja2's import runs at the child's lowered priority
    import basertd.server.transport.http.chat_template  # noqa: F401  (before the child says ready)

    serve(render)
