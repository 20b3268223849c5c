"""Pure builders of the Deployment's companions: the endpoint Service, the PDB and the ServiceMonitor."""

from __future__ import annotations

from typing import Any

from kvasir.operator import naming
from kvasir.operator.api.spec import LLMDeploymentSpec

MONITORING_GROUP = "monitoring.coreos.com"
MONITORING_VERSION = "v1"


def _metadata(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": naming.common_labels(name, spec.runtime.image)}


def build_service(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The v1 Service in front of the ready serving pods: the OpenAI-compatible endpoint."""
    metadata = _metadata(name, namespace, spec)
    if spec.service.annotations:
        metadata["annotations"] = dict(spec.service.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": spec.service.type,
            # A multi-node group answers through its leader only.
            "selector": naming.serving_selector(name, spec.multi_node),
            "ports": [
                {
                    "name": naming.RUNTIME_PORT_NAME,
                    "port": spec.service.port,
                    "targetPort": naming.RUNTIME_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def build_pod_disruption_budget(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """A policy/v1 PDB: voluntary disruptions (drains, upgrades) take at most one pod at a time (of
    a multi-node group too: every pod of it, workers included, carries the selector's labels)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, spec),
        "spec": {
            # maxUnavailable rather than minAvailable: a single-replica deployment must not block
            # node drains forever; with more replicas the fleet never loses more than one at once.
            "maxUnavailable": 1,
            "selector": {"matchLabels": naming.selector_labels(name)},
            # A pod that never became ready (stuck loading) serves nothing: let drains evict it.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_service_monitor(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """A Prometheus Operator ServiceMonitor scraping every pod's /metrics through the Service."""
    return {
        "apiVersion": f"{MONITORING_GROUP}/{MONITORING_VERSION}",
        "kind": "ServiceMonitor",
        "metadata": _metadata(name, namespace, spec),
        "spec": {
            "selector": {"matchLabels": naming.selector_labels(name)},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [
                {
                    "port": naming.RUNTIME_PORT_NAME,
                    "path": naming.METRICS_PATH,
                    "interval": spec.monitoring.interval,
                }
            ],
        },
    }
