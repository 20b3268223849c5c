"""The RBAC role: valid, no wildcards, no Secret listing, and exactly what the operator uses:
every request of a full run against the emulator is allowed, and every granted verb is used."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvasir.operator.children.routing import EPP_RULES, ROUTER_RULES, build_router_rbac
from kvasir.operator.leader import LeaseConfig

RBAC = "deploy/kvasir.yaml"  # the chart's default render (scripts/render-deploy.sh)


@pytest.fixture(scope="module")
def rbac(kt) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((kt.REPO / RBAC).read_text()))


def _rules(rbac: list[dict[str, Any]], kind: str) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for doc in rbac
        if doc["kind"] == kind
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_manifests_are_valid(rbac) -> None:
    for doc in rbac:
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)


def test_no_wildcards_and_no_secret_listing(rbac) -> None:
    granted = _rules(rbac, "ClusterRole") | _rules(rbac, "Role")
    assert not [g for g in granted if "*" in g]
    assert {verb for group, resource, verb in granted if resource == "secrets"} == {"get"}
    assert not [g for g in granted if g[2] in {"deletecollection", "escalate", "bind", "impersonate"}]
    # Deletes only of the children a spec can stop wanting (spec.monitoring, spec.routing,
    # spec.parallelism.nodes); the garbage collector does the rest.
    assert {resource for _, resource, verb in granted if verb == "delete"} == {
        "configmaps",
        "servicemonitors",
        "inferencepools",
        "deployments",
        "leaderworkersets",
        "services",
        "serviceaccounts",
        "roles",
        "rolebindings",
    }
    # RBAC lets the operator grant only what it holds itself: every rule of the Roles it writes.
    assert _granted_by_children() <= _rules(rbac, "ClusterRole")


def _granted_by_children() -> set[tuple[str, str, str]]:
    """What the Roles the operator writes (the router's, the endpoint picker's) grant: the router's
    of a deployment that scales to zero included (get and patch its scale subresource)."""
    wake = build_router_rbac("demo", "team-a", wakes=True)[1]["rules"]
    return {
        (group, resource, verb)
        for rule in (*ROUTER_RULES, *EPP_RULES, *wake)
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_owner_references_that_block_deletion_are_permitted(rbac, kt) -> None:
    """blockOwnerDeletion needs update on the owner's finalizers (OwnerReferencesPermissionEnforcement)."""
    from kvasir.operator.children.manifests import owner_reference

    reference = owner_reference(kt.llmd("demo"))
    granted = _rules(rbac, "ClusterRole")
    assert reference["blockOwnerDeletion"] is True
    assert ("inference.kvasir.dev", "llmdeployments/finalizers", "update") in granted


def _verb(request: Any) -> str:
    if request.method == "GET":
        if request.name is None:
            return "watch" if request.params.get("watch") == "true" else "list"
        return "get"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[
        getattr(request.method, "value", request.method)
    ]


@pytest.mark.asyncio
@pytest.mark.monitoring
@pytest.mark.inference_pools
@pytest.mark.leader_worker_sets
async def test_every_request_is_granted_and_every_grant_used(
    cluster, start_operator, kt, rbac, fake_pods
) -> None:
    lease = LeaseConfig(
        namespace="kvasir-system",
        identity="pod-a",
        # Generous: this test checks grants, not leadership. Operator and emulator share one event
        # loop here, and on a loaded 2-core machine the emulator's CEL checks can hold it for
        # seconds; a 4 s renew deadline then lapsed and the operator stopped mid-test. Renewals
        # are still written every retry period, which the grants check below relies on.
        lease_seconds=90,
        renew_deadline_seconds=60,
        retry_seconds=0.05,
    )
    port, pods = fake_pods
    await start_operator(
        leader=lease, metrics_port=port, autoscaler_poll_seconds=0.1, scrape_timeout_seconds=0.5
    )
    # An autoscaled deployment under load, then idle: pods listed, scaled up, costed, scaled down.
    for name in ("demo-0", "demo-1"):
        await cluster.create(kt.PODS, kt.pod_object(name, pods[name].ip, instance="scaled"))
        pods[name].text = kt.exposition(kv=1.0, waiting=3)
    policy = {
        "maxReplicas": 3,
        "windows": {"intervalSeconds": 1, "scaleDownSeconds": 0},
        "behavior": {"scaleDownPeriodSeconds": 0},
    }
    await cluster.create(kt.LLMD, kt.llmd("scaled", replicas=2, autoscaling=policy))
    await cluster.wait(lambda: cluster.get(kt.LLMD, "scaled")["spec"]["replicas"] == 3, what="autoscaled up")
    await cluster.create(kt.PODS, kt.pod_object("demo-2", pods["demo-2"].ip, instance="scaled"))
    for name in ("demo-0", "demo-1", "demo-2"):
        pods[name].text = kt.exposition(kv=0.01, running=0)
    await cluster.wait(
        lambda: cluster.get(kt.LLMD, "scaled")["spec"]["replicas"] == 2, what="autoscaled down"
    )
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf", "namespace": kt.NS}}
    await cluster.create(kt.SECRETS, secret | {"data": {"token": "eA=="}})
    gated = {"source": "hf://org/name", "tokenSecretRef": {"name": "hf"}}
    await cluster.create(kt.LLMD, kt.llmd("demo", model=gated))
    await cluster.create(kt.LLMD, kt.llmd("broken", model={"source": "hf://org/bad name"}))
    await cluster.wait(lambda: cluster.get(kt.MONITORS, "demo"), what="the ServiceMonitor")
    # Drift on every kind of child: each is patched back.
    await cluster.patch(kt.MONITORS, "demo", {"spec": {"endpoints": []}})
    await cluster.patch(kt.PDBS, "demo", {"spec": {"maxUnavailable": 5}})
    await cluster.patch(kt.SERVICES, "demo", {"spec": {"type": "NodePort"}})
    await cluster.patch(kt.DEPLOYMENTS, "demo", {"spec": {"replicas": 7}})
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo")["spec"]["replicas"] == 1, what="repair")
    await cluster.wait(lambda: cluster.get(kt.SERVICES, "demo")["spec"]["type"] == "ClusterIP", what="repair")
    await cluster.wait(lambda: cluster.get(kt.PDBS, "demo")["spec"]["maxUnavailable"] == 1, what="repair")
    await cluster.wait(lambda: cluster.get(kt.MONITORS, "demo")["spec"]["endpoints"], what="repair")
    await cluster.wait(
        lambda: any(r.resource == kt.EVENTS for r in cluster.requests(agent="kvasir-operator")),
        what="a Warning event",
    )
    # A spec that stops wanting a child: the ServiceMonitor is deleted.
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 2}, "spec": {"monitoring": {"enabled": False}}}
    )
    await cluster.wait(lambda: cluster.get(kt.MONITORS, "demo") is None, what="the ServiceMonitor deleted")
    # spec.routing: the router's children written, drifted and repaired, then the InferencePool,
    # then neither (each mode's children deleted when the mode changes).
    await cluster.patch(
        kt.LLMD, "demo", {"metadata": {"generation": 3}, "spec": {"routing": {"mode": "kvasir"}}}
    )
    await cluster.wait(lambda: cluster.get(kt.ROLE_BINDINGS, "demo-router"), what="the router's RoleBinding")
    await cluster.patch(
        kt.SERVICE_ACCOUNTS, "demo-router", {"metadata": {"labels": {"app.kubernetes.io/name": "x"}}}
    )
    await cluster.patch(kt.ROLES, "demo-router", {"rules": []})
    await cluster.patch(kt.ROLE_BINDINGS, "demo-router", {"subjects": []})
    router = {"mode": "kvasir", "router": {"replicas": 2}}
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 4}, "spec": {"routing": router}})
    await cluster.wait(lambda: cluster.get(kt.ROLES, "demo-router").get("rules"), what="the Role repaired")
    await cluster.wait(
        lambda: cluster.get(kt.ROLE_BINDINGS, "demo-router").get("subjects"), what="the binding repaired"
    )
    await cluster.wait(
        lambda: (
            cluster.get(kt.SERVICE_ACCOUNTS, "demo-router")["metadata"]["labels"]["app.kubernetes.io/name"]
            == "kvasir-router"
        ),
        what="the account repaired",
    )
    gateway = {"mode": "gateway", "endpointPicker": {"service": "epp"}}
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 5}, "spec": {"routing": gateway}})
    await cluster.wait(lambda: cluster.get(kt.INFERENCE_POOLS, "demo"), what="the InferencePool")
    await cluster.wait(lambda: cluster.get(kt.SERVICE_ACCOUNTS, "demo-router") is None, what="router gone")
    gateway = {"mode": "gateway", "endpointPicker": {"service": "epp", "port": 9003}}
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 6}, "spec": {"routing": gateway}})
    await cluster.wait(
        lambda: (
            cluster.get(kt.INFERENCE_POOLS, "demo")["spec"]["endpointPickerRef"]["port"]["number"] == 9003
        ),
        what="the InferencePool updated",
    )
    # No service of the user's: the operator deploys the stock picker, then deletes it with the mode.
    await cluster.patch(
        kt.LLMD,
        "demo",
        {"metadata": {"generation": 7}, "spec": {"routing": {"mode": "gateway", "endpointPicker": None}}},
    )
    await cluster.wait(lambda: cluster.get(kt.ROLE_BINDINGS, "demo-epp"), what="the picker's RoleBinding")
    await cluster.wait(
        lambda: cluster.get(kt.INFERENCE_POOLS, "demo")["spec"]["endpointPickerRef"]["name"] == "demo-epp",
        what="the InferencePool naming the operator's picker",
    )
    await cluster.patch(
        kt.LLMD,
        "demo",
        {"metadata": {"generation": 8}, "spec": {"routing": {"mode": "none", "endpointPicker": None}}},
    )
    await cluster.wait(
        lambda: cluster.get(kt.INFERENCE_POOLS, "demo") is None, what="the InferencePool deleted"
    )
    await cluster.wait(lambda: cluster.get(kt.SERVICE_ACCOUNTS, "demo-epp") is None, what="picker gone")
    # spec.lora: the adapters' ConfigMap written, rewritten when the list changes, deleted with it.
    lora = [{"name": "sql", "source": "/adapters/sql", "rank": 8}]
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 9}, "spec": {"lora": lora}})
    await cluster.wait(lambda: cluster.get(kt.CONFIG_MAPS, "demo-lora"), what="the adapters' ConfigMap")
    lora.append({"name": "chat", "source": "/adapters/chat", "rank": 8})
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 10}, "spec": {"lora": lora}})
    await cluster.wait(
        lambda: "chat" in cluster.get(kt.CONFIG_MAPS, "demo-lora")["data"]["adapters.json"],
        what="the ConfigMap updated",
    )
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 11}, "spec": {"lora": None}})
    await cluster.wait(lambda: cluster.get(kt.CONFIG_MAPS, "demo-lora") is None, what="the ConfigMap deleted")
    # spec.parallelism: a LeaderWorkerSet replaces the Deployment, is scaled, and goes back.
    nodes = {"resources": {"gpus": 8}, "parallelism": {"tensor": 16, "nodes": 2}}
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 12}, "spec": nodes})
    await cluster.wait(lambda: cluster.get(kt.LEADER_WORKER_SETS, "demo"), what="the LeaderWorkerSet")
    await cluster.patch(kt.LLMD, "demo", {"metadata": {"generation": 13}, "spec": {"replicas": 2}})
    await cluster.wait(
        lambda: cluster.get(kt.LEADER_WORKER_SETS, "demo")["spec"]["replicas"] == 2, what="the LWS scaled"
    )
    await cluster.patch(
        kt.LLMD,
        "demo",
        {"metadata": {"generation": 14}, "spec": {"parallelism": None, "resources": {"gpus": 1}}},
    )
    await cluster.wait(lambda: cluster.get(kt.LEADER_WORKER_SETS, "demo") is None, what="the LWS deleted")
    await cluster.wait(
        lambda: len(cluster.writes(kt.LEASES, agent="kvasir-operator (leader")) >= 2, what="a lease renewal"
    )
    cluster_wide, leader_role = _rules(rbac, "ClusterRole"), _rules(rbac, "Role")
    used = set()
    # Implied, not called: blockOwnerDeletion (test_owner_references_that_block_deletion_are_permitted).
    used.add(("inference.kvasir.dev", "llmdeployments/finalizers", "update"))
    # Held to be granted (the escalation check), not called: the children's Roles' rules.
    used |= _granted_by_children()
    for request in cluster.requests(agent="kopf") + cluster.requests(agent="kvasir-operator"):
        if request.resource is None or not request.resource.plural:
            continue  # discovery (/api, /apis/...): allowed to every authenticated user
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        needed = (request.resource.group, resource, _verb(request))
        used.add(needed)
        allowed = leader_role if request.resource.plural == "leases" else cluster_wide
        assert needed in allowed, f"{request.method} {request.url.path} needs {needed}"
        if request.resource.plural == "leases":
            assert request.namespace == "kvasir-system"
    assert used == cluster_wide | leader_role, (
        f"granted but never used: {(cluster_wide | leader_role) - used}"
    )
