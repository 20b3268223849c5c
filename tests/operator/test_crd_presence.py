"""CRDs coming and going while the real operator runs (kopf loop included, against kmock): the
ServiceMonitor CRD installed after the operator started, and the LLMDeployment CRD removed (an
uninstall, or an upgrade by delete-and-create) and installed again. Removing a resource from
kmock's declarations is what deleting its CRD does to discovery: its group/version no longer lists
it and every request to it answers 404."""

from __future__ import annotations

import contextlib
from typing import Any

import kmock
import pytest

pytestmark = pytest.mark.asyncio

POLL = 0.1  # discovery_seconds, scaled down


def _declare_monitors(cluster: Any, kt: Any) -> None:
    cluster.kmock.resources[kt.MONITORS] = kmock.ResourceInfo(
        kind="ServiceMonitor",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    )


def _remove_crd(cluster: Any, kt: Any) -> None:
    """What deleting the CRD does: every object of the kind goes, and the kind is no longer served."""
    for key in [key for key in cluster.kmock.objects if key[0] == kt.LLMD]:
        with contextlib.suppress(KeyError):
            del cluster.kmock.objects[key]
    del cluster.kmock.resources[kt.LLMD]


def _restore_crd(cluster: Any, kt: Any) -> None:
    cluster.kmock.resources[kt.LLMD] = kmock.ResourceInfo(
        kind="LLMDeployment",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status", "scale"},
    )


async def test_service_monitor_made_once_its_crd_is_installed(cluster, start_operator, kt) -> None:
    await start_operator(discovery_seconds=POLL)
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.SERVICES, "demo"), what="the Service")
    assert cluster.get(kt.MONITORS, "demo") is None

    _declare_monitors(cluster, kt)  # the Prometheus Operator installed afterwards
    monitor = await cluster.wait(lambda: cluster.get(kt.MONITORS, "demo"), what="the ServiceMonitor")
    assert monitor["metadata"]["ownerReferences"][0]["name"] == "demo"


async def test_operator_waits_while_its_crd_is_gone_and_resumes(cluster, start_operator, kt) -> None:
    handle = await start_operator(discovery_seconds=POLL)
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the first Deployment")

    _remove_crd(cluster, kt)
    await cluster.wait(lambda: handle.state.phase == "waiting-for-crd", what="the operator to wait")
    assert handle.alive and handle.error is None
    assert handle.state.healthy() == (True, "waiting-for-crd")  # no restart loop while uninstalled

    _restore_crd(cluster, kt)
    await cluster.wait(lambda: handle.state.phase == "leading", what="the operator to resume")
    await cluster.create(kt.LLMD, kt.llmd("again"))
    deployment = await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "again"), what="the new Deployment")
    assert deployment["metadata"]["ownerReferences"][0]["name"] == "again"
    assert handle.alive and handle.error is None


async def test_operator_started_before_its_crd_waits_for_it(cluster, start_operator, kt) -> None:
    del cluster.kmock.resources[kt.LLMD]
    handle = await start_operator(wait_ready=False, discovery_seconds=POLL)
    await cluster.wait(lambda: handle.state.phase == "waiting-for-crd", what="the operator to wait")

    _restore_crd(cluster, kt)
    await cluster.wait(lambda: handle.ready.is_set(), what="the kopf loop to start")
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
