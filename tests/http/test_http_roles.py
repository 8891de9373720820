"""Messages laid out for templates that want alternating roles (``roles.alternating``), and the
second render ``Templates.render_chat`` gives a chat the template refused: the shipped Gemma
template (the default model's) rendered in the real sandbox children."""

from __future__ import annotations

import asyncio

import pytest

from basertd.server.transport.http.chat_template import ChatTemplate, ChatTemplateError, load_template_text
from basertd.server.transport.http.roles import alternating
from basertd.server.transport.http.templates import Templates


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


@pytest.mark.parametrize(
    ("messages", "laid_out"),
    [
        ([msg("developer", "D"), msg("user", "U")], [msg("system", "D"), msg("user", "U")]),
        (
            [msg("system", "S"), msg("developer", "D"), msg("user", "U")],
            [msg("system", "S\n\nD"), msg("user", "U")],
        ),
        ([msg("user", "a"), msg("user", "b")], [msg("user", "a\n\nb")]),
        (
            [
                msg("system", "S"),
                msg("user", "U"),
                msg("assistant", "A"),
                msg("system", "S2"),
                msg("user", "V"),
            ],
            [msg("system", "S"), msg("user", "U"), msg("assistant", "A"), msg("user", "S2\n\nV")],
        ),
        (  # tool turns are never merged
            [msg("user", "a"), {"role": "tool", "tool_call_id": "c", "content": "r"}, msg("user", "b")],
            [msg("user", "a"), {"role": "tool", "tool_call_id": "c", "content": "r"}, msg("user", "b")],
        ),
    ],
)
def test_alternating_keeps_every_word_and_changes_only_the_layout(messages, laid_out):
    before = [dict(m) for m in messages]
    assert alternating(messages) == laid_out
    assert messages == before  # the input is not changed


def test_a_chat_the_gemma_template_refuses_is_rendered_again_laid_out():
    gemma = ChatTemplate(load_template_text("gemma"), bos_token="<bos>")

    async def main() -> tuple[list[str], str]:
        t = Templates(None)  # type: ignore[arg-type]  # no tools: the front end is not asked
        try:
            out = [
                await t.render_chat(gemma, m, None)
                for m in (
                    [msg("developer", "D"), msg("user", "U")],
                    [msg("system", "S"), msg("system", "T"), msg("user", "U")],
                    [msg("user", "a"), msg("user", "b")],
                )
            ]
            with pytest.raises(
                ChatTemplateError, match="alternate"
            ) as err:  # still refused: the first reason
                await t.render_chat(gemma, [msg("assistant", "A"), msg("user", "U")], None)
            return out, str(err.value)
        finally:
            await t.close()

    (dev, systems, users), _ = asyncio.run(main())
    assert dev == gemma.render([msg("system", "D"), msg("user", "U")])
    assert systems == gemma.render([msg("system", "S\n\nT"), msg("user", "U")])
    assert users == gemma.render([msg("user", "a\n\nb")])
