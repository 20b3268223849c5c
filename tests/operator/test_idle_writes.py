"""Nothing is written to an LLMDeployment that waits on something outside it: a missing Secret
(retried in memory, reads only), an invalid spec (through resyncs), pods that cannot be scheduled
(across an operator restart). The condition saying what it waits for is written once. Counted as
a real API server's audit log would: every write to the object, by anyone but the test."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.asyncio

WRITES = {"POST", "PUT", "PATCH", "DELETE"}
# Enough rounds of the slowest retry (0.5 s at the tests' timings) or resync to see a loop.
ROUNDS = 10
SETTLE = 4


def _condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in (obj or {}).get("status", {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


def _writes_to(cluster: Any, kt: Any, name: str) -> list[Any]:
    """Every write to the LLMDeployment `name` (status and annotations included) but the test's."""
    return [
        r
        for r in cluster.requests()
        if r.method in WRITES
        and r.resource == kt.LLMD
        and r.name == name
        and not r.headers.get("User-Agent", "").startswith(kt.TEST_AGENT)
    ]


def _reads(cluster: Any, kt: Any, resource: str, name: str) -> int:
    return sum(
        1
        for r in cluster.requests(agent="kvasir-operator")
        if r.method == "GET" and r.resource == resource and r.name == name
    )


async def _degraded(cluster: Any, kt: Any, name: str, reason: str) -> dict[str, Any]:
    return await cluster.wait(
        lambda: (
            _condition(cluster.get(kt.LLMD, name), "Degraded").get("reason") == reason
            and cluster.get(kt.LLMD, name)
        ),
        what=reason,
    )


async def _idle_for_rounds(cluster: Any, kt: Any, name: str, resource: str, read: str) -> None:
    """Let the object settle (kopf records the spec it handled, once: the emulator, which never
    bumps resourceVersion, makes kopf repeat that write a few times), then wait until the operator
    has read `resource` `read` ROUNDS more times and assert that nothing wrote to the object."""

    async def rounds(count: int) -> None:
        reads = _reads(cluster, kt, resource, read)
        await cluster.wait(
            lambda: _reads(cluster, kt, resource, read) >= reads + count, what=f"{count} more checks"
        )

    await rounds(SETTLE)
    before = len(_writes_to(cluster, kt, name))
    await rounds(ROUNDS)
    late = [(r.headers.get("User-Agent"), r.data) for r in _writes_to(cluster, kt, name)[before:]]
    assert late == []


async def test_a_missing_secret_is_retried_without_writing_to_the_object(cluster, start_operator, kt) -> None:
    await start_operator()
    model = {"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "tokenSecretRef": {"name": "hf"}}
    await cluster.create(kt.LLMD, kt.llmd("gated", model=model))
    parent = await _degraded(cluster, kt, "gated", "SecretNotFound")
    assert parent["status"]["phase"] == "Degraded"
    # The retries read the Secret, and write nothing: no status churn, no kopf bookkeeping.
    await _idle_for_rounds(cluster, kt, "gated", kt.SECRETS, "hf")
    annotations = cluster.get(kt.LLMD, "gated")["metadata"].get("annotations") or {}
    assert not any("_locals_" in key or "<locals>" in key for key in annotations), annotations


async def test_an_invalid_spec_is_not_rewritten_at_each_resync(cluster, start_operator, kt) -> None:
    await start_operator(handlers={"resync_seconds": 0.1})
    await cluster.create(kt.LLMD, kt.llmd("bad", model={"source": "hf://org/na me"}))
    await _degraded(cluster, kt, "bad", "InvalidSpec")
    await _idle_for_rounds(cluster, kt, "bad", kt.LLMD, "bad")


async def test_unschedulable_pods_after_a_restart_write_nothing(cluster, start_operator, kt) -> None:
    first = await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
    labels = cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["template"]["metadata"]["labels"]
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "no GPU",
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-7c9f-abcde", "namespace": kt.NS, "labels": labels},
        "status": {"phase": "Pending", "conditions": [unschedulable]},
    }
    await cluster.create(kt.PODS, pod)
    await _degraded(cluster, kt, "demo", "Unschedulable")
    await first.stop()
    # A restart (or a failover): the new leader resumes, finds the status already true, writes nothing.
    await start_operator(handlers={"resync_seconds": 0.1})
    await _idle_for_rounds(cluster, kt, "demo", kt.LLMD, "demo")
