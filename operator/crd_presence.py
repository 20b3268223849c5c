"""The CRDs the operator depends on can come and go while it runs: its own (an uninstall, an
upgrade by delete-and-create), the Prometheus Operator's ServiceMonitor and the Gateway API
Inference Extension's InferencePool, and LeaderWorkerSet (multi-node groups). Discovery tells which
are served; it needs no RBAC and is one small GET each, so it is polled, and the operator reacts:
it waits for its own CRD instead of crashing, and creates (or stops creating) ServiceMonitors as
soon as their CRD appears (or goes); the same for InferencePools (`spec.routing.mode: gateway`) and
LeaderWorkerSets (`spec.parallelism.nodes` above 1)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvasir.operator import naming
from kvasir.operator.children.companions import MONITORING_GROUP, MONITORING_VERSION
from kvasir.operator.children.manifests import INFERENCE_POOLS, LEADER_WORKER_SETS, SERVICE_MONITORS
from kvasir.operator.kube import ApiError, KubeClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """Which of the CRDs discovery lists right now."""

    llm_deployments: bool
    service_monitors: bool
    inference_pools: bool = False
    leader_worker_sets: bool = False


async def served(client: KubeClient) -> Served:
    return Served(
        llm_deployments=await client.has_resource(naming.GROUP, naming.VERSION, naming.PLURAL),
        service_monitors=await client.has_resource(
            MONITORING_GROUP, MONITORING_VERSION, SERVICE_MONITORS.plural
        ),
        inference_pools=await client.has_resource(
            INFERENCE_POOLS.group, INFERENCE_POOLS.version, INFERENCE_POOLS.plural
        ),
        leader_worker_sets=await client.has_resource(
            LEADER_WORKER_SETS.group, LEADER_WORKER_SETS.version, LEADER_WORKER_SETS.plural
        ),
    )


async def wait_for_own_crd(
    client: KubeClient,
    stop: asyncio.Event,
    poll_seconds: float,
    waiting: Callable[[], None] = lambda: None,
) -> bool:
    """Until the LLMDeployment CRD is served (True) or `stop` is set (False); calls `waiting()` and
    logs once if it has to wait."""
    warned = False
    while not stop.is_set():
        try:
            if await client.has_resource(naming.GROUP, naming.VERSION, naming.PLURAL):
                if warned:
                    logger.info("the LLMDeployment CRD is served again")
                return True
        except ApiError as exc:
            logger.warning("discovery failed: %s", exc)
        if not warned:
            logger.warning(
                "the LLMDeployment CRD (%s.%s) is not installed; waiting for it", naming.PLURAL, naming.GROUP
            )
            warned = True
            waiting()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=poll_seconds)
    return False


async def watch_crds(
    client: KubeClient,
    poll_seconds: float,
    *,
    own_crd_gone: asyncio.Event,
    monitoring_changed: Callable[[bool], Awaitable[None]],
    monitoring: bool | None,
    inference_pools_changed: Callable[[bool], Awaitable[None]] | None = None,
    inference_pools: bool | None = None,
    leader_worker_sets_changed: Callable[[bool], Awaitable[None]] | None = None,
    leader_worker_sets: bool | None = None,
) -> None:
    """Forever: set `own_crd_gone` when the LLMDeployment CRD disappears, and call
    `monitoring_changed(now)` when the ServiceMonitor CRD appears or disappears (and
    `inference_pools_changed(now)` for the InferencePool CRD, `leader_worker_sets_changed(now)`
    for the LeaderWorkerSet CRD)."""
    while True:
        await asyncio.sleep(poll_seconds)
        try:
            now = await served(client)
        except ApiError as exc:
            logger.warning("discovery failed: %s", exc)
            continue
        if not now.llm_deployments:
            logger.warning("the LLMDeployment CRD was removed; pausing until it is back")
            own_crd_gone.set()
            return
        if now.service_monitors != monitoring:
            logger.info("the ServiceMonitor CRD %s", "appeared" if now.service_monitors else "was removed")
            monitoring = now.service_monitors
            await monitoring_changed(now.service_monitors)
        if inference_pools_changed is not None and now.inference_pools != inference_pools:
            logger.info("the InferencePool CRD %s", "appeared" if now.inference_pools else "was removed")
            inference_pools = now.inference_pools
            await inference_pools_changed(now.inference_pools)
        if leader_worker_sets_changed is not None and now.leader_worker_sets != leader_worker_sets:
            logger.info("the LeaderWorkerSet CRD %s", "appeared" if now.leader_worker_sets else "was removed")
            leader_worker_sets = now.leader_worker_sets
            await leader_worker_sets_changed(now.leader_worker_sets)
