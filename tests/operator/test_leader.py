"""Leader election on a Lease (against kmock): one leader at a time, quick hand-over, expiry, and
no overlap when the API server is too slow to answer a renewal (at scaled-down timings)."""

from __future__ import annotations

import asyncio
import time

import kmock
import kopf
import pytest

from kvasir.operator.kube import KubeClient, NotLeader
from kvasir.operator.leader import LeaderElector, LeaseConfig

pytestmark = pytest.mark.asyncio


async def _client(cluster, identity: str = "pod") -> KubeClient:
    client = KubeClient(request_timeout=30, user_agent=f"kvasir-operator (leader-election; {identity})")
    await client.connect(kopf.ConnectionInfo(server=cluster.url))
    return client


def _config(identity: str, lease_seconds: float = 1.0) -> LeaseConfig:
    return LeaseConfig(
        namespace="kvasir-system",
        identity=identity,
        lease_seconds=lease_seconds,
        renew_deadline_seconds=0.6 * lease_seconds,
        retry_seconds=0.05,
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
    # A lease a loaded machine cannot lapse: at 1 s, one slow renewal on a busy 2-core machine
    # handed over mid-test and the standby then (rightly) acted. Expiry has its own tests; here the
    # hand-over comes from the leader's release.
    leader = await start_operator(leader=_config("pod-a", lease_seconds=60))
    standby = await start_operator(leader=_config("pod-b", lease_seconds=60), wait_ready=False)
    await cluster.wait(lambda: standby.state.phase == "standby", what="the second replica waits")
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the leader acts")
    await cluster.wait(lambda: cluster.get(kt.SERVICES, "demo"), what="the leader's Service")
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


async def test_timings_must_nest() -> None:
    with pytest.raises(ValueError, match="retry < renew deadline < lease duration"):
        LeaseConfig(namespace="ns", identity="a", lease_seconds=15, renew_deadline_seconds=15)


async def test_a_leader_cut_off_by_a_slow_api_stops_before_another_starts(cluster, kt) -> None:
    """client-go's RenewDeadline: the leader's renewal hangs (the API answers after 30 s, longer
    than the lease); it must stop acting before the standby may take over, not when the request
    finally times out."""
    a, b = await _client(cluster, "pod-a"), await _client(cluster, "pod-b")
    leader, standby = LeaderElector(a, _config("pod-a")), LeaderElector(b, _config("pod-b"))
    fenced = KubeClient(request_timeout=30, may_write=leader.may_act)
    await fenced.connect(kopf.ConnectionInfo(server=cluster.url))
    stalled = asyncio.Event()

    async def hang() -> None:
        stalled.set()
        await asyncio.sleep(30)  # emulated API latency: far beyond the lease duration
        raise NotImplementedError

    try:
        await leader.acquire()
        holding = asyncio.ensure_future(leader.hold())
        await asyncio.sleep(0.2)  # a few successful renewals first
        assert leader.may_act()
        (
            cluster.kmock[
                "patch", kmock.resource(kt.LEASES), {"User-Agent": "kvasir-operator (leader-election; pod-a)"}
            ]
            << hang
        )
        await asyncio.wait_for(stalled.wait(), kt.TIMEOUT)
        taking_over = asyncio.ensure_future(standby.acquire())
        await asyncio.wait_for(leader.lost.wait(), kt.TIMEOUT)
        stopped_at = time.monotonic()
        assert not leader.may_act() and not leader.leading
        with pytest.raises(NotLeader):  # the fence: no write leaves this replica any more
            await fenced.create("/api/v1/namespaces/team-a/services", {"metadata": {"name": "x"}})
        await asyncio.wait_for(taking_over, kt.TIMEOUT)
        acquired_at = time.monotonic()
        assert standby.leading
        # The standby waited a whole lease duration after it last saw a renewal; the leader gave up
        # at its renew deadline (0.6 s) after its last renewal was sent: no overlap.
        assert stopped_at < acquired_at
        assert acquired_at - stopped_at > 0.2
        await asyncio.wait_for(holding, kt.TIMEOUT)
    finally:
        for client in (a, b, fenced):
            await client.close()
