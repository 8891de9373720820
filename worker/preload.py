"""Load llama.cpp's shared libraries before numpy, in a worker that runs the llamacpp engine
(import this module first, as ``basertd.worker.main`` does).

With a CUDA build of llama.cpp a process that imported numpy before libllama was loaded dies with
SIGSEGV inside ``llama_model_load_from_file`` once layers are offloaded; the other order loads and
serves. Seen on an H200 (CUDA 13.0, driver 580.159, Python 3.12, numpy 2.5.2 and 2.5.5, the
llama.cpp that llama-cpp-python 0.3.36 vendors), every time, in the worker and in a bare
interpreter alike; ``OPENBLAS_NUM_THREADS=1`` and ``OMP_NUM_THREADS=1`` did not help, and both
orders map the same libraries, so the cause is not traced. A CPU build loads either way.

Importing ``llama_cpp`` loads libllama and its ggml backends (``llama_cpp.llama_cpp``) before
``llama_cpp.llama`` imports numpy. It happens only when the command line selects the llamacpp
engine (``--engine llamacpp`` or ``--engine=llamacpp``), so a worker of another engine pays
nothing, and not when numpy was already imported (too late to help: the engine reports a load
failure as it would). A missing llama-cpp-python is left to the engine's own error.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

ENGINE = "llamacpp"


def selects_llamacpp(argv: Sequence[str]) -> bool:
    """True when ``argv`` (a worker's arguments) names the llamacpp engine."""
    for i, arg in enumerate(argv):
        if arg == "--engine" and i + 1 < len(argv):
            return argv[i + 1] == ENGINE
        if arg == f"--engine={ENGINE}":
            return True
    return False


def preload(argv: Sequence[str]) -> bool:
    """Import ``llama_cpp`` when ``argv`` selects it and numpy is not loaded yet. Returns whether
    llama.cpp's libraries are now loaded ahead of numpy."""
    if not selects_llamacpp(argv) or "numpy" in sys.modules:
        return False
    try:
        import llama_cpp  # noqa: F401
    except ImportError:  # reported by the engine's factory, with its own message
        return False
    return True


preload(sys.argv[1:])
