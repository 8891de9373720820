"""deploy/grafana and deploy/prometheus against a real daemon: every PromQL expression of the
Grafana dashboard and of the alert rules parses (``promql-parser``, the Python binding of the Rust
PromQL parser that GreptimeDB maintains) and every metric it names is one a running daemon (the C
reference engine, durability on, vllm_compat on) exports on ``/metrics``: a family's samples are
its name (gauge), ``_total`` (counter), ``_bucket`` / ``_sum`` / ``_count`` (histogram), read
from the families' ``# TYPE`` lines, so a labelled counter nothing has counted yet still counts as
exported. Label matchers must name a label the family's samples carry. The rules file has the
alerts the operators' guide promises, each with a severity and a summary."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from daemon_harness import Daemon
from prometheus_client.parser import text_string_to_metric_families
from serving_harness import ref_toml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "basertd-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "basertd-alerts.yaml"
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}
PROMISED_ALERTS = {
    "BasertdWorkerGivenUp",
    "BasertdSchedulerStalled",
    "BasertdWalFsyncSlow",
    "BasertdQueueOverBound",
    "BasertdKvPoolPressure",
}
LABEL_VALUES = re.compile(r"^label_values\((?P<metric>[a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*\w+\)$")
NO_LABEL_CHECK = {"instance", "job", "le", "__name__"}  # added by Prometheus or the histogram


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every series name the daemon exports -> the labels its samples carry (empty when none)."""
    cfg = ref_toml(lanes=2, grant=2) + '[http]\nlisten = ["127.0.0.1:0"]\n'
    with Daemon(cfg) as d:
        with d.client() as c:
            c.generate("a request so the histograms have samples", max_tokens=8, temperature=0)
        url = "http://" + d.http_addresses()[0]
        text = httpx.get(url + "/metrics", timeout=30).text
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES[family.type]:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def selectors(node: object) -> Iterator[promql_parser.VectorSelector]:
    """Every vector selector of a parsed expression. An expression kind this walk does not know
    fails the test rather than hiding the names under it."""
    p = promql_parser
    if isinstance(node, p.VectorSelector):
        yield node
    elif isinstance(node, p.MatrixSelector):
        yield node.vector_selector
    elif isinstance(node, p.BinaryExpr):
        yield from selectors(node.lhs)
        yield from selectors(node.rhs)
    elif isinstance(node, p.AggregateExpr):
        yield from selectors(node.expr)
        if node.param is not None:
            yield from selectors(node.param)
    elif isinstance(node, p.Call):
        for arg in node.args:
            yield from selectors(arg)
    elif isinstance(node, (p.ParenExpr, p.UnaryExpr, p.SubqueryExpr)):
        yield from selectors(node.expr)
    elif not isinstance(node, (p.NumberLiteral, p.StringLiteral)):
        raise AssertionError(f"unknown PromQL node {type(node).__name__}: {node}")


def check_expression(expr: str, exported: dict[str, set[str]], where: str) -> set[str]:
    """Parse ``expr`` (Grafana's ``$variables`` as regex matchers are plain strings to PromQL) and
    check every metric and matcher label it names; the metric names."""
    tree = promql_parser.parse(expr)
    found = set()
    for vs in selectors(tree):
        assert vs.name, f"{where}: a selector without a metric name: {expr}"
        assert vs.name in exported, f"{where}: {vs.name} is not exported by the daemon ({expr})"
        labels = exported[vs.name]
        for m in vs.matchers.matchers:
            assert m.name in NO_LABEL_CHECK or not labels or m.name in labels, (
                f"{where}: {vs.name} has no label {m.name} (it has {sorted(labels)})"
            )
        found.add(vs.name)
    return found


def test_every_dashboard_expression_names_exported_metrics(exported):
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    used: set[str] = set()
    targets = 0
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            targets += 1
            used |= check_expression(target["expr"], exported, panel["title"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = LABEL_VALUES.match(var["definition"])
            assert m and m["metric"] in exported, var
    assert targets >= 20
    # the headline series are on it, ours and vLLM's names
    for name in (
        "basertd_ttft_seconds_bucket",
        "basertd_inter_token_latency_seconds_bucket",
        "basertd_queue_depth",
        "basertd_kv_pool_usage_ratio",
        "basertd_wal_fsync_seconds_bucket",
        "basertd_preemptions_total",
        "basertd_crash_resumes_total",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in used, name


def test_every_alert_expression_names_exported_metrics(exported):
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert set(names) >= PROMISED_ALERTS, PROMISED_ALERTS - set(names)
    for rule in rules:
        check_expression(rule["expr"], exported, rule["alert"])
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
        assert rule["labels"]["severity"] in ("warning", "critical"), rule
        assert rule["annotations"]["summary"], rule


def test_the_check_catches_a_misspelt_metric_and_label(exported):
    """The check itself can fail: an unknown name, an unknown label, an unparsable expression."""
    with pytest.raises(AssertionError, match="not exported"):
        check_expression("sum(rate(basertd_ttft_second_bucket[5m]))", exported, "t")
    with pytest.raises(AssertionError, match="has no label"):
        check_expression('basertd_queue_depth{klass="batch"}', exported, "t")
    with pytest.raises(Exception):  # noqa: B017 - the parser's own error type
        promql_parser.parse("sum(rate(basertd_ticks_total[5m])")
