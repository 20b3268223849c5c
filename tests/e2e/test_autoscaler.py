"""Kvasir's autoscaler end to end: the chart's operator scrapes a real `kvasir serve` pod (the
bundled model, run by the node agent on the pod's address), sees its queue grow under load, and
scales the LLMDeployment through its /scale subresource; the Deployment controller and the
scheduler bring up the second replica, another real `kvasir serve`, which turns Ready."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.control_plane import ControlPlane
from tests.e2e.kvasir_release import REPO, Release, condition, llmd
from tests.e2e.node_agent import NodeAgent
from tests.e2e.polling import wait_for

MINIMAL = REPO / "crds" / "samples" / "minimal.yaml"
STARTUP = 240.0  # loading the bundled model takes ~20 s alone, more on 2 busy cores
CLIENTS = 8

pytestmark = pytest.mark.slow


def _autoscaled(namespace: str) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(MINIMAL.read_text())
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"].update(
        runtime={"maxNumSeqs": 1},  # one running request: the rest of the load waits in the queue
        resources={"gpus": 0, "cpu": "1", "memory": "2Gi"},
        autoscaling={
            "minReplicas": 1,
            "maxReplicas": 2,
            "targets": {"queuePerReplica": 1},
            "windows": {"intervalSeconds": 2},
        },
    )
    return manifest


def _load(ip: str, stop: threading.Event) -> None:
    """Keep one long request in flight until `stop`."""
    body = {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            try:
                with client.stream("POST", f"http://{ip}:8000/v1/chat/completions", json=body) as response:
                    for _ in response.iter_lines():
                        if stop.is_set():
                            break  # disconnects: the server frees the request
            except httpx.HTTPError:
                stop.wait(0.5)


def test_queue_on_a_real_runtime_pod_scales_out(
    control_plane: ControlPlane, release: Release, node_agent: NodeAgent, namespace: str
) -> None:
    node_agent.run_processes_in(namespace)
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(_autoscaled(namespace)))
    control_plane.kubectl(
        "rollout", "status", "deployment/smollm2", "-n", namespace, f"--timeout={STARTUP:.0f}s"
    )
    (pod,) = control_plane.kubectl_json("get", "pods", "-n", namespace)["items"]
    ip = pod["status"]["podIP"]

    stop = threading.Event()
    clients = [threading.Thread(target=_load, args=(ip, stop), daemon=True) for _ in range(CLIENTS)]
    for client in clients:
        client.start()
    try:

        def scaled() -> dict[str, Any] | None:
            obj = llmd(control_plane, namespace, "smollm2")
            return obj if obj["spec"].get("replicas") == 2 else None

        try:
            obj = wait_for(scaled, "the autoscaler to ask for 2 replicas", 120, interval=1)
        except TimeoutError as error:
            status = llmd(control_plane, namespace, "smollm2").get("status")
            raise AssertionError(f"{error}\n{json.dumps(status, indent=1)}\n{release.logs()}") from None
        decision = obj["status"]["autoscaling"]
        assert decision["desiredReplicas"] == 2
        assert decision["signals"]["queuePerReplica"] >= 1
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=150)

    # The second replica is a real runtime too: it loads the model and passes its readiness probe.
    control_plane.kubectl(
        "rollout", "status", "deployment/smollm2", "-n", namespace, f"--timeout={STARTUP:.0f}s"
    )
    pods = control_plane.kubectl_json("get", "pods", "-n", namespace)["items"]
    assert len(pods) == 2 and all(condition(p, "Ready")["status"] == "True" for p in pods)
    for other in pods:
        models = httpx.get(f"http://{other['status']['podIP']}:8000/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    scale_writes = [
        e
        for e in release.operator_requests()
        if e["verb"] == "patch"
        and (e.get("objectRef") or {}).get("subresource") == "scale"
        and e["objectRef"].get("namespace") == namespace
    ]
    assert scale_writes, "the scale-up did not go through /scale"
