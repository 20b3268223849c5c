"""Thin kopf handlers: every trigger becomes one `Reconciler.reconcile` call; nothing else lives here.

No handler here needs a finalizer on the user's objects (no deletion handler, no per-object timer
or daemon): with the operator down or uninstalled, deleting an LLMDeployment, its namespace or the
CRD never hangs. Periodic work runs in one operator-wide loop over `ParentIndex` (see runner.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from kvasir.operator import naming
from kvasir.operator.index import ParentIndex
from kvasir.operator.kube import KubeClient
from kvasir.operator.reconcile import Reconciler
from kvasir.operator.retries import RetryQueue, waits_unwatched

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
    # on every Secret of the cluster). Retried in memory (retries.py), never through kopf.
    retry_base_seconds: float = 2.0
    retry_max_seconds: float = 30.0
    # An invalid spec is fixed by a spec change (an event of its own); the periodic resync catches
    # a fix that arrives another way (a CRD or operator upgrade).
    resync_seconds: float | None = 300.0  # periodic drift check (runner.py); None disables it
    watch_server_timeout_seconds: int = 300
    # How long kopf waits to see its own patch come back through the watch (kopf's default: 5 s).
    consistency_timeout_seconds: float = 5.0


def default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then KUBECONFIG / ~/.kube/config (kopf's own parsers)."""
    info = kopf.login_with_service_account(**kwargs)
    if info is not None:
        return in_cluster_address(info, os.environ)
    return kopf.login_with_kubeconfig(**kwargs)


def in_cluster_address(info: kopf.ConnectionInfo, environ: Mapping[str, str]) -> kopf.ConnectionInfo:
    """The API server at KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT, which the kubelet sets in
    every pod, as client-go's in-cluster config does. kopf dials https://kubernetes.default.svc,
    which needs cluster DNS: on a node without it (or with DNS not up yet) the operator never
    logged in. Without those variables, kopf's address is kept."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return info
    return dataclasses.replace(info, server=f"https://{f'[{host}]' if ':' in host else host}:{port}")


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
    client: KubeClient,
    reconciler: Reconciler,
    config: HandlerConfig,
    index: ParentIndex,
    retries: RetryQueue,
) -> kopf.OperatorRegistry:
    """A fresh registry with all handlers bound to this client and reconciler (one per operator run).

    Handlers never raise kopf's TemporaryError: kopf would keep its retry state in annotations on
    the user's object, writing to it twice per retry for as long as it waits. Waiting is a
    condition in the status, written once, and a retry in `retries`."""
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

    async def reconcile_parent(namespace: str, name: str, trigger: str) -> bool:
        """Reconcile; True while the object waits on something only a timed retry will notice."""
        result = await reconciler.reconcile(namespace, name, trigger)
        if result is None or result.problem is None:
            return False
        if result.problem.reason != "NotLeader":
            logger.info("%s/%s: %s: %s", namespace, name, result.problem.reason, result.problem.message)
        return waits_unwatched(result.problem.reason, result.retryable)

    async def handle(namespace: str, name: str, trigger: str) -> None:
        waiting = await reconcile_parent(namespace, name, trigger)
        retries.record((namespace, name), waiting, lambda: reconcile_parent(namespace, name, "retry"))

    # Explicit ids: they name kopf's bookkeeping annotations, which must not show Python internals.
    @kopf.on.resume(*parent, id="reconcile-on-resume", registry=registry)
    async def on_resume(*, name: str, namespace: str | None, **_: Any) -> None:
        await handle(namespace or "", name, "resume")

    @kopf.on.create(*parent, id="reconcile-on-create", registry=registry)
    async def on_create(*, name: str, namespace: str | None, **_: Any) -> None:
        await handle(namespace or "", name, "create")

    @kopf.on.update(*parent, field="spec", id="reconcile-on-update", registry=registry)
    async def on_update(*, name: str, namespace: str | None, **_: Any) -> None:
        await handle(namespace or "", name, "update")

    @kopf.on.event(*parent, id="index", registry=registry)
    def track(
        *, event: Mapping[str, Any], body: Mapping[str, Any], name: str, namespace: str | None, **_: Any
    ) -> None:
        # The index behind the operator-wide loops (resync, autoscaling); no finalizer needed.
        if event.get("type") == "DELETED":
            index.discard(namespace or "", name)
            retries.forget((namespace or "", name))
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
        await handle(namespace or "", owner, "child")

    for group, version, plural in CHILD_RESOURCES:
        handler_id = f"child-{plural}"
        kopf.on.event(group, version, plural, id=handler_id, labels=CHILD_LABELS, registry=registry)(on_child)
    return registry
