"""Leader election on a Lease (against kmock): one leader at a time, quick hand-over, expiry."""

from __future__ import annotations

import asyncio

import kopf
import pytest

from kvasir.operator.kube import KubeClient
from kvasir.operator.leader import LeaderElector, LeaseConfig

pytestmark = pytest.mark.asyncio


async def _client(cluster) -> KubeClient:
    client = KubeClient(request_timeout=5)
    await client.connect(kopf.ConnectionInfo(server=cluster.url))
    return client


def _config(identity: str) -> LeaseConfig:
    return LeaseConfig(
        namespace="kvasir-system", identity=identity, lease_seconds=1.0, renew_seconds=0.2, retry_seconds=0.05
    )


async def test_one_holder_and_release_hands_over(cluster, kt) -> None:
    a, b = await _client(cluster), await _client(cluster)
    try:
        first, second = LeaderElector(a, _config("pod-a")), LeaderElector(b, _config("pod-b"))
        assert await first.try_acquire_or_renew()
        assert not await second.try_acquire_or_renew()
        lease = cluster.get(kt.LEASES, "kvasir-operator", namespace="kvasir-system")
        assert lease["spec"]["holderIdentity"] == "pod-a"
        assert lease["spec"]["leaseDurationSeconds"] == 1
        first.leading = True
        await first.release()
        assert await second.try_acquire_or_renew()
        lease = cluster.get(kt.LEASES, "kvasir-operator", namespace="kvasir-system")
        assert lease["spec"]["holderIdentity"] == "pod-b"
        assert lease["spec"]["leaseTransitions"] == 1
    finally:
        await a.close()
        await b.close()


async def test_a_silent_holder_expires(cluster, kt) -> None:
    a, b = await _client(cluster), await _client(cluster)
    try:
        assert await LeaderElector(a, _config("pod-a")).try_acquire_or_renew()  # then never renews
        standby = LeaderElector(b, _config("pod-b"))
        await asyncio.wait_for(standby.acquire(), timeout=kt.TIMEOUT)
        assert standby.leading
        lease = cluster.get(kt.LEASES, "kvasir-operator", namespace="kvasir-system")
        assert lease["spec"]["holderIdentity"] == "pod-b"
    finally:
        await a.close()
        await b.close()


async def test_two_operators_never_both_act(cluster, start_operator, kt) -> None:
    leader = await start_operator(leader=_config("pod-a"))
    standby = await start_operator(leader=_config("pod-b"), wait_ready=False)
    await cluster.wait(lambda: standby.state.phase == "standby", what="the second replica waits")
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the leader acts")
    assert (
        standby.metrics.registry.get_sample_value(
            "kvasir_operator_reconciles_total", {"trigger": "create", "result": "ok"}
        )
        is None
    )
    assert leader.metrics.registry.get_sample_value("kvasir_operator_leader") == 1
    # A graceful stop releases the lease; the standby takes over and reconciles what exists.
    await leader.stop()
    await asyncio.to_thread(standby.ready.wait, kt.TIMEOUT)
    assert standby.state.phase == "leading"
    await cluster.delete(kt.SERVICES, "demo")
    await cluster.wait(lambda: cluster.get(kt.SERVICES, "demo"), what="the new leader repairs drift")
