"""The Link W handshake through ``WorkerProcess``: version, the capability record
built from the engine, the rings as inherited, and the model identity."""

from __future__ import annotations

import os
import stat

from basertd.schema.abi import RingKind, RingRole, SpaceKind
from basertd.server.workers.process import (
    EMIT_RING_ID,
    LOGITS_RING_ID,
    PROMPT_RING_ID,
    RingGeometry,
)
from basertd.server.workers.sync_worker import SyncWorker


def test_capabilities_describe_engine_model_and_rings(make_spec):
    spec = make_spec(
        ref_config={"vocab_size": 300, "seed_lease_ticks": 5, "page_size_tokens": 8, "pool_bytes": 1 << 19},
        lanes=4,
        context_length=128,
        prompt_ring=RingGeometry.for_elems(64, 32),
        emit_ring=RingGeometry.for_elems(128, 8),
        logits_ring=RingGeometry.for_elems(4, 300),
    )
    with SyncWorker(spec) as w:
        caps = w.capabilities
        assert w.link.version == 1
        assert (caps.engine, caps.vocab_size, caps.max_lanes, caps.max_batch_size) == ("basert", 300, 4, 4)
        assert (caps.context_length, caps.page_size_tokens, caps.pool_bytes) == (128, 8, 1 << 19)
        assert caps.seed_lease_ticks == 5  # what the engine declares (ABI rule 84)
        assert caps.eos_token_ids == [2] and caps.bos_token_id == 1 and caps.tokenizer.kind == "bytes"
        assert len(caps.model_id) == 32 and int(caps.model_id, 16) >= 0
        assert [(s.space_id, s.kind, s.page_size_tokens, s.name) for s in caps.state_spaces] == [
            (0, SpaceKind.PAGED_TOKEN_KV, 8, "kv")
        ]
        rings = {r.ring_id: r for r in caps.rings}
        for rid, geo, kind, role in (
            (PROMPT_RING_ID, spec.prompt_ring, RingKind.TOKENS, RingRole.ENGINE_READS),
            (EMIT_RING_ID, spec.emit_ring, RingKind.TOKENS, RingRole.ENGINE_WRITES),
            (LOGITS_RING_ID, spec.logits_ring, RingKind.LOGITS, RingRole.ENGINE_WRITES),
        ):
            r = rings[rid]
            assert (r.kind, r.role, r.slots, r.slot_bytes, r.length) == (
                kind,
                role,
                geo.slots,
                geo.slot_bytes,
                geo.length,
            )
        # The endpoint lives in a private directory; the rings are memfds, not files.
        assert stat.S_IMODE(os.stat(w.proc.runtime_dir).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(w.proc.ipc_path).st_mode)
        fd_dir = f"/proc/{w.proc.pid}/fd"
        memfds = {
            os.stat(f"{fd_dir}/{fd}").st_ino
            for fd in os.listdir(fd_dir)
            if os.readlink(f"{fd_dir}/{fd}").startswith("/memfd:basertd-w0-")
        }
        # the three ring segments and the control segment (Python's mmap holds a dup of each)
        assert len(memfds) == 4
        first_id = caps.model_id
    with SyncWorker(spec) as w:
        assert w.capabilities.model_id == first_id  # same model, same identity
    other = make_spec(ref_config={"vocab_size": 300, "eos_period": 7})
    with SyncWorker(other) as w:
        assert w.capabilities.model_id != first_id


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.decode().partition("=") for kv in f.read().split(b"\0") if kv]
    return {k: v for k, _, v in items}


def test_worker_openmp_threads_poll_briefly_unless_told(make_spec, monkeypatch):
    # compute_env: the worker's OpenMP threads poll briefly, then sleep, instead of spinning on
    # the cores the link thread and the coordinator need; an operator's setting passes through.
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(key, raising=False)
    with SyncWorker(make_spec(lanes=1, context_length=64)) as w:
        env = _environ(w.proc.pid)
        assert env["GOMP_SPINCOUNT"] == "3000" and "OMP_WAIT_POLICY" not in env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with SyncWorker(make_spec(lanes=1, context_length=64)) as w:
        env = _environ(w.proc.pid)
        assert env["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in env
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    with SyncWorker(make_spec(lanes=1, context_length=64)) as w:
        assert _environ(w.proc.pid)["GOMP_SPINCOUNT"] == "300000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    with SyncWorker(make_spec(lanes=1, context_length=64, env={"GOMP_SPINCOUNT": "0"})) as w:
        assert _environ(w.proc.pid)["GOMP_SPINCOUNT"] == "0"  # the spec's own env wins
