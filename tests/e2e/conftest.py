"""Fixtures of the end-to-end suite: a real control plane (started from KUBEBUILDER_ASSETS, or the
cluster in KUBECONFIG) and the node agent, once per session. Every test here is marked `e2e` and
skipped, with the reason, where neither variable is set. KVASIR_E2E_NODE=kubelet runs only the
tests marked `real_node`, on a real kubelet (tests/e2e/real_node/); they are skipped otherwise."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.control_plane import ControlPlane
from tests.e2e.kvasir_release import Release
from tests.e2e.node_agent import NodeAgent
from tests.e2e.real_node.node import host_address
from tests.external_tools import tool

HERE = Path(__file__).resolve().parent
NO_CONTROL_PLANE = (
    "needs a real control plane: set KUBEBUILDER_ASSETS to a directory with etcd and kube-apiserver "
    "(envtest layout) or KUBECONFIG to a cluster"
)


REAL_NODE = os.environ.get("KVASIR_E2E_NODE") == "kubelet"
NOT_REAL_NODE = (
    "runs pods on a real kubelet: set KVASIR_E2E_NODE=kubelet and KUBEBUILDER_ASSETS with kubelet and "
    "kube-proxy (docs/real-node.md)"
)
ONLY_REAL_NODE = (
    "KVASIR_E2E_NODE=kubelet runs only the real-node tests: the node agent beside a kubelet would take "
    "some of their pods"
)


def _configured() -> bool:
    return bool(os.environ.get("KUBEBUILDER_ASSETS") or os.environ.get("KUBECONFIG"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items, not only this folder's.
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)
            if not _configured():
                item.add_marker(pytest.mark.skip(reason=NO_CONTROL_PLANE))
            elif (item.get_closest_marker("real_node") is not None) != REAL_NODE:
                item.add_marker(pytest.mark.skip(reason=ONLY_REAL_NODE if REAL_NODE else NOT_REAL_NODE))


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    if not _configured():
        pytest.skip(NO_CONTROL_PLANE)
    if REAL_NODE and os.environ.get("KUBEBUILDER_ASSETS"):
        # Pods on the real node reach this API server through the `kubernetes` Service.
        plane = ControlPlane.start(Path(os.environ["KUBEBUILDER_ASSETS"]), node_address=host_address())
    else:
        plane = ControlPlane.from_environment()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def controllers(control_plane: ControlPlane) -> None:
    """Skip a test that needs pods scheduled and reconciled where only etcd and the API server run."""
    if not control_plane.controllers:
        pytest.skip("needs kube-controller-manager and kube-scheduler in KUBEBUILDER_ASSETS")


@pytest.fixture(scope="session")
def node_agent(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeAgent]:
    agent = NodeAgent(
        control_plane.access,
        tmp_path_factory.mktemp("node-agent"),
        wait_schedulable=control_plane.controllers,
    )
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test, deleted (without waiting) afterwards."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{stem}-{secrets.token_hex(3)}"
    control_plane.kubectl("create", "namespace", name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary (PATH or .tools/bin); skipped, or failed in CI, without it."""
    return tool("helm")


@pytest.fixture(scope="session")
def release(control_plane: ControlPlane, node_agent: NodeAgent, helm: str) -> Iterator[Release]:
    """The chart installed once for the session (CRD included); uninstalled at the end."""
    if not control_plane.controllers:
        pytest.skip("needs kube-controller-manager and kube-scheduler in KUBEBUILDER_ASSETS")
    installed = Release(control_plane, node_agent, helm)
    installed.install()
    try:
        yield installed
    finally:
        installed.uninstall()
