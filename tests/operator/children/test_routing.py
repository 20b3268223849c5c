"""The routing builders: an InferencePool over the deployment's pods, the stock endpoint picker
and Kvasir's router with the RBAC each needs, each valid against the Kubernetes schemas (the InferencePool against its shape)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvasir.observability import metric_names
from kvasir.operator import naming
from kvasir.operator.api.spec import EPP_IMAGE
from kvasir.operator.children.routing import (
    EPP_METRIC_FLAGS,
    build_epp_deployment,
    build_epp_rbac,
    build_epp_service,
    build_inference_pool,
    build_router_deployment,
    build_router_rbac,
    build_router_service,
    epp_selector,
    router_selector,
)

K8S_VERSION = kubernetes_validate.utils.latest_version()


def test_the_inference_pool_selects_the_model_pods_on_the_serving_port() -> None:
    pool = build_inference_pool("demo", "team-a", epp_service="demo-epp")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["spec"]["selector"] == {"matchLabels": naming.selector_labels("demo")}
    assert pool["spec"]["targetPorts"] == [{"number": naming.RUNTIME_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "demo-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    with pytest.raises(ValueError, match="failure_mode"):
        build_inference_pool("demo", "team-a", epp_service="e", failure_mode="Maybe")


def test_the_router_children_are_valid_kubernetes_objects() -> None:
    children = [
        *build_router_rbac("demo", "team-a"),
        build_router_deployment("demo", "team-a", image="ghcr.io/kvasir/runtime:0.1.0"),
        build_router_service("demo", "team-a"),
    ]
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
    kinds = [child["kind"] for child in children]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]


def test_the_router_lists_the_deployments_pods_and_is_never_one_of_them() -> None:
    deployment = build_router_deployment("demo", "team-a", image="img:1")
    pod = deployment["spec"]["template"]
    args = pod["spec"]["containers"][0]["args"]
    assert args[:4] == ["--deployment", "demo", "--namespace", "team-a"]
    model_selector = naming.selector_labels("demo").items()
    assert not model_selector <= pod["metadata"]["labels"].items()  # the model's Service never picks it
    assert router_selector("demo").items() <= pod["metadata"]["labels"].items()
    role = build_router_rbac("demo", "team-a")[1]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]  # all it does
    assert pod["spec"]["serviceAccountName"] == role["metadata"]["name"]
    # A drain never cut short: grace > preStop pause + drain timeout.
    assert pod["spec"]["terminationGracePeriodSeconds"] > 5 + int(args[args.index("--drain-timeout") + 1])


def test_the_router_reads_the_pods_adapter_lists_with_their_api_key() -> None:
    """With spec.server.apiKeySecretRef the model pods' /v1/models needs the key: the router gets it
    from the same Secret as `--backend-api-key`'s variable (the flag table's own name)."""
    from kvasir.operator.api.spec import parse_spec
    from kvasir.operator.children.manifests import build_children
    from kvasir.router.config import ROUTER_FLAGS

    def router_env(server: dict[str, Any]) -> Any:
        spec = parse_spec({"model": {"source": "/m"}, "routing": {"mode": "kvasir"}, "server": server})
        children = build_children("demo", "ns", spec, with_service_monitor=False)
        (router,) = [
            c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "demo-router"
        ]
        return router["spec"]["template"]["spec"]["containers"][0].get("env")

    (flag,) = [flag for flag in ROUTER_FLAGS if flag.dest == "backend_api_key"]
    secret = {"name": "keys", "key": "api"}
    assert router_env({"apiKeySecretRef": secret}) == [
        {"name": flag.env, "valueFrom": {"secretKeyRef": secret}}
    ]
    assert router_env({}) is None


def test_the_router_service_is_reached_as_the_model_service_would_be() -> None:
    from kvasir.operator.api.spec import parse_spec
    from kvasir.operator.children.manifests import build_children

    spec = parse_spec(
        {
            "model": {"source": "/m"},
            "service": {"type": "LoadBalancer", "port": 80, "annotations": {"lb": "internal"}},
            "runtime": {"image": "registry.example/kvasir:1", "imagePullSecrets": ["pull"]},
            "routing": {"mode": "kvasir", "router": {"replicas": 2}},
        }
    )
    by_name = {
        (m["kind"], m["metadata"]["name"]): m
        for m in build_children("demo", "ns", spec, with_service_monitor=False)
    }
    service = by_name["Service", "demo-router"]
    assert (service["spec"]["type"], service["spec"]["ports"][0]["port"]) == ("LoadBalancer", 80)
    assert service["metadata"]["annotations"] == {"lb": "internal"}
    deployment = by_name["Deployment", "demo-router"]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert pod["containers"][0]["image"] == "registry.example/kvasir:1"
    assert pod["imagePullSecrets"] == [{"name": "pull"}]
    # RBAC objects come before the Deployment whose pods use them.
    kinds = [kind for kind, name in by_name if name == "demo-router"]
    assert kinds.index("RoleBinding") < kinds.index("Deployment")


def test_rbac_children_are_owned_by_their_top_level_keys() -> None:
    """Roles and RoleBindings have no spec: their rules, roleRef and subjects are what the operator
    owns; a ServiceAccount's secrets stay the API server's, and no spec is invented for it."""
    from kvasir.operator.children.ownership import merge_into_live, up_to_date, with_record

    account, role, binding = build_router_rbac("demo", "team-a")
    live_role = with_record(role) | {"rules": []}
    assert not up_to_date(live_role, role)
    assert merge_into_live(live_role, role)["rules"] == role["rules"]
    assert up_to_date(with_record(role), role)
    live_binding = with_record(binding) | {"subjects": []}
    assert not up_to_date(live_binding, binding)
    assert merge_into_live(live_binding, binding)["subjects"] == binding["subjects"]
    live_account = with_record(account) | {"secrets": [{"name": "token"}]}
    assert up_to_date(live_account, account)
    merged = merge_into_live(live_account, account)
    assert merged["secrets"] == [{"name": "token"}] and "spec" not in merged


def test_the_picker_children_are_valid_kubernetes_objects() -> None:
    children = [
        *build_epp_rbac("demo", "team-a"),
        build_epp_deployment("demo", "team-a"),
        build_epp_service("demo", "team-a"),
    ]
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
        assert child["metadata"]["name"] == "demo-epp"
    assert [child["kind"] for child in children] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
    ]


def test_the_picker_reads_its_pool_and_kvasirs_metric_names() -> None:
    deployment = build_epp_deployment("demo", "team-a")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == EPP_IMAGE
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == "demo"
    assert args[args.index("--pool-namespace") + 1] == "team-a"
    assert args[args.index("--grpc-port") + 1] == "9002"
    # The picker's metric flags (vLLM's names by default) name the series the runtime exports.
    flags = dict(arg.split("=", 1) for arg in args if arg.endswith("-metric=" + arg.split("=")[-1]))
    assert set(EPP_METRIC_FLAGS) <= set(args)
    assert flags == {
        "--total-queued-requests-metric": "kvasir_requests_waiting",
        "--total-running-requests-metric": "kvasir_requests_running",
        "--kv-cache-usage-percentage-metric": "kvasir_kv_cache_usage_ratio",
        "--lora-info-metric": "kvasir_lora_requests_info",
        "--cache-info-metric": "kvasir_cache_config_info",
    }
    assert set(flags.values()) <= {metric.name for metric in metric_names.RUNTIME}
    assert {port["containerPort"] for port in container["ports"]} == {9002, 9003, 9090}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
    assert pod["metadata"]["labels"].items() >= epp_selector("demo").items()
    assert not naming.selector_labels("demo").items() <= pod["metadata"]["labels"].items()
    assert (
        build_epp_deployment("demo", "team-a", image="mirror/epp:v1")["spec"]["template"]["spec"][
            "containers"
        ][0]["image"]
        == "mirror/epp:v1"
    )


def test_the_picker_role_grants_only_reads_of_pods_pools_and_objectives() -> None:
    account, role, binding = build_epp_rbac("demo", "team-a")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    reads = ("get", "list", "watch")
    assert granted == {
        *(("", "pods", verb) for verb in reads),
        *(("inference.networking.k8s.io", "inferencepools", verb) for verb in reads),
        *(("inference.networking.x-k8s.io", "inferenceobjectives", verb) for verb in reads),
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "team-a"}
    ]
    assert (
        build_epp_deployment("demo", "team-a")["spec"]["template"]["spec"]["serviceAccountName"] == "demo-epp"
    )


def test_the_picker_service_exposes_grpc_on_the_pools_port() -> None:
    service = build_epp_service("demo", "team-a", port=9100)
    assert service["spec"]["selector"] == epp_selector("demo")
    (grpc,) = [port for port in service["spec"]["ports"] if port["name"] == "grpc"]
    assert (grpc["port"], grpc["targetPort"]) == (9100, "grpc")
    with pytest.raises(ValueError, match="port"):
        build_epp_service("demo", "team-a", port=0)
