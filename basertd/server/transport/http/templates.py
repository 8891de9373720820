"""The chat template of the worker a request goes to, built once per worker from what the front
end says it is made of (``FrontendPort.template_inputs``, ``chat_template.template_source``) and
cached by worker handle; a worker without one caches its ``ChatTemplateError`` (the dialects answer
400, never a silent fallback)."""

from __future__ import annotations

from basertd.server.transport.http.chat_template import ChatTemplate, ChatTemplateError, template_source
from basertd.server.transport.http.port import FrontendPort


class Templates:
    """Chat templates per worker handle of ``frontend``."""

    def __init__(self, frontend: FrontendPort) -> None:
        self.frontend = frontend
        self._cache: dict[int, ChatTemplate | ChatTemplateError] = {}

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
