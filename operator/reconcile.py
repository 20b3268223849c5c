"""One reconcile of one LLMDeployment: parse, build, apply the children, observe, write status.

Every trigger (create, update, resume, a child's event, the periodic resync) ends up here, so the
result depends only on the spec and the cluster, never on which event arrived first."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvasir.operator import naming
from kvasir.operator.api.source import SpecError
from kvasir.operator.api.spec import LLMDeploymentSpec, SecretKeyRef, parse_name, parse_spec
from kvasir.operator.children.apply import Applier, NotOwned, Outcome
from kvasir.operator.children.companions import MONITORING_GROUP, MONITORING_VERSION
from kvasir.operator.children.manifests import (
    DEPLOYMENTS,
    INFERENCE_POOLS,
    LEADER_WORKER_SETS,
    SERVICE_MONITORS,
    SERVICES,
    ChildKind,
    adopt,
    build_children,
    kind_of,
    optional_children,
)
from kvasir.operator.children.routing import router_name
from kvasir.operator.events import EventRecorder
from kvasir.operator.kube import ApiError, KubeClient, NotLeader, resource_path
from kvasir.operator.lora_sync import LoraReport, LoraSync, read_api_key
from kvasir.operator.metrics import OperatorMetrics
from kvasir.operator.pod_health import pod_problem
from kvasir.operator.status import DEGRADED, Observation, Problem, status_patch

logger = logging.getLogger(__name__)

# The API server refuses a child as invalid: the spec holds a value only it could check.
INVALID_STATUSES = frozenset({400, 422})


@dataclass(frozen=True)
class ReconcileResult:
    """What one reconcile did; `problem` set means the spec is not (fully) realised."""

    problem: Problem | None
    outcomes: tuple[tuple[str, Outcome], ...]
    status_written: bool
    retryable: bool  # a later retry may succeed without a spec change (API faults, missing Secret)


@dataclass
class _Applied:
    """What applying the children of one LLMDeployment did."""

    outcomes: list[tuple[str, Outcome]] = field(default_factory=list)
    problems: list[tuple[Problem, bool]] = field(default_factory=list)  # with: may a retry fix it?
    conflicts: set[tuple[str, str]] = field(default_factory=set)  # (kind, name) another owner holds


def _degraded(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == DEGRADED:
            return dict(cond)
    return {}


class Reconciler:
    """Holds the API client, metrics and per-object locks; `reconcile` is safe to call concurrently."""

    def __init__(self, client: KubeClient, metrics: OperatorMetrics, *, apply_backoff: float = 0.1) -> None:
        self.client = client
        self.metrics = metrics
        self.applier = Applier(client, backoff=apply_backoff)
        self.events = EventRecorder(client)
        self.lora = LoraSync()
        self._locks: collections.defaultdict[tuple[str, str], asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )
        # Whether the API serves ServiceMonitors: None until asked; the operator's discovery loop
        # (runner.py) sets it when the CRD comes or goes, and a 404 on a ServiceMonitor forgets it.
        self.monitoring: bool | None = None
        # The same for InferencePools (spec.routing.mode gateway) and LeaderWorkerSets (multi-node).
        self.inference_pools: bool | None = None
        self.leader_worker_sets: bool | None = None

    async def monitoring_available(self) -> bool:
        """Whether ServiceMonitors can be created (discovery; asked once, then kept up to date)."""
        if self.monitoring is None:
            self.monitoring = await self.client.has_resource(
                MONITORING_GROUP, MONITORING_VERSION, SERVICE_MONITORS.plural
            )
        return self.monitoring

    async def inference_pools_available(self) -> bool:
        """Whether InferencePools can be created (discovery, kept up to date as `monitoring` is)."""
        if self.inference_pools is None:
            self.inference_pools = await self.client.has_resource(
                INFERENCE_POOLS.group, INFERENCE_POOLS.version, INFERENCE_POOLS.plural
            )
        return self.inference_pools

    async def leader_worker_sets_available(self) -> bool:
        """Whether LeaderWorkerSets can be created (discovery, kept up to date as `monitoring` is)."""
        if self.leader_worker_sets is None:
            self.leader_worker_sets = await self.client.has_resource(
                LEADER_WORKER_SETS.group, LEADER_WORKER_SETS.version, LEADER_WORKER_SETS.plural
            )
        return self.leader_worker_sets

    async def _check_secret(self, namespace: str, ref: SecretKeyRef | None, field: str) -> Problem | None:
        if ref is None:
            return None
        # A single GET by name: the operator never lists Secrets (see charts/kvasir/templates/rbac.yaml).
        secret = await self.client.get(resource_path("", "v1", "secrets", namespace, ref.name))
        if secret is None:
            return Problem("SecretNotFound", f"Secret {namespace}/{ref.name} ({field}) not found")
        if ref.key not in (secret.get("data") or {}) and ref.key not in (secret.get("stringData") or {}):
            return Problem(
                "SecretKeyNotFound", f"Secret {namespace}/{ref.name} ({field}) has no key {ref.key!r}"
            )
        return None

    async def _check_secrets(self, namespace: str, spec: LLMDeploymentSpec) -> Problem | None:
        return await self._check_secret(
            namespace, spec.model.token_secret, "spec.model.tokenSecretRef"
        ) or await self._check_secret(namespace, spec.server.api_key_secret, "spec.server.apiKeySecretRef")

    async def _apply_children(self, parent: dict[str, Any], spec: LLMDeploymentSpec) -> _Applied:
        """Apply every child independently: one refused or failing child never keeps the others
        from converging, and every problem names the child it concerns."""
        meta = parent["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        monitoring = await self.monitoring_available()
        pools = await self.inference_pools_available()
        groups = await self.leader_worker_sets_available()
        children = build_children(
            name,
            namespace,
            spec,
            with_service_monitor=monitoring,
            with_inference_pool=pools,
            with_leader_worker_set=groups,
        )
        adopt(children, parent)
        applied = _Applied()
        if spec.multi_node and not groups:
            # Discovery reconciles every LLMDeployment when the CRD appears: no timed retry needed.
            applied.problems.append((Problem("LeaderWorkerSetUnavailable", _no_lws(spec)), True))
        for child in children:
            kind, child_name = kind_of(child), child["metadata"]["name"]
            try:
                outcome = await self.applier.apply(child)
            except NotOwned as exc:
                applied.conflicts.add((kind.kind, child_name))
                applied.problems.append((Problem("ChildConflict", str(exc)), True))
                continue
            except NotLeader:
                raise
            except ApiError as exc:
                if kind in _OPTIONAL_CRDS and exc.status == 404:
                    # The CRD went away since discovery said it was there: ask again next time.
                    self._forget_crd(kind)
                    continue
                applied.problems.append(_child_problem(kind.kind, namespace, child_name, exc))
                continue
            self._count(kind.kind, outcome, namespace, child_name)
            applied.outcomes.append((kind.kind, outcome))
        wanted = {(kind_of(child), child["metadata"]["name"]) for child in children}
        # Children this spec no longer asks for: the ServiceMonitor (monitoring off), the router's
        # (routing mode no longer kvasir), the InferencePool (mode no longer gateway), the
        # Deployment or the LeaderWorkerSet (the other one runs the pods now). A kind whose CRD is
        # not served has nothing to delete; and a Deployment stays while the LeaderWorkerSet that
        # would replace it cannot be made (it serves the last spec, as after an invalid one).
        served = {SERVICE_MONITORS: monitoring, INFERENCE_POOLS: pools, LEADER_WORKER_SETS: groups}
        for unwanted in optional_children(name):
            if (unwanted.kind, unwanted.name) in wanted or not served.get(unwanted.kind, True):
                continue
            if unwanted.kind == DEPLOYMENTS and unwanted.name == name and spec.multi_node and not groups:
                continue
            try:
                outcome = await self.applier.delete_unwanted(
                    unwanted.kind, namespace, unwanted.name, meta.get("uid", "")
                )
            except NotLeader:
                raise
            except ApiError as exc:
                if unwanted.kind in _OPTIONAL_CRDS and exc.status == 404:
                    self._forget_crd(unwanted.kind)
                    continue
                applied.problems.append(_child_problem(unwanted.kind.kind, namespace, unwanted.name, exc))
                continue
            self._count(unwanted.kind.kind, outcome, namespace, unwanted.name)
            applied.outcomes.append((unwanted.kind.kind, outcome))
        return applied

    def _forget_crd(self, kind: ChildKind) -> None:
        if kind == SERVICE_MONITORS:
            self.monitoring = None
        elif kind == INFERENCE_POOLS:
            self.inference_pools = None
        else:
            self.leader_worker_sets = None

    def _count(self, kind: str, outcome: Outcome, namespace: str, name: str) -> None:
        if outcome is not Outcome.UNCHANGED:
            self.metrics.writes.labels(kind=kind, action=outcome.value).inc()
            logger.info("%s %s/%s %s", kind, namespace, name, outcome.value)

    async def reconcile(self, namespace: str, name: str, trigger: str) -> ReconcileResult | None:
        """Converge the children of one LLMDeployment and write its status; None if it is gone or
        being deleted (then the garbage collector owns its children and nothing is written).

        The parent is read fresh under a per-object lock, so concurrent triggers never act on a
        stale status (which would write the same status twice)."""
        deleting = False
        async with self._locks[(namespace, name)]:
            with self.metrics.duration.time():
                try:
                    path = resource_path(naming.GROUP, naming.VERSION, naming.PLURAL, namespace, name)
                    parent = await self.client.get(path)
                except ApiError as exc:
                    parent, early = None, Problem("ApiError", f"Kubernetes API: {exc}")
                    result: ReconcileResult | None = ReconcileResult(early, (), False, True)
                else:
                    deleting = parent is not None and bool(
                        (parent.get("metadata") or {}).get("deletionTimestamp")
                    )
                    result = None if parent is None or deleting else await self._reconcile(parent)
        if deleting:
            self.metrics.reconciles.labels(trigger=trigger, result="deleting").inc()
        if result is not None:
            label = "error" if result.problem else "ok"
            self.metrics.reconciles.labels(trigger=trigger, result=label).inc()
            if result.problem:
                self.metrics.errors.labels(reason=result.problem.reason).inc()
        return result

    async def _reconcile(self, parent: dict[str, Any]) -> ReconcileResult:
        meta = parent["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        spec: LLMDeploymentSpec | None = None
        applied = _Applied()
        try:
            parse_name(name)
            spec = parse_spec(parent.get("spec") or {})
        except SpecError as exc:
            applied.problems.append((Problem("InvalidSpec", str(exc)), False))
        try:
            if spec is not None:
                secret_problem = await self._check_secrets(namespace, spec)
                if secret_problem is not None:
                    applied.problems.append((secret_problem, True))
                else:
                    applied = await self._apply_children(parent, spec)
        except NotLeader as exc:
            return ReconcileResult(Problem("NotLeader", str(exc)), tuple(applied.outcomes), False, True)
        except ApiError as exc:
            applied.problems.append((Problem("ApiError", f"Kubernetes API: {exc}"), True))
        # Observe what runs whatever happened above: status must describe the cluster, not our errors.
        deployment = service = router = None
        pods: list[dict[str, Any]] = []
        lora_status = None if spec is None or not spec.lora else LoraReport({}, (), ()).status(spec.lora)
        try:
            deployment = await self._workload(namespace, name, spec)
            if spec is not None and spec.routing.mode == "kvasir":
                router = await self.client.get(
                    resource_path("apps", "v1", DEPLOYMENTS.plural, namespace, router_name(name))
                )
            if spec is None:
                service = await self.client.get(resource_path("", "v1", SERVICES.plural, namespace, name))
            if deployment is not None:
                # Every pod of the model, a group's workers too: one that cannot be scheduled or
                # started stops its whole group.
                pods = await self._pods(namespace, name)
                problem = pod_problem(pods)
                if problem is not None:
                    applied.problems.append((problem, True))
                if spec is not None and spec.lora:
                    lora_status = await self._sync_lora(namespace, spec, pods, applied)
        except NotLeader as exc:
            return ReconcileResult(Problem("NotLeader", str(exc)), tuple(applied.outcomes), False, True)
        except ApiError as exc:
            applied.problems.append((Problem("ApiError", f"reading the children: {exc}"), True))
        problem, retryable = _first(applied.problems)
        endpoint_service = name if spec is None or spec.routing.mode != "kvasir" else router_name(name)
        observation = Observation(
            name,
            namespace,
            meta.get("generation"),
            spec,
            deployment,
            problem,
            service=service,
            service_conflict=(SERVICES.kind, endpoint_service) in applied.conflicts,
            inference_pools_served=self.inference_pools,
            router=router,
            lora=lora_status,
            pods=tuple(pods),
            cold_start_seconds=_measured_cold_start(parent),
        )
        outcomes = tuple(applied.outcomes)
        try:
            written = await self._write_status(parent, observation)
        except ApiError as exc:
            failed = problem or Problem("ApiError", f"status not written: {exc}")
            return ReconcileResult(failed, outcomes, False, True)
        return ReconcileResult(problem, outcomes, written, retryable)

    async def _sync_lora(
        self, namespace: str, spec: LLMDeploymentSpec, pods: list[dict[str, Any]], applied: _Applied
    ) -> list[dict[str, Any]]:
        """Load spec.lora on every ready pod (operator/lora_sync.py); status.lora from what they
        serve. An adapter that fails to load is a problem that a retry may fix."""
        report = await self.lora.sync(spec.lora, pods, await read_api_key(self.client, namespace, spec))
        if report.failures:
            applied.problems.append((Problem("AdapterLoadFailed", "; ".join(report.failures)), True))
        return report.status(spec.lora)

    async def _workload(
        self, namespace: str, name: str, spec: LLMDeploymentSpec | None
    ) -> dict[str, Any] | None:
        """The live object running the model's pods: the LeaderWorkerSet for a multi-node spec (when
        its CRD is served), else the Deployment (for an invalid spec, whichever exists)."""
        groups = self.leader_worker_sets
        kind = LEADER_WORKER_SETS
        lws_path = resource_path(kind.group, kind.version, kind.plural, namespace, name)
        if spec is not None and spec.multi_node and groups:
            return await self.client.get(lws_path)
        deployment = await self.client.get(resource_path("apps", "v1", DEPLOYMENTS.plural, namespace, name))
        if deployment is None and spec is None and groups:
            return await self.client.get(lws_path)
        return deployment

    async def _pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """This LLMDeployment's pods (one list call, filtered by the API server)."""
        selector = naming.selector_string(naming.selector_labels(name))
        found = await self.client.request(
            "GET", resource_path("", "v1", "pods", namespace), params={"labelSelector": selector}
        )
        return list(found.get("items") or [])

    async def _write_status(self, parent: dict[str, Any], observation: Observation) -> bool:
        """Merge-patch `.status` only when a field we own changed (fields we no longer report are
        removed with null); post an Event when a new problem appears."""
        current = parent.get("status") or {}
        patch = status_patch(observation, current)
        problem = observation.problem
        before = _degraded(current)
        if problem and before.get("message") != problem.message:
            await self.events.warning(parent, problem.reason, problem.message)
        if not patch:
            return False
        path = resource_path(
            naming.GROUP, naming.VERSION, naming.PLURAL, observation.namespace, observation.name, "status"
        )
        try:
            await self.client.merge_patch(path, {"status": patch})
        except ApiError as exc:
            if exc.status == 404:
                return False  # the parent is gone; garbage collection takes the children
            raise
        return True


_OPTIONAL_CRDS = (SERVICE_MONITORS, INFERENCE_POOLS, LEADER_WORKER_SETS)


def _no_lws(spec: LLMDeploymentSpec) -> str:
    return (
        f"spec.parallelism.nodes is {spec.nodes_per_replica}: a replica spanning nodes runs as a "
        f"LeaderWorkerSet ({LEADER_WORKER_SETS.plural}.{LEADER_WORKER_SETS.group}/{LEADER_WORKER_SETS.version}), "
        "whose CRD is not installed; install LeaderWorkerSet (its CRD and controller). Nothing is "
        "created for the group until then; a Deployment of an earlier spec keeps running"
    )


def _child_problem(kind: str, namespace: str, name: str, exc: ApiError) -> tuple[Problem, bool]:
    """A failed write of one child: refused as invalid (the spec holds a value only the API server
    could check; a retry cannot help) or an API fault (retried), naming the child either way."""
    if exc.status in INVALID_STATUSES:
        return Problem("InvalidSpec", f"the API server refused the {kind}: {exc.message}"), False
    return Problem("ApiError", f"{kind} {namespace}/{name}: {exc}"), True


def _first(problems: list[tuple[Problem, bool]]) -> tuple[Problem | None, bool]:
    """The problem to report: the first one; retryable only if every problem may pass by itself."""
    if not problems:
        return None, True
    if len(problems) == 1:
        return problems[0]
    message = "; ".join(p.message for p, _ in problems)
    return Problem(problems[0][0].reason, message), all(r for _, r in problems)


def _measured_cold_start(parent: Mapping[str, Any]) -> float | None:
    """The autoscaler's measured time-to-ready (status.autoscaling.timeToReadySeconds), if any."""
    value = ((parent.get("status") or {}).get("autoscaling") or {}).get("timeToReadySeconds")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
