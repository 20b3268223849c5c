"""The dashboards: the committed JSON is the builder's output, it is structurally sound (unique
panel ids, datasource variables, known units, the 24-column grid), every query parses (promtool),
and every metric a query names is one the runtime, the router or the operator exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvasir.observability import promql
from kvasir.observability.dashboards import DASHBOARDS, panel_queries
from kvasir.observability.generate import outputs
from kvasir.operator.metrics import OperatorMetrics
from tests.external_tools import REPO, tool

# Grafana's unit ids the dashboards may use (public/app/core/utils/units in Grafana).
UNITS = {"s", "ms", "percentunit", "percent", "reqps", "short", "none", "bytes", "ops"}
# What the variables stand for when a query is checked outside Grafana.
VARIABLES = {
    "$__rate_interval": "1m",
    "$__range": "1h",
    "$namespace": ".*",
    "$deployment": ".*",
    "$pod": ".*",
    "$ttft_slo": "1.0",
    "$itl_slo": "0.1",
    "$availability": "0.999",
}


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"an unknown variable in {expr}"
    return expr


def variable_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(variable, PromQL) of each query variable: Grafana's `label_values(SELECTOR, LABEL)` as the
    query whose series carry the values it offers."""
    found = []
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
        assert match, variable["query"]
        found.append((variable["name"], f"group by ({match[2]}) ({match[1]})"))
    return found


def boards() -> dict[str, dict[str, Any]]:
    return {name: json.loads((REPO / "dashboards" / f"{name}.json").read_text()) for name in DASHBOARDS}


def test_committed_files_are_the_generated_ones() -> None:
    for path, text in outputs(REPO).items():
        assert path.is_file(), f"{path} is missing: run python -m kvasir.observability.generate"
        assert path.read_text() == text, f"{path} is stale: run python -m kvasir.observability.generate"


@pytest.mark.parametrize("name", list(DASHBOARDS))
def test_dashboard_structure(name: str) -> None:
    board = boards()[name]
    assert board["uid"].startswith("kvasir-") and len(board["uid"]) <= 40
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for key in ("namespace", "deployment"):
        assert variables[key]["datasource"]["uid"] == "${datasource}"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in board["panels"]:
        x, w = panel["gridPos"]["x"], panel["gridPos"]["w"]
        assert x >= 0 and x + w <= 24, f"{panel['title']} leaves the 24-column grid"
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("description"), f"{panel['title']} has no description"
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit in UNITS, f"{panel['title']}: unit {unit!r}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_every_query_parses(tmp_path: Path) -> None:
    """promtool checks each query's PromQL, the variables' too (as a recording rule, the one way it
    parses an expression)."""
    queries = [q for board in boards().values() for q in (*panel_queries(board), *variable_queries(board))]
    rules = [
        {"record": f"check:{index}", "expr": substitute(expr)} for index, (_, expr) in enumerate(queries)
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _exported_operator_metrics() -> set[str]:
    names = set()
    for family in OperatorMetrics().registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(f"{family.name}_total")
        if family.type == "histogram":
            names.update(f"{family.name}_{suffix}" for suffix in ("bucket", "count", "sum"))
    return names


def test_queries_name_only_exported_metrics() -> None:
    runtime = set()
    for name in promql.RUNTIME_METRICS + promql.ROUTER_METRICS:
        runtime |= {name, f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    known = runtime | _exported_operator_metrics()
    for board in boards().values():
        for title, expr in panel_queries(board):
            for metric in re.findall(r"\bkvasir_[a-z0-9_]+", expr):
                assert metric in known, f"{board['title']} / {title}: {metric} is not exported"


def test_the_observability_doc_lists_every_dashboard() -> None:
    doc = (REPO / "docs" / "observability.md").read_text()
    assert [board["title"] for board in boards().values() if f"| {board['title']} |" not in doc] == []
