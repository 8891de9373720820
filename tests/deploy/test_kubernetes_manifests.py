"""deploy/kubernetes parses and validates: the core kinds against the Kubernetes JSON schemas
shipped with ``kubernetes-validate`` (strict: unknown fields are errors); InferencePool against
the required structure of the Inference Extension's ``inference.networking.k8s.io/v1`` CRD
(written out here: the CRD itself is not installed); HTTPRoute against the fields the route uses;
the embedded basertd.toml against our own config; and the operational promises (readiness on
/health, a preStop drain, a grace period above the drain timeout, the sockets, a state volume)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml

from basertd.server.config import Config, parse_config

DIR = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"
CORE_KINDS = {"Deployment", "Service", "ConfigMap", "NetworkPolicy"}

INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "extensionRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
                    },
                },
                "extensionRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}

HTTP_ROUTE_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "spec": {
            "type": "object",
            "required": ["parentRefs", "rules"],
            "properties": {
                "parentRefs": {"type": "array", "minItems": 1, "items": {"required": ["name"]}},
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "matches": {"type": "array"},
                            "backendRefs": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {
                                        "group": {"const": "inference.networking.k8s.io"},
                                        "kind": {"const": "InferencePool"},
                                    },
                                },
                            },
                            "timeouts": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}


def documents() -> list[dict]:
    docs = []
    for path in sorted(DIR.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


def test_every_manifest_parses_and_the_core_kinds_validate_strictly():
    docs = documents()
    assert {d["kind"] for d in docs} == CORE_KINDS | {"InferencePool", "HTTPRoute"}
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_core_kind_with_an_unknown_field_is_refused():  # the validator really checks
    dep = by_kind("Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_inference_pool_and_route_have_the_extensions_structure():
    pool, route = by_kind("InferencePool"), by_kind("HTTPRoute")
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    jsonschema.validate(route, HTTP_ROUTE_V1)
    dep = by_kind("Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    http = {p["name"]: p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert pool["spec"]["targetPorts"][0]["number"] == http["http"]
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]
    bad = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}, {"number": 8001}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, INFERENCE_POOL_V1)


def embedded_config() -> tuple[dict, Config]:
    data = tomllib.loads(by_kind("ConfigMap")["data"]["basertd.toml"])
    # [http] belongs to the HTTP front end; validate it only where this checkout has it
    known = {f.name for f in msgspec.structs.fields(Config)}
    return data, parse_config({k: v for k, v in data.items() if k in known}, source="configmap")


def test_the_pod_drains_before_it_stops_and_serves_both_sockets():
    data, cfg = embedded_config()
    assert cfg.kv_events.enabled and cfg.metrics.vllm_compat
    spec = by_kind("Deployment")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["basertctl", "drain"]
    drain = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert drain == cfg.operators.drain_timeout_s
    assert spec["terminationGracePeriodSeconds"] > drain + 5  # + the workers' close grace
    assert data.get("http", {}).get("listen") == ["0.0.0.0:8000"]
    assert any(p["containerPort"] == 8000 for p in c["ports"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["runtime"] == cfg.runtime_dir  # the native Unix socket lives there
    assert {"state", "config"} <= mounts.keys()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(len(cfg.workers))  # one worker per GPU


def test_kv_events_bind_the_pod_ip_carry_no_token_ids_and_only_the_picker_reaches_them():
    _, cfg = embedded_config()
    kv = cfg.kv_events
    assert not kv.include_token_ids  # page hashes only
    for endpoint in (kv.endpoint, kv.replay_endpoint):
        assert "*" not in endpoint and "0.0.0.0" not in endpoint and "::" not in endpoint
    assert kv.replay_endpoint.startswith("tcp://${POD_IP}:")  # expanded at start, like the topic
    replay_port = int(kv.replay_endpoint.rsplit(":", 1)[1])
    ports = range(replay_port, replay_port + len(cfg.workers))  # one replay socket per worker
    pol = by_kind("NetworkPolicy")
    labels = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert pol["spec"]["policyTypes"] == ["Ingress"]  # anything not listed is refused
    for port in ports:
        rules = [
            r
            for r in pol["spec"]["ingress"]
            for p in r["ports"]
            if p["port"] <= port <= p.get("endPort", p["port"])
        ]
        assert rules and all(r.get("from") for r in rules), f"port {port} is open to every pod"
        for r in rules:
            for peer in r["from"]:
                assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "basertd-epp"}
