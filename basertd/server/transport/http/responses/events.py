"""A streamed response's server-sent events, in the order the Responses API sends them: each event
is ``event: <type>`` and ``data: <json>`` whose ``type`` repeats the name and whose
``sequence_number`` counts from 0; there is no ``[DONE]``.

``response.created`` and ``response.in_progress`` open the stream (the response in progress, no
output yet). A message item is ``response.output_item.added``, ``response.content_part.added``
(an empty ``output_text``), one ``response.output_text.delta`` per piece of text, then
``response.output_text.done``, ``response.content_part.done`` and ``response.output_item.done``
(the item whole). A function call is ``response.output_item.added`` (arguments ""), one
``response.function_call_arguments.delta`` with the whole arguments (a call is held until it is
complete, as on the chat dialect), ``response.function_call_arguments.done`` and
``response.output_item.done``. The stream ends with ``response.completed`` or
``response.incomplete`` (the output cut by ``max_output_tokens``), or ``response.failed`` (the
generation failed after it was accepted: the response's ``error`` says why).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from basertd.server.transport.http import sse
from basertd.server.transport.http.responses import wire

_encode = msgspec.json.Encoder().encode


class OutputStream:
    """Writes one response's events to ``resp`` (module docstring); ``output`` collects the
    finished output items, ``text`` the message text sent so far."""

    def __init__(self, resp: web.StreamResponse, shape: wire.Shape) -> None:
        self.resp = resp
        self.shape = shape
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self._message: tuple[int, str] | None = None
        self._text: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def message_open(self) -> bool:
        return self._message is not None

    async def send(self, kind: str, **fields: Any) -> None:
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        await self.resp.write(b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n")

    async def comment(self, text: str) -> None:
        await self.resp.write(sse.comment(text))

    async def begin(self) -> None:
        """``response.created`` and ``response.in_progress``."""
        for kind in ("response.created", "response.in_progress"):
            await self.send(kind, response=self.shape.object("in_progress", []))

    async def open_message(self) -> None:
        index, item_id = len(self.output), wire.new_id("msg")
        self._message = (index, item_id)
        self.output.append(wire.message_item(item_id, "", "in_progress"))
        await self.send("response.output_item.added", output_index=index, item=self.output[index])
        await self.send(
            "response.content_part.added",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=wire.text_part(""),
        )

    async def delta(self, text: str) -> None:
        """Send ``text`` as message text, opening the message first if need be ("" sends nothing)."""
        if not text:
            return
        if self._message is None:
            await self.open_message()
        index, item_id = self._message  # type: ignore[misc]
        self._text.append(text)
        await self.send(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    async def close_message(self, status: str) -> None:
        """Finish the message (opened now if no text came), its item ``status`` completed or
        incomplete."""
        if self._message is None:
            await self.open_message()
        index, item_id = self._message  # type: ignore[misc]
        text = self.text
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        await self.send("response.output_text.done", **where, text=text, logprobs=[])
        await self.send("response.content_part.done", **where, part=wire.text_part(text))
        self.output[index] = wire.message_item(item_id, text, status)
        await self.send("response.output_item.done", output_index=index, item=self.output[index])

    async def calls(self, calls: list[dict[str, Any]]) -> None:
        """One function-call item per chat ``tool_calls`` entry."""
        for call in calls:
            index, item_id = len(self.output), wire.new_id("fc")
            self.output.append(wire.call_item(item_id, call, "in_progress"))
            await self.send("response.output_item.added", output_index=index, item=self.output[index])
            args = call["function"]["arguments"]
            where = {"item_id": item_id, "output_index": index}
            await self.send("response.function_call_arguments.delta", **where, delta=args)
            await self.send("response.function_call_arguments.done", **where, arguments=args)
            self.output[index] = wire.call_item(item_id, call)
            await self.send("response.output_item.done", output_index=index, item=self.output[index])

    async def end(self, response: dict[str, Any]) -> None:
        """The closing event of ``response`` (its status names it)."""
        await self.send(f"response.{response['status']}", response=response)
