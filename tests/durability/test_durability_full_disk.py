"""The journal fails loud (DESIGN.md "Crash = preemption; acceptance is durable"): a real
``basertd serve`` on the reference engine whose ``state_dir`` is a real, small tmpfs.

Filled to the last byte while the daemon serves, the next group commit's write fails with ENOSPC
(mode "tick", and "write", the default, whose commits do not fsync): nothing is acknowledged, and
the daemon exits with status 74 (``EXIT_JOURNAL_FAILED``) so that systemd's ``Restart=on-failure``
restarts it, never 0. A start on that state directory while it has less than ``[durability]
min_free_bytes`` free refuses to become ready (exit 1, saying why); and one on a read-only state
directory likewise. Mounting needs root (as here and in CI); where ``mount`` is
not permitted the test skips."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_harness import Daemon
from serving_harness import ref_toml

from basertd.client import ClientError

MIN_FREE = 1 << 20


@contextlib.contextmanager
def tmpfs(size: str, *, read_only: bool = False):
    """A fresh tmpfs of ``size`` mounted on a private directory; skips the test when mounting is
    not permitted."""
    where = Path(tempfile.mkdtemp(prefix="brt-fs-", dir="/tmp"))
    opts = f"size={size},mode=0700" + (",ro" if read_only else "")
    if os.geteuid() != 0:
        where.rmdir()
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"mount is not permitted here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem has no byte left (ENOSPC)."""
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError:
                break
        for size in (4096, 512, 1):  # the last partial chunks
            while True:
                try:
                    f.write(b"\0" * size)
                except OSError:
                    break


def serve(config: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "basertd.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "LISTEN_FDS")},
    )


def config(mode: str = "tick") -> str:
    return ref_toml(lanes=2, context=256) + f'[durability]\nmode = "{mode}"\nmin_free_bytes = {MIN_FREE}\n'


@pytest.mark.parametrize("mode", ["write", "tick"])
def test_a_full_state_dir_exits_74_and_a_start_on_it_refuses_to_become_ready(mode):
    with tmpfs("4m") as state:
        d = Daemon(config(mode), state_dir=state)
        try:
            with d.client() as c:
                assert len(c.generate("before", max_tokens=4, temperature=0).ids) == 4
                fill(state / "filler")
                # the segment's last page may still take a few small frames; then ENOSPC
                with pytest.raises(ClientError):  # never acknowledged: the connection just ends
                    for i in range(1000):
                        c.generate(f"after {i}", max_tokens=4, temperature=0, resume=False)
            rc = d.proc.wait(60)
        except BaseException:
            d.kill()
            raise
        log = d.log_text()
        assert rc == 74, log
        failed = [e for e in d.log_events() if e.get("event") == "durability_failed"]
        assert failed and "No space left on device" in failed[0]["error"], log
        d.track_children()
        d.assert_released()  # workers reaped, socket and runtime files removed
        conf = Path(tempfile.mkdtemp(prefix="brt-c-", dir="/tmp")) / "basertd.toml"
        # the next start's runtime directory lives beside its config: the daemon's own goes with
        # cleanup(), and a start on it would create it again and leave it behind
        conf.write_text(d.config_path.read_text().replace(str(d.runtime_dir), str(conf.parent / "rt")))
        d.cleanup()
        # some space back, still under min_free_bytes: the next start refuses, saying why
        filler = state / "filler"
        os.truncate(filler, max(0, filler.stat().st_size - MIN_FREE // 2))
        out = serve(conf)
        assert out.returncode == 1, out.stderr
        assert "cannot start" in out.stderr and "min_free_bytes" in out.stderr, out.stderr
        assert "daemon_ready" not in out.stderr
        assert not d.base.exists()
        shutil.rmtree(conf.parent)


def test_a_read_only_state_dir_refuses_to_become_ready(tmp_path):
    with tmpfs("1m", read_only=True) as state:
        conf = tmp_path / "basertd.toml"
        conf.write_text(
            f'runtime_dir = "{tmp_path / "rt"}"\nstate_dir = "{state}"\n' + config() + "[http]\nlisten = []\n"
        )
        out = serve(conf)
        assert out.returncode == 1, out.stderr
        assert "cannot take a write" in out.stderr and "Read-only file system" in out.stderr, out.stderr
        assert not (tmp_path / "rt" / "basertd.sock").exists()
