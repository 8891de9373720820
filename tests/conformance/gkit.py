"""Helpers shared by the section G tests (seeds and the prefix cache): publishing prefixes,
state-space configs with blob spaces, and a tainted cache entry made through real state ops."""

from __future__ import annotations

from lanekit import R, xfail_unless_reference

from basertd.native.abi import AbiError
from basertd.native.ref import RefSpace
from basertd.schema.abi import Encoding, OpState, SpaceFlag, SpaceKind, Status
from basertd.schema.tick import TokenRange

PAGED = RefSpace(0, SpaceKind.PAGED_TOKEN_KV, name="kv")
U64_MAX = 2**64 - 1


def blob(flags: int = 0, interval: int = 16) -> RefSpace:
    """A recurrent-state space (id 1) snapshotting every ``interval`` tokens."""
    return RefSpace(
        1,
        SpaceKind.RECURRENT_BLOB,
        flags=flags,
        blob_bytes=512,
        snapshot_cadence=2,
        snapshot_interval_tokens=interval,
        name="ssm",
    )


FLAGGED = {"ops unavailable": SpaceFlag.OPS_UNAVAILABLE, "no prefix cache": SpaceFlag.NO_PREFIX_CACHE}


def publish(rig, tag: int, tokens) -> None:
    """Admit ``tokens`` as lane ``tag``, prefill them, retire with publish_to_cache."""
    rig.start(tag, list(tokens))
    rig.tick(retires=[R(tag, publish=True)])


def candidates(rig, span, space_id: int = 0) -> list[int]:
    """space_match candidate lengths of ``span`` in one space."""
    (m,) = rig.bundle.space_match(space_id, span).spaces
    return [c.prefix_len for c in m.candidates]


def wait_op(rig, op: int) -> int:
    """Tick (empty plans) until ``op`` is terminal; returns its state."""
    for _ in range(16):
        state = rig.bundle.op_poll(op).state
        if state in (OpState.DONE, OpState.FAILED, OpState.CANCELLED):
            return state
        rig.tick()
    raise AssertionError(f"op {op} did not finish in 16 ticks")


def publish_tainted(rig, tag: int, tokens) -> None:
    """Publish ``tokens`` from a lane whose first block went through a Q8 demote and a promote
    (taint QUANTIZED_DEMOTION, ABI rule 107). xfails while the engine refuses state ops."""
    rig.start(tag, list(tokens))
    seq = rig.bundle.lane_sequence(tag)
    rng = TokenRange(start=0, end=16)
    try:
        size, gen = rig.bundle.export_size(seq, 0, rng, Encoding.Q8)
        op = rig.bundle.demote(seq, 0, rng, Encoding.Q8, gen, size)
    except AbiError as e:
        if e.status == Status.ERR_OP_UNSUPPORTED:
            xfail_unless_reference(
                rig.bundle, "state ops (RULES.md section H): lossy demote is how a variant gets tainted"
            )
        raise
    assert wait_op(rig, op) == OpState.DONE
    data = rig.bundle.op_output(op)
    assert wait_op(rig, rig.bundle.promote(seq, 0, rng, data)) == OpState.DONE
    rig.tick(retires=[R(tag, publish=True)])
