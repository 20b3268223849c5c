"""The node agent's process mode on a real control plane: a Kvasir runtime pod runs the real
`kvasir serve` on its own loopback address, turns Ready when its readiness probe passes, is
restarted when killed and stopped gracefully when deleted; a missing Secret is reported as a kubelet
reports it."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.control_plane import ControlPlane
from tests.e2e.node_agent import NodeAgent
from tests.e2e.pod_launch import kvasir_executable
from tests.e2e.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "crds" / "samples" / "minimal.yaml"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
START = "180s"  # loading the embedded model takes ~20 s on 2 busy cores; generous for CI


def _status(control_plane: ControlPlane, namespace: str, pod: str) -> dict[str, Any]:
    status: dict[str, Any] = control_plane.kubectl_json("get", "pod", pod, "-n", namespace)["status"]
    return status


@pytest.mark.slow
@pytest.mark.usefixtures("controllers")
def test_runtime_pod_runs_restarts_and_stops_as_a_real_process(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    node_agent.run_processes_in(namespace)
    rendered = subprocess.run(
        [*kvasir_executable(), "render", "-f", str(SAMPLE), "-n", namespace],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    control_plane.kubectl("apply", "-f", "-", stdin=rendered)
    control_plane.kubectl("rollout", "status", "deployment/smollm2", "-n", namespace, f"--timeout={START}")

    (pod,) = control_plane.kubectl_json("get", "pods", "-n", namespace)["items"]
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    process = node_agent.pod_process(namespace, name)
    assert process is not None and process.poll() is None
    models = httpx.get(f"http://{ip}:8000/v1/models", timeout=10).json()
    assert [model["id"] for model in models["data"]] == [MODEL]

    node_agent.kill(namespace, name, signal.SIGKILL)
    restarted = wait_for(
        lambda: (
            (s := _status(control_plane, namespace, name)["containerStatuses"][0])["restartCount"] == 1 and s
        ),
        "the restart",
    )
    assert restarted["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    control_plane.kubectl(
        "wait", "--for=condition=Ready", f"pod/{name}", "-n", namespace, f"--timeout={START}"
    )
    second = node_agent.pod_process(namespace, name)
    assert second is not None and second is not process and second.poll() is None
    assert node_agent.log_path(namespace, name).read_text().count("node agent starts:") == 2

    control_plane.kubectl("delete", "deployment", "smollm2", "-n", namespace)
    wait_for(
        lambda: not control_plane.kubectl("get", "pods", "-n", namespace, "-o", "name").stdout.strip(),
        "the pod to be deleted",
    )
    # SIGTERM (after the preStop pause) let the runtime drain and exit on its own: no SIGKILL.
    assert second.poll() is not None and second.returncode != -signal.SIGKILL


@pytest.mark.usefixtures("controllers")
def test_missing_secret_is_a_create_container_config_error(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    node_agent.run_processes_in(namespace)
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "needs-secret", "namespace": namespace},
        "spec": {
            "containers": [
                {"name": "kvasir", "image": "kvasir", "command": ["kvasir"], "args": ["serve"], "env": env}
            ]
        },
    }
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(pod))

    def waiting() -> dict[str, Any]:
        statuses = _status(control_plane, namespace, "needs-secret").get("containerStatuses") or [{}]
        state: dict[str, Any] = statuses[0].get("state", {}).get("waiting") or {}
        return state if state.get("reason") == "CreateContainerConfigError" else {}

    assert wait_for(waiting, "CreateContainerConfigError")["message"] == 'secret "hf-token" not found'
    control_plane.kubectl(
        "create", "secret", "generic", "hf-token", "--from-literal=other=x", "-n", namespace
    )
    message = f"couldn't find key token in Secret {namespace}/hf-token"
    wait_for(lambda: waiting().get("message") == message, "the missing key to be reported")
    assert node_agent.pod_process(namespace, "needs-secret") is None
    assert _status(control_plane, namespace, "needs-secret")["phase"] == "Pending"
    control_plane.kubectl("delete", "pod", "needs-secret", "-n", namespace, "--timeout=60s")
