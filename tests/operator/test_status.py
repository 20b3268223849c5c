"""Status computation: conditions from the observed Deployment, stable transition times."""

from __future__ import annotations

from dataclasses import replace

from kvasir.operator.api.spec import parse_spec
from kvasir.operator.status import Observation, Problem, compute_status, next_status

SPEC = parse_spec({"model": {"source": "hf://org/name"}, "replicas": 2})


def _deployment(replicas: int, ready: int, updated: int, **extra: object) -> dict:
    status = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated, **extra}
    return {"metadata": {"generation": 3}, "status": {"observedGeneration": 3, **status}}


def _conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_pending_then_progressing_then_running() -> None:
    missing = compute_status(Observation("m", "ns", 1, SPEC, None))
    assert missing["phase"] == "Pending"
    assert _conditions(missing)["Available"] == ("False", "DeploymentMissing")
    loading = compute_status(Observation("m", "ns", 1, SPEC, _deployment(2, 0, 2)))
    # Pods exist but none serves: Pending, as the user guide says (not Progressing).
    assert loading["phase"] == "Pending"
    assert _conditions(loading)["Available"] == ("False", "NoReplicasReady")
    half = compute_status(Observation("m", "ns", 1, SPEC, _deployment(2, 1, 2)))
    assert half["phase"] == "Progressing"
    assert _conditions(half)["Available"] == ("True", "ReplicasReady")
    assert _conditions(half)["Progressing"] == ("True", "RolloutInProgress")
    done = compute_status(Observation("m", "ns", 1, SPEC, _deployment(2, 2, 2)))
    assert done["phase"] == "Running"
    assert _conditions(done) == {
        "Available": ("True", "ReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert done["replicas"] == 2 and done["readyReplicas"] == 2 and done["desiredReplicas"] == 2
    assert done["endpoint"] == "http://m.ns.svc:8000"


def test_surge_pod_still_rolling() -> None:
    surge = compute_status(Observation("m", "ns", 1, SPEC, _deployment(3, 2, 1)))
    assert _conditions(surge)["Progressing"] == ("True", "RolloutInProgress")


def test_problems_degrade() -> None:
    stuck = _deployment(
        2,
        1,
        1,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "slow",
            }
        ],
    )
    status = compute_status(Observation("m", "ns", 1, SPEC, stuck))
    assert status["phase"] == "Degraded"
    assert _conditions(status)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    invalid = compute_status(Observation("m", "ns", 4, None, None, Problem("InvalidSpec", "bad source")))
    assert invalid["observedGeneration"] == 4
    assert [c["message"] for c in invalid["conditions"] if c["type"] == "Degraded"] == ["bad source"]


def test_transition_times_are_kept_while_status_holds() -> None:
    obs = Observation("m", "ns", 1, SPEC, _deployment(2, 1, 2))
    first = next_status(obs, None, now="2026-01-01T00:00:00Z")
    again = next_status(obs, first | {"kvCacheUsagePercent": 42.0}, now="2026-01-01T00:05:00Z")
    assert again["conditions"] == first["conditions"]
    assert again["kvCacheUsagePercent"] == 42.0  # the autoscaler's field survives
    ready = next_status(
        Observation("m", "ns", 1, SPEC, _deployment(2, 2, 2)), first, now="2026-01-01T00:09:00Z"
    )
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {
        "Available": "2026-01-01T00:00:00Z",
        "Progressing": "2026-01-01T00:09:00Z",
        "Degraded": "2026-01-01T00:00:00Z",
    }


def test_a_service_owned_by_someone_else_is_not_the_endpoint() -> None:
    """Its ports and selector are not ours: no endpoint, not Available, whatever the pods do."""
    problem = Problem("ChildConflict", "Service ns/m already exists and has no controller")
    obs = Observation("m", "ns", 1, SPEC, _deployment(2, 2, 2), problem, service_conflict=True)
    status = compute_status(obs)
    assert "endpoint" not in status
    assert _conditions(status)["Available"] == ("False", "ServiceNotOwned")
    assert _conditions(status)["Degraded"] == ("True", "ChildConflict")
    assert status["phase"] == "Degraded"


def test_a_pod_problem_degrades_at_once() -> None:
    problem = Problem("Unschedulable", "the pod cannot be scheduled: 0/1 nodes are available")
    status = compute_status(Observation("m", "ns", 1, SPEC, _deployment(2, 0, 2), problem))
    assert status["phase"] == "Degraded"
    assert _conditions(status)["Degraded"] == ("True", "Unschedulable")


def _routed(routing: dict, **observed: object) -> dict:
    spec = parse_spec({"model": {"source": "hf://org/name"}, "routing": routing})
    return compute_status(Observation("m", "ns", 1, spec, _deployment(1, 1, 1), **observed))  # type: ignore[arg-type]


def test_without_routing_there_is_no_routed_condition_and_the_endpoint_is_the_service() -> None:
    status = _routed({"mode": "none"})
    assert "Routed" not in _conditions(status)
    assert status["endpoint"] == "http://m.ns.svc:8000"


def test_the_router_is_the_endpoint_and_its_readiness_the_condition() -> None:
    status = _routed({"mode": "kvasir", "router": {"replicas": 2}})
    assert status["endpoint"] == "http://m-router.ns.svc:8000"
    assert _conditions(status)["Routed"] == ("False", "RouterNotReady")
    status = _routed({"mode": "kvasir", "router": {"replicas": 2}}, router={"status": {"readyReplicas": 1}})
    assert _conditions(status)["Routed"] == ("True", "RouterReady")
    assert status["phase"] == "Running"  # routing never degrades the model's own phase


def test_a_missing_inference_pool_crd_is_a_condition_not_a_problem() -> None:
    gateway = {"mode": "gateway", "endpointPicker": {"service": "epp"}}
    status = _routed(gateway, inference_pools_served=False)
    assert _conditions(status)["Routed"] == ("False", "InferencePoolCRDMissing")
    assert _conditions(status)["Degraded"] == ("False", "AsExpected")
    assert status["endpoint"] == "http://m.ns.svc:8000"
    assert _conditions(_routed(gateway, inference_pools_served=True))["Routed"] == (
        "True",
        "InferencePoolWritten",
    )


def test_the_stock_picker_is_named_when_the_spec_names_none() -> None:
    """mode gateway without endpointPicker: the pool names the picker the operator deploys (the
    status once failed an assertion here, and every reconcile of such an object with it)."""
    status = _routed({"mode": "gateway"}, inference_pools_served=True)
    routed = next(c for c in status["conditions"] if c["type"] == "Routed")
    assert routed["reason"] == "InferencePoolWritten"
    assert routed["message"].endswith("names the endpoint picker m-epp:9002")


def test_scaled_to_zero_and_the_cold_start_warning() -> None:
    def spec(replicas: int, slo: dict | None = None) -> object:
        policy: dict = {"minReplicas": 0, "maxReplicas": 2}
        if slo is not None:
            policy["slo"] = slo
        return parse_spec(
            {
                "model": {"source": "/m"},
                "replicas": replicas,
                "autoscaling": policy,
                "routing": {"mode": "kvasir"},
            }
        )

    def seen(replicas: int, ready: int, cold: float | None = None, slo: dict | None = None) -> dict:
        obs = Observation("m", "ns", 1, spec(replicas, slo), _deployment(replicas, ready, replicas))  # type: ignore[arg-type]
        return _conditions(compute_status(replace(obs, cold_start_seconds=cold)))

    assert seen(0, 0)["ScaledToZero"] == ("True", "Idle")
    assert seen(1, 0)["ScaledToZero"] == ("False", "Activating")
    assert seen(1, 1)["ScaledToZero"] == ("False", "Active")
    assert "ColdStartExceedsSLO" not in seen(0, 0, cold=120.0)  # no TTFT objective: nothing to warn of
    assert "ColdStartExceedsSLO" not in seen(0, 0, slo={"timeToFirstTokenSeconds": 2})  # not measured yet
    slow = seen(0, 0, cold=120.0, slo={"timeToFirstTokenSeconds": 2})
    assert slow["ColdStartExceedsSLO"] == ("True", "ColdStartTooLong")
    fast = seen(1, 1, cold=20.0, slo={"timeToFirstTokenSeconds": 30})
    assert fast["ColdStartExceedsSLO"] == ("False", "ColdStartWithinSLO")
    # minReplicas 1: neither condition.
    fixed = parse_spec({"model": {"source": "/m"}, "autoscaling": {"maxReplicas": 2}})
    assert "ScaledToZero" not in _conditions(
        compute_status(Observation("m", "ns", 1, fixed, _deployment(1, 1, 1)))
    )
