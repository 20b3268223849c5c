"""spec.routing through the real kopf loop against kmock's emulator: mode kvasir deploys the router
(account, Role, RoleBinding, Deployment, Service) and points status.endpoint at it; mode gateway
writes an InferencePool only where its CRD is served, and says so in status where it is not, and
deploys the stock endpoint picker for it unless the spec names the user's own; changing the mode removes what the old mode created."""

from __future__ import annotations

from typing import Any

import kmock
import pytest

pytestmark = pytest.mark.asyncio

ROUTER_CHILDREN = ("SERVICE_ACCOUNTS", "ROLES", "ROLE_BINDINGS", "DEPLOYMENTS", "SERVICES")
GATEWAY = {"mode": "gateway", "endpointPicker": {"service": "demo-epp", "failureMode": "FailOpen"}}
NO_ROUTING = {"mode": "none", "endpointPicker": None}  # a merge patch: null removes the picker


def _condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in (obj or {}).get("status", {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


def _router(cluster: Any, kt: Any, name: str = "demo-router") -> dict[str, Any]:
    return {resource: cluster.get(getattr(kt, resource), name) for resource in ROUTER_CHILDREN}


def _picker(cluster: Any, kt: Any) -> dict[str, Any]:
    """The stock endpoint picker's children: the same kinds as the router's."""
    return _router(cluster, kt, "demo-epp")


async def _parent_where(cluster: Any, kt: Any, check: Any, what: str) -> dict[str, Any]:
    def found() -> Any:
        parent = cluster.get(kt.LLMD, "demo")
        return parent if parent is not None and check(parent) else None

    result: dict[str, Any] = await cluster.wait(found, what=what)
    return result


def _resyncs(operator: Any) -> float:
    value = operator.metrics.registry.get_sample_value(
        "kvasir_operator_reconciles_total", {"trigger": "resync", "result": "ok"}
    )
    return float(value or 0)


async def test_kvasir_mode_deploys_the_router_and_the_endpoint_names_it(cluster, start_operator, kt) -> None:
    operator = await start_operator(handlers={"resync_seconds": 0.3})
    await cluster.create(kt.LLMD, kt.llmd("demo", replicas=3, routing={"mode": "kvasir"}))
    await cluster.wait(lambda: all(_router(cluster, kt).values()), what="the router's children")
    children = _router(cluster, kt)
    for child in children.values():
        assert [ref["uid"] for ref in child["metadata"]["ownerReferences"]] == ["uid-demo"]
        assert child["metadata"]["ownerReferences"][0]["controller"] is True
    assert children["ROLES"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    assert children["ROLE_BINDINGS"]["subjects"][0]["name"] == "demo-router"
    pod = children["DEPLOYMENTS"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-router"
    args = pod["containers"][0]["args"]
    assert args[args.index("--deployment") + 1] == "demo"
    assert args[args.index("--namespace") + 1] == kt.NS
    service = children["SERVICES"]
    assert service["spec"]["ports"][0]["port"] == 8000
    # The model's own children are still there; the router's Service selects only router pods.
    assert cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["replicas"] == 3
    assert service["spec"]["selector"] != cluster.get(kt.SERVICES, "demo")["spec"]["selector"]
    parent = await _parent_where(
        cluster,
        kt,
        lambda p: p.get("status", {}).get("endpoint", "").startswith("http://demo-router"),
        "the endpoint at the router",
    )
    assert parent["status"]["endpoint"] == f"http://demo-router.{kt.NS}.svc:8000"
    assert _condition(parent, "Routed")["reason"] == "RouterNotReady"
    assert _condition(parent, "Degraded")["status"] == "False"
    # The router's pods become ready (its Deployment's status): the condition follows.
    ready = {"status": {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}}
    await cluster.patch(kt.DEPLOYMENTS, "demo-router", ready, sub="status")
    parent = await _parent_where(
        cluster, kt, lambda p: _condition(p, "Routed").get("status") == "True", "the router ready"
    )
    assert _condition(parent, "Routed")["reason"] == "RouterReady"
    assert _condition(parent, "Routed")["message"].startswith("1/1 router pods ready")

    # Converged: further reconciles (the resync loop every 0.3 s) write none of the router's children.
    versions = {r: cluster.versions(getattr(kt, r), "demo-router") for r in ROUTER_CHILDREN}
    before = _resyncs(operator)
    await cluster.wait(lambda: _resyncs(operator) >= before + 3, what="three more resyncs")
    assert {r: cluster.versions(getattr(kt, r), "demo-router") for r in ROUTER_CHILDREN} == versions

    # Drift on the Role is put back at the next reconcile.
    await cluster.patch(kt.ROLES, "demo-router", {"rules": []})
    await cluster.wait(lambda: cluster.get(kt.ROLES, "demo-router").get("rules"), what="the Role repaired")


@pytest.mark.inference_pools
async def test_changing_the_mode_removes_the_old_modes_children(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", routing={"mode": "kvasir"}))
    await cluster.wait(lambda: all(_router(cluster, kt).values()), what="the router's children")

    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"routing": GATEWAY}})
    pool = await cluster.wait(lambda: cluster.get(kt.INFERENCE_POOLS, "demo"), what="the InferencePool")
    await cluster.wait(lambda: not any(_router(cluster, kt).values()), what="the router's children deleted")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["selector"]["matchLabels"] == selector
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "demo-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    parent = await _parent_where(
        cluster, kt, lambda p: _condition(p, "Routed").get("reason") == "InferencePoolWritten", "Routed"
    )
    assert _condition(parent, "Routed")["status"] == "True"
    assert parent["status"]["endpoint"] == f"http://demo.{kt.NS}.svc:8000"
    # The model's children survived the switch.
    assert cluster.get(kt.DEPLOYMENTS, "demo") is not None
    assert cluster.get(kt.SERVICES, "demo") is not None

    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 3}, "spec": {"routing": NO_ROUTING}})
    await cluster.wait(lambda: cluster.get(kt.INFERENCE_POOLS, "demo") is None, what="the pool deleted")
    parent = await _parent_where(
        cluster,
        kt,
        lambda p: not _condition(p, "Routed") and p["status"].get("observedGeneration") == 3,
        "no Routed condition",
    )
    assert parent["status"]["endpoint"] == f"http://demo.{kt.NS}.svc:8000"
    assert _condition(parent, "Degraded")["status"] == "False"


async def test_gateway_without_the_crd_is_a_condition_not_an_error(cluster, start_operator, kt) -> None:
    await start_operator(discovery_seconds=0.1)
    await cluster.create(kt.LLMD, kt.llmd("demo", routing=GATEWAY))
    parent = await _parent_where(cluster, kt, lambda p: _condition(p, "Routed"), "the Routed condition")
    routed = _condition(parent, "Routed")
    assert (routed["status"], routed["reason"]) == ("False", "InferencePoolCRDMissing")
    assert "inferencepools.inference.networking.k8s.io" in routed["message"]
    assert _condition(parent, "Degraded")["status"] == "False"
    assert not [r for r in cluster.requests(agent="kvasir-operator") if r.resource == kt.INFERENCE_POOLS]

    # The Gateway API Inference Extension installed afterwards: the pool is written, status follows.
    cluster.kmock.resources[kt.INFERENCE_POOLS] = kmock.ResourceInfo(
        kind="InferencePool",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    )
    await cluster.wait(lambda: cluster.get(kt.INFERENCE_POOLS, "demo"), what="the InferencePool")
    await _parent_where(
        cluster, kt, lambda p: _condition(p, "Routed").get("reason") == "InferencePoolWritten", "Routed"
    )


async def test_no_picker_is_deployed_without_the_inference_pool_crd(cluster, start_operator, kt) -> None:
    """The picker watches its InferencePool: without the CRD it could only crash-loop."""
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", routing={"mode": "gateway"}))
    parent = await _parent_where(cluster, kt, lambda p: _condition(p, "Routed"), "the Routed condition")
    assert _condition(parent, "Routed")["reason"] == "InferencePoolCRDMissing"
    assert not any(_picker(cluster, kt).values())


@pytest.mark.inference_pools
async def test_gateway_without_a_picker_service_deploys_the_stock_picker(cluster, start_operator, kt) -> None:
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo", replicas=2, routing={"mode": "gateway"}))
    await cluster.wait(lambda: all(_picker(cluster, kt).values()), what="the picker's children")
    pool = await cluster.wait(lambda: cluster.get(kt.INFERENCE_POOLS, "demo"), what="the InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "demo-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    children = _picker(cluster, kt)
    for child in children.values():
        assert [ref["uid"] for ref in child["metadata"]["ownerReferences"]] == ["uid-demo"]
    assert {rule["resources"][0] for rule in children["ROLES"]["rules"]} == {
        "pods",
        "inferencepools",
        "inferenceobjectives",
    }
    assert children["ROLE_BINDINGS"]["subjects"][0]["name"] == "demo-epp"
    pod = children["DEPLOYMENTS"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-epp"
    args = pod["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == "demo"
    assert args[args.index("--pool-namespace") + 1] == kt.NS
    assert "--kv-cache-usage-percentage-metric=kvasir_kv_cache_usage_ratio" in args
    assert children["SERVICES"]["spec"]["selector"].items() <= (
        children["DEPLOYMENTS"]["spec"]["template"]["metadata"]["labels"].items()
    )

    # A picker of the user's: the pool names it and the operator's picker goes.
    routing = {"mode": "gateway", "endpointPicker": {"service": "shared-epp"}}
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"routing": routing}})
    await cluster.wait(
        lambda: cluster.get(kt.INFERENCE_POOLS, "demo")["spec"]["endpointPickerRef"]["name"] == "shared-epp",
        what="the pool naming the user's picker",
    )
    await cluster.wait(lambda: not any(_picker(cluster, kt).values()), what="the picker's children deleted")

    # Back to the stock picker, then no routing: pool and picker both deleted.
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 3}, "spec": {"routing": {"endpointPicker": None}}}
    )
    await cluster.wait(lambda: all(_picker(cluster, kt).values()), what="the picker redeployed")
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 4}, "spec": {"routing": NO_ROUTING}})
    await cluster.wait(lambda: cluster.get(kt.INFERENCE_POOLS, "demo") is None, what="the pool deleted")
    await cluster.wait(
        lambda: not any(_picker(cluster, kt).values()), what="the picker deleted with the mode"
    )
    assert cluster.get(kt.DEPLOYMENTS, "demo") is not None
