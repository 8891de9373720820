"""Import structlog without rich, for the daemon's and the worker's start (import it first).

structlog imports rich, when it is installed, at its own import (``structlog.dev`` for the
console renderer's tracebacks, ``structlog.tracebacks`` for locals' reprs): about 130 ms of a
process's start, for features basertd never uses (its logs are JSON lines,
``structlog.processors.JSONRenderer``, tracebacks through ``format_exc_info``, rich-free).
Importing this module first imports structlog with ``import rich`` failing, so structlog falls
back to its plain formatters; ``rich`` itself stays importable afterwards (``basertctl top``
uses it). Nothing happens when structlog or rich was imported before. Only the two entry points
(``basertd.cli``, ``basertd.worker.main``) import it, so a program using ``basertd.client`` keeps
structlog as it would have it.
"""

from __future__ import annotations

import sys

if "structlog" not in sys.modules and "rich" not in sys.modules:
    sys.modules["rich"] = None  # type: ignore[assignment]  # ``import rich`` -> ImportError
    try:
        import structlog  # noqa: F401
    finally:
        if sys.modules.get("rich", False) is None:
            del sys.modules["rich"]
