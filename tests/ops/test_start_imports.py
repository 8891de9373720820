"""What the two processes import at start (``basertd.lean_structlog``, the lazy imports of the HTTP
app and of llguidance): the heavy optional packages stay out of a start that does not use them,
and what they served still works. Each check runs in a fresh interpreter, as the daemon and the
worker start."""

from __future__ import annotations

import json
import subprocess
import sys

LAZY = ("rich", "aiohttp", "llguidance")


def _modules_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints a JSON object on its last stdout line."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_the_daemon_without_http_imports_no_rich_aiohttp_or_llguidance():
    got = _modules_after(
        "import sys, json\n"
        "import basertd.cli\n"
        "import basertd.server.daemon\n"
        f"print(json.dumps({{m: m in sys.modules for m in {LAZY!r}}}))\n"
    )
    assert got == dict.fromkeys(LAZY, False), got


def test_the_worker_imports_no_rich_or_llguidance_before_its_first_grammar():
    got = _modules_after(
        "import sys, json\n"
        "import basertd.worker.main\n"
        "import basertd.worker.engines.llamacpp.factory\n"
        f"print(json.dumps({{m: m in sys.modules for m in {LAZY!r}}}))\n"
    )
    assert got == dict.fromkeys(LAZY, False), got


def test_lean_structlog_keeps_tracebacks_and_leaves_rich_importable():
    got = _modules_after(
        "import sys, json, io\n"
        "import basertd.cli\n"
        "import structlog\n"
        "from basertd.server.daemon import configure_logging\n"
        "configure_logging('info')\n"
        "buf = io.StringIO()\n"
        "structlog.configure(logger_factory=structlog.PrintLoggerFactory(buf))\n"
        "log = structlog.get_logger('t')\n"
        "try:\n"
        "    {}['missing']\n"
        "except KeyError:\n"
        "    log.exception('failed')\n"
        "line = json.loads(buf.getvalue())\n"
        "import rich.console\n"
        "print(json.dumps({'exception': line['exception'], 'rich': 'rich.console' in sys.modules}))\n"
    )
    assert got["exception"].startswith("Traceback (most recent call last):"), got
    assert "KeyError: 'missing'" in got["exception"], got
    assert got["rich"] is True


def test_compile_spec_imports_llguidance_on_first_use():
    got = _modules_after(
        "import sys, json\n"
        "from basertd.grammar_compile import compile_spec\n"
        "before = 'llguidance' in sys.modules\n"
        "grammar = compile_spec('regex', 'a+')\n"
        "print(json.dumps({'before': before, 'compiled': bool(grammar)}))\n"
    )
    assert got == {"before": False, "compiled": True}, got


def test_the_sandbox_children_start_without_rich_structlog_or_asyncio():
    """The children of the sandbox pools start while the daemon does: they import neither the
    pool's side (asyncio, structlog) nor anything heavier (``sandbox_child``)."""
    for module in ("basertd.server.request.spec_check", "basertd.server.transport.http.template_render"):
        got = _modules_after(
            f"import sys, json\nimport {module}\n"
            "print(json.dumps([m for m in ('rich', 'structlog', 'asyncio', 'numpy') if m in sys.modules]))\n"
        )
        assert got == [], module
