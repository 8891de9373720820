"""One ``PlanRejected`` for a refused plan in every layer (ABI rules 13, 17-52)."""

from __future__ import annotations

from basertd.native import abi as nabi
from basertd.schema.abi import Status
from basertd.schema.rejection import PLAN_REJECTION_RANGE, PlanRejected
from basertd.server.workers import link_errors
from basertd.worker.engines import base


def test_every_layer_raises_the_schema_class():
    # The binding, the engine protocol and the coordinator's link name one class, so one
    # ``except PlanRejected`` means the same refusal wherever it is written.
    assert nabi.PlanRejected is PlanRejected
    assert base.PlanRejected is PlanRejected
    assert link_errors.PlanRejected is PlanRejected
    assert nabi.PLAN_REJECTION_RANGE is PLAN_REJECTION_RANGE


def test_a_refusal_is_not_a_call_error_of_any_layer():
    assert not issubclass(PlanRejected, (nabi.AbiError, base.EngineError, link_errors.LinkError))


def test_status_message_and_plan_seq():
    err = PlanRejected(-104, "decodes[0]: lane 7 unknown", plan_seq=12)
    assert err.status is Status(-104) and isinstance(err.status, Status)
    assert err.message == "decodes[0]: lane 7 unknown" and err.plan_seq == 12
    assert str(err) == f"{Status(-104).name}: decodes[0]: lane 7 unknown"
    unknown = PlanRejected(-109)  # unassigned code: kept as the raw int (rule 13)
    assert unknown.status == -109 and not isinstance(unknown.status, Status) and unknown.plan_seq is None


def test_binding_maps_tick_codes_only():
    err = nabi.error_for(int(Status.REJECT_BOUNDS), "baseRT_tick", "admits[0]")
    assert type(err) is PlanRejected and err.status is Status.REJECT_BOUNDS
    assert "baseRT_tick" in err.message and "admits[0]" in err.message
    assert type(nabi.error_for(int(Status.REJECT_BOUNDS), "baseRT_match")) is nabi.AbiError
