"""The committed dashboard is what deploy/grafana/build.py builds; every panel reads its
Prometheus through ``$datasource``; and every kvroute series a panel or a rule names is one
the orchestrator exports (a misspelt name would only show as an empty panel). That each
query returns data from a real Prometheus is tests/integration/test_grafana_prometheus.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from orchestrator.metrics import Metrics
from tests.dashboard_queries import DASHBOARD, ROOT, metric_names, panel_queries, panels, rules


def exported_series() -> set[str]:
    """The sample names of every metric of the orchestrator, whether or not it has samples yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in Metrics().registry.collect() for suffix in suffixes[family.type]}


def test_the_committed_dashboard_is_what_the_script_builds():
    pytest.importorskip("grafanalib", reason="the test extra's grafanalib builds the dashboard: run `make setup`")
    spec = importlib.util.spec_from_file_location("grafana_build", ROOT / "deploy" / "grafana" / "build.py")
    build = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(build)
    finally:
        del sys.modules[spec.name]
    assert DASHBOARD.read_text() == build.rendered(), "run python deploy/grafana/build.py and commit kvroute.json"


def test_every_panel_queries_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(target["datasource"]["uid"] == "${datasource}" for target in panel["targets"]), panel["title"]


def test_every_series_a_panel_or_rule_reads_is_exported():
    exported = exported_series()
    queries = [(title, expr) for title, expr in panel_queries("1m")]
    queries += [(rule.get("record") or rule["alert"], rule["expr"]) for rule in rules("record") + rules("alert")]
    unknown = {(title, name) for title, expr in queries for name in metric_names(expr) - exported}
    assert not unknown
    assert sum(len(metric_names(expr)) for _, expr in queries) > 30  # the names were found at all
