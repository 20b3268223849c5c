"""Pure status computation: observed Deployment or LeaderWorkerSet state (and any problem) in,
`.status` dict out. A multi-node group is one replica: replicas and readyReplicas count groups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvasir.operator import naming
from kvasir.operator.api.spec import EndpointPickerSpec, LLMDeploymentSpec
from kvasir.operator.children.manifests import INFERENCE_POOLS
from kvasir.operator.children.routing import epp_name, router_name

# The status fields this module computes; the rest belong to the autoscaler.
OWNED_KEYS = (
    "phase",
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "desiredReplicas",
    "selector",
    "endpoint",
    "conditions",
    "lora",
)
AUTOSCALER_KEYS = ("kvCacheUsagePercent", "queueDepth", "autoscaling")

AVAILABLE = "Available"
ROUTED = "Routed"  # only with spec.routing.mode kvasir or gateway
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
SCALED_TO_ZERO = "ScaledToZero"  # only with autoscaling.minReplicas 0
COLD_START_EXCEEDS_SLO = "ColdStartExceedsSLO"  # only with minReplicas 0 and a TTFT objective


@dataclass(frozen=True)
class Problem:
    """Why the operator cannot make the spec real; becomes the Degraded condition and an Event."""

    reason: str  # CamelCase, e.g. InvalidSpec, SecretNotFound, ApiError
    message: str


@dataclass(frozen=True)
class Observation:
    """What the reconciler saw: the parsed spec (None if unparseable) and the live workload (the
    Deployment, or the LeaderWorkerSet of a multi-node spec) in `deployment`."""

    name: str
    namespace: str
    generation: int | None
    spec: LLMDeploymentSpec | None
    deployment: Mapping[str, Any] | None
    problem: Problem | None = None
    service: Mapping[str, Any] | None = None  # read only when the spec is invalid (see compute_status)
    # The Service with the endpoint's name belongs to someone else: the endpoint is not this model.
    service_conflict: bool = False
    # Whether discovery lists the InferencePool CRD (None: not asked yet); read for routing gateway.
    inference_pools_served: bool | None = None
    router: Mapping[str, Any] | None = None  # the router's live Deployment (routing mode kvasir)
    lora: list[dict[str, Any]] | None = None  # status.lora: each adapter's ready replicas (spec.lora)
    pods: Sequence[Mapping[str, Any]] = ()  # the model's pods, a group's workers included
    # The autoscaler's measured start-up time (status.autoscaling.timeToReadySeconds), if any.
    cold_start_seconds: float | None = None


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    cond: dict[str, Any] = {"type": kind, "status": "True" if ok else "False", "reason": reason}
    cond["message"] = message
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _deployment_condition(deployment: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for cond in deployment.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def ready_groups(pods: Sequence[Mapping[str, Any]], size: int) -> int:
    """Groups of a LeaderWorkerSet whose `size` pods are all Ready (none of them terminating).
    Counted from the pods, which the operator watches, rather than read from the LeaderWorkerSet's
    status, which it does not: a reconcile on the last pod's Ready event would read a count the
    LWS controller has not raised yet, and keep it until the next resync."""
    ready: dict[str, int] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        group = (meta.get("labels") or {}).get(naming.LWS_GROUP_INDEX_LABEL)
        conditions = (pod.get("status") or {}).get("conditions") or []
        is_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        if group is not None and is_ready and not meta.get("deletionTimestamp"):
            ready[group] = ready.get(group, 0) + 1
    return sum(1 for count in ready.values() if count >= size)


def _ready(obs: Observation, workload: Mapping[str, Any]) -> int:
    status = workload.get("status") or {}
    if workload.get("kind") != "LeaderWorkerSet":
        return int(status.get("readyReplicas") or 0)
    size = ((workload.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size") or 1
    return ready_groups(obs.pods, int(size))


def _workload_kind(obs: Observation) -> str:
    return "LeaderWorkerSet" if obs.spec is not None and obs.spec.multi_node else "Deployment"


def _rollout(obs: Observation, desired: int) -> tuple[int, int, int, bool, Problem | None]:
    """(replicas, ready, updated, rolled_out, stuck_problem) read from the live workload: pods of
    a Deployment, groups of a LeaderWorkerSet (whose status has the same three counts)."""
    deployment = obs.deployment or {}
    status = deployment.get("status") or {}
    replicas = int(status.get("replicas") or 0)
    ready = _ready(obs, deployment)
    updated = int(status.get("updatedReplicas") or 0)
    observed = status.get("observedGeneration")
    generation = deployment.get("metadata", {}).get("generation")
    current = observed is None or generation is None or observed >= generation
    rolled_out = current and updated >= desired and ready >= desired and replicas <= desired
    progressing = _deployment_condition(deployment, "Progressing")
    stuck: Problem | None = None
    if progressing.get("reason") == "ProgressDeadlineExceeded":
        stuck = Problem("ProgressDeadlineExceeded", progressing.get("message") or "the rollout is stuck")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if failure.get("status") == "True":
        stuck = Problem(failure.get("reason") or "ReplicaFailure", failure.get("message") or "pods fail")
    return replicas, ready, updated, rolled_out, stuck


def _invalid_spec_status(obs: Observation, status: dict[str, Any]) -> dict[str, Any]:
    """An unparseable spec changes nothing in the cluster: the children stay as the last valid
    spec left them, and status keeps reporting what they do (not zeros, not stale fields)."""
    invalid = obs.problem or Problem("InvalidSpec", "the spec cannot be parsed")
    gen = obs.generation
    live = (obs.deployment or {}).get("status") or {}
    ready = _ready(obs, obs.deployment or {})
    status.update(
        phase="Degraded",
        replicas=int(live.get("replicas") or 0),
        readyReplicas=ready,
        updatedReplicas=int(live.get("updatedReplicas") or 0),
    )
    ports = ((obs.service or {}).get("spec") or {}).get("ports") or []
    if ports and ports[0].get("port"):
        status["endpoint"] = naming.endpoint_url(obs.name, obs.namespace, int(ports[0]["port"]))
    if obs.deployment is None:
        available = _condition(AVAILABLE, False, invalid.reason, "nothing is deployed for this spec", gen)
    elif ready > 0:
        message = f"{ready} replicas of the last valid spec are ready"
        available = _condition(AVAILABLE, True, "ReplicasReady", message, gen)
    else:
        available = _condition(
            AVAILABLE, False, "NoReplicasReady", "no replica of the last valid spec is ready", gen
        )
    status["conditions"] = [
        available,
        _condition(PROGRESSING, False, invalid.reason, invalid.message, gen),
        _condition(DEGRADED, True, invalid.reason, invalid.message, gen),
    ]
    return status


def compute_status(obs: Observation) -> dict[str, Any]:
    """The full `.status` for an observation, without transition times (see `merge_conditions`)."""
    status: dict[str, Any] = {}
    if obs.generation is not None:
        status["observedGeneration"] = obs.generation
    # The scale subresource's selector: what an HPA counts as replicas, a group's leader only.
    multi_node = obs.spec is not None and obs.spec.multi_node
    status["selector"] = naming.selector_string(naming.serving_selector(obs.name, multi_node))
    gen = obs.generation
    if obs.spec is None:
        return _invalid_spec_status(obs, status)
    desired = obs.spec.desired_replicas
    status["desiredReplicas"] = desired
    if not obs.service_conflict:
        status["endpoint"] = naming.endpoint_url(_endpoint_service(obs), obs.namespace, obs.spec.service.port)
    replicas, ready, updated, rolled_out, stuck = _rollout(obs, desired)
    status.update(replicas=replicas, readyReplicas=ready, updatedReplicas=updated)
    if obs.lora is not None:
        status["lora"] = obs.lora
    problem = obs.problem or stuck
    counts = f"{ready}/{desired} replicas ready"
    if obs.spec.multi_node:
        counts += f" (groups of {obs.spec.nodes_per_replica} pods)"
    kind = _workload_kind(obs)
    if obs.deployment is None:
        available = _condition(AVAILABLE, False, f"{kind}Missing", f"the {kind} does not exist yet", gen)
    elif desired == 0:
        available = _condition(AVAILABLE, False, "ScaledToZero", "desired replicas is 0", gen)
    elif obs.service_conflict:
        message = f"{counts}, but the Service {obs.namespace}/{obs.name} belongs to someone else"
        available = _condition(AVAILABLE, False, "ServiceNotOwned", message, gen)
    elif ready > 0:
        available = _condition(AVAILABLE, True, "ReplicasReady", counts, gen)
    else:
        available = _condition(AVAILABLE, False, "NoReplicasReady", f"{counts}; models may be loading", gen)
    if rolled_out and obs.deployment is not None:
        progressing = _condition(PROGRESSING, False, "RolloutComplete", counts, gen)
    else:
        message = f"{updated}/{desired} replicas updated, {counts}"
        progressing = _condition(PROGRESSING, True, "RolloutInProgress", message, gen)
    if problem is not None:
        degraded = _condition(DEGRADED, True, problem.reason, problem.message, gen)
    else:
        degraded = _condition(DEGRADED, False, "AsExpected", "no problems observed", gen)
    status["conditions"] = [available, progressing, degraded]
    routed = _routed(obs)
    if routed is not None:
        status["conditions"].append(routed)
    status["conditions"] += _zero(obs, desired, ready)
    status["phase"] = _phase(problem, progressing["status"] == "True", ready)
    return status


def _endpoint_service(obs: Observation) -> str:
    """The Service clients should use: Kvasir's router when it routes, else the pods' Service."""
    assert obs.spec is not None
    return router_name(obs.name) if obs.spec.routing.mode == "kvasir" else obs.name


def _routed(obs: Observation) -> dict[str, Any] | None:
    """Who routes requests, when it is not the plain Service: the router, or the gateway's picker
    through an InferencePool, which can be written only where its CRD is installed. A missing CRD
    is a condition, not a failed reconcile: the operator writes the pool once discovery lists it."""
    assert obs.spec is not None
    routing, gen = obs.spec.routing, obs.generation
    if routing.mode == "kvasir":
        service = f"{obs.namespace}/{router_name(obs.name)}"
        ready = int(((obs.router or {}).get("status") or {}).get("readyReplicas") or 0)
        counts = f"{ready}/{routing.router.replicas} router pods ready"
        if ready > 0:
            return _condition(
                ROUTED, True, "RouterReady", f"{counts}; Service {service} routes requests", gen
            )
        return _condition(ROUTED, False, "RouterNotReady", f"{counts} behind Service {service}", gen)
    if routing.mode != "gateway":
        return None
    if obs.inference_pools_served:
        # Without endpointPicker the pool names the stock picker the operator deploys.
        picker = routing.endpoint_picker or EndpointPickerSpec()
        service = picker.service or epp_name(obs.name)
        message = (
            f"InferencePool {obs.namespace}/{obs.name} names the endpoint picker {service}:{picker.port}"
        )
        return _condition(ROUTED, True, "InferencePoolWritten", message, gen)
    message = (
        f"the InferencePool CRD ({INFERENCE_POOLS.plural}.{INFERENCE_POOLS.group}, "
        f"{INFERENCE_POOLS.version}) is not installed: install the Gateway API Inference Extension's "
        "CRDs; until then requests reach the pods through the Service"
    )
    return _condition(ROUTED, False, "InferencePoolCRDMissing", message, gen)


def _zero(obs: Observation, desired: int, ready: int) -> list[dict[str, Any]]:
    """With minReplicas 0: ScaledToZero (True at zero; False while waking or serving), and the
    warning that the TTFT objective is shorter than a cold start (a request that wakes the
    deployment waits at least that long)."""
    assert obs.spec is not None
    policy, gen = obs.spec.autoscaling, obs.generation
    if policy is None or policy.min_replicas != 0:
        return []
    if desired == 0:
        zero = _condition(
            SCALED_TO_ZERO,
            True,
            "Idle",
            "no requests: no replica runs; the router holds the next request and wakes it",
            gen,
        )
    elif ready == 0:
        zero = _condition(SCALED_TO_ZERO, False, "Activating", f"woken: 0/{desired} replicas ready", gen)
    else:
        zero = _condition(SCALED_TO_ZERO, False, "Active", f"{ready}/{desired} replicas ready", gen)
    ttft = policy.slo_ttft_seconds
    cold = obs.cold_start_seconds
    if ttft is None or cold is None:
        return [zero]
    if cold > ttft:
        message = (
            f"the measured cold start ({cold:.0f}s) is longer than slo.timeToFirstTokenSeconds "
            f"({ttft:g}s): a request that wakes the deployment from zero cannot meet it; set "
            "minReplicas 1 to hold the objective"
        )
        warning = _condition(COLD_START_EXCEEDS_SLO, True, "ColdStartTooLong", message, gen)
    else:
        message = f"the measured cold start ({cold:.0f}s) is within slo.timeToFirstTokenSeconds ({ttft:g}s)"
        warning = _condition(COLD_START_EXCEEDS_SLO, False, "ColdStartWithinSLO", message, gen)
    return [zero, warning]


def _phase(problem: Problem | None, progressing: bool, ready: int) -> str:
    """One word a user can act on: Degraded (something needs you; the Degraded condition says
    what), Pending (nothing serves yet: pods are being scheduled, started or loading the model),
    Progressing (it serves while the rest of the spec is rolled out or scaled up), Running (every
    desired replica is ready and current)."""
    if problem is not None:
        return "Degraded"
    if progressing:
        return "Progressing" if ready > 0 else "Pending"
    return "Running"


def merge_conditions(
    new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]] | None, now: str
) -> list[dict[str, Any]]:
    """Stamp lastTransitionTime: kept from `old` while a condition's status is unchanged, else `now`."""
    previous = {cond.get("type"): cond for cond in old or []}
    merged = []
    for cond in new:
        stamped = dict(cond)
        before = previous.get(cond["type"])
        if before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime"):
            stamped["lastTransitionTime"] = before["lastTransitionTime"]
        else:
            stamped["lastTransitionTime"] = now
        merged.append(stamped)
    return merged


def next_status(
    obs: Observation, current: Mapping[str, Any] | None, now: str | None = None
) -> dict[str, Any]:
    """The status to write, keeping fields others own (autoscaler metrics) and stable timestamps."""
    current = dict(current or {})
    status = compute_status(obs)
    status["conditions"] = merge_conditions(
        status["conditions"], current.get("conditions"), now or now_rfc3339()
    )
    # Fields this module does not compute (kvCacheUsagePercent, queueDepth, autoscaling) belong
    # to the autoscaler.
    for key in AUTOSCALER_KEYS:
        if key in current:
            status[key] = current[key]
    return status


def status_patch(
    obs: Observation, current: Mapping[str, Any] | None, now: str | None = None
) -> dict[str, Any]:
    """The merge patch taking `.status` from `current` to what `obs` shows: changed fields, and
    null for fields this module owns but no longer reports (a merge patch keeps what it omits)."""
    current = dict(current or {})
    wanted = next_status(obs, current, now)
    patch = {key: value for key, value in wanted.items() if current.get(key) != value}
    for key in OWNED_KEYS:
        if key in current and key not in wanted:
            patch[key] = None
    return patch
