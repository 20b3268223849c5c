"""Pure builders for routing an LLMDeployment's traffic: the Gateway API Inference Extension's
InferencePool over its pods, or Kvasir's router (ServiceAccount, Role and RoleBinding to list the
pods, Deployment, Service). Plain arguments in, manifest dicts out; the reconciler decides which
to write from `spec.routing` (children/manifests.py; docs/routing.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvasir.operator import naming
from kvasir.operator.children.deployment import PRESTOP_PAUSE_SECONDS, RUN_AS_USER

INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_VERSION = "v1"
EPP_PORT = 9002  # the endpoint picker's ext-proc gRPC port
FAILURE_MODES = ("FailClose", "FailOpen")
ROUTER_PORT = 8080
ROUTER_COMPONENT = "router"
ROUTER_DRAIN_SECONDS = 30


def router_name(name: str) -> str:
    """The router's children of LLMDeployment `name` (its Deployment, Service, account, role)."""
    return f"{name}-router"


def router_selector(name: str) -> dict[str, str]:
    """The router pods' labels: never matching the model pods' selector (`naming.selector_labels`)."""
    return {naming.LABEL_NAME: "kvasir-router", naming.LABEL_INSTANCE: name}


def _labels(name: str) -> dict[str, str]:
    return {
        **router_selector(name),
        naming.LABEL_COMPONENT: ROUTER_COMPONENT,
        naming.LABEL_PART_OF: "kvasir",
        naming.LABEL_MANAGED_BY: naming.MANAGER,
    }


def build_inference_pool(
    name: str, namespace: str, *, epp_service: str, epp_port: int = EPP_PORT, failure_mode: str = "FailClose"
) -> dict[str, Any]:
    """An InferencePool selecting the deployment's pods on the serving port; the picker named by
    `epp_service` chooses among the Ready ones."""
    if failure_mode not in FAILURE_MODES:
        raise ValueError(f"failure_mode must be one of {', '.join(FAILURE_MODES)}, got {failure_mode!r}")
    if not 1 <= epp_port <= 65535:
        raise ValueError(f"epp_port must be a port number, got {epp_port}")
    return {
        "apiVersion": f"{INFERENCE_GROUP}/{INFERENCE_VERSION}",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(naming.selector_labels(name))},
        "spec": {
            "selector": {"matchLabels": naming.selector_labels(name)},
            "targetPorts": [{"number": naming.RUNTIME_PORT}],
            "endpointPickerRef": {
                "name": epp_service,
                "port": {"number": epp_port},
                "failureMode": failure_mode,
            },
        },
    }


def build_router_rbac(name: str, namespace: str) -> list[dict[str, Any]]:
    """The router's ServiceAccount, a Role to list the namespace's pods, and their binding. Only
    `list`: the router lists the pods every few seconds and never gets or watches one, and a Role
    may grant only what the operator holds itself (RBAC's escalation check)."""
    router = router_name(name)
    metadata = {"name": router, "namespace": namespace, "labels": _labels(name)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(metadata)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(metadata),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(metadata),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router},
            "subjects": [{"kind": "ServiceAccount", "name": router, "namespace": namespace}],
        },
    ]


def build_router_deployment(
    name: str,
    namespace: str,
    *,
    image: str,
    image_pull_policy: str = "IfNotPresent",
    image_pull_secrets: tuple[str, ...] = (),
    replicas: int = 1,
    extra_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`kvasir router --deployment NAME` as a Deployment (the runtime image carries the command)."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    router = router_name(name)
    port = {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}
    container = {
        "name": ROUTER_COMPONENT,
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": ["kvasir", "router"],
        "args": _router_args(name, namespace, extra_args),
        "ports": [port],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_PAUSE_SECONDS}}},
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod: dict[str, Any] = {
        "serviceAccountName": router,
        "containers": [container],
        "terminationGracePeriodSeconds": PRESTOP_PAUSE_SECONDS + ROUTER_DRAIN_SECONDS + 10,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER},
    }
    if image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router, "namespace": namespace, "labels": _labels(name)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": router_selector(name)},
            "template": {"metadata": {"labels": _labels(name)}, "spec": pod},
        },
    }


def _router_args(name: str, namespace: str, extra: tuple[str, ...]) -> list[str]:
    return [
        "--deployment", name, "--namespace", namespace, "--host", "0.0.0.0",
        "--port", str(ROUTER_PORT), "--backend-port", str(naming.RUNTIME_PORT),
        "--drain-timeout", str(ROUTER_DRAIN_SECONDS), *extra,
    ]  # fmt: skip


def build_router_service(
    name: str,
    namespace: str,
    *,
    port: int = 80,
    service_type: str = "ClusterIP",
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The router's Service: what `status.endpoint` points at when the router is on. It takes the
    endpoint Service's type, port and annotations (`spec.service`): clients reach the router as
    they would reach the pods."""
    metadata: dict[str, Any] = {"name": router_name(name), "namespace": namespace, "labels": _labels(name)}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": service_type,
            "selector": router_selector(name),
            "ports": [
                {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
            ],
        },
    }
