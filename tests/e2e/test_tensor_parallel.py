"""Models bigger than one GPU, on a real control plane: a `gpus: 2` LLMDeployment becomes one pod
with two GPUs and --tensor-parallel-size 2 that the real scheduler places on the node (the node
agent's Node advertises 4 nvidia.com/gpu); a multi-node spec is Degraded while no LeaderWorkerSet
CRD is served, and becomes a LeaderWorkerSet that the API server accepts once the CRD is installed,
replacing the Deployment of the spec before it. The CRD is a stand-in (tests/e2e/manifests): no LWS
controller runs here, so no group's pods are made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.control_plane import ControlPlane
from tests.e2e.kvasir_release import DISCOVERY_SECONDS, Release, condition, status_where
from tests.e2e.polling import wait_for

HERE = Path(__file__).resolve().parent
SAMPLES = HERE.parents[1] / "crds" / "samples"
LWS_CRD_FILE = HERE / "manifests" / "leaderworkersets.leaderworkerset.x-k8s.io.yaml"
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
LEADER = "leaderworkerset.sigs.k8s.io/worker-index"
SETTLE = 90.0

pytestmark = pytest.mark.slow


def _sample(name: str, namespace: str, **spec: Any) -> str:
    manifest = yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"].update(spec)
    return json.dumps(manifest)


def _get(control_plane: ControlPlane, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    found = control_plane.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def test_two_gpus_render_and_schedule_as_one_pod(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=_sample("tensor-parallel", namespace))
    obj = status_where(
        control_plane,
        release,
        namespace,
        "qwen-14b-tp2",
        "Running",
        lambda o: (o.get("status") or {}).get("phase") == "Running",
    )
    assert obj["status"]["readyReplicas"] == 1
    (pod,) = control_plane.kubectl_json(
        "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/instance=qwen-14b-tp2"
    )["items"]
    # The real scheduler bound it: the node had two of its four GPUs free for it.
    node = control_plane.kubectl_json("get", "node", pod["spec"]["nodeName"])
    assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 2
    assert condition(pod, "PodScheduled")["status"] == "True"
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert (
        container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    )  # the server's default: request = limit
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    control_plane.kubectl("delete", "llmd", "qwen-14b-tp2", "-n", namespace, "--wait=false")


def test_multi_node_waits_for_the_crd_then_becomes_a_leader_worker_set(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    assert control_plane.kubectl("get", "crd", LWS_CRD, check=False).returncode != 0
    # One node first (no pods needed: replicas 0), so that the switch deletes its Deployment.
    one_node = {"replicas": 0, "resources": {"gpus": 2}}
    control_plane.kubectl("apply", "-f", "-", stdin=_sample("tensor-parallel", namespace, **one_node))
    wait_for(lambda: _get(control_plane, "deployment", "qwen-14b-tp2", namespace), "the Deployment", SETTLE)

    multi_node = {
        "replicas": 2,
        "resources": {"gpus": 8},
        "parallelism": {"tensor": 16, "nodes": 2},
    }
    control_plane.kubectl("apply", "-f", "-", stdin=_sample("tensor-parallel", namespace, **multi_node))

    def unavailable(obj: dict[str, Any]) -> bool:
        degraded = condition(obj, "Degraded")
        return degraded.get("reason") == "LeaderWorkerSetUnavailable" and (
            (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
        )

    obj = status_where(
        control_plane, release, namespace, "qwen-14b-tp2", "LeaderWorkerSetUnavailable", unavailable
    )
    assert obj["status"]["phase"] == "Degraded"
    assert _get(control_plane, "deployment", "qwen-14b-tp2", namespace) is not None  # kept meanwhile

    control_plane.kubectl("apply", "-f", str(LWS_CRD_FILE))
    try:
        control_plane.wait_established(LWS_CRD)
        lws = wait_for(
            lambda: _get(control_plane, LWS_CRD, "qwen-14b-tp2", namespace),
            "the LeaderWorkerSet",
            DISCOVERY_SECONDS * 3 + 30,
        )
        # Stored by the API server as written: the group, its size and both templates.
        assert lws["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        assert lws["spec"]["replicas"] == 2
        group = lws["spec"]["leaderWorkerTemplate"]
        assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
        leader_args = group["leaderTemplate"]["spec"]["containers"][0]["args"]
        assert leader_args[leader_args.index("--tensor-parallel-size") + 1] == "16"
        assert leader_args[leader_args.index("--node-rank") + 1] == "0"
        worker_args = group["workerTemplate"]["spec"]["containers"][0]["args"]
        assert worker_args[:2] == ["serve", "--headless"]
        assert worker_args[worker_args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        # The scale subresource works on the stand-in as on the real CRD: groups, not pods.
        scale = json.loads(control_plane.kubectl("get", "--raw", _scale_path(namespace)).stdout)
        assert scale["spec"]["replicas"] == 2
        wait_for(
            lambda: _get(control_plane, "deployment", "qwen-14b-tp2", namespace) is None,
            "the one-node Deployment deleted",
            SETTLE,
        )
        service = _get(control_plane, "service", "qwen-14b-tp2", namespace)
        assert service is not None and service["spec"]["selector"][LEADER] == "0"
        obj = status_where(
            control_plane,
            release,
            namespace,
            "qwen-14b-tp2",
            "Degraded cleared",
            lambda o: condition(o, "Degraded").get("status") == "False",
        )
        assert obj["status"]["selector"].endswith(f"{LEADER}=0")
        # kubectl scale on the LLMDeployment reaches the groups.
        control_plane.kubectl("scale", "llmd", "qwen-14b-tp2", "-n", namespace, "--replicas=3")
        wait_for(
            lambda: (
                (_get(control_plane, LWS_CRD, "qwen-14b-tp2", namespace) or {})
                .get("spec", {})
                .get("replicas")
                == 3
            ),
            "three groups",
            SETTLE,
        )
    finally:
        control_plane.kubectl("delete", "llmd", "qwen-14b-tp2", "-n", namespace, "--wait=false", check=False)
        control_plane.kubectl("delete", "crd", LWS_CRD, "--timeout=60s")


def _scale_path(namespace: str) -> str:
    return f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{namespace}/leaderworkersets/qwen-14b-tp2/scale"
