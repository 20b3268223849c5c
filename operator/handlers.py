"""Thin kopf handlers: every trigger becomes one `Reconciler.reconcile` call; nothing else lives here.

No handler here needs a finalizer on the user's objects (no deletion handler, no per-object timer
or daemon): with the operator down or uninstalled, deleting an LLMDeployment, its namespace or the
CRD never hangs. Periodic work runs in one operator-wide loop over `ParentIndex` (see runner.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from kvasir.operator import naming
from kvasir.operator.index import ParentIndex
from kvasir.operator.kube import KubeClient
from kvasir.operator.reconcile import Reconciler

logger = logging.getLogger(__name__)

LoginFn = Callable[..., Any]
CHILD_LABELS = {naming.LABEL_MANAGED_BY: naming.MANAGER}
CHILD_SELECTOR = f"{naming.LABEL_MANAGED_BY}={naming.MANAGER}"
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    # Pods are the Deployment's, not the operator's, but they carry its labels; watching them is
    # how a scheduling failure or a crash loop reaches status at once instead of at the next resync.
    ("", "v1", "pods"),
)


@dataclass(frozen=True)
class HandlerConfig:
    """Knobs of the kopf layer; the defaults suit a real cluster, tests shorten the timings."""

    login: LoginFn
    # A missing Secret or an API fault: 2 s doubling to 30 s, so that creating the Secret is seen
    # within half a minute (Secrets are read, never watched: watching them would need list/watch
    # on every Secret of the cluster).
    retry_base_seconds: float = 2.0
    retry_max_seconds: float = 30.0
    # An invalid spec is fixed by a spec change (an event of its own); this re-check only catches a
    # fix that arrives another way (a CRD or operator upgrade).
    invalid_retry_seconds: float = 300.0
    resync_seconds: float | None = 300.0  # periodic drift check (runner.py); None disables it
    watch_server_timeout_seconds: int = 300
    # How long kopf waits to see its own patch come back through the watch (kopf's default: 5 s).
    consistency_timeout_seconds: float = 5.0


def default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then KUBECONFIG / ~/.kube/config (kopf's own parsers)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def retry_delay(retry: int, config: HandlerConfig) -> float:
    """Exponential backoff for a failed reconcile: base * 2^retry, capped."""
    return float(min(config.retry_base_seconds * 2 ** min(retry, 30), config.retry_max_seconds))


def controller_name(body: Mapping[str, Any]) -> str | None:
    """The LLMDeployment a child or pod belongs to: from the child's ownerReferences, or, for a pod
    (its owner is a ReplicaSet), from the labels of the operator's pod template (None if not ours)."""
    meta = body.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == naming.KIND and ref.get("apiVersion", "").startswith(naming.GROUP + "/"):
            return str(ref.get("name"))
    labels = meta.get("labels") or {}
    if labels.get(naming.LABEL_MANAGED_BY) == naming.MANAGER and labels.get(naming.LABEL_INSTANCE):
        return str(labels[naming.LABEL_INSTANCE])
    return None


def build_registry(
    client: KubeClient, reconciler: Reconciler, config: HandlerConfig, index: ParentIndex
) -> kopf.OperatorRegistry:
    """A fresh registry with all handlers bound to this client and reconciler (one per operator run)."""
    registry = kopf.OperatorRegistry()
    parent = (naming.GROUP, naming.VERSION, naming.PLURAL)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Bookkeeping in annotations, not .status: the status schema stays exactly what users read.
        prefix = naming.ANNOTATION_PREFIX
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=prefix, key="last-handled-configuration"
        )
        settings.posting.level = logging.WARNING  # Events for problems only, not for every success
        settings.scanning.disabled = True  # no CRD watching: fewer permissions, fixed resources
        settings.watching.server_timeout = config.watch_server_timeout_seconds
        settings.persistence.consistency_timeout = config.consistency_timeout_seconds
        # Watch only our own children, filtered by the API server, not every Deployment in the cluster.
        for group, version, plural in CHILD_RESOURCES:
            settings.watching.label_selectors[group, version, plural] = CHILD_SELECTOR

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info: kopf.ConnectionInfo | None = config.login(**kwargs)
        if info is not None:
            await client.connect(info)
        return info

    async def reconcile_parent(name: str, namespace: str | None, retry: int, trigger: str) -> None:
        result = await reconciler.reconcile(namespace or "", name, trigger)
        if result is not None and result.problem is not None:
            # Retried with backoff either way: an invalid spec is retried slowly, in case a fix
            # arrives through a path that does not change .spec (a Secret, a CRD upgrade).
            delay = retry_delay(retry, config) if result.retryable else config.invalid_retry_seconds
            raise kopf.TemporaryError(f"{result.problem.reason}: {result.problem.message}", delay=delay)

    @kopf.on.resume(*parent, registry=registry)
    async def on_resume(*, name: str, namespace: str | None, retry: int, **_: Any) -> None:
        await reconcile_parent(name, namespace, retry, "resume")

    @kopf.on.create(*parent, registry=registry)
    async def on_create(*, name: str, namespace: str | None, retry: int, **_: Any) -> None:
        await reconcile_parent(name, namespace, retry, "create")

    @kopf.on.update(*parent, field="spec", registry=registry)
    async def on_update(*, name: str, namespace: str | None, retry: int, **_: Any) -> None:
        await reconcile_parent(name, namespace, retry, "update")

    @kopf.on.event(*parent, registry=registry)
    def track(
        *, event: Mapping[str, Any], body: Mapping[str, Any], name: str, namespace: str | None, **_: Any
    ) -> None:
        # The index behind the operator-wide loops (resync, autoscaling); no finalizer needed.
        if event.get("type") == "DELETED":
            index.discard(namespace or "", name)
        else:
            autoscaled = bool((body.get("spec") or {}).get("autoscaling"))
            index.add(namespace or "", name, autoscaled=autoscaled)

    async def on_child(
        *, event: Mapping[str, Any], body: Mapping[str, Any], namespace: str | None, **_: Any
    ) -> None:
        if event.get("type") is None:
            return  # the initial listing: resume handlers already reconcile every parent
        owner = controller_name(body)
        if owner is None:
            return
        result = await reconciler.reconcile(namespace or "", owner, "child")
        if result is not None and result.problem is not None:
            logger.warning("reconcile of %s/%s after a child event: %s", namespace, owner, result.problem)

    for group, version, plural in CHILD_RESOURCES:
        kopf.on.event(group, version, plural, labels=CHILD_LABELS, registry=registry)(on_child)
    return registry
