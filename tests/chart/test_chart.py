"""The Helm chart, with the real `helm` binary: lint and render for each mode, every rendered
manifest valid for Kubernetes (kubernetes-validate, strict), bad values refused by the schema, one
CRD, deploy/ equal to the default render, and a README that lists every value."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.external_tools import REPO, tool

CHART = REPO / "charts" / "kvasir"
K8S_VERSION = kubernetes_validate.utils.latest_version()
NAMESPACE = "kvasir-system"
# Kinds of the Prometheus Operator: no schema in kubernetes-validate; checked by shape below.
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

MODES = {
    "default": [],
    "single-namespace": ["--set", "watch.namespaces={team-a,team-b}"],
    "everything-on": [
        "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
        "--set", "prometheusRule.enabled=true", "--set", "operator.prometheusUrl=http://prometheus:9090",
    ],
    "no-leader-election": ["--set", "leaderElection.enabled=false", "--set", "replicaCount=1"],
}  # fmt: skip


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def render(*values: str, crds: bool = True) -> list[dict[str, Any]]:
    args = ["template", "kvasir", str(CHART), "--namespace", NAMESPACE, *values]
    if crds:
        args.append("--include-crds")
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def test_helm_lint() -> None:
    for values in MODES.values():
        helm("lint", "--strict", str(CHART), *values)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_rendered_manifest_is_valid(mode: str) -> None:
    docs = render(*MODES[mode])
    kinds = {doc["kind"] for doc in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ConfigMap"} <= kinds
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"], doc["kind"]
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_modes_choose_cluster_or_namespace_roles() -> None:
    cluster = {d["kind"] for d in render()}
    assert {"ClusterRole", "ClusterRoleBinding"} <= cluster
    scoped = render(*MODES["single-namespace"])
    assert "ClusterRole" not in {d["kind"] for d in scoped}
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in scoped if d["kind"] == "Role"}
    assert {("team-a", "kvasir-operator"), ("team-b", "kvasir-operator")} <= roles
    operator = next(d for d in scoped if d["kind"] == "Deployment")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


@pytest.mark.parametrize("mode", ["default", "single-namespace"])
def test_every_role_lets_the_operator_manage_leader_worker_sets(mode: str) -> None:
    """Multi-node groups: get, create and update the LeaderWorkerSet, delete it when the spec goes
    back to one node; never watched or listed (its CRD may be absent)."""
    roles = [
        d
        for d in render(*MODES[mode])
        if d["kind"] in {"ClusterRole", "Role"} and not d["metadata"]["name"].endswith("-leader-election")
    ]
    assert roles
    for role in roles:
        verbs = {
            verb
            for rule in role["rules"]
            if "leaderworkerset.x-k8s.io" in rule["apiGroups"] and "leaderworkersets" in rule["resources"]
            for verb in rule["verbs"]
        }
        assert verbs == {"get", "create", "update", "delete"}, role["metadata"]


def test_the_operator_runs_as_its_cli_expects() -> None:
    """Every flag the Deployment passes is one `kvasir operator` accepts (parsed by the real CLI)."""
    from kvasir.cli import build_parser

    for values in MODES.values():
        operator = next(d for d in render(*values) if d["kind"] == "Deployment")
        container = operator["spec"]["template"]["spec"]["containers"][0]
        build_parser().parse_args(container["args"])  # exits on an unknown flag
        assert operator["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_prometheus_rule_is_the_generated_rules() -> None:
    rules = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    rendered = next(d for d in render(*MODES["everything-on"]) if d["kind"] == "PrometheusRule")
    assert rendered["spec"]["groups"] == rules["groups"]
    quiet = render(*MODES["everything-on"], "--set", "prometheusRule.absentAlerts=false")
    groups = next(d for d in quiet if d["kind"] == "PrometheusRule")["spec"]["groups"]
    exprs = [rule["expr"] for group in groups for rule in group["rules"]]
    assert not [e for e in exprs if e.startswith("absent(")] and len(exprs) == sum(
        len(g["rules"]) for g in rules["groups"]
    ) - sum(1 for g in rules["groups"] for r in g["rules"] if str(r["expr"]).startswith("absent("))


def test_dashboards_ship_as_sidecar_configmaps() -> None:
    maps = [d for d in render() if d["kind"] == "ConfigMap"]
    shipped = {key: value for cm in maps for key, value in cm["data"].items()}
    assert set(shipped) == {p.name for p in (REPO / "dashboards").glob("*.json")}
    for name, text in shipped.items():
        assert json.loads(text) == json.loads((REPO / "dashboards" / name).read_text())
    assert all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in maps)


@pytest.mark.parametrize(
    "values, field",
    [
        (["--set", "replicaCount=0"], "replicaCount"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "watch.namespaces={Team_A}"], "namespaces"),
        (["--set", "operator.scrapeTimeoutSeconds=-1"], "scrapeTimeoutSeconds"),
        (["--set", "metrics.podMonitor.interval=often"], "interval"),
        (["--set", "unknownKey=1"], "unknownKey"),
        (["--set", "operator.prometheusUrl=prometheus:9090"], "prometheusUrl"),
    ],
)
def test_bad_values_are_refused_by_the_schema(values: list[str], field: str) -> None:
    result = helm("template", "kvasir", str(CHART), *values, check=False)
    assert result.returncode != 0 and field in result.stderr, result.stderr


def test_two_operators_without_a_lease_are_refused() -> None:
    result = helm("template", "kvasir", str(CHART), "--set", "leaderElection.enabled=false", check=False)
    assert result.returncode != 0 and "replicaCount: 1" in result.stderr


def test_the_chart_ships_the_crd_unchanged() -> None:
    crd = "llmdeployments.inference.kvasir.dev.yaml"
    assert (CHART / "crds" / crd).read_text() == (REPO / "crds" / crd).read_text()


def test_deploy_manifests_are_the_default_render() -> None:
    """deploy/kvasir.yaml (for users without Helm) is what scripts/render-deploy.sh writes."""
    expected = subprocess.run(
        [str(REPO / "scripts" / "render-deploy.sh"), "--stdout"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": f"{Path(tool('helm')).parent}:/usr/bin:/bin"},
    ).stdout
    assert (REPO / "deploy" / "kvasir.yaml").read_text() == expected, "run scripts/render-deploy.sh"


def test_readme_lists_every_value() -> None:
    readme = (CHART / "README.md").read_text()

    def keys(values: dict[str, Any], prefix: str = "") -> list[str]:
        found = []
        for key, value in values.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and key != "resources":
                found += keys(value, f"{path}.")
            else:
                found.append(path)
        return found

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [key for key in keys(values) if f"`{key}`" not in readme]
    assert not missing, f"charts/kvasir/README.md does not list {missing}"


def _field_refs(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node["fieldRef"]] if isinstance(node.get("fieldRef"), dict) else []
        return found + [ref for value in node.values() for ref in _field_refs(value)]
    if isinstance(node, list):
        return [ref for item in node for ref in _field_refs(item)]
    return []


@pytest.mark.parametrize("mode", list(MODES))
def test_field_refs_name_their_api_version(mode: str) -> None:
    """The API server defaults `fieldRef.apiVersion` to v1. A manifest without it, applied
    client-side and then with `kubectl apply --server-side`, conflicts on `env[].valueFrom.fieldRef`
    (the two managers disagree on who owns the defaulted field), so the chart writes it out."""
    refs = [ref for doc in render(*MODES[mode]) for ref in _field_refs(doc)]
    assert refs, "the operator's Deployment passes its pod name and namespace through fieldRefs"
    assert all(ref.get("apiVersion") == "v1" for ref in refs), refs
