"""The Kvasir operator installed with its Helm chart on the real control plane, its pods run by the
node agent as real `kvasir operator` processes under the chart's ServiceAccount; and what the
tests ask of an LLMDeployment (its status, its Events, the operator's requests in the audit log)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvasir.operator.runner import OperatorConfig
from tests.e2e.control_plane import ControlPlane, KubectlError
from tests.e2e.node_agent import NodeAgent
from tests.e2e.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvasir"
CRD_FILE = REPO / "crds" / "llmdeployments.inference.kvasir.dev.yaml"
CRD_NAME = "llmdeployments.inference.kvasir.dev"
RELEASE = "kvasir"
NAMESPACE = "kvasir-system"
FULLNAME = "kvasir-operator"  # the chart's name for a release called "kvasir"
OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}"
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
# Seconds the chart's operator leaves between discovery polls for its CRDs.
DISCOVERY_SECONDS = OperatorConfig().discovery_seconds


@dataclass
class Release:
    control_plane: ControlPlane
    node_agent: NodeAgent
    helm: str

    def helm_run(self, *args: str, timeout: float = 300) -> str:
        command = [
            self.helm,
            f"--kubeconfig={self.control_plane.kubeconfig}",
            *args,
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def install(self) -> None:
        """`helm install` into kvasir-system (CRD from the chart's crds/), then wait until both
        operator replicas are Ready and one holds the Lease."""
        self.node_agent.run_processes_in(NAMESPACE)
        self.helm_run(
            "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", "--wait", "--timeout=240s"
        )
        self.leader()

    def uninstall(self) -> None:
        """Stop the operators (scale to 0 and wait until their pods, processes included, are gone),
        then `helm uninstall`. Uninstalling at once removed the Role while a stopping operator
        still released its Lease with it: a 403 in the audit log the RBAC test reads."""
        self.control_plane.kubectl("scale", "deployment", FULLNAME, "-n", NAMESPACE, "--replicas=0")
        wait_for(lambda: not self.pods(terminating=True), "the operator pods to stop", 120)
        self.helm_run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=120s")

    def pods(self, terminating: bool = False) -> list[dict[str, Any]]:
        """The operator's pods (with `terminating`, those being deleted too)."""
        selector = f"app.kubernetes.io/name=kvasir-operator,app.kubernetes.io/instance={RELEASE}"
        listed = self.control_plane.kubectl_json("get", "pods", "-n", NAMESPACE, "-l", selector)
        return [pod for pod in listed["items"] if terminating or not pod["metadata"].get("deletionTimestamp")]

    def lease_holder(self) -> str:
        lease = self.control_plane.kubectl_json("get", "lease", FULLNAME, "-n", NAMESPACE)
        return str(lease["spec"].get("holderIdentity") or "")

    def leader(self, timeout: float = 60.0, other_than: str = "") -> str:
        """The operator pod holding the Lease (a live one, and not `other_than`)."""

        def holder() -> str:
            names = {pod["metadata"]["name"] for pod in self.pods()}
            try:
                held = self.lease_holder()
            except KubectlError:  # the Lease is not created yet
                return ""
            return held if held in names and held != other_than else ""

        return wait_for(holder, f"an operator pod to lead (not {other_than!r})", timeout)

    def logs(self) -> str:
        """The operator processes' output, for failure messages."""
        out = []
        for pod in self.pods():
            path = self.node_agent.log_path(NAMESPACE, pod["metadata"]["name"])
            if path.exists():
                out.append(
                    f"--- {pod['metadata']['name']}\n" + "\n".join(path.read_text().splitlines()[-40:])
                )
        return "\n".join(out)

    def log_text(self) -> str:
        """Everything the current operator pods' processes wrote."""
        paths = [self.node_agent.log_path(NAMESPACE, pod["metadata"]["name"]) for pod in self.pods()]
        return "\n".join(path.read_text() for path in paths if path.exists())

    def operator_requests(self) -> list[dict[str, Any]]:
        return self.control_plane.audit_events(OPERATOR_USER)


def llmd(control_plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = control_plane.kubectl_json("get", "llmd", name, "-n", namespace)
    return found


def status_where(
    control_plane: ControlPlane,
    release: Release,
    namespace: str,
    name: str,
    what: str,
    check: Callable[[dict[str, Any]], bool],
    timeout: float = 90.0,
) -> dict[str, Any]:
    """Wait until `check(llmd)` holds; a timeout shows the last status and the operator's logs.
    90 s by default: long enough for a status to follow the cluster on a loaded 2-core machine."""
    last: dict[str, Any] = {}

    def probe() -> dict[str, Any] | None:
        nonlocal last
        last = llmd(control_plane, namespace, name)
        return last if check(last) else None

    try:
        found: dict[str, Any] = wait_for(probe, what, timeout, interval=0.5)
    except TimeoutError as error:
        raise AssertionError(
            f"{error}\nstatus: {json.dumps(last.get('status'), indent=1)}\n{release.logs()}"
        ) from None
    return found


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


def events(control_plane: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    """The Events about LLMDeployment `name`, from either Events API's view."""
    selector = f"involvedObject.kind=LLMDeployment,involvedObject.name={name}"
    listed = control_plane.kubectl_json("get", "events", "-n", namespace, "--field-selector", selector)
    return list(listed["items"])
