"""The real kopf operator loop against kmock's Kubernetes emulator: create, update, scale, drift,
status, invalid specs, API faults, restarts and idempotency."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import kmock
import pytest

pytestmark = pytest.mark.asyncio


def _condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in (obj or {}).get("status", {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


def _fail_first(times: int, status: int, reason: str) -> Any:
    """A kmock reaction answering `status` to the first `times` matching requests, then passing."""
    seen = [0]

    def react() -> Any:
        if seen[0] < times:
            seen[0] += 1
            return kmock.KubernetesError(status=status, reason=reason, message=f"injected {status}")
        raise NotImplementedError  # let the emulator serve it

    return react


def _slow(seconds: float) -> Any:
    async def react() -> None:
        await asyncio.sleep(seconds)  # emulated API latency, not a wait in the test
        raise NotImplementedError

    return react


async def _converged(cluster: Any, kt: Any, name: str = "demo") -> dict[str, Any]:
    for resource in kt.CHILDREN:
        await cluster.wait(lambda r=resource: cluster.get(r, name), what=f"{resource} {name}")
    return await cluster.wait(
        lambda: (
            (cluster.get(kt.LLMD, name) or {}).get("status", {}).get("endpoint")
            and cluster.get(kt.LLMD, name)
        ),
        what="the parent's status",
    )


async def test_create_makes_owned_children_and_status(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    parent = await _converged(cluster, kt)
    for resource in kt.CHILDREN:
        child = cluster.get(resource, "demo")
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "inference.kvasir.dev/v1alpha1",
                "kind": "LLMDeployment",
                "name": "demo",
                "uid": "uid-demo",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    status = parent["status"]
    assert status["endpoint"] == "http://demo.team-a.svc:8000"
    assert status["desiredReplicas"] == 1
    assert status["observedGeneration"] == 1
    assert status["selector"] == "app.kubernetes.io/instance=demo,app.kubernetes.io/name=kvasir"
    assert status["phase"] == "Pending"
    assert _condition(parent, "Degraded")["status"] == "False"
    assert _condition(parent, "Available")["reason"] == "NoReplicasReady"
    # No ServiceMonitor without the monitoring.coreos.com CRDs.
    assert cluster.writes(kt.MONITORS) == []


@pytest.mark.monitoring
async def test_service_monitor_when_the_crd_exists(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    monitor = await cluster.wait(lambda: cluster.get(kt.MONITORS, "demo"), what="ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


async def test_spec_change_rolls_the_deployment(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    change = {"metadata": {"generation": 2}, "spec": {"runtime": {"maxNumSeqs": 64}}}
    await cluster.patch(kt.LLMD, "demo", change)

    def args() -> list[str]:
        return cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["template"]["spec"]["containers"][0]["args"]

    await cluster.wait(lambda: "64" in args(), what="the new --max-num-seqs")
    assert args()[args().index("--max-num-seqs") + 1] == "64"
    await cluster.wait(
        lambda: cluster.get(kt.LLMD, "demo")["status"].get("observedGeneration") == 2,
        what="observedGeneration",
    )


async def test_scale_subresource_scales_the_deployment(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", replicas=1))
    await _converged(cluster, kt)
    # What `kubectl scale llmd/demo --replicas=3` sends.
    await cluster.patch(kt.LLMD, "demo", {"spec": {"replicas": 3}}, sub="scale")
    await cluster.wait(
        lambda: cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["replicas"] == 3, what="3 replicas"
    )
    await cluster.wait(
        lambda: cluster.get(kt.LLMD, "demo")["status"]["desiredReplicas"] == 3, what="desired 3"
    )


async def test_deleted_child_is_recreated(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    await cluster.delete(kt.SERVICES, "demo")
    await cluster.delete(kt.DEPLOYMENTS, "demo")
    await cluster.wait(lambda: cluster.get(kt.SERVICES, "demo"), what="the Service back")
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment back")


async def test_edited_child_is_put_back(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    await cluster.patch(
        kt.DEPLOYMENTS, "demo", {"spec": {"strategy": {"rollingUpdate": {"maxUnavailable": 3}}}}
    )
    await cluster.wait(
        lambda: (
            cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        ),
        what="maxUnavailable restored",
    )


async def test_deployment_status_flows_to_the_parent(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", replicas=2))
    await _converged(cluster, kt)
    loading = {"status": {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 1}}
    await cluster.patch(kt.DEPLOYMENTS, "demo", loading, sub="status")
    parent = await cluster.wait(
        lambda: (
            cluster.get(kt.LLMD, "demo")["status"].get("readyReplicas") == 1 and cluster.get(kt.LLMD, "demo")
        ),
        what="1 ready",
    )
    assert parent["status"]["phase"] == "Progressing"
    assert _condition(parent, "Available")["status"] == "True"
    assert _condition(parent, "Progressing") | {"lastTransitionTime": None} == {
        "type": "Progressing",
        "status": "True",
        "reason": "RolloutInProgress",
        "message": "2/2 replicas updated, 1/2 replicas ready",
        "observedGeneration": 1,
        "lastTransitionTime": None,
    }
    ready = {"status": {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}}
    await cluster.patch(kt.DEPLOYMENTS, "demo", ready, sub="status")
    parent = await cluster.wait(
        lambda: cluster.get(kt.LLMD, "demo")["status"]["phase"] == "Running" and cluster.get(kt.LLMD, "demo"),
        what="Running",
    )
    assert _condition(parent, "Progressing")["reason"] == "RolloutComplete"
    assert parent["status"]["readyReplicas"] == 2
    stuck = {
        "status": {
            "conditions": [
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": "too slow",
                }
            ]
        }
    }
    await cluster.patch(kt.DEPLOYMENTS, "demo", stuck, sub="status")
    parent = await cluster.wait(
        lambda: (
            _condition(cluster.get(kt.LLMD, "demo"), "Degraded").get("status") == "True"
            and cluster.get(kt.LLMD, "demo")
        ),
        what="Degraded",
    )
    assert _condition(parent, "Degraded")["reason"] == "ProgressDeadlineExceeded"


def _warnings(cluster: Any, kt: Any, reason: str) -> list[dict[str, Any]]:
    return [
        r.data
        for r in cluster.requests()
        if r.method == "POST" and r.resource == kt.EVENTS and (r.data or {}).get("reason") == reason
    ]


async def test_invalid_spec_is_degraded_with_an_event(cluster, start_operator, kt) -> None:
    handle = await start_operator()
    # The CRD's CEL rule accepts this shape (hf://X/Y) but no Hugging Face repository can be named so.
    await cluster.create(kt.LLMD, kt.llmd("bad", model={"source": "hf://org/na me"}))
    parent = await cluster.wait(
        lambda: (
            _condition(cluster.get(kt.LLMD, "bad"), "Degraded").get("status") == "True"
            and cluster.get(kt.LLMD, "bad")
        ),
        what="Degraded",
    )
    degraded = _condition(parent, "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "'na me' in 'hf://org/na me' is not a valid Hugging Face name" in degraded["message"]
    assert parent["status"]["phase"] == "Degraded"
    events = await cluster.wait(lambda: _warnings(cluster, kt, "InvalidSpec"), what="a Warning event")
    assert events[0]["type"] == "Warning"
    assert events[0]["involvedObject"]["name"] == "bad"
    assert cluster.names(kt.DEPLOYMENTS) == []
    assert handle.alive and handle.error is None  # never crash-loops the operator
    # Fixing the spec converges.
    fix = {"metadata": {"generation": 2}, "spec": {"model": {"source": "hf://org/name"}}}
    await cluster.patch(kt.LLMD, "bad", fix)
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "bad"), what="the Deployment after the fix")
    await cluster.wait(
        lambda: _condition(cluster.get(kt.LLMD, "bad"), "Degraded").get("status") == "False",
        what="not Degraded",
    )


async def test_missing_secret_is_retried_until_it_appears(cluster, start_operator, kt) -> None:
    await start_operator()
    model = {"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "tokenSecretRef": {"name": "hf"}}
    await cluster.create(kt.LLMD, kt.llmd("gated", model=model))
    parent = await cluster.wait(
        lambda: (
            _condition(cluster.get(kt.LLMD, "gated"), "Degraded").get("reason") == "SecretNotFound"
            and cluster.get(kt.LLMD, "gated")
        ),
        what="SecretNotFound",
    )
    assert (
        _condition(parent, "Degraded")["message"] == "Secret team-a/hf (spec.model.tokenSecretRef) not found"
    )
    await cluster.wait(lambda: _warnings(cluster, kt, "SecretNotFound"), what="a Warning event")
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf", "namespace": kt.NS}}
    await cluster.create(kt.SECRETS, secret | {"data": {"token": "aGZfeHl6"}})
    deployment = await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "gated"), what="the Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in env
    # The operator only ever GETs Secrets by name.
    secret_requests = [r for r in cluster.requests(agent="kvasir-operator") if r.resource == kt.SECRETS]
    assert {(r.method, r.name) for r in secret_requests} == {("GET", "hf")}


async def test_api_faults_converge(cluster, start_operator, kt) -> None:
    ours = {"User-Agent": "kvasir-operator"}
    km = cluster.kmock
    km["post", kmock.resource(kt.DEPLOYMENTS), ours] << _fail_first(2, 500, "InternalError")
    km["post", kmock.resource(kt.SERVICES), ours] << _fail_first(1, 409, "AlreadyExists")
    km["get", kmock.resource(kt.PDBS), ours] << _fail_first(1, 503, "ServiceUnavailable")
    km["patch", kmock.resource(kt.LLMD), ours] << _fail_first(1, 500, "InternalError")  # the status
    km[kmock.resource(kt.PDBS)] << _slow(0.2)
    # kopf's own requests fail too (its initial listing), and kopf retries them itself.
    km["get", kmock.resource(kt.DEPLOYMENTS), {"User-Agent": re.compile("kopf.*")}] << _fail_first(
        1, 500, "X"
    )
    handle = await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    parent = await _converged(cluster, kt)
    assert _condition(parent, "Degraded")["status"] == "False"
    assert [cluster.names(r) for r in kt.CHILDREN] == [["demo"]] * 3
    # The failed status write surfaced as a retried error, not as a crash. (kmock stores a write
    # even when it answers 500, so the status can be visible before the error is counted.)
    await cluster.wait(
        lambda: handle.metrics.registry.get_sample_value(
            "kvasir_operator_reconcile_errors_total", {"reason": "ApiError"}
        ),
        what="the counted ApiError",
    )
    assert handle.alive


async def test_restart_midway_makes_no_duplicates(cluster, start_operator, kt) -> None:
    # The Service's creation hangs long enough for the operator to die in the middle of a reconcile.
    cluster.kmock["post", kmock.resource(kt.SERVICES)] << _slow(30)
    first = await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
    await first.crash()  # not a graceful stop
    await start_operator()
    await _converged(cluster, kt)
    for resource in kt.CHILDREN:
        assert cluster.names(resource) == ["demo"]
    # The Deployment was created once and never rewritten: the second operator found it up to date.
    assert cluster.versions(kt.DEPLOYMENTS, "demo") == 1


async def test_second_reconcile_writes_nothing(cluster, start_operator, kt) -> None:
    first = await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    await first.stop()
    before = {r: cluster.versions(r, "demo") for r in (*kt.CHILDREN, kt.LLMD)}
    writes_before = len([r for r in cluster.requests(agent="kvasir-operator") if r.method != "GET"])
    second = await start_operator()
    # The resume handler reconciles every existing object once; wait for that reconcile to finish.
    await cluster.wait(
        lambda: second.metrics.registry.get_sample_value(
            "kvasir_operator_reconciles_total", {"trigger": "resume", "result": "ok"}
        ),
        what="the resume reconcile",
    )
    writes_after = len([r for r in cluster.requests(agent="kvasir-operator") if r.method != "GET"])
    assert writes_after == writes_before
    for resource in kt.CHILDREN:
        assert cluster.versions(resource, "demo") == before[resource]


async def test_resync_loop_repairs_drift_without_an_event(cluster, start_operator, kt) -> None:
    await start_operator(handlers={"resync_seconds": 0.3})
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    # Removed straight from the store: no watch event reaches the operator, as in a watch gap.
    cluster.kmock.objects[kt.PDBS, kt.NS, "demo"].delete()
    assert cluster.get(kt.PDBS, "demo") is None
    await cluster.wait(lambda: cluster.get(kt.PDBS, "demo"), what="the PDB recreated by the resync loop")
