"""One reconcile of one LLMDeployment: parse, build, apply the children, observe, write status.

Every trigger (create, update, resume, a child's event, the resync timer) ends up here, so the
result depends only on the spec and the cluster, never on which event arrived first."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvasir.operator import naming
from kvasir.operator.apply import Outcome, apply
from kvasir.operator.companions import MONITORING_GROUP, MONITORING_VERSION
from kvasir.operator.kube import ApiError, KubeClient, resource_path
from kvasir.operator.manifests import DEPLOYMENTS, adopt, build_children, kind_of
from kvasir.operator.metrics import OperatorMetrics
from kvasir.operator.source import SpecError
from kvasir.operator.spec import LLMDeploymentSpec, parse_spec
from kvasir.operator.status import DEGRADED, Observation, Problem, next_status

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileResult:
    """What one reconcile did; `problem` set means the spec is not (fully) realised."""

    problem: Problem | None
    outcomes: tuple[tuple[str, Outcome], ...]
    status_written: bool
    retryable: bool  # a later retry may succeed without a spec change (API faults, missing Secret)


def _degraded(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == DEGRADED:
            return dict(cond)
    return {}


class Reconciler:
    """Holds the API client, metrics and per-object locks; `reconcile` is safe to call concurrently."""

    def __init__(
        self,
        client: KubeClient,
        metrics: OperatorMetrics,
        *,
        monitoring_ttl_seconds: float = 300.0,
        apply_backoff: float = 0.1,
        warn: Any = None,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self._locks: collections.defaultdict[tuple[str, str], asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )
        self._monitoring_ttl = monitoring_ttl_seconds
        self._monitoring: tuple[float, bool] | None = None
        self._apply_backoff = apply_backoff
        # kopf.warn in the operator (posts a Kubernetes Event); injectable so this module stays kopf-free.
        self._warn = warn

    async def monitoring_available(self) -> bool:
        """Whether ServiceMonitors can be created; cached because CRDs come and go rarely."""
        now = time.monotonic()
        if self._monitoring is None or now - self._monitoring[0] > self._monitoring_ttl:
            available = await self.client.has_resource(
                MONITORING_GROUP, MONITORING_VERSION, "servicemonitors"
            )
            self._monitoring = (now, available)
        return self._monitoring[1]

    async def _check_secret(self, namespace: str, spec: LLMDeploymentSpec) -> Problem | None:
        ref = spec.model.token_secret
        if ref is None:
            return None
        # A single GET by name: the operator never lists Secrets (see deploy/rbac).
        secret = await self.client.get(resource_path("", "v1", "secrets", namespace, ref.name))
        if secret is None:
            return Problem(
                "SecretNotFound", f"Secret {namespace}/{ref.name} (spec.model.tokenSecretRef) not found"
            )
        if ref.key not in (secret.get("data") or {}) and ref.key not in (secret.get("stringData") or {}):
            return Problem("SecretKeyNotFound", f"Secret {namespace}/{ref.name} has no key {ref.key!r}")
        return None

    async def _apply_children(
        self, parent: dict[str, Any], spec: LLMDeploymentSpec
    ) -> list[tuple[str, Outcome]]:
        meta = parent["metadata"]
        monitor = spec.monitoring.enabled and await self.monitoring_available()
        children = build_children(meta["name"], meta["namespace"], spec, with_service_monitor=monitor)
        adopt(children, parent)
        outcomes = []
        for child in children:
            outcome = await apply(self.client, child, backoff=self._apply_backoff)
            kind = kind_of(child).kind
            if outcome is not Outcome.UNCHANGED:
                self.metrics.writes.labels(kind=kind, action=outcome.value).inc()
                logger.info("%s %s/%s %s", kind, meta["namespace"], meta["name"], outcome.value)
            outcomes.append((kind, outcome))
        return outcomes

    async def reconcile(self, namespace: str, name: str, trigger: str) -> ReconcileResult | None:
        """Converge the children of one LLMDeployment and write its status; None if it is gone.

        The parent is read fresh under a per-object lock, so concurrent triggers never act on a
        stale status (which would write the same status twice)."""
        async with self._locks[(namespace, name)]:
            with self.metrics.duration.time():
                try:
                    path = resource_path(naming.GROUP, naming.VERSION, naming.PLURAL, namespace, name)
                    parent = await self.client.get(path)
                except ApiError as exc:
                    parent, early = None, Problem("ApiError", f"Kubernetes API: {exc}")
                    result: ReconcileResult | None = ReconcileResult(early, (), False, True)
                else:
                    result = None if parent is None else await self._reconcile(parent)
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
        problem: Problem | None = None
        retryable = True
        outcomes: list[tuple[str, Outcome]] = []
        try:
            spec = parse_spec(parent.get("spec") or {})
        except SpecError as exc:
            problem, retryable = Problem("InvalidSpec", str(exc)), False
        try:
            if spec is not None:
                problem = await self._check_secret(namespace, spec)
            if spec is not None and problem is None:
                outcomes = await self._apply_children(parent, spec)
            deployment = await self.client.get(
                resource_path("apps", "v1", DEPLOYMENTS.plural, namespace, name)
            )
        except ApiError as exc:
            # Report what we know; the caller retries with backoff.
            problem, retryable = Problem("ApiError", f"Kubernetes API: {exc}"), True
            deployment = None
        observation = Observation(name, namespace, meta.get("generation"), spec, deployment, problem)
        try:
            written = await self._write_status(parent, observation)
        except ApiError as exc:
            failed = problem or Problem("ApiError", f"status not written: {exc}")
            return ReconcileResult(failed, tuple(outcomes), False, True)
        return ReconcileResult(problem, tuple(outcomes), written, retryable)

    async def _write_status(self, parent: dict[str, Any], observation: Observation) -> bool:
        """Patch `.status` only when a field we own changed; post an Event when a new problem appears."""
        current = parent.get("status") or {}
        status = next_status(observation, current)
        problem = observation.problem
        before = _degraded(current)
        if problem and self._warn is not None and before.get("message") != problem.message:
            self._warn(parent, reason=problem.reason, message=problem.message)
        if all(current.get(key) == value for key, value in status.items()):
            return False
        path = resource_path(
            naming.GROUP, naming.VERSION, naming.PLURAL, observation.namespace, observation.name, "status"
        )
        try:
            await self.client.merge_patch(path, {"status": status})
        except ApiError as exc:
            if exc.status == 404:
                return False  # the parent is gone; garbage collection takes the children
            raise
        return True
