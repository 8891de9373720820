"""Whether a compiled JSON-schema grammar takes a text whole (llguidance's matcher over the tiny
GGUF's tokenizer: the ``tokenizer`` fixture of conftest.py)."""

from __future__ import annotations

import json

import llguidance

from basertd.worker.engines.llamacpp.grammar import compile_spec


def accepts(tok: llguidance.LLTokenizer, schema: object, text: str) -> bool:
    """True when the compiled JSON-schema grammar of ``schema`` takes ``text`` whole and accepts there."""
    m = llguidance.LLMatcher(tok, compile_spec("json_schema", json.dumps(schema)), log_level=0)
    ids = tok.tokenize_str(text)
    if m.validate_tokens(ids) != len(ids):
        return False
    assert m.consume_tokens(ids)
    return m.is_accepting()
