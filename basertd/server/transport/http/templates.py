"""Chats for the HTTP dialects: the chat template of the worker a request goes to, rendered off the
event loop, and a chat's tool fields to a tool plan whose grammar compiled.

Templates are built once per worker from what the front end says they are made of
(``FrontendPort.template_inputs``, ``chat_template.template_source``) and cached by worker handle;
a worker without one caches its ``ChatTemplateError`` (the dialects answer 400, never a silent
fallback).

Rendering runs a template the request does not control on messages it does: a template with a
long loop, or one that prints without end, would stop the daemon's loop. ``Templates.render``
therefore renders in a ``sandbox.SandboxPool`` of ``template_render`` children (``[compile]
processes``): killed past ``template_timeout_s``, refused past ``template_max_chars`` characters
of output or ``memory_mib`` of memory; each is a ``ChatTemplateError`` (a 400 naming it), counted
in ``basertd_sandbox_jobs_failed_total{pool="chat_template"}``. A process, not a thread: a thread
cannot be stopped, and counting a sandbox's loop iterations misses loops that call nothing.
"""

from __future__ import annotations

from typing import Any

import structlog

from basertd.server.config_sections import CompileConfig
from basertd.server.request.grammar import GrammarRequestError, check_tool_caps
from basertd.server.request.sandbox import SandboxBusy, SandboxError, SandboxJobError, SandboxPool
from basertd.server.transport.http import roles, tool_calls
from basertd.server.transport.http.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateRefused,
    template_source,
)
from basertd.server.transport.http.errors import HttpError, bad_request
from basertd.server.transport.http.port import FrontendPort

log = structlog.get_logger("basertd.http")

POOL = "chat_template"
"""The sandbox pool's name in metrics and logs."""


class Templates:
    """Chat templates per worker handle of ``frontend``, rendered under ``config``'s limits
    (module docstring); ``on_failure(pool, reason)`` counts a render that gave no text."""

    def __init__(
        self,
        frontend: FrontendPort,
        config: CompileConfig | None = None,
        on_failure: Any = None,
    ) -> None:
        self.frontend = frontend
        self.config = config = config or CompileConfig()
        self._on_failure = on_failure
        self._cache: dict[int, ChatTemplate | ChatTemplateError] = {}
        self.pool = SandboxPool(
            POOL,
            "basertd.server.transport.http.template_render",
            size=config.processes,
            timeout_s=config.template_timeout_s,
            max_pending=config.max_pending,
            memory_bytes=config.memory_mib << 20,
        )

    def for_model(self, model: str) -> tuple[int, ChatTemplate]:
        """``(worker handle, template)`` of the worker a request for ``model`` goes to. Raises
        ``ChatTemplateError`` when it has none, ``AdmissionError`` for an unknown model."""
        wid = self.frontend.route(model)
        cached = self._cache.get(wid)
        if cached is None:
            inputs = self.frontend.template_inputs(wid)
            try:
                source = template_source(inputs.configured, inputs.own, default_model=inputs.default_model)
                cached = ChatTemplate(source, bos_token=inputs.bos_token, eos_token=inputs.eos_token)
            except ChatTemplateError as exc:
                cached = exc
            self._cache[wid] = cached
        if isinstance(cached, ChatTemplateError):
            raise cached
        return wid, cached

    def check_messages(self, count: int) -> None:
        """Refuse a chat of more than ``[compile] max_messages`` messages (a 400 naming the cap)
        before its messages are converted (on the loop: 200,000 took over a second)."""
        if count > self.config.max_messages:
            raise bad_request(
                f"messages: at most {self.config.max_messages} messages per chat, got {count}", "messages"
            )

    async def render(
        self,
        template: ChatTemplate,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """``template.render(...)`` in a child process (module docstring). Raises
        ``ChatTemplateError`` (the template's refusal or failure, the time, output or memory
        limit, a crash) or a 429 ``HttpError`` when ``max_pending`` renders already wait."""
        job = [
            template.source,
            template.bos_token,
            template.eos_token,
            messages,
            add_generation_prompt,
            tools,
            self.config.template_max_chars,
        ]
        try:
            return await self.pool.run(job)
        except SandboxJobError as exc:
            self._failed("refused")
            raise ChatTemplateRefused(str(exc)) from None
        except SandboxBusy as exc:
            self._failed(exc.reason)
            raise HttpError(
                429, f"too many chats are being rendered; retry shortly ({exc})", code="queue_full"
            ) from None
        except SandboxError as exc:
            self._failed(exc.reason)
            log.warning("chat_template_failed", reason=exc.reason, error=str(exc))
            raise ChatTemplateError(f"chat template failed: {exc}") from None

    def _failed(self, reason: str) -> None:
        if self._on_failure is not None:
            self._on_failure(POOL, reason)

    async def render_chat(
        self, template: ChatTemplate, messages: list[dict[str, Any]], plan: tool_calls.ToolPlan | None
    ) -> str:
        """The prompt text of a chat with tools (``tool_calls.render``), rendered off the loop.
        When the template refuses the messages (a ``ChatTemplateError`` it raised, not a limit),
        they are rendered once more laid out for a template that wants alternating roles
        (``roles.alternating``); if that fails too, the first refusal is raised."""
        try:
            return await tool_calls.render(self.render, template, messages, plan)
        except ChatTemplateRefused as refused:
            laid_out = roles.alternating(messages)
            if laid_out == messages:
                raise
            try:
                return await tool_calls.render(self.render, template, laid_out, plan)
            except ChatTemplateRefused:
                raise refused from None

    async def tool_plan(
        self, model: str, qos: str, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None
    ) -> tool_calls.ToolPlan | None:
        """The plan of a chat's tool fields (``tool_calls.plan_of``) whose grammar compiled
        (``FrontendPort.compile_spec``, after the queue caps of ``model``'s worker), with
        ``tools`` inside ``[compile] max_tools`` and ``max_tools_bytes``. Raises a 400
        ``HttpError`` naming the field or the cap, or ``AdmissionError``."""
        try:
            check_tool_caps(tools, self.config.max_tools, self.config.max_tools_bytes)
        except GrammarRequestError as exc:
            raise bad_request(str(exc), "tools") from None
        plan = tool_calls.plan_of(tools, tool_choice, parallel_tool_calls)
        if plan is None:
            return None
        spec = await self.frontend.compile_spec(model, qos, plan.spec)
        return plan.with_spec(spec)

    async def close(self) -> None:
        """Stop the render processes."""
        await self.pool.close()
