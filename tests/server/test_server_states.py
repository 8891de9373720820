"""QoS classes and lifecycle states are one enum each, and their wire form is the plain name."""

from __future__ import annotations

import msgspec
import pytest

from basertd.schema import client, control
from basertd.schema.client import QosClass
from basertd.server.config import ConfigError, parse_config
from basertd.server.request import record as requests
from basertd.server.sched import qos
from basertd.server.states import DaemonState, HealthStatus, SlotState


def test_qos_classes_ranks_and_names_come_from_one_enum():
    assert requests.QOS_CLASSES == (QosClass.INTERACTIVE, QosClass.BATCH, QosClass.BACKGROUND)
    assert [qos.qos_rank(q) for q in QosClass] == [0, 1, 2]
    assert qos.qos_rank("batch") == 1  # a plain name is the same key
    assert qos.INTERACTIVE == qos.qos_rank(QosClass.INTERACTIVE) == 0


def test_qos_wire_form_is_the_plain_name():
    body = msgspec.msgpack.encode(client.Generate(request_id="r", prompt="x", qos=QosClass.BATCH))
    assert msgspec.msgpack.decode(body)["qos"] == "batch"
    gen = msgspec.msgpack.decode(body, type=client.Generate)
    assert gen.qos is QosClass.BATCH
    with pytest.raises(msgspec.ValidationError):
        bad = msgspec.msgpack.encode({"request_id": "r", "qos": "urgent"})
        msgspec.msgpack.decode(bad, type=client.Generate)


def test_lane_caps_keys_are_qos_classes():
    cfg = parse_config({"scheduler": {"lane_caps": {"background": 1}}})
    assert cfg.scheduler.lane_caps == {QosClass.BACKGROUND: 1}
    with pytest.raises(ConfigError):
        parse_config({"scheduler": {"lane_caps": {"urgent": 1}}})


def test_states_print_and_encode_as_their_names():
    assert f"{DaemonState.READY}" == "ready" and SlotState.GIVEN_UP == "given_up"
    row = control.StatusResult(state=DaemonState.DRAINING)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(row))["state"] == "draining"
    assert msgspec.json.encode(HealthStatus.DEGRADED) == b'"degraded"'
