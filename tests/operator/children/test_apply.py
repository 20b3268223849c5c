"""The write model, pure: which parts of a child the operator overwrites, which it shares, and when
a live object (shaped as a real API server returns it) needs no write."""

from __future__ import annotations

import copy
from typing import Any

from kvasir.operator.api.spec import parse_spec
from kvasir.operator.children.manifests import adopt, build_children
from kvasir.operator.children.ownership import (
    APPLIED_ANNOTATION,
    contains,
    merge_into_live,
    up_to_date,
    with_record,
)


def _children(kt: Any, **spec: Any) -> dict[str, dict[str, Any]]:
    parent = kt.llmd("demo", **spec)
    built = build_children("demo", kt.NS, parse_spec(parent["spec"]), with_service_monitor=True)
    adopt(built, parent)
    return {child["kind"]: child for child in built}


def _stored(kt: Any, desired: dict[str, Any]) -> dict[str, Any]:
    """What a real API server stores after the operator creates `desired`."""
    kind = desired["kind"]
    return kt.apiserver.normalize(kind, with_record(desired), None, "kvasir-operator")


def test_contains_ignores_server_defaults() -> None:
    desired = {"spec": {"replicas": 2, "ports": [{"name": "http", "port": 8000}], "nodeSelector": {}}}
    live = {
        "metadata": {"uid": "x"},
        "spec": {"replicas": 2, "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]},
    }
    assert contains(live, desired)  # an empty map matches a missing one (Go's omitempty)


def test_contains_sees_drift() -> None:
    desired = {"spec": {"replicas": 2, "args": ["--a", "1"]}}
    assert not contains({"spec": {"replicas": 3, "args": ["--a", "1"]}}, desired)
    assert not contains({"spec": {"replicas": 2, "args": ["--a"]}}, desired)  # lists compare by length too
    assert not contains({"spec": {"replicas": 2}}, desired)  # a field removed by someone
    assert not contains(
        {"spec": {"replicas": True, "args": ["--a", "1"]}}, {"spec": {"replicas": 1, "args": ["--a", "1"]}}
    )
    assert contains({"x": 1.0}, {"x": 1})


def test_a_server_shaped_child_is_up_to_date(kt) -> None:
    """Canonical quantities, defaults, managedFields, a new resourceVersion: nothing to write."""
    children = _children(kt, resources={"cpu": "0.5", "memory": "1024Mi", "gpus": 1})
    for desired in children.values():
        live = _stored(kt, desired)
        assert live["metadata"]["managedFields"]
        assert up_to_date(live, desired), desired["kind"]
    deployment = _stored(kt, children["Deployment"])
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"memory": "1Gi", "nvidia.com/gpu": "1"},
    }


def test_a_field_removed_from_the_spec_is_removed_from_the_child(kt) -> None:
    before = _children(
        kt,
        scheduling={"nodeSelector": {"pool": "h100"}, "priorityClassName": "high"},
        service={"annotations": {"example.com/lb": "internal"}},
    )
    after = _children(kt)
    for kind in ("Deployment", "Service"):
        live = _stored(kt, before[kind])
        assert not up_to_date(live, after[kind])  # the applied hash differs: a write is due
        body = merge_into_live(live, after[kind])
        assert body["metadata"]["resourceVersion"] == live["metadata"]["resourceVersion"]  # optimistic
        assert "managedFields" not in body["metadata"]
        stored = kt.apiserver.normalize(kind, body, live, "kvasir-operator")
        assert up_to_date(stored, after[kind])
        if kind == "Deployment":
            pod = stored["spec"]["template"]["spec"]
            assert "nodeSelector" not in pod and "priorityClassName" not in pod
        else:
            assert "example.com/lb" not in stored["metadata"]["annotations"]
            assert stored["spec"]["clusterIP"] == live["spec"]["clusterIP"]  # the server's stays


def test_what_others_own_survives_a_write(kt) -> None:
    desired = _children(kt, service={"annotations": {"example.com/lb": "internal"}})
    live = _stored(kt, desired["Deployment"])
    live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "3"
    live["spec"]["paused"] = True  # kubectl rollout pause
    template = live["spec"]["template"]["metadata"]
    template.setdefault("annotations", {})["kubectl.kubernetes.io/restartedAt"] = "2026-11-23T10:00:00Z"
    live["metadata"]["ownerReferences"].append(
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u"}
    )
    changed = _children(kt, replicas=3)["Deployment"]
    body = merge_into_live(live, changed)
    assert body["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "3"
    assert body["spec"]["paused"] is True
    assert body["spec"]["replicas"] == 3
    assert body["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"]
    assert {ref["uid"] for ref in body["metadata"]["ownerReferences"]} == {"u", "uid-demo"}
    # A mesh's annotation on the Service survives our own annotation being removed.
    service = _stored(kt, desired["Service"])
    service["metadata"]["annotations"]["mesh.example/inject"] = "true"
    body = merge_into_live(service, _children(kt)["Service"])
    assert body["metadata"]["annotations"]["mesh.example/inject"] == "true"
    assert "example.com/lb" not in body["metadata"]["annotations"]


def test_an_edit_by_someone_else_is_drift(kt) -> None:
    desired = _children(kt)["Deployment"]
    live = _stored(kt, desired)
    live["spec"]["template"]["spec"]["containers"][0]["args"].append("--enforce-eager")
    assert not up_to_date(live, desired)
    live = _stored(kt, desired)
    live["metadata"]["labels"].pop("app.kubernetes.io/part-of")
    assert not up_to_date(live, desired)


def test_a_value_the_server_normalises_does_not_loop(kt) -> None:
    """If the server rewrites a value the builders cannot express, the answer to our own write
    is accepted as up to date (no write on every reconcile)."""
    desired = _children(kt)["Deployment"]
    live = _stored(kt, desired)
    live["spec"]["template"]["spec"]["containers"][0]["image"] = (
        "docker.io/" + desired["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    assert not up_to_date(live, desired)
    from kvasir.operator.children.ownership import owned_spec_digest

    assert up_to_date(live, desired, settled_spec=owned_spec_digest(live))
    edited = copy.deepcopy(live)
    edited["spec"]["replicas"] = 7  # a later edit by someone else is still drift
    assert not up_to_date(edited, desired, settled_spec=owned_spec_digest(live))


def test_the_applied_record_is_written(kt) -> None:
    desired = _children(kt, service={"annotations": {"a.example/b": "c"}})["Service"]
    record = with_record(desired)["metadata"]["annotations"][APPLIED_ANNOTATION]
    assert '"annotations":["a.example/b"]' in record
