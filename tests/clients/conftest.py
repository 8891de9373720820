"""The client matrix: each mainstream client library, unmodified, against a real ``basertd serve``.

``daemon`` (one per test module) serves the tiny random-weight ``llama`` GGUF
(``tests/tinymodel.py``) on the llama.cpp engine (structured outputs and tool calls need its
llguidance grammars), two lanes, one thread, with the shipped ``chatml`` template, on a loopback
HTTP port: ``daemon.http_url`` is its base URL, ``MODEL`` the model name clients send. A random
model writes no sense, so the tests bound every output (enums, bounded integers, ``max_tokens``)
and assert that each call parses and validates, never what it says.

``BASERTD_CLIENT_MATRIX=default`` runs the same tests on the default model (Gemma 3 270M, its
shipped ``gemma`` template, two threads) instead: the matrix as users meet it (tens of minutes on a
busy 2-core box, not part of ``make test``; give pytest ``--timeout 1800``).
"""

from __future__ import annotations

import os

import pytest
from daemon_harness import Daemon

ON_DEFAULT_MODEL = os.environ.get("BASERTD_CLIENT_MATRIX") == "default"
MODEL = "gemma-3-270m-q4_k_m" if ON_DEFAULT_MODEL else "tiny-llama"
"""The served model name the clients send."""
TIMEOUT_S = 900.0 if ON_DEFAULT_MODEL else 120.0
"""Seconds a client waits for one reply (the default model on a busy 2-core box is slow)."""


@pytest.fixture(scope="module")
def daemon(request):
    if ON_DEFAULT_MODEL:
        worker = 'engine = "llamacpp"\nthreads = 2\n'
    else:
        tiny = request.getfixturevalue("tiny_gguf")
        worker = f'engine = "llamacpp"\nmodel = "{tiny}"\nthreads = 1\nchat_template = "chatml"\n'
    config = f'[[workers]]\n{worker}lanes = 2\ncontext_length = 4096\n[http]\nlisten = ["127.0.0.1:0"]\n'
    with Daemon(config, ready_timeout=300) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d
