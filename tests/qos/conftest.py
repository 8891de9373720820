"""The serving-under-contention tests (issue 8) reuse the end-to-end daemon harness."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for sub in ("e2e", "qos"):
    if str(_TESTS / sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / sub))
