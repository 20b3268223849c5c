"""Pure builders for routing an LLMDeployment's traffic: the Gateway API Inference Extension's
InferencePool over its pods and, unless the user names their own, the stock endpoint picker (EPP)
that chooses among them; or Kvasir's router. Each deployed component gets a ServiceAccount, a Role
with exactly what it reads, their RoleBinding, a Deployment and a Service. Plain arguments in, manifest dicts out; the reconciler decides which
to write from `spec.routing` (children/manifests.py; docs/routing.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvasir.observability import metric_names as m
from kvasir.operator import naming
from kvasir.operator.api.spec import EPP_IMAGE, SecretKeyRef
from kvasir.operator.children.deployment import PRESTOP_PAUSE_SECONDS, RUN_AS_USER

INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_VERSION = "v1"
EPP_PORT = 9002  # the endpoint picker's ext-proc gRPC port
EPP_HEALTH_PORT = 9003  # its gRPC health service (probes)
EPP_METRICS_PORT = 9090
EPP_COMPONENT = "endpoint-picker"
# Point the picker at Kvasir's series instead of vLLM's names (docs/routing.md has the table).
EPP_METRIC_FLAGS = (
    f"--total-queued-requests-metric={m.WAITING.name}",
    f"--total-running-requests-metric={m.RUNNING.name}",
    f"--kv-cache-usage-percentage-metric={m.KV_USAGE.name}",
    f"--lora-info-metric={m.LORA_INFO.name}",
    f"--cache-info-metric={m.CACHE_CONFIG_INFO.name}",
)
# What the picker reads in its namespace (the upstream inferencepool chart's Role): the pods, its
# pool, and the InferenceObjectives it watches (alpha API group). A Role may grant only what the
# operator holds itself (RBAC's escalation check), so the chart's rules hold these too.
EPP_RULES = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [INFERENCE_GROUP], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["inference.networking.x-k8s.io"],
        "resources": ["inferenceobjectives"],
        "verbs": ["get", "list", "watch"],
    },
)
ROUTER_RULES = ({"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},)
# The router is the activator of a deployment that scales to zero: on its first held request it
# reads the scale subresource of its own LLMDeployment and, at 0, writes 1 (get and patch, that one
# object only). The operator holds both verbs on every llmdeployments/scale (the chart's rules).
ROUTER_WAKE_VERBS = ("get", "patch")
FAILURE_MODES = ("FailClose", "FailOpen")
ROUTER_PORT = 8080
ROUTER_COMPONENT = "router"
ROUTER_DRAIN_SECONDS = 30
# `kvasir router --backend-api-key`'s variable: the router reads the model pods' /v1/models (the
# adapters each serves) with the key the pods require (the operator never imports the router).
ROUTER_BACKEND_KEY_ENV = "KVASIR_BACKEND_API_KEY"


def router_name(name: str) -> str:
    """The router's children of LLMDeployment `name` (its Deployment, Service, account, role)."""
    return f"{name}-router"


def router_selector(name: str) -> dict[str, str]:
    """The router pods' labels: never matching the model pods' selector (`naming.selector_labels`)."""
    return {naming.LABEL_NAME: "kvasir-router", naming.LABEL_INSTANCE: name}


def epp_name(name: str) -> str:
    """The endpoint picker's children of LLMDeployment `name` (when the operator deploys it)."""
    return f"{name}-epp"


def epp_selector(name: str) -> dict[str, str]:
    """The picker pods' labels: never matching the model pods' or the router's."""
    return {naming.LABEL_NAME: "kvasir-epp", naming.LABEL_INSTANCE: name}


def _labels(name: str) -> dict[str, str]:
    return _component_labels(router_selector(name), ROUTER_COMPONENT)


def _epp_labels(name: str) -> dict[str, str]:
    return _component_labels(epp_selector(name), EPP_COMPONENT)


def _component_labels(selector: dict[str, str], component: str) -> dict[str, str]:
    return {
        **selector,
        naming.LABEL_COMPONENT: component,
        naming.LABEL_PART_OF: "kvasir",
        naming.LABEL_MANAGED_BY: naming.MANAGER,
    }


def _hardened_container() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def build_inference_pool(
    name: str,
    namespace: str,
    *,
    epp_service: str,
    epp_port: int = EPP_PORT,
    failure_mode: str = "FailClose",
    multi_node: bool = False,
) -> dict[str, Any]:
    """An InferencePool selecting the deployment's serving pods (a group's leaders only) on the
    serving port; the picker named by `epp_service` chooses among the Ready ones."""
    if failure_mode not in FAILURE_MODES:
        raise ValueError(f"failure_mode must be one of {', '.join(FAILURE_MODES)}, got {failure_mode!r}")
    if not 1 <= epp_port <= 65535:
        raise ValueError(f"epp_port must be a port number, got {epp_port}")
    return {
        "apiVersion": f"{INFERENCE_GROUP}/{INFERENCE_VERSION}",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(naming.selector_labels(name))},
        "spec": {
            "selector": {"matchLabels": naming.serving_selector(name, multi_node)},
            "targetPorts": [{"number": naming.RUNTIME_PORT}],
            "endpointPickerRef": {
                "name": epp_service,
                "port": {"number": epp_port},
                "failureMode": failure_mode,
            },
        },
    }


def build_router_rbac(name: str, namespace: str, *, wakes: bool = False) -> list[dict[str, Any]]:
    """The router's ServiceAccount, a Role to list the namespace's pods, and their binding. Only
    `list`: the router lists the pods every few seconds and never gets or watches one, and a Role
    may grant only what the operator holds itself (RBAC's escalation check). `wakes` (minReplicas
    0): also get and patch the scale subresource of LLMDeployment `name`, to wake it from zero."""
    rules: tuple[dict[str, list[str]], ...] = ROUTER_RULES
    if wakes:
        wake = {
            "apiGroups": [naming.GROUP],
            "resources": [f"{naming.PLURAL}/scale"],
            "resourceNames": [name],
            "verbs": list(ROUTER_WAKE_VERBS),
        }
        rules = (*ROUTER_RULES, wake)
    return _account_role_binding(router_name(name), namespace, _labels(name), rules)


def build_epp_rbac(name: str, namespace: str) -> list[dict[str, Any]]:
    """The endpoint picker's ServiceAccount, its Role (`EPP_RULES`) and their binding."""
    return _account_role_binding(epp_name(name), namespace, _epp_labels(name), EPP_RULES)


def _account_role_binding(
    account: str, namespace: str, labels: dict[str, str], rules: tuple[dict[str, list[str]], ...]
) -> list[dict[str, Any]]:
    metadata = {"name": account, "namespace": namespace, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(metadata)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(metadata),
            "rules": [{key: list(values) for key, values in rule.items()} for rule in rules],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(metadata),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
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
    backend_api_key: SecretKeyRef | None = None,
    hold: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """`kvasir router --deployment NAME` as a Deployment (the runtime image carries the command);
    `backend_api_key`: the Secret key of the model pods' API key (spec.server.apiKeySecretRef);
    `hold` (minReplicas 0): (seconds, requests) the router holds while no replica is ready."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    router = router_name(name)
    port = {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}
    container = {
        "name": ROUTER_COMPONENT,
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": ["kvasir", "router"],
        "args": _router_args(name, namespace, (*_hold_args(hold), *extra_args)),
        "ports": [port],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_PAUSE_SECONDS}}},
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": _hardened_container(),
    }
    if backend_api_key is not None:
        ref = {"name": backend_api_key.name, "key": backend_api_key.key}
        container["env"] = [{"name": ROUTER_BACKEND_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}]
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


def _hold_args(hold: tuple[int, int] | None) -> tuple[str, ...]:
    if hold is None:
        return ()
    seconds, requests = hold
    return ("--hold-timeout", str(seconds), "--max-held-requests", str(requests))


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


def build_epp_deployment(name: str, namespace: str, *, image: str = EPP_IMAGE) -> dict[str, Any]:
    """The stock endpoint picker for the InferencePool `name`, reading Kvasir's metric names. One
    replica: without leader election every replica would serve with its own view of the pods.
    `--metrics-endpoint-auth=false`: authenticating its /metrics needs cluster-wide TokenReviews,
    which a namespaced Role cannot grant."""
    picker = epp_name(name)
    grpc_health = {"port": EPP_HEALTH_PORT, "service": "inference-extension"}
    container = {
        "name": "epp",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": _epp_args(name, namespace),
        "ports": [
            {"name": "grpc", "containerPort": EPP_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {"grpc": grpc_health, "initialDelaySeconds": 5, "periodSeconds": 10},
        "livenessProbe": {"grpc": grpc_health, "initialDelaySeconds": 5, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": _hardened_container(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": picker, "namespace": namespace, "labels": _epp_labels(name)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": epp_selector(name)},
            "template": {
                "metadata": {"labels": _epp_labels(name)},
                "spec": {
                    "serviceAccountName": picker,
                    "containers": [container],
                    # The picker's image runs as a non-root user of its own (distroless nonroot).
                    "securityContext": {"runAsNonRoot": True},
                },
            },
        },
    }


def _epp_args(name: str, namespace: str) -> list[str]:
    return [
        "--pool-name", name, "--pool-namespace", namespace,
        "--grpc-port", str(EPP_PORT), "--grpc-health-port", str(EPP_HEALTH_PORT),
        "--metrics-port", str(EPP_METRICS_PORT), "--metrics-endpoint-auth=false",
        *EPP_METRIC_FLAGS,
    ]  # fmt: skip


def build_epp_service(name: str, namespace: str, *, port: int = EPP_PORT) -> dict[str, Any]:
    """The picker's Service: what the InferencePool's endpointPickerRef names (`port`, gRPC)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be a port number, got {port}")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": epp_name(name), "namespace": namespace, "labels": _epp_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": epp_selector(name),
            "ports": [
                {
                    "name": "grpc",
                    "port": port,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
                {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }
