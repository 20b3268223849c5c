"""The create-or-patch comparison: live objects carry server defaults, desired fields decide."""

from __future__ import annotations

from kvasir.operator.apply import contains


def test_contains_ignores_server_defaults() -> None:
    desired = {"spec": {"replicas": 2, "ports": [{"name": "http", "port": 8000}]}}
    live = {
        "metadata": {"uid": "x"},
        "spec": {"replicas": 2, "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]},
    }
    assert contains(live, desired)


def test_contains_sees_drift() -> None:
    desired = {"spec": {"replicas": 2, "args": ["--a", "1"]}}
    assert not contains({"spec": {"replicas": 3, "args": ["--a", "1"]}}, desired)
    assert not contains({"spec": {"replicas": 2, "args": ["--a"]}}, desired)  # lists compare by length too
    assert not contains({"spec": {"replicas": 2}}, desired)  # a field removed by someone
    assert not contains(
        {"spec": {"replicas": True, "args": ["--a", "1"]}}, {"spec": {"replicas": 1, "args": ["--a", "1"]}}
    )
    assert contains({"x": 1.0}, {"x": 1})
