"""All children of one LLMDeployment, in apply order; shared by the reconciler and `kvasir render`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir.operator.api.spec import LLMDeploymentSpec
from kvasir.operator.children.companions import (
    build_pod_disruption_budget,
    build_service,
    build_service_monitor,
)
from kvasir.operator.children.deployment import build_deployment


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
ALL_KINDS = (DEPLOYMENTS, SERVICES, PDBS, SERVICE_MONITORS)


def kind_of(manifest: dict[str, Any]) -> ChildKind:
    """The ChildKind of a manifest built by this module."""
    for child in ALL_KINDS:
        if child.kind == manifest["kind"] and child.api_version == manifest["apiVersion"]:
            return child
    raise ValueError(f"not a child kind: {manifest['apiVersion']} {manifest['kind']}")


def build_children(
    name: str, namespace: str, spec: LLMDeploymentSpec, *, with_service_monitor: bool
) -> list[dict[str, Any]]:
    """The manifests for one LLMDeployment; the ServiceMonitor only when asked for and enabled."""
    children = [
        build_deployment(name, namespace, spec),
        build_service(name, namespace, spec),
        build_pod_disruption_budget(name, namespace, spec),
    ]
    if with_service_monitor and spec.monitoring.enabled:
        children.append(build_service_monitor(name, namespace, spec))
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
