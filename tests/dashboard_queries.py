"""The PromQL that deploy/grafana/kvroute.json and deploy/prometheus/kvroute-rules.yml hold,
read back as a user's Grafana and Prometheus would read them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute.json"
RULES = ROOT / "deploy" / "prometheus" / "kvroute-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvroute-rules.test.yml"
# A name that is part of a recorded series' name (``worker:kvroute_...:ratio``) is not a metric's.
METRIC_NAME = re.compile(r"(?<![:\w])kvroute_[a-z0-9_]+(?![:\w])")


def panels(dashboard: dict | None = None) -> list[dict]:
    """Every graph panel, those inside collapsed rows too; rows themselves are not panels."""
    dashboard = dashboard if dashboard is not None else json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def panel_queries(rate_interval: str) -> list[tuple[str, str]]:
    """(panel title, query) for every query of every panel, Grafana's ``$__rate_interval``
    replaced by ``rate_interval`` as Grafana would."""
    return [(panel["title"], target["expr"].replace("$__rate_interval", rate_interval))
            for panel in panels() for target in panel["targets"]]


def rules(kind: str) -> list[dict]:
    """``kind``: "record" or "alert"."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if kind in rule]


def metric_names(expr: str) -> set[str]:
    """The kvroute series ``expr`` reads (recorded series, ``kvroute:...``, are not matched)."""
    return set(METRIC_NAME.findall(expr))
