"""What the two processes import at start (``basertd.lean_structlog``, the lazy imports of the HTTP
app and of llguidance): the heavy optional packages stay out of a start that does not use them,
and what they served still works; and that ``basertd serve`` spawns its workers before importing
the daemon (``basertd.server.launch``). Each check runs in a fresh interpreter, as the daemon and
the worker start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

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


def test_serve_spawns_its_workers_before_it_imports_the_daemon():
    """``basertd serve`` spawns the workers (``basertd.server.launch``) before it imports
    ``basertd.server.daemon``, so their start overlaps the daemon's imports; a start that fails
    after the launch (here the daemon's import) kills them and removes what the launch made."""
    base = Path(tempfile.mkdtemp(prefix="brt-l-", dir="/tmp"))  # short: ipc paths fit sun_path
    try:
        cfg = base / "basertd.toml"
        cfg.write_text(
            f'runtime_dir = "{base / "rt"}"\nstate_dir = "{base / "state"}"\n'
            '[[workers]]\nengine = "basert"\nlanes = 1\ncontext_length = 64\n'
        )
        code = (
            "import json, os, sys\n"
            "class StopAtTheDaemon:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name != 'basertd.server.daemon':\n"
            "            return None\n"
            "        me = os.getpid()\n"
            "        with open(f'/proc/{me}/task/{me}/children') as f:\n"
            "            kids = [int(k) for k in f.read().split()]\n"
            "        cmds = {k: open(f'/proc/{k}/cmdline', 'rb').read().decode() for k in kids}\n"
            "        print(json.dumps({'spawned': cmds, 'loaded': sorted(sys.modules)}), flush=True)\n"
            "        raise ImportError('the test stops the start here')\n"
            "sys.meta_path.insert(0, StopAtTheDaemon())\n"
            "from basertd.cli import main\n"
            f"sys.argv = ['basertd', 'serve', '--config', {str(cfg)!r}]\n"
            "main()\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "the test stops the start here" in out.stderr, out.stderr[-2000:]
        seen = json.loads(out.stdout.splitlines()[0])
        workers = [int(pid) for pid, cmd in seen["spawned"].items() if "basertd.worker.main" in cmd]
        assert len(workers) == 1, seen["spawned"]
        # what the launch imported is light: none of the scheduler, the metrics or the front end
        heavy = {"basertd.server.sched.loop", "basertd.server.frontend.admission", "prometheus_client"}
        assert heavy.isdisjoint(seen["loaded"])
        # released on the way out: the worker killed and reaped, its directories gone
        assert not os.path.exists(f"/proc/{workers[0]}")
        assert list((base / "rt").glob("workers-*")) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_llamacpp_worker_loads_llama_cpp_before_numpy_and_no_other_worker_does():
    """``basertd.worker.preload``: with a CUDA build, numpy imported before libllama loads made
    every model load on the GPU die with SIGSEGV; the llamacpp worker loads libllama first, a
    worker of another engine does not load it at all."""
    order = (
        "import sys, json\n"
        "sys.argv = ['basertd-worker'] + {argv!r}\n"
        "import basertd.worker.main\n"
        "m = list(sys.modules)\n"
        "lib = m.index('llama_cpp.llama_cpp') if 'llama_cpp.llama_cpp' in m else -1\n"
        "print(json.dumps({{'lib': lib, 'numpy': m.index('numpy')}}))\n"
    )
    for argv in (["--engine", "llamacpp", "--model", "x.gguf"], ["--engine=llamacpp"]):
        got = _modules_after(order.format(argv=argv))
        assert 0 <= got["lib"] < got["numpy"], (argv, got)
    got = _modules_after(order.format(argv=["--engine", "basert"]))
    assert got["lib"] == -1, got
