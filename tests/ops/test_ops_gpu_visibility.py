"""The coordinator hides every GPU from its own process (``workers.process.hide_gpus``: it loads
llama.cpp only for vocabularies, and a GPU build would initialise its runtime there) while each
worker is spawned with the GPU visibility the daemon was started with, narrowed by its ``device``
(``device_env``). Checked on a real daemon's processes through /proc/<pid>/environ; the reference
engine ignores the device, so no GPU is needed."""

from __future__ import annotations

import pytest
from daemon_harness import Daemon
from proc_testutil import children_of
from serving_harness import ref_toml

from basertd.server.workers.environment import NO_GPU


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.decode().partition("=") for kv in f.read().split(b"\0") if kv]
    return {k: v for k, _, v in items}


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.parametrize("started_with", ["0,1", None])
def test_workers_get_the_daemons_gpus_and_the_coordinators_other_children_none(started_with):
    cfg = ref_toml(workers=1) + ref_toml(workers=1, worker='device = "cuda:1"').split("[scheduler]")[0]
    env = {"HIP_VISIBLE_DEVICES": "2"}
    if started_with is not None:
        env["CUDA_VISIBLE_DEVICES"] = started_with
    with Daemon(cfg, env=env) as d:
        w0, w1 = d.workers()
        cpu, gpu = _environ(w0.pid), _environ(w1.pid)
        assert cpu.get("CUDA_VISIBLE_DEVICES") == started_with and cpu["HIP_VISIBLE_DEVICES"] == "2"
        assert gpu["CUDA_VISIBLE_DEVICES"] == "1" and gpu["HIP_VISIBLE_DEVICES"] == "2"
        # the coordinator's own environment, as the sandbox processes it spawned inherit it
        sandboxes = [p for p in children_of(d.proc.pid) if "spec_check" in _cmdline(p)]
        assert sandboxes, "no sandbox process to read"
        for pid in sandboxes:
            seen = _environ(pid)
            assert seen["CUDA_VISIBLE_DEVICES"] == seen["HIP_VISIBLE_DEVICES"] == NO_GPU
