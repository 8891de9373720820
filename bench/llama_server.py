"""llama-server, the anchor of the serving benches: built once from the llama.cpp sources that the
installed llama-cpp-python vendors, then run as a subprocess on a loopback port.

The build: pip downloads the llama-cpp-python sdist of the installed version (its ``vendor/
llama.cpp``, the very sources the engine's wheel was compiled from), cmake builds the target
``llama-server`` with the wheel's portable flags (``-DGGML_NATIVE=OFF``) and static libraries, and
the binary is kept in ``<model cache>/../basertd-llama-server/<version>/llama-server``
(``$BASERTD_LLAMA_SERVER`` names a binary to use instead). About 10 minutes on two cores, once per
box; ``python bench/llama_server.py build`` does it ahead of a bench.

    with LlamaServer(model, ctx=16384, parallel=8, threads=2) as srv:
        srv.url  # http://127.0.0.1:PORT, /health answered 200
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from basertd.models import model_cache_dir

ENV = "BASERTD_LLAMA_SERVER"
"""Environment variable naming a llama-server binary to use instead of building one."""


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (the sources llama-server is built from)."""
    return importlib.metadata.version("llama_cpp_python")


def binary_path() -> Path:
    """Where the built llama-server of the installed version lives (it may not exist yet)."""
    return model_cache_dir().parent / "basertd-llama-server" / llama_cpp_version() / "llama-server"


def build(*, jobs: int = 2, log=sys.stderr) -> Path:
    """The llama-server binary, built first when it is not there (module docstring). Raises
    RuntimeError when the sdist cannot be fetched or cmake fails (its output's tail attached)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    target = binary_path()
    if target.is_file():
        return target
    version = llama_cpp_version()
    with tempfile.TemporaryDirectory(prefix="brt-llama-server-") as tmp:
        work = Path(tmp)
        print(f"llama-server: fetching the llama-cpp-python {version} sdist", file=log, flush=True)
        _run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--dest", str(work), f"llama_cpp_python=={version}"],
        )  # fmt: skip
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (src,) = work.glob("llama_cpp_python-*/vendor/llama.cpp")
        print(f"llama-server: building from {src.relative_to(work)} (minutes)", file=log, flush=True)
        build_dir = work / "build"
        _run(
            ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"],
        )  # fmt: skip
        _run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)])
        (built,) = build_dir.glob("bin/llama-server")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(built, partial)
        partial.rename(target)
    return target


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} … failed ({done.returncode}):\n{tail}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server subprocess on ``model`` (``-c ctx -np parallel -t threads``, continuous
    batching, loopback only). ``url`` once /health answers 200; ``ready_s`` the seconds from spawn
    to that; ``close()`` stops it (SIGTERM, then SIGKILL). ``extra`` adds command-line arguments.
    Raises RuntimeError (with the log's tail) when it exits or is not ready in ``timeout`` s."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        ctx: int = 16384,
        parallel: int = 8,
        threads: int = 2,
        extra: tuple[str, ...] = (),
        timeout: float = 300.0,
    ) -> None:
        binary = build()
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix="brt-llama-server-", suffix=".log")[1])
        cmd = [str(binary), "-m", str(model), "-c", str(ctx), "-np", str(parallel), "-t", str(threads),
               "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port), *extra]  # fmt: skip
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        self.ready_s = time.monotonic() - t0

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"llama-server not ready within {timeout:g} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    @property
    def pids(self) -> list[int]:
        """The server's processes (one: llama-server does not fork)."""
        return [self.proc.pid] if self.proc.poll() is None else []

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python bench/llama_server.py build")
    print(build())
