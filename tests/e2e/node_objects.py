"""The node agent's own objects: its Node (capacity, Ready condition, addresses) and its Lease in
kube-node-lease, the heartbeat the node lifecycle controller watches."""

from __future__ import annotations

import datetime
from typing import Any

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40  # the kubelet's default; the agent renews every 10 s, a quarter of it, as kubelets do


def now() -> str:
    """A Kubernetes `Time`: seconds, UTC."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """A Kubernetes `MicroTime` (Lease renewTime)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def capacity(gpus: int) -> dict[str, str]:
    return {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(gpus),
    }


def node_status(gpus: int, host_ip: str, name: str, kubelet_version: str) -> dict[str, Any]:
    """The status a healthy kubelet posts: no pressure, Ready, everything allocatable."""
    stamp = now()

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": stamp,
        }

    return {
        "capacity": capacity(gpus),
        "allocatable": capacity(gpus),
        "conditions": [
            condition(
                "MemoryPressure",
                "False",
                "KubeletHasSufficientMemory",
                "kubelet has sufficient memory available",
            ),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            condition(
                "PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"
            ),
            condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        ],
        "addresses": [{"type": "InternalIP", "address": host_ip}, {"type": "Hostname", "address": name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "machineID": "kvasir-e2e",
            "systemUUID": "kvasir-e2e",
            "bootID": "kvasir-e2e",
            "kernelVersion": "",
            "osImage": "kvasir e2e node agent",
            "containerRuntimeVersion": "kvasir-e2e://0",
            "kubeletVersion": kubelet_version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


def node_manifest(name: str, gpus: int, host_ip: str, kubelet_version: str) -> dict[str, Any]:
    """The Node a kubelet registers (with its status: registration posts both at once)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
        "spec": {},
        "status": node_status(gpus, host_ip, name, kubelet_version),
    }


def lease_manifest(node: dict[str, Any]) -> dict[str, Any]:
    """The node's Lease, owned by the Node as the kubelet makes it (deleted with the Node)."""
    name = node["metadata"]["name"]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": LEASE_NAMESPACE,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
            ],
        },
        "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()},
    }
