"""The chart's PodMonitors find the pods the operator creates and label them as the dashboards and
rules read them: the runtime one selects the model pods and not the router's, the router one the
router pods and not the model's, and both set `service` to the LLMDeployment's name (the label the
dashboards' `deployment` variable and every rule group by)."""

from __future__ import annotations

from typing import Any

from kvasir.operator.api.spec import parse_spec
from kvasir.operator.children.deployment import build_deployment
from kvasir.operator.children.routing import build_router_deployment
from tests.chart.test_chart import render

NAME = "demo"


def _pod_labels() -> dict[str, dict[str, str]]:
    spec = parse_spec({"model": {"source": "hf://org/model"}, "routing": {"mode": "kvasir"}})
    runtime = build_deployment(NAME, "team-a", spec)
    router = build_router_deployment(NAME, "team-a", image="kvasir:test")
    return {
        "runtime": runtime["spec"]["template"]["metadata"]["labels"],
        "router": router["spec"]["template"]["metadata"]["labels"],
    }


def _monitors() -> dict[str, dict[str, Any]]:
    """The PodMonitors by what their names end with (runtime, router)."""
    docs = render("--set", "metrics.podMonitor.enabled=true", crds=False)
    return {doc["metadata"]["name"].rsplit("-", 1)[1]: doc for doc in docs if doc["kind"] == "PodMonitor"}


def _selects(monitor: dict[str, Any], labels: dict[str, str]) -> bool:
    wanted = monitor["spec"]["selector"]["matchLabels"]
    return all(labels.get(key) == value for key, value in wanted.items())


def _service_label(monitor: dict[str, Any], labels: dict[str, str]) -> str | None:
    """The `service` label a scraped pod with `labels` ends up with (the relabelling applied)."""
    service = None
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
        for rule in endpoint.get("relabelings", []):
            if rule["targetLabel"] == "service":
                (source,) = rule["sourceLabels"]
                key = source.removeprefix("__meta_kubernetes_pod_label_")
                by_meta = {
                    k.replace(".", "_").replace("/", "_").replace("-", "_"): v for k, v in labels.items()
                }
                service = by_meta.get(key)
    return service


def test_each_pod_monitor_selects_its_own_pods_and_labels_them_with_the_deployment() -> None:
    monitors = _monitors()
    pods = _pod_labels()
    runtime, router = monitors["runtime"], monitors["router"]
    assert _selects(runtime, pods["runtime"]) and not _selects(runtime, pods["router"])
    assert _selects(router, pods["router"]) and not _selects(router, pods["runtime"])
    assert _service_label(runtime, pods["runtime"]) == NAME
    assert _service_label(router, pods["router"]) == NAME


def test_pod_monitors_are_off_by_default() -> None:
    assert not [doc for doc in render(crds=False) if doc["kind"] == "PodMonitor"]
