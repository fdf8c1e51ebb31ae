"""Deployment, the Grafana dashboard (``deploy/dashboards/mtc.json``): every series it
queries is one a replicator exports (its own ``Metrics`` registry, not a list kept
by hand), grouped only by labels the series or the scrape configs carry; and every
series of docs/operations.md's metrics table is on it, or left out here with the
reason."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mtc.sidecar.replicator.metrics import Metrics

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "dashboards" / "mtc.json"
# What the scrape configs add (components/monitoring-*: jobset and slice from the pod's
# labels) and what every Kubernetes target carries.
SCRAPE_LABELS = {"namespace", "pod", "jobset", "slice"}
# Series of the table deliberately not on the dashboard, and why. None today.
LEFT_OUT: dict[str, str] = {}


def exported() -> dict[str, set[str]]:
    """Every series a replicator exports, with its labels (a counter as ``_total``)."""
    text = generate_latest(Metrics().registry).decode()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("mtc_"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = {label for s in family.samples for label in s.labels}
    # A labelled series has no samples until used: its label names from the metric
    # objects (prometheus_client keeps them in _labelnames).
    m = Metrics()
    for attr in vars(m).values():
        labelnames = getattr(attr, "_labelnames", ())
        name = getattr(attr, "_name", "")
        if labelnames and name:
            out.setdefault(name + ("_total" if attr._type == "counter" else ""),
                           set()).update(labelnames)
    return out


def exprs(node: Any) -> list[str]:
    """Every query of the dashboard: panels' targets and template variables."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        if isinstance(node.get("definition"), str):
            found.append(node["definition"])
        return found + [e for v in node.values() for e in exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in exprs(v)]
    return []


def table_series() -> set[str]:
    """The series docs/operations.md's metrics table lists (as test_deploy_monitoring
    reads it: `mtc_x_sent_total`, `_received_total` is two)."""
    table = (REPO / "docs" / "operations.md").read_text().split("## Alerts")[0]
    listed = set(re.findall(r"`(mtc_[a-z_]+)", table))
    for full, tail in re.findall(r"`(mtc_[a-z_]+)`, `(_[a-z_]+)`", table):
        listed.add(full.rsplit("_", 2)[0] + tail)
    return listed


def test_dashboard_queries_only_what_replicators_export() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    series = exported()
    queries = exprs(dashboard["panels"]) + exprs(dashboard["templating"])
    assert queries
    for q in queries:
        for name in re.findall(r"\bmtc_[a-z_]+", q):
            assert name in series, f"{q!r} reads {name}, which no replicator exports"
            for by in re.findall(r"\bby \(([^)]*)\)", q):
                labels = {x.strip() for x in by.split(",")}
                assert labels <= series[name] | SCRAPE_LABELS, (q, labels - series[name])


def test_every_series_of_the_operations_table_is_on_the_dashboard() -> None:
    on = {n for q in exprs(json.loads(DASHBOARD.read_text())["panels"])
          for n in re.findall(r"\bmtc_[a-z_]+", q)}
    listed = table_series()
    assert listed <= set(exported()), f"the table names {listed - set(exported())}"
    missing = listed - on - set(LEFT_OUT)
    assert not missing, f"in docs/operations.md's table, not on the dashboard: {missing}"
    assert not set(LEFT_OUT) & on, "left out and yet on the dashboard"


def test_panels_do_not_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        assert g["x"] + g["w"] <= 24
        cells |= mine
