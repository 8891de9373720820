"""The client matrix: each mainstream client library, unmodified, against a real ``basertd serve``.

``daemon`` (one per test module) serves the tiny random-weight ``llama`` GGUF
(``tests/tinymodel.py``) on the llama.cpp engine (structured outputs and tool calls need its
llguidance grammars), one lane pair, one thread, with the shipped ``chatml`` template, on a
loopback HTTP port: ``daemon.http_url`` is its base URL, ``MODEL`` the model name clients send.
A random model writes no sense, so the tests bound every output (enums, bounded strings and
numbers, ``max_tokens``) and assert that each call parses and validates, never what it says.
"""

from __future__ import annotations

import pytest
from daemon_harness import Daemon

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    config = (
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gguf}"\nlanes = 2\ncontext_length = 4096\n'
        'threads = 1\nchat_template = "chatml"\n[http]\nlisten = ["127.0.0.1:0"]\n'
    )
    with Daemon(config) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d
