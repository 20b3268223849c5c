"""End to end on a real cluster (KUBECONFIG): install the CRD, run the operator, apply a sample and
wait for its children. Skipped with a reason where there is no cluster (CI, developer machines).

Run with: KUBECONFIG=~/.kube/config python -m pytest -m k8s tests/operator/test_k8s_cluster.py
"""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import subprocess
import uuid

import pytest

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG"), reason="needs a Kubernetes cluster: KUBECONFIG is not set"
    ),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl on PATH to install the CRD"),
]


def kubectl(*args: str, stdin: str | None = None) -> str:
    result = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.asyncio
async def test_sample_gets_its_children(kt, samples) -> None:
    import yaml

    from kvasir.operator.handlers import HandlerConfig, default_login
    from kvasir.operator.runner import OperatorConfig, run_operator

    namespace = f"kvasir-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("apply", "-f", str(kt.CRD_PATH))
    kubectl("wait", "--for=condition=Established", "crd/llmdeployments.inference.kvasir.dev", "--timeout=60s")
    kubectl("create", "namespace", namespace)
    stop = asyncio.Event()
    config = OperatorConfig(
        handlers=HandlerConfig(login=default_login), namespaces=(namespace,), http_port=None
    )
    operator = asyncio.create_task(run_operator(config, stop=stop))
    try:
        sample = copy.deepcopy(samples["minimal"])
        sample["metadata"]["namespace"] = namespace
        sample["spec"]["resources"] = {"gpus": 0, "cpu": "100m", "memory": "256Mi"}  # schedulable anywhere
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(sample))
        name = sample["metadata"]["name"]
        for kind in ("deployment", "service", "poddisruptionbudget"):
            kubectl(
                "wait", "-n", namespace, f"{kind}/{name}", "--for=jsonpath={.metadata.name}", "--timeout=120s"
            )
        kubectl(
            "wait",
            "-n",
            namespace,
            f"llmd/{name}",
            "--for=jsonpath={.status.observedGeneration}=1",
            "--timeout=120s",
        )
        owner = kubectl(
            "get", "-n", namespace, f"deployment/{name}", "-o", "jsonpath={.metadata.ownerReferences[0].kind}"
        )
        assert owner == "LLMDeployment"
        kubectl("scale", "-n", namespace, f"llmd/{name}", "--replicas=2")
        kubectl(
            "wait",
            "-n",
            namespace,
            f"deployment/{name}",
            "--for=jsonpath={.spec.replicas}=2",
            "--timeout=60s",
        )
    finally:
        stop.set()
        await asyncio.wait_for(operator, timeout=60)
        kubectl("delete", "namespace", namespace, "--wait=false")
