"""One ``basertd serve`` subprocess for the benches: its own runtime and state directories under
``/tmp``, its log in ``daemon.log`` there, ready when the socket answers a health check with "ok".

    with BenchDaemon(workers_toml(model=m, threads=2), prefix="brt-serving-") as d:
        with d.client() as c: ...

``workers_toml`` writes one ``[[workers]]`` table; ``extra`` takes any further TOML (a
``[durability]`` table, say). ``http=True`` listens on an ephemeral loopback port and sets ``url``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from basertd.client import Client
from basertd.schema import control


def workers_toml(engine: str = "llamacpp", **keys: object) -> str:
    """One ``[[workers]]`` table: ``engine`` and every key given (strings quoted, None skipped)."""
    lines = ["[[workers]]", f'engine = "{engine}"']
    for k, v in keys.items():
        if v is not None:
            lines.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}")
    return "\n".join(lines) + "\n"


class BenchDaemon:
    """``basertd serve`` with ``workers`` (TOML from ``workers_toml``) and ``extra`` TOML.

    Raises RuntimeError (with the log's tail) when the daemon exits or is not ready in ``ready_s``.
    """

    def __init__(
        self,
        workers: str,
        *,
        prefix: str = "brt-bench-",
        extra: str = "",
        http: bool = False,
        ready_s: float = 300.0,
    ) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.sock = self.base / "rt" / "basertd.sock"
        self.log = self.base / "daemon.log"
        self.url: str | None = None
        listen = '["127.0.0.1:0"]' if http else "[]"
        cfg = self.base / "basertd.toml"
        cfg.write_text(
            f'runtime_dir = "{self.base / "rt"}"\nstate_dir = "{self.base / "state"}"\n'
            f"{workers}{extra}[http]\nlisten = {listen}\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "BASERTD_SOCKET"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "basertd.cli", "serve", "--config", str(cfg)],
                stdout=log,
                stderr=log,
                env=env,
            )
        try:
            self._wait_ready(ready_s)
        except BaseException:
            self.close()
            raise
        if http:
            for ev in self.events():
                if ev.get("event") == "http_listening":
                    self.url = "http://" + ev["addresses"][0]

    WORKER_FAILED = frozenset({"worker_start_failed", "worker_crash", "worker_error", "worker_given_up"})
    """Log events that end the wait at once: a worker that cannot start is retried by the daemon,
    so waiting out ``ready_s`` would only hide why (the log's tail goes with the error)."""

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"basertd exited ({self.proc.returncode}): {self.tail()}")
            failed = [ev for ev in self.events() if ev.get("event") in self.WORKER_FAILED]
            if failed:
                raise RuntimeError(f"basertd's worker failed to start ({failed[0]}): {self.tail(6000)}")
            try:
                with Client(self.sock, timeout=5) as c:
                    if c.health().status == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"basertd not ready in {timeout:.0f} s: {self.tail()}")

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def client(self, timeout: float = 600) -> Client:
        return Client(self.sock, timeout=timeout)

    def events(self) -> list[dict]:
        """The daemon's JSON log lines so far (lines that are not a JSON object are skipped)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                out.append(ev)
        return out

    def access(self) -> dict[str, dict]:
        """The access-log records so far, by request id."""
        return {ev["request_id"]: ev for ev in self.events() if ev.get("event") == "access"}

    def worker_pid(self, index: int = 0) -> int:
        with self.client(timeout=10) as c:
            return c.request(control.Workers()).workers[index].pid

    def close(self) -> None:
        """SIGTERM (a drain), SIGKILL after 120 s; the directories go."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> BenchDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
