"""Scale to zero on a real control plane: an LLMDeployment with `minReplicas: 0` sits at zero
(ScaledToZero True); the router's activation, sent as the router sends it (GET the scale
subresource, PATCH replicas 1 with its resourceVersion, under the router's own ServiceAccount
and the Role the operator wrote for it), brings the Deployment to one replica. The time from
the PATCH to the operator's write of the Deployment is read off the API server's audit log and
printed (the goal: within 1 s). A write with a stale resourceVersion, as the autoscaler's
scale-down would be after a wake, is refused with 409."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.control_plane import ControlPlane, KubectlError
from tests.e2e.kvasir_release import REPO, Release, condition, status_where
from tests.e2e.node_agent import NodeAgent
from tests.e2e.polling import wait_for

MINIMAL = REPO / "crds" / "samples" / "minimal.yaml"

pytestmark = pytest.mark.slow


def _at_zero(namespace: str) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(MINIMAL.read_text())
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"].update(
        replicas=0,
        resources={"gpus": 0, "cpu": "1", "memory": "2Gi"},
        routing={"mode": "kvasir"},
        autoscaling={
            "minReplicas": 0,
            "maxReplicas": 2,
            "windows": {"intervalSeconds": 2},
            "scaleToZero": {"idleSeconds": 60, "holdSeconds": 120, "maxHeld": 10},
        },
    )
    return manifest


def _time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00")).timestamp()


def test_the_routers_activation_wakes_a_deployment_at_zero(
    control_plane: ControlPlane, release: Release, node_agent: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(_at_zero(namespace)))
    status_where(
        control_plane,
        release,
        namespace,
        "smollm2",
        "ScaledToZero True",
        lambda obj: condition(obj, "ScaledToZero").get("reason") == "Idle",
    )

    def deployment() -> dict[str, Any] | None:
        found = control_plane.kubectl(
            "get", "deployment", "smollm2", "-n", namespace, "-o", "json", check=False
        )
        return json.loads(found.stdout) if found.returncode == 0 else None

    assert wait_for(deployment, "the model's Deployment", 60)["spec"]["replicas"] == 0
    role = wait_for(
        lambda: control_plane.kubectl_json("get", "role", "smollm2-router", "-n", namespace),
        "the router's Role",
        60,
    )
    assert {"resources": ["llmdeployments/scale"], "resourceNames": ["smollm2"]}.items() <= role["rules"][
        -1
    ].items()

    # The router's activation, under the router's own ServiceAccount.
    router = control_plane.service_account_kubeconfig(
        namespace, "smollm2-router", tmp_path / "router.kubeconfig"
    )
    scale = json.loads(
        control_plane.kubectl(
            "get", "--raw", f"/apis/inference.kvasir.dev/v1alpha1/namespaces/{namespace}/llmdeployments/smollm2/scale",
            kubeconfig=router,
        ).stdout
    )  # fmt: skip
    assert scale["spec"].get("replicas", 0) == 0
    stale = scale["metadata"]["resourceVersion"]
    wake = {"metadata": {"resourceVersion": stale}, "spec": {"replicas": 1}}
    control_plane.kubectl(
        "patch", "llmd", "smollm2", "-n", namespace, "--subresource=scale", "--type=merge", "-p", json.dumps(wake),
        kubeconfig=router,
    )  # fmt: skip
    # The router may not touch any other deployment's scale.
    other = control_plane.kubectl(
        "auth", "can-i", "patch", "llmdeployments/other", "--subresource=scale", "-n", namespace,
        kubeconfig=router, check=False,
    )  # fmt: skip
    assert other.stdout.strip() == "no"

    woken = wait_for(lambda: (d := deployment()) and d["spec"]["replicas"] == 1 and d, "one replica", 60)
    assert woken["spec"]["replicas"] == 1
    status_where(
        control_plane,
        release,
        namespace,
        "smollm2",
        "ScaledToZero False",
        lambda obj: condition(obj, "ScaledToZero").get("status") == "False",
    )

    # From the activation to the operator's write of the Deployment, on the API server's clock.
    events = control_plane.audit_events()
    patch = next(
        e
        for e in events
        if e["verb"] == "patch"
        and (e.get("objectRef") or {}).get("subresource") == "scale"
        and e["objectRef"].get("namespace") == namespace
        and e["user"]["username"].endswith(":smollm2-router")
    )
    written = [
        e
        for e in release.operator_requests()
        if e["verb"] in {"update", "patch"}
        and (e.get("objectRef") or {}).get("resource") == "deployments"
        and e["objectRef"].get("name") == "smollm2"
        and e["objectRef"].get("namespace") == namespace
        and not e["objectRef"].get("subresource")
        and _time(e) >= _time(patch)
    ]
    assert written, "the operator did not write the Deployment after the activation"
    seconds = _time(written[0]) - _time(patch)
    print(f"\nscale to zero: activation PATCH -> Deployment replicas 1 written in {seconds * 1000:.0f} ms")

    # The autoscaler's scale-down carries the resourceVersion it read: one read before the wake loses.
    down = {"metadata": {"resourceVersion": stale}, "spec": {"replicas": 0}}
    with pytest.raises(KubectlError) as refused:
        control_plane.kubectl(
            "patch", "llmd", "smollm2", "-n", namespace, "--subresource=scale", "--type=merge", "-p",
            json.dumps(down),
        )  # fmt: skip
    assert "the object has been modified" in str(refused.value) or "Conflict" in str(refused.value)
    assert deployment()["spec"]["replicas"] == 1  # type: ignore[index]
