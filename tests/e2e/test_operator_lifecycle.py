"""The operator's life on a real control plane, beyond one LLMDeployment: leadership handed over on
a pod deletion and taken over after a kill -9, CRDs installed and removed under it (the Prometheus
Operator's ServiceMonitor, and its own), a Helm upgrade that changes the CRD, and, over the whole
session, not one request refused by the chart's RBAC."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.control_plane import ControlPlane
from tests.e2e.kvasir_release import (
    CHART,
    CRD_FILE,
    CRD_NAME,
    DISCOVERY_SECONDS,
    FULLNAME,
    NAMESPACE,
    RELEASE,
    Release,
    condition,
)
from tests.e2e.node_agent import NodeAgent
from tests.e2e.polling import wait_for

HERE = Path(__file__).resolve().parent
SERVICE_MONITOR_CRD = HERE / "manifests" / "servicemonitors.monitoring.coreos.com.yaml"
INFERENCE_POOL_CRD = HERE / "manifests" / "inferencepools.inference.networking.k8s.io.yaml"
MINIMAL = HERE.parents[1] / "crds" / "samples" / "minimal.yaml"
# The chart's Lease timings are client-go's (15 s lease); a takeover needs the lease to expire.
TAKEOVER = 60.0

pytestmark = pytest.mark.slow


def _minimal(namespace: str, name: str = "smollm2", **spec: Any) -> str:
    manifest = yaml.safe_load(MINIMAL.read_text())
    manifest["metadata"].update(name=name, namespace=namespace)
    manifest["spec"].update(spec)
    return json.dumps(manifest)


def _reconciled(
    control_plane: ControlPlane, release: Release, namespace: str, name: str, timeout: float
) -> None:
    """The operator made the Deployment and wrote status for the current generation."""

    def done() -> bool:
        found = control_plane.kubectl("get", "llmd", name, "-n", namespace, "-o", "json", check=False)
        if found.returncode != 0:
            return False
        obj = json.loads(found.stdout)
        return (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]

    try:
        wait_for(done, f"llmd {namespace}/{name} to be reconciled", timeout)
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{release.logs()}") from None
    control_plane.kubectl("get", "deployment", name, "-n", namespace)


def _restarts(release: Release) -> dict[str, int]:
    return {
        pod["metadata"]["name"]: sum(
            c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or []
        )
        for pod in release.pods()
    }


def _ready_standby(release: Release, leader: str) -> str:
    """The name of a Ready operator pod other than `leader` (its signal handlers are in place)."""

    def standby() -> str | None:
        for pod in release.pods():
            ready = any(
                c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or []
            )
            if ready and pod["metadata"]["name"] != leader:
                return str(pod["metadata"]["name"])
        return None

    return wait_for(standby, "a Ready standby operator pod", TAKEOVER)


def _exit_code_after_delete(control_plane: ControlPlane, node_agent: NodeAgent, pod: str) -> int:
    """Delete `pod` (SIGTERM after its preStop, as a kubelet does) and return its process's exit code."""
    process = node_agent.pod_process(NAMESPACE, pod)
    assert process is not None and process.poll() is None, f"{pod} has no running process"
    control_plane.kubectl("delete", "pod", pod, "-n", NAMESPACE, "--wait=false")
    wait_for(lambda: process.poll() is not None, f"{pod}'s process to exit", TAKEOVER)
    return int(process.returncode)


def test_deleting_the_standby_then_the_leader_hands_over_and_both_exit_0(
    control_plane: ControlPlane, release: Release, node_agent: NodeAgent, namespace: str
) -> None:
    """SIGTERM stops a standby (waiting for the Lease, kopf not started) and a leader (kopf
    running) with exit 0: before the fix the standby died of the signal (143) and the leader
    exited 1 ("the kopf loop stopped by itself")."""
    leader = release.leader()
    standby = _ready_standby(release, leader)
    assert _exit_code_after_delete(control_plane, node_agent, standby) == 0
    assert release.leader() == leader  # a standby leaving changes nothing
    _ready_standby(release, leader)  # its replacement, which takes over next
    assert _exit_code_after_delete(control_plane, node_agent, leader) == 0
    # SIGTERM: the leader releases the Lease on its way out, so the standby need not wait it out.
    successor = release.leader(other_than=leader, timeout=TAKEOVER)
    assert successor != leader
    control_plane.kubectl("apply", "-f", "-", stdin=_minimal(namespace))
    _reconciled(control_plane, release, namespace, "smollm2", TAKEOVER)
    control_plane.kubectl("rollout", "status", f"deployment/{FULLNAME}", "-n", NAMESPACE, "--timeout=180s")


def test_kill_9_of_the_leader_is_survived(
    control_plane: ControlPlane, release: Release, node_agent: NodeAgent, namespace: str
) -> None:
    leader = release.leader()
    node_agent.kill(NAMESPACE, leader, signal.SIGKILL)  # no release of the Lease, no goodbye
    # The container restarts, as under a kubelet; whoever leads next (the standby once the lease
    # expires, or the restarted process) picks up new work.
    control_plane.kubectl("apply", "-f", "-", stdin=_minimal(namespace, name="after-kill"))
    _reconciled(control_plane, release, namespace, "after-kill", TAKEOVER + 30)
    assert release.leader() in {pod["metadata"]["name"] for pod in release.pods()}
    wait_for(lambda: _restarts(release).get(leader) == 1, "the killed container's restart")


def test_service_monitor_crd_installed_while_running(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=_minimal(namespace, monitoring={"enabled": True}))
    _reconciled(control_plane, release, namespace, "smollm2", 90)
    assert (
        control_plane.kubectl("get", "crd", "servicemonitors.monitoring.coreos.com", check=False).returncode
        != 0
    )
    control_plane.kubectl("apply", "-f", str(SERVICE_MONITOR_CRD))
    try:
        control_plane.wait_established("servicemonitors.monitoring.coreos.com")
        # Discovery is polled every 10 s; then the operator reconciles every LLMDeployment.
        monitor = wait_for(
            lambda: (
                control_plane.kubectl(
                    "get",
                    "servicemonitors.monitoring.coreos.com",
                    "smollm2",
                    "-n",
                    namespace,
                    "-o",
                    "json",
                    check=False,
                ).stdout
            ),
            "the ServiceMonitor",
            DISCOVERY_SECONDS * 3 + 30,
        )
        spec = json.loads(monitor)["spec"]
        assert spec["endpoints"][0]["path"] == "/metrics"
    finally:
        control_plane.kubectl("delete", "crd", "servicemonitors.monitoring.coreos.com", "--timeout=60s")


def test_own_crd_removed_and_reinstalled_while_running(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    """An uninstall of the CRD (every LLMDeployment goes with it) does not crash-loop the operator:
    it waits, healthy, and resumes when the CRD is back. The children of the deleted
    LLMDeployments are collected once the CRD is back: while it is gone, the garbage collector
    cannot resolve their owner's kind and leaves them (seen on kube-controller-manager 1.36)."""
    control_plane.kubectl("apply", "-f", "-", stdin=_minimal(namespace))
    _reconciled(control_plane, release, namespace, "smollm2", 90)
    before = _restarts(release)
    control_plane.kubectl("delete", "crd", CRD_NAME, "--timeout=120s")
    try:
        wait_for(
            lambda: "waiting for it" in release.log_text() or None,
            "the operator to log that it waits for its CRD",
            DISCOVERY_SECONDS * 3 + 30,
        )
        assert _restarts(release) == before
        assert all(condition(pod, "Ready")["status"] == "True" for pod in release.pods())
    finally:
        control_plane.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
        control_plane.wait_established(CRD_NAME)
    wait_for(
        lambda: (
            not control_plane.kubectl(
                "get", "deployment", "smollm2", "-n", namespace, "-o", "name", check=False
            ).stdout.strip()
        ),
        "the garbage collector to remove the Deployment of the deleted LLMDeployment",
        120,
    )
    control_plane.kubectl("apply", "-f", "-", stdin=_minimal(namespace, name="reborn"))
    _reconciled(control_plane, release, namespace, "reborn", DISCOVERY_SECONDS * 3 + 60)
    assert _restarts(release) == before


def test_helm_upgrade_leaves_the_crd_and_kubectl_upgrades_it(
    control_plane: ControlPlane, release: Release, tmp_path: Path
) -> None:
    """Helm installs crds/ once and never upgrades it: a changed CRD in a new chart version reaches
    the cluster only through `kubectl apply --server-side` (what docs/operator.md prescribes)."""
    chart = tmp_path / "kvasir"
    shutil.copytree(CHART, chart)
    crd_copy = chart / "crds" / CRD_FILE.name
    changed = yaml.safe_load(crd_copy.read_text())
    marker = "upgraded by the e2e suite"
    changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] = marker
    crd_copy.write_text(yaml.safe_dump(changed, sort_keys=False))

    release.helm_run("upgrade", RELEASE, str(chart), "-n", NAMESPACE, "--wait", "--timeout=240s")
    stored = control_plane.kubectl_json("get", "crd", CRD_NAME)
    assert stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"].get("description") != marker

    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_copy))
    stored = control_plane.kubectl_json("get", "crd", CRD_NAME)
    assert stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] == marker
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))  # back
    release.leader()


def test_kubectl_first_install_needs_skip_crds(
    control_plane: ControlPlane, release: Release, tmp_path: Path
) -> None:
    """The CRD applied with `kubectl apply` (client-side) before the chart, and different from the
    chart's (an older version): Helm 4 applies the chart's CRD server-side and fails on the
    conflict with kubectl's fields; `helm install --skip-crds` is the kubectl-first path."""
    release.uninstall()
    try:
        older = yaml.safe_load(CRD_FILE.read_text())
        older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] = "an older CRD"
        control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(older))

        command = [
            release.helm,
            f"--kubeconfig={control_plane.kubeconfig}",
            "install",
            RELEASE,
            str(CHART),
            "-n",
            NAMESPACE,
        ]
        refused = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        assert refused.returncode != 0
        assert 'conflict with "kubectl-client-side-apply"' in refused.stderr, refused.stderr

        release.helm_run(
            "install", RELEASE, str(CHART), "-n", NAMESPACE, "--skip-crds", "--wait", "--timeout=240s"
        )
        release.leader()
    finally:
        control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        if not release.pods():  # the install above failed: put the session's release back
            release.helm_run(
                "install", RELEASE, str(CHART), "-n", NAMESPACE, "--skip-crds", "--wait", "--timeout=240s"
            )
    stored = control_plane.kubectl_json("get", "crd", CRD_NAME)
    assert stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"].get("description") != "an older CRD"


def test_no_request_of_the_operator_was_forbidden(control_plane: ControlPlane, release: Release) -> None:
    """Over everything the session did, the chart's ServiceAccount was enough: not one request
    refused by RBAC. (NamespaceLifecycle also answers 403, to a child written into a namespace
    being deleted, which each test's teardown causes: that is no missing permission.)"""
    requests = release.operator_requests()
    assert requests, "the operator made no request at all"
    forbidden = [
        (e["verb"], e.get("objectRef"), e["responseStatus"].get("message"))
        for e in requests
        if e["responseStatus"]["code"] == 403
        and "because it is being terminated" not in (e["responseStatus"].get("message") or "")
    ]
    assert forbidden == []


def test_inference_pool_crd_installed_while_running(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    """spec.routing.mode gateway before the Inference Extension is installed: a condition, not an
    error; the pool is written once discovery lists its CRD."""
    routing = {"mode": "gateway", "endpointPicker": {"service": "smollm2-epp"}}
    control_plane.kubectl("apply", "-f", "-", stdin=_minimal(namespace, replicas=0, routing=routing))
    _reconciled(control_plane, release, namespace, "smollm2", 90)
    crd = "inferencepools.inference.networking.k8s.io"
    assert control_plane.kubectl("get", "crd", crd, check=False).returncode != 0
    obj = json.loads(control_plane.kubectl("get", "llmd", "smollm2", "-n", namespace, "-o", "json").stdout)
    routed = condition(obj, "Routed")
    assert (routed["status"], routed["reason"]) == ("False", "InferencePoolCRDMissing"), obj["status"]
    assert condition(obj, "Degraded")["status"] == "False"
    control_plane.kubectl("apply", "-f", str(INFERENCE_POOL_CRD))
    try:
        control_plane.wait_established(crd)
        pool = wait_for(
            lambda: (
                control_plane.kubectl(
                    "get", f"{crd}", "smollm2", "-n", namespace, "-o", "json", check=False
                ).stdout
            ),
            "the InferencePool",
            DISCOVERY_SECONDS * 3 + 30,
        )
        spec = json.loads(pool)["spec"]
        assert spec["endpointPickerRef"] == {
            "name": "smollm2-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        }
        assert spec["targetPorts"] == [{"number": 8000}]
        # No picker Service named: the operator deploys the stock picker. A real API server checks
        # its objects, and RBAC's escalation check that the operator holds what its Role grants.
        control_plane.kubectl(
            "patch", "llmd", "smollm2", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"routing": {"endpointPicker": None}}}),
        )  # fmt: skip
        wait_for(
            lambda: control_plane.kubectl(
                "get", "deployment,service,role,rolebinding,serviceaccount", "smollm2-epp",
                "-n", namespace, "-o", "name", check=False,
            ).stdout.count("smollm2-epp") == 5,
            "the endpoint picker's five objects",
            60,
        )  # fmt: skip
        pool_ref = json.loads(
            control_plane.kubectl("get", crd, "smollm2", "-n", namespace, "-o", "json").stdout
        )["spec"]["endpointPickerRef"]
        assert pool_ref["name"] == "smollm2-epp"
    finally:
        control_plane.kubectl("delete", "crd", crd, "--timeout=60s")
