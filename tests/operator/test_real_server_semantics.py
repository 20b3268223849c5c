"""The operator against what a real API server does and kmock alone forgives (tests/operator/
apiserver.py adds it): field removal, no needless writes with server-shaped objects, unwanted
children deleted, no finalizer, deletion respected, status that tells the truth, one child's
failure not blocking the others, /scale, and server-side watch filtering."""

from __future__ import annotations

import datetime
from typing import Any

import kmock
import pytest

pytestmark = pytest.mark.asyncio


def _condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in (obj or {}).get("status", {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


async def _conflict_with(
    cluster, start_operator, kt, resource: str, foreign: dict[str, Any]
) -> dict[str, Any]:
    """Create `foreign` (a child's name, no controller), then the LLMDeployment; wait for
    ChildConflict and return the parent."""
    await cluster.create(resource, foreign)
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    parent: dict[str, Any] = await cluster.wait(
        lambda: (
            _condition(cluster.get(kt.LLMD, "demo"), "Degraded").get("reason") == "ChildConflict"
            and cluster.get(kt.LLMD, "demo")
        ),
        what="ChildConflict",
    )
    return parent


def _pod(cluster: Any, kt: Any, name: str = "demo") -> dict[str, Any]:
    return cluster.get(kt.DEPLOYMENTS, name)["spec"]["template"]["spec"]


def _env(cluster: Any, kt: Any) -> dict[str, Any]:
    return {e["name"]: e for e in _pod(cluster, kt)["containers"][0]["env"]}


async def _converged(cluster: Any, kt: Any, name: str = "demo", generation: int = 1) -> dict[str, Any]:
    for resource in kt.CHILDREN:
        await cluster.wait(lambda r=resource: cluster.get(r, name), what=f"{resource} {name}")
    return await cluster.wait(
        lambda: (
            (cluster.get(kt.LLMD, name) or {}).get("status", {}).get("observedGeneration") == generation
            and cluster.get(kt.LLMD, name)
        ),
        what=f"status of generation {generation}",
    )


def _operator_writes(cluster: Any) -> int:
    return len([r for r in cluster.requests(agent="kvasir-operator") if r.method != "GET"])


async def test_removing_fields_from_the_spec_removes_them_from_the_children(
    cluster, start_operator, kt
) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf", "namespace": kt.NS}}
    await cluster.create(kt.SECRETS, secret | {"data": {"token": "aGY="}})
    await start_operator()
    full = {
        "model": {"source": "hf://org/name", "tokenSecretRef": {"name": "hf"}, "cacheSize": "100Gi"},
        "scheduling": {
            "nodeSelector": {"pool": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "inference-high",
        },
        "service": {"annotations": {"example.com/lb": "internal"}},
    }
    await cluster.create(kt.LLMD, kt.llmd("demo", **full))
    await _converged(cluster, kt)
    assert _pod(cluster, kt)["nodeSelector"] == {"pool": "h100"}
    assert "HF_TOKEN" in _env(cluster, kt)
    # Tools other than the operator annotate the Service and pause nothing; theirs must survive.
    await cluster.patch(kt.SERVICES, "demo", {"metadata": {"annotations": {"mesh.example/inject": "true"}}})
    removal = {
        "metadata": {"generation": 2},
        "spec": {
            "model": {"tokenSecretRef": None, "cacheSize": None},
            "scheduling": {"nodeSelector": None, "tolerations": None, "priorityClassName": None},
            "service": {"annotations": None},
        },
    }
    await cluster.patch(kt.LLMD, "demo", removal)
    await _converged(cluster, kt, generation=2)
    await cluster.wait(lambda: "nodeSelector" not in _pod(cluster, kt), what="nodeSelector removed")
    pod = _pod(cluster, kt)
    assert "tolerations" not in pod and "priorityClassName" not in pod
    assert "HF_TOKEN" not in _env(cluster, kt)
    assert "sizeLimit" not in next(v for v in pod["volumes"] if v["name"] == "model-cache")["emptyDir"]
    assert "ephemeral-storage" not in pod["containers"][0]["resources"]["requests"]
    annotations = cluster.get(kt.SERVICES, "demo")["metadata"]["annotations"]
    assert "example.com/lb" not in annotations
    assert annotations["mesh.example/inject"] == "true"
    # Every write was a PUT of the whole object; none was refused as stale.
    assert cluster.server["puts"] >= 2


async def test_an_unchanged_object_is_never_rewritten(cluster, start_operator, kt) -> None:
    """Canonical quantities, server defaults, managedFields and fresh resourceVersions in the live
    objects: a restarted operator (and a second reconcile) still writes nothing."""
    spec = {
        "resources": {"cpu": "0.5", "memory": "1024Mi", "shmSize": "1.5Gi"},
        "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
        "scheduling": {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}},
    }
    first = await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", **spec))
    await _converged(cluster, kt)
    deployment = cluster.get(kt.DEPLOYMENTS, "demo")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}  # as the server stores them
    assert container["terminationMessagePath"] == "/dev/termination-log"  # a server default
    assert deployment["metadata"]["managedFields"][0]["manager"] == "kvasir-operator"
    await first.stop()
    before = {r: cluster.versions(r, "demo") for r in kt.CHILDREN}
    writes_before = _operator_writes(cluster)
    second = await start_operator()
    await cluster.wait(
        lambda: second.metrics.registry.get_sample_value(
            "kvasir_operator_reconciles_total", {"trigger": "resume", "result": "ok"}
        ),
        what="the resume reconcile",
    )
    assert _operator_writes(cluster) == writes_before
    assert {r: cluster.versions(r, "demo") for r in kt.CHILDREN} == before


@pytest.mark.monitoring
async def test_a_child_no_longer_wanted_is_deleted(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.MONITORS, "demo"), what="the ServiceMonitor")
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"monitoring": {"enabled": False}}}
    )
    await cluster.wait(lambda: cluster.get(kt.MONITORS, "demo") is None, what="the ServiceMonitor deleted")
    deletes = [r for r in cluster.writes(kt.MONITORS) if r.method == "DELETE"]
    assert len(deletes) == 1
    assert deletes[0].data["preconditions"]["uid"]  # only the incarnation it saw
    assert cluster.get(kt.DEPLOYMENTS, "demo") and cluster.get(kt.SERVICES, "demo")


@pytest.mark.monitoring
async def test_a_foreign_object_with_a_childs_name_is_left_alone(cluster, start_operator, kt) -> None:
    foreign = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "demo", "namespace": kt.NS},
        "spec": {"endpoints": [{"port": "metrics"}]},
    }
    parent = await _conflict_with(cluster, start_operator, kt, kt.MONITORS, foreign)
    assert (
        "ServiceMonitor team-a/demo already exists and has no controller"
        in _condition(parent, "Degraded")["message"]
    )
    assert cluster.get(kt.MONITORS, "demo")["spec"]["endpoints"] == [{"port": "metrics"}]
    for resource in kt.CHILDREN:  # the other children converge regardless
        assert cluster.get(resource, "demo")
    assert parent["status"]["endpoint"] == "http://demo.team-a.svc:8000"  # the Service is ours
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"monitoring": {"enabled": False}}}
    )
    await cluster.wait(
        lambda: _condition(cluster.get(kt.LLMD, "demo"), "Degraded").get("status") == "False",
        what="not Degraded",
    )
    assert cluster.get(kt.MONITORS, "demo") is not None  # never deleted: it is not ours


async def test_no_finalizer_is_ever_put_on_an_llmdeployment(cluster, start_operator, kt) -> None:
    handle = await start_operator(handlers={"resync_seconds": 0.2})
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    await cluster.wait(
        lambda: handle.metrics.registry.get_sample_value(
            "kvasir_operator_reconciles_total", {"trigger": "resync", "result": "ok"}
        ),
        what="a periodic resync",
    )
    assert not cluster.get(kt.LLMD, "demo")["metadata"].get("finalizers")
    finalizer_writes = [
        r for r in cluster.requests() if r.resource == kt.LLMD and "finalizers" in str(r.data or {})
    ]
    assert finalizer_writes == []


async def test_a_parent_being_deleted_gets_nothing_created(cluster, start_operator, kt) -> None:
    first = await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    await first.stop()  # so that no reconcile that read the parent earlier is still in flight
    # Foreground deletion: the garbage collector sets deletionTimestamp and deletes the children.
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    marked = {"metadata": {"deletionTimestamp": now, "finalizers": ["foregroundDeletion"]}}
    await cluster.patch(kt.LLMD, "demo", marked)
    await cluster.delete(kt.SERVICES, "demo")
    posts_before = len([r for r in cluster.writes(kt.SERVICES) if r.method == "POST"])
    second = await start_operator(handlers={"resync_seconds": 0.2})
    await cluster.delete(kt.PDBS, "demo")  # a child event for the new operator too
    for trigger in ("resync", "child"):
        await cluster.wait(
            lambda t=trigger: second.metrics.registry.get_sample_value(
                "kvasir_operator_reconciles_total", {"trigger": t, "result": "deleting"}
            ),
            what=f"a {trigger} reconcile of the parent being deleted",
        )
    assert cluster.get(kt.SERVICES, "demo") is None and cluster.get(kt.PDBS, "demo") is None
    assert len([r for r in cluster.writes(kt.SERVICES) if r.method == "POST"]) == posts_before


async def test_an_invalid_spec_keeps_reporting_what_runs(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", replicas=2, service={"port": 9000}))
    await _converged(cluster, kt)
    await cluster.patch(
        kt.DEPLOYMENTS,
        "demo",
        {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}},
        sub="status",
    )
    await cluster.wait(
        lambda: cluster.get(kt.LLMD, "demo")["status"].get("readyReplicas") == 2, what="2 ready"
    )
    # Now an edit the CRD cannot catch (a Hub name with a space) makes the spec unusable.
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"model": {"source": "hf://org/na me"}}}
    )
    parent = await _converged(cluster, kt, generation=2)
    status = parent["status"]
    assert status["phase"] == "Degraded"
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)  # the last valid spec still runs
    assert "desiredReplicas" not in status  # nothing is asked for: no stale value left behind
    assert status["endpoint"] == "http://demo.team-a.svc:9000"  # observed from the live Service
    assert _condition(parent, "Available")["status"] == "True"
    assert _condition(parent, "Degraded")["reason"] == "InvalidSpec"
    assert cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["replicas"] == 2  # untouched


async def test_one_refused_child_does_not_stop_the_others(cluster, start_operator, kt) -> None:
    refused = kmock.KubernetesError(
        status=422,
        reason="Invalid",
        message='Deployment.apps "demo" is invalid: spec.template.spec.affinity.nodeAffinity: Invalid value',
    )
    ours = {"User-Agent": "kvasir-operator"}
    cluster.kmock["post", kmock.resource(kt.DEPLOYMENTS), ours] << (lambda: refused)
    handle = await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(
        lambda: cluster.get(kt.SERVICES, "demo") and cluster.get(kt.PDBS, "demo"), what="the others"
    )
    parent = await cluster.wait(
        lambda: (
            _condition(cluster.get(kt.LLMD, "demo"), "Degraded").get("reason") == "InvalidSpec"
            and cluster.get(kt.LLMD, "demo")
        ),
        what="InvalidSpec",
    )
    assert "the API server refused the Deployment" in _condition(parent, "Degraded")["message"]
    assert "spec.template.spec.affinity.nodeAffinity" in _condition(parent, "Degraded")["message"]
    assert (
        handle.metrics.registry.get_sample_value(
            "kvasir_operator_reconcile_errors_total", {"reason": "ApiError"}
        )
        is None
    )


async def test_scale_works_without_replicas_in_the_manifest(cluster, start_operator, kt, crd) -> None:
    """A real API server answers GET /scale with an error when spec.replicas is absent; the CRD
    defaults it, so an HPA or KEDA can scale an LLMDeployment that never named a count."""
    await start_operator()
    manifest = kt.apply_defaults(kt.crd_schema(crd), kt.llmd("demo"))  # what the API server stores
    assert manifest["spec"]["replicas"] == 1
    await cluster.create(kt.LLMD, manifest)
    await _converged(cluster, kt)
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"replicas": 3}}, sub="scale"
    )
    await cluster.wait(
        lambda: cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["replicas"] == 3, what="3 replicas"
    )
    # Someone scaling the Deployment directly is drift: the LLMDeployment's count is the truth.
    await cluster.patch(kt.DEPLOYMENTS, "demo", {"spec": {"replicas": 7}})
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["replicas"] == 3, what="put back")


async def test_autoscaled_replicas_stay_within_bounds(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(
        kt.LLMD, kt.llmd("demo", replicas=1, autoscaling={"minReplicas": 2, "maxReplicas": 4})
    )
    await cluster.wait(
        lambda: (cluster.get(kt.DEPLOYMENTS, "demo") or {}).get("spec", {}).get("replicas") == 2, what="min"
    )
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"replicas": 9}}, sub="scale"
    )
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["replicas"] == 4, what="max")


async def test_children_are_watched_through_a_label_selector(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    for resource in kt.CHILDREN:
        watches = [
            r
            for r in cluster.requests(agent="kopf")
            if r.resource == resource and r.method == "GET" and r.name is None
        ]
        assert watches, resource
        for watch in watches:
            assert watch.params.get("labelSelector") == "app.kubernetes.io/managed-by=kvasir-operator"


async def test_the_api_key_comes_from_a_secret(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", server={"apiKeySecretRef": {"name": "api"}}))
    parent = await cluster.wait(
        lambda: (
            _condition(cluster.get(kt.LLMD, "demo"), "Degraded").get("reason") == "SecretNotFound"
            and cluster.get(kt.LLMD, "demo")
        ),
        what="SecretNotFound",
    )
    assert "spec.server.apiKeySecretRef" in _condition(parent, "Degraded")["message"]
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "api", "namespace": kt.NS}}
    await cluster.create(kt.SECRETS, secret | {"data": {"api-key": "c2VjcmV0"}})
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
    env = _env(cluster, kt)["KVASIR_API_KEY"]
    assert env == {"name": "KVASIR_API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "api-key"}}}
    assert "c2VjcmV0" not in str(cluster.get(kt.DEPLOYMENTS, "demo"))


@pytest.mark.monitoring
async def test_a_failing_child_never_hides_the_others_or_the_deployment(cluster, start_operator, kt) -> None:
    """The ServiceMonitor CRD deleted under the operator (its POST answers 404 "page not found")
    and the Service's API failing with 500: the Deployment and PDB still converge, status reads
    the Deployment, and the problem names the child it is about."""
    ours = {"User-Agent": "kvasir-operator"}
    gone = kmock.KubernetesError(status=404, reason="NotFound", message="404 page not found")
    broken = kmock.KubernetesError(status=500, reason="InternalError", message="etcdserver: timeout")
    cluster.kmock["post", kmock.resource(kt.MONITORS), ours] << (lambda: gone)
    # (kmock stores a POST even when it answers an error, so the Service's reads fail instead.)
    cluster.kmock["get", kmock.resource(kt.SERVICES), ours] << (lambda: broken)
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", replicas=2))
    await cluster.wait(
        lambda: cluster.get(kt.DEPLOYMENTS, "demo") and cluster.get(kt.PDBS, "demo"), what="the others"
    )
    # The Deployment controller reports both pods ready.
    status = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}
    await cluster.patch(
        kt.DEPLOYMENTS, "demo", {"metadata": {"generation": 1}, "status": status}, sub="status"
    )
    parent = await cluster.wait(
        lambda: (
            (cluster.get(kt.LLMD, "demo") or {}).get("status", {}).get("readyReplicas") == 2
            and cluster.get(kt.LLMD, "demo")
        ),
        what="readyReplicas 2",
    )
    assert _condition(parent, "Available")["reason"] == "ReplicasReady"
    degraded = _condition(parent, "Degraded")
    assert degraded["reason"] == "ApiError"
    assert degraded["message"].startswith("Service team-a/demo: 500")
    assert "ServiceMonitor" not in degraded["message"]  # a missing CRD is not an error


async def test_an_unschedulable_pod_reaches_status_and_an_event_at_once(cluster, start_operator, kt) -> None:
    """A pod event (not the resync) brings the scheduler's verdict into Degraded and an Event."""
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await _converged(cluster, kt)
    message = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."
    template_labels = cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["template"]["metadata"]["labels"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-7c9f-abcde", "namespace": kt.NS, "labels": template_labels},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
            ],
        },
    }
    await cluster.create(kt.PODS, pod)
    parent = await cluster.wait(
        lambda: (
            _condition(cluster.get(kt.LLMD, "demo"), "Degraded").get("reason") == "Unschedulable"
            and cluster.get(kt.LLMD, "demo")
        ),
        what="Unschedulable",
    )
    assert _condition(parent, "Degraded")["message"] == f"the pod cannot be scheduled: {message}"
    assert parent["status"]["phase"] == "Degraded"
    events = [
        r.data
        for r in cluster.requests(agent="kvasir-operator")
        if r.method == "POST" and r.resource == kt.EVENTS and (r.data or {}).get("reason") == "Unschedulable"
    ]
    assert events and events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "demo"


async def test_a_service_owned_by_someone_else_is_no_endpoint(cluster, start_operator, kt) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo", "namespace": kt.NS},
        "spec": {"ports": [{"port": 5432}]},
    }
    parent = await _conflict_with(cluster, start_operator, kt, kt.SERVICES, foreign)
    assert "endpoint" not in parent["status"]
    assert _condition(parent, "Available")["status"] == "False"
    assert _condition(parent, "Available")["reason"] == "ServiceNotOwned"
    assert [port["port"] for port in cluster.get(kt.SERVICES, "demo")["spec"]["ports"]] == [5432]
    assert [r for r in cluster.writes(kt.SERVICES) if r.method != "POST"] == []  # left alone
