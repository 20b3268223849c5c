"""The harness itself on a real control plane: authentication and authorisation with the audit log,
and pods going through the real Deployment and ReplicaSet controllers, scheduler and garbage
collector to the node agent."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.control_plane import ControlPlane
from tests.e2e.node_agent import NODE_NAME, NodeAgent
from tests.e2e.polling import wait_for

PAUSE = "registry.k8s.io/pause:3.10"
GC = "system:serviceaccount:kube-system:generic-garbage-collector"


def _deployment(name: str, namespace: str, replicas: int) -> str:
    labels = {"app": name}
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "pause", "image": PAUSE}]},
                },
            },
        }
    )


def _pod(name: str, namespace: str, gpus: int) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "containers": [
                    {"name": "main", "image": PAUSE, "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
                ]
            },
        }
    )


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in obj["status"].get("conditions") or [] if c["type"] == kind)


def _forbidden_in_audit(control_plane: ControlPlane, user: str, resource: str) -> list[dict[str, Any]]:
    return [
        event
        for event in control_plane.audit_events(user)
        if event["responseStatus"]["code"] == 403
        and (event.get("objectRef") or {}).get("resource") == resource
    ]


def test_anonymous_request_is_forbidden_and_audited(control_plane: ControlPlane) -> None:
    response = httpx.get(
        f"{control_plane.server}/api/v1/namespaces/default/secrets",
        verify=control_plane.access.ssl_context(),
        timeout=10,
    )
    assert response.status_code == 403
    status = response.json()
    assert status["reason"] == "Forbidden"
    assert 'User "system:anonymous" cannot list resource "secrets"' in status["message"]
    if control_plane.audit_log is not None:
        wait_for(lambda: _forbidden_in_audit(control_plane, "system:anonymous", "secrets"), "the audit event")


def test_service_account_without_grants_is_forbidden_and_audited(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    control_plane.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "nobody", tmp_path / "nobody.kubeconfig")
    user = f"system:serviceaccount:{namespace}:nobody"
    # Authenticated (the TokenRequest token works: SelfSubjectReview is open to everyone) ...
    whoami = control_plane.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig)
    assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == user
    # ... but not authorised.
    refused = control_plane.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert refused.returncode != 0
    assert f'User "{user}" cannot list resource "pods"' in refused.stderr
    if control_plane.audit_log is not None:
        events = wait_for(lambda: _forbidden_in_audit(control_plane, user, "pods"), "the audit event")
        assert events[0]["verb"] == "list"
        assert events[0]["objectRef"]["namespace"] == namespace


@pytest.mark.usefixtures("controllers")
def test_deployment_gets_ready_pods_from_the_real_controllers(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=_deployment("pause", namespace, 2))
    control_plane.kubectl("rollout", "status", "deployment/pause", "-n", namespace, "--timeout=60s")

    pods = control_plane.kubectl_json("get", "pods", "-n", namespace, "-l", "app=pause")["items"]
    assert len(pods) == 2
    ips = set()
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE_NAME
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
        assert pod["status"]["phase"] == "Running"
        assert _condition(pod, "Ready")["status"] == "True"
        assert _condition(pod, "PodScheduled")["status"] == "True"
        (container,) = pod["status"]["containerStatuses"]
        assert container["ready"] and container["started"] and "running" in container["state"]
        ip = ipaddress.ip_address(pod["status"]["podIP"])
        assert ip.is_loopback and str(ip) != "127.0.0.1"
        ips.add(ip)
    assert len(ips) == 2


@pytest.mark.usefixtures("controllers", "node_agent")
def test_deleting_a_deployment_removes_replicaset_and_pods_through_the_garbage_collector(
    control_plane: ControlPlane, namespace: str
) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=_deployment("doomed", namespace, 2))
    control_plane.kubectl("rollout", "status", "deployment/doomed", "-n", namespace, "--timeout=60s")
    replicasets = control_plane.kubectl_json("get", "replicasets", "-n", namespace)["items"]
    pods = control_plane.kubectl_json("get", "pods", "-n", namespace)["items"]
    assert len(replicasets) == 1 and len(pods) == 2

    control_plane.kubectl("delete", "deployment", "doomed", "-n", namespace, "--timeout=60s")

    def dependents() -> str:
        listed = control_plane.kubectl("get", "replicasets,pods", "-n", namespace, "-o", "name").stdout
        return "gone" if not listed.strip() else ""

    wait_for(dependents, "the ReplicaSet and its pods to be deleted")
    if control_plane.audit_log is not None:
        # The deletes came from the garbage collector, acting as its own ServiceAccount.
        deleted = {
            (event["objectRef"]["resource"], event["objectRef"]["name"])
            for event in control_plane.audit_events(GC)
            if event["verb"] == "delete" and event["objectRef"].get("namespace") == namespace
        }
        assert ("replicasets", replicasets[0]["metadata"]["name"]) in deleted
        assert {("pods", pod["metadata"]["name"]) for pod in pods} <= deleted


@pytest.mark.usefixtures("controllers", "node_agent")
def test_pod_asking_for_more_gpus_than_the_node_has_is_unschedulable(
    control_plane: ControlPlane, namespace: str
) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=_pod("greedy", namespace, gpus=5))
    control_plane.kubectl(
        "wait", "--for=condition=PodScheduled=false", "pod/greedy", "-n", namespace, "--timeout=60s"
    )
    pod = control_plane.kubectl_json("get", "pod", "greedy", "-n", namespace)
    scheduled = _condition(pod, "PodScheduled")
    assert scheduled["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in scheduled["message"]
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]

    # The node does advertise its 4 GPUs: a pod taking all of them runs.
    control_plane.kubectl("apply", "-f", "-", stdin=_pod("all-gpus", namespace, gpus=4))
    control_plane.kubectl("wait", "--for=condition=Ready", "pod/all-gpus", "-n", namespace, "--timeout=60s")
    control_plane.kubectl("delete", "pod", "all-gpus", "-n", namespace, "--timeout=60s")
