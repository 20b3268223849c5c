"""All children of one LLMDeployment, in apply order; shared by the reconciler and `kvasir render`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir.operator.api.spec import EPP_IMAGE, EndpointPickerSpec, LLMDeploymentSpec
from kvasir.operator.children.companions import (
    build_pod_disruption_budget,
    build_service,
    build_service_monitor,
)
from kvasir.operator.children.deployment import build_deployment
from kvasir.operator.children.leaderworkerset import LWS_GROUP, LWS_VERSION, build_leader_worker_set
from kvasir.operator.children.lora import aliases_json, build_lora_config_map, lora_config_map_name
from kvasir.operator.children.routing import (
    INFERENCE_GROUP,
    INFERENCE_VERSION,
    build_epp_deployment,
    build_epp_rbac,
    build_epp_service,
    build_inference_pool,
    build_router_deployment,
    build_router_rbac,
    build_router_service,
    epp_name,
    router_name,
)


@dataclass(frozen=True)
class ChildKind:
    """API coordinates of one kind of child: enough to build its URL and to name it in RBAC."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


DEPLOYMENTS = ChildKind("apps", "v1", "deployments", "Deployment")
SERVICES = ChildKind("", "v1", "services", "Service")
PDBS = ChildKind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
SERVICE_MONITORS = ChildKind("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor")
SERVICE_ACCOUNTS = ChildKind("", "v1", "serviceaccounts", "ServiceAccount")
ROLES = ChildKind("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDINGS = ChildKind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
INFERENCE_POOLS = ChildKind(INFERENCE_GROUP, INFERENCE_VERSION, "inferencepools", "InferencePool")
CONFIG_MAPS = ChildKind("", "v1", "configmaps", "ConfigMap")
LEADER_WORKER_SETS = ChildKind(LWS_GROUP, LWS_VERSION, "leaderworkersets", "LeaderWorkerSet")
ALL_KINDS = (
    CONFIG_MAPS,
    DEPLOYMENTS,
    LEADER_WORKER_SETS,
    SERVICES,
    PDBS,
    SERVICE_MONITORS,
    SERVICE_ACCOUNTS,
    ROLES,
    ROLE_BINDINGS,
    INFERENCE_POOLS,
)


def kind_of(manifest: dict[str, Any]) -> ChildKind:
    """The ChildKind of a manifest built by this module."""
    for child in ALL_KINDS:
        if child.kind == manifest["kind"] and child.api_version == manifest["apiVersion"]:
            return child
    raise ValueError(f"not a child kind: {manifest['apiVersion']} {manifest['kind']}")


@dataclass(frozen=True)
class OptionalChild:
    """A child that some specs (or clusters) have and others not: which kind, under which name."""

    kind: ChildKind
    name: str


def optional_children(name: str) -> tuple[OptionalChild, ...]:
    """Every child a spec can stop wanting: when `spec.monitoring`, `spec.routing` or
    `spec.parallelism.nodes` changes, the reconciler deletes those of this list the new spec no
    longer builds (the model's pods run in a Deployment or, multi-node, in a LeaderWorkerSet)."""
    deployed = (router_name(name), epp_name(name))  # the router's and the endpoint picker's
    return (
        OptionalChild(DEPLOYMENTS, name),
        OptionalChild(LEADER_WORKER_SETS, name),
        OptionalChild(CONFIG_MAPS, lora_config_map_name(name)),
        OptionalChild(SERVICE_MONITORS, name),
        *(
            OptionalChild(kind, component)
            for component in deployed
            for kind in (SERVICES, DEPLOYMENTS, ROLE_BINDINGS, ROLES, SERVICE_ACCOUNTS)
        ),
        OptionalChild(INFERENCE_POOLS, name),
    )


def build_children(
    name: str,
    namespace: str,
    spec: LLMDeploymentSpec,
    *,
    with_service_monitor: bool,
    with_inference_pool: bool = True,
    with_leader_worker_set: bool = True,
) -> list[dict[str, Any]]:
    """The manifests for one LLMDeployment: the model's pods in a Deployment, or for a multi-node
    spec in a LeaderWorkerSet when asked for (its CRD is served), else in nothing: a group cannot
    be half-built from a Deployment. The ServiceMonitor only when asked for and enabled;
    the router's children with routing mode kvasir; the InferencePool with mode gateway, when
    asked for (the operator asks when its CRD is served), and with it the stock endpoint picker's
    children unless `spec.routing.endpointPicker.service` names the user's own."""
    # spec.lora's ConfigMap before the Deployment: its pods mount it.
    children = [build_lora_config_map(name, namespace, spec)] if spec.lora else []
    if not spec.multi_node:
        children.append(build_deployment(name, namespace, spec))
    elif with_leader_worker_set:
        children.append(build_leader_worker_set(name, namespace, spec))
    children += [
        build_service(name, namespace, spec),
        build_pod_disruption_budget(name, namespace, spec),
    ]
    if with_service_monitor and spec.monitoring.enabled:
        children.append(build_service_monitor(name, namespace, spec))
    routing = spec.routing
    if routing.mode == "kvasir":
        # RBAC before the Deployment: its pods start with an account that may list the pods.
        policy = spec.autoscaling
        zero = policy is not None and policy.min_replicas == 0
        children += build_router_rbac(name, namespace, wakes=zero)
        children.append(
            build_router_deployment(
                name,
                namespace,
                image=spec.runtime.image,
                image_pull_policy=spec.runtime.image_pull_policy,
                image_pull_secrets=spec.runtime.image_pull_secrets,
                replicas=routing.router.replicas,
                extra_args=("--lora-aliases", aliases_json(spec)) if spec.lora_aliases else (),
                backend_api_key=spec.server.api_key_secret,
                hold=(policy.hold_seconds, policy.max_held) if zero and policy is not None else None,
            )
        )
        children.append(
            build_router_service(
                name,
                namespace,
                port=spec.service.port,
                service_type=spec.service.type,
                annotations=spec.service.annotations,
            )
        )
    elif routing.mode == "gateway" and with_inference_pool:
        picker = routing.endpoint_picker or EndpointPickerSpec()
        if picker.service is None:
            # No picker of the user's: the stock one, for this pool alone (as KServe does).
            children += build_epp_rbac(name, namespace)
            children.append(build_epp_deployment(name, namespace, image=picker.image or EPP_IMAGE))
            children.append(build_epp_service(name, namespace, port=picker.port))
        children.append(
            build_inference_pool(
                name,
                namespace,
                epp_service=picker.service or epp_name(name),
                epp_port=picker.port,
                failure_mode=picker.failure_mode,
                multi_node=spec.multi_node,
            )
        )
    return children


def owner_reference(parent: dict[str, Any]) -> dict[str, Any]:
    """A controller reference to the parent: garbage collection deletes the child with it."""
    meta = parent["metadata"]
    return {
        "apiVersion": parent.get("apiVersion", ""),
        "kind": parent.get("kind", ""),
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def adopt(children: list[dict[str, Any]], parent: dict[str, Any]) -> None:
    """Make `parent` the controller of every child (in place; children are fresh builder output)."""
    reference = owner_reference(parent)
    for child in children:
        child["metadata"]["ownerReferences"] = [dict(reference)]
